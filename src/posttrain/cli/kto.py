"""``posttrain kto``: Kahneman-Tversky Optimization from the command line.

Every ``KTOConfig`` field is a flag, next to the :class:`KTOScriptArguments` below. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``), which ``KTOTrainer`` splits into
desirable (chosen) and undesirable (rejected) examples, on CPU, prints the held-out accuracy
before and after (100 fixed problems the pairs never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model.

A dataset given with ``--dataset_name`` is unpaired ``prompt``/``completion``/``label`` rows
or ``chosen``/``rejected`` pairs (``data/unpaired.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.options import parse_config
from posttrain.cli.training import TaskScriptArguments, builtin_task_accuracy, run_training, task_dataset

# Settings of the no-argument run: a real KTO job that ends within minutes on a laptop CPU.
# Each pair gives a desirable and an undesirable example, so a batch of 8 is 4 pairs' worth;
# the default random sampling mixes both kinds in every batch (the KL pairs come from it).
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "kto-smollm2-arithmetic",
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
class KTOScriptArguments(TaskScriptArguments):
    """What to train on, besides the ``KTOConfig`` flags (see ``TaskScriptArguments``)."""

    task_seed: int = field(default=2, metadata={"help": "Seed of the built-in preference pairs."})


def _build_kto(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import KTOConfig, KTOTrainer
    from posttrain.data.tasks import arithmetic_preference_dataset

    script, config = parse_config(
        argv,
        KTOScriptArguments,
        KTOConfig,
        command="kto",
        summary="Align with KTO on desirable and undesirable completions.",
        defaults=LAPTOP_DEFAULTS,
    )
    dataset = task_dataset(script, arithmetic_preference_dataset)
    trainer = KTOTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.builtin_task = script.dataset_name is None and script.evaluate
    return trainer, config


def kto(argv: list[str]) -> Any:
    """Align with KTO on labelled completions or pairs (every KTOConfig field is a flag; --config RECIPE.yaml).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct on the built-in arithmetic preference pairs (each split
    into a desirable and an undesirable example), with the held-out accuracy before and after.
    The ``--accelerate_*`` launcher flags work as for ``posttrain grpo``.

    Args:
        argv: the arguments after ``posttrain kto``.

    Returns:
        The trained ``KTOTrainer``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("kto", argv, _build_kto, builtin_task_accuracy)
