"""``posttrain orpo``: Odds Ratio Preference Optimization from the command line.

Every ``ORPOConfig`` field is a flag, next to the :class:`ORPOScriptArguments` below. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen
over a wrong result or an untagged answer), with no reference model, on CPU, prints the
held-out accuracy before and after (100 fixed problems the pairs never contain, greedy),
writes it to ``output_dir/accuracy.json``, and saves the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.options import parse_config
from posttrain.cli.training import TaskScriptArguments, builtin_task_accuracy, run_training, task_dataset

# Settings of the no-argument run: a real ORPO job that ends within minutes on a laptop CPU.
# The learning rate is the ORPO paper's (Appendix C); beta is its lambda.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "orpo-smollm2-arithmetic",
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
class ORPOScriptArguments(TaskScriptArguments):
    """What to train on, besides the ``ORPOConfig`` flags (see ``TaskScriptArguments``)."""

    task_seed: int = field(default=2, metadata={"help": "Seed of the built-in preference pairs."})


def _build_orpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import ORPOConfig, ORPOTrainer
    from posttrain.data.tasks import arithmetic_preference_dataset

    script, config = parse_config(
        argv,
        ORPOScriptArguments,
        ORPOConfig,
        command="orpo",
        summary="Align with ORPO on preference pairs, without a reference model.",
        defaults=LAPTOP_DEFAULTS,
    )
    dataset = task_dataset(script, arithmetic_preference_dataset)
    trainer = ORPOTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.builtin_task = script.dataset_name is None and script.evaluate
    return trainer, config


def orpo(argv: list[str]) -> Any:
    """Align with ORPO on preference pairs (every ORPOConfig field is a flag; --config RECIPE.yaml).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct on the built-in arithmetic preference pairs, with the
    held-out accuracy before and after. The ``--accelerate_*`` launcher flags work as for
    ``posttrain grpo``.

    Args:
        argv: the arguments after ``posttrain orpo``.

    Returns:
        The trained ``ORPOTrainer``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("orpo", argv, _build_orpo, builtin_task_accuracy)
