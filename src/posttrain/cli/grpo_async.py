"""``posttrain grpo-async``: asynchronous GRPO from the command line.

Every ``AsyncGRPOConfig`` field is a flag, next to the script arguments ``posttrain grpo`` also
takes (:mod:`posttrain.cli.online`). With no arguments it trains the embedded
SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, with a background sampler one
step ahead of training, prints the greedy accuracy on held-out problems before and after, and
saves the result.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.online import build_online_trainer
from posttrain.cli.training import builtin_task_accuracy, run_training

# Settings of the no-argument run: posttrain grpo's laptop run (one prompt x eight completions
# per step, 64 tokens, lr 1e-6), with the sampler one step ahead (max_staleness=1: on two cores
# a deeper pipeline adds staleness without more overlap).
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "grpo-async-smollm2-arithmetic",
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 64,
    "max_staleness": 1,
    "learning_rate": 1e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


def _build_grpo_async(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import AsyncGRPOConfig, AsyncGRPOTrainer

    summary = "Train with asynchronous GRPO (a background sampler up to max_staleness steps ahead; score centering)."
    return build_online_trainer(
        argv, "grpo-async", summary, AsyncGRPOConfig, AsyncGRPOTrainer, LAPTOP_DEFAULTS
    )


def grpo_async(argv: list[str]) -> Any:
    """Train with asynchronous GRPO (every AsyncGRPOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the embedded
    SmolLM2-135M-Instruct on the built-in arithmetic task, with the held-out accuracy before and
    after (``--evaluate false`` skips it). The ``--accelerate_*`` flags relaunch it under
    ``accelerate launch`` as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("grpo-async", argv, _build_grpo_async, builtin_task_accuracy)
