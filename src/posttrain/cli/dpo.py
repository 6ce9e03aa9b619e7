"""``posttrain dpo``: Direct Preference Optimization from the command line.

Every ``DPOConfig`` field is a flag, next to the :class:`DPOScriptArguments` below. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen
over a wrong result or an untagged answer), on CPU, prints the held-out accuracy before and
after (100 fixed problems the pairs never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.options import parse_config
from posttrain.cli.training import TaskScriptArguments, builtin_task_accuracy, run_training, task_dataset

# Settings of the no-argument run: a real DPO job that ends within minutes on a laptop CPU.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "dpo-smollm2-arithmetic",
    "max_steps": 30,
    "per_device_train_batch_size": 8,
    "learning_rate": 5e-6,
    "lr_scheduler_type": "constant",
    "beta": 0.1,
    "max_length": 512,
    "logging_steps": 5,
    "save_steps": 30,
    "save_total_limit": 1,
    "gradient_checkpointing": False,
    "report_to": "none",
}


@dataclass
class DPOScriptArguments(TaskScriptArguments):
    """What to train on, besides the ``DPOConfig`` flags (see ``TaskScriptArguments``)."""

    task_seed: int = field(default=2, metadata={"help": "Seed of the built-in preference pairs."})


def _build_dpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import DPOConfig, DPOTrainer
    from posttrain.data.tasks import arithmetic_preference_dataset

    script, config = parse_config(
        argv,
        DPOScriptArguments,
        DPOConfig,
        command="dpo",
        summary="Align with DPO on preference pairs.",
        defaults=LAPTOP_DEFAULTS,
    )
    dataset = task_dataset(script, arithmetic_preference_dataset)
    trainer = DPOTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.builtin_task = script.dataset_name is None and script.evaluate
    return trainer, config


def dpo(argv: list[str]) -> Any:
    """Align with DPO on preference pairs (every DPOConfig field is a flag; --config RECIPE.yaml).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct on the built-in arithmetic preference pairs, with the
    held-out accuracy before and after. The ``--accelerate_*`` launcher flags work as for
    ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("dpo", argv, _build_dpo, builtin_task_accuracy)
