"""``posttrain orpo``: Odds Ratio Preference Optimization from the command line.

Every ``ORPOConfig`` field is a flag, next to the ``cli.training.PairTaskScriptArguments``. With no
arguments it trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic preference
pairs (``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen
over a wrong result or an untagged answer), with no reference model, on CPU, prints the
held-out accuracy before and after (100 fixed problems the pairs never contain, greedy),
writes it to ``output_dir/accuracy.json``, and saves the model.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.training import (
    build_task_trainer,
    builtin_task_accuracy,
    laptop_defaults,
    run_training,
)

# Settings of the no-argument run: a real ORPO job that ends within minutes on a laptop CPU.
# The learning rate is the ORPO paper's (Appendix C); beta is its lambda.
LAPTOP_DEFAULTS: dict[str, Any] = laptop_defaults("orpo", 5e-6, beta=0.1)


def _build_orpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain.data.tasks import arithmetic_preference_dataset

    return build_task_trainer(
        argv,
        command="orpo",
        summary="Align with ORPO on preference pairs, without a reference model.",
        trainer="ORPOTrainer",
        builtin=arithmetic_preference_dataset,
        defaults=LAPTOP_DEFAULTS,
    )


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
