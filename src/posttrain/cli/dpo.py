"""``posttrain dpo``: Direct Preference Optimization from the command line.

Every ``DPOConfig`` field is a flag, next to the ``cli.training.PairTaskScriptArguments``. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen
over a wrong result or an untagged answer), on CPU, prints the held-out accuracy before and
after (100 fixed problems the pairs never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.training import (
    build_task_trainer,
    builtin_task_accuracy,
    laptop_defaults,
    run_training,
)

# Settings of the no-argument run: a real DPO job that ends within minutes on a laptop CPU.
LAPTOP_DEFAULTS: dict[str, Any] = laptop_defaults("dpo", 5e-6, beta=0.1)


def _build_dpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain.data.tasks import arithmetic_preference_dataset

    return build_task_trainer(
        argv,
        command="dpo",
        summary="Align with DPO on preference pairs.",
        trainer="DPOTrainer",
        builtin=arithmetic_preference_dataset,
        defaults=LAPTOP_DEFAULTS,
    )


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
