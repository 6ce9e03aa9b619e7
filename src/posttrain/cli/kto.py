"""``posttrain kto``: Kahneman-Tversky Optimization from the command line.

Every ``KTOConfig`` field is a flag, next to the ``cli.training.PairTaskScriptArguments``. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``), which ``KTOTrainer`` splits into
desirable (chosen) and undesirable (rejected) examples, on CPU, prints the held-out accuracy
before and after (100 fixed problems the pairs never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model.

A dataset given with ``--dataset_name`` is unpaired ``prompt``/``completion``/``label`` rows
or ``chosen``/``rejected`` pairs (``data/unpaired.py``).
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.training import (
    build_task_trainer,
    builtin_task_accuracy,
    laptop_defaults,
    run_training,
)

# Settings of the no-argument run: a real KTO job that ends within minutes on a laptop CPU.
# Each pair gives a desirable and an undesirable example, so a batch of 8 is 4 pairs' worth;
# the default random sampling mixes both kinds in every batch (the KL pairs come from it).
LAPTOP_DEFAULTS: dict[str, Any] = laptop_defaults("kto", 5e-6, beta=0.1)


def _build_kto(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain.data.tasks import arithmetic_preference_dataset

    return build_task_trainer(
        argv,
        command="kto",
        summary="Align with KTO on desirable and undesirable completions.",
        trainer="KTOTrainer",
        builtin=arithmetic_preference_dataset,
        defaults=LAPTOP_DEFAULTS,
    )


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
