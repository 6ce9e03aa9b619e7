"""``posttrain cpo``: Contrastive Preference Optimization (and SimPO, AlphaPO) from the command line.

Every ``CPOConfig`` field is a flag, next to the ``cli.training.PairTaskScriptArguments``;
``--loss_type simpo`` and ``--loss_type alphapo`` select SimPO and AlphaPO. With no arguments
it trains the embedded SmolLM2-135M-Instruct with the CPO loss (sigmoid, plus the chosen
completions' NLL) on the built-in arithmetic preference pairs
(``data.tasks.arithmetic_preference_dataset``: the right result in the answer tag chosen over
a wrong result or an untagged answer), with no reference model, on CPU, prints the held-out
accuracy before and after (100 fixed problems the pairs never contain, greedy), writes it to
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

# Settings of the no-argument run: a real CPO job that ends within minutes on a laptop CPU.
LAPTOP_DEFAULTS: dict[str, Any] = laptop_defaults("cpo", 5e-6, loss_type="sigmoid", beta=0.1)


def _build_cpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain.data.tasks import arithmetic_preference_dataset

    return build_task_trainer(
        argv,
        command="cpo",
        summary="Align with CPO, SimPO or AlphaPO on preference pairs, without a reference model.",
        trainer="CPOTrainer",
        builtin=arithmetic_preference_dataset,
        defaults=LAPTOP_DEFAULTS,
    )


def cpo(argv: list[str]) -> Any:
    """Align with CPO/SimPO/AlphaPO on preference pairs (every CPOConfig field is a flag; --config RECIPE.yaml).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct with the CPO loss on the built-in arithmetic preference
    pairs, with the held-out accuracy before and after. The ``--accelerate_*`` launcher flags
    work as for ``posttrain grpo``.

    Args:
        argv: the arguments after ``posttrain cpo``.

    Returns:
        The trained ``CPOTrainer``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("cpo", argv, _build_cpo, builtin_task_accuracy)
