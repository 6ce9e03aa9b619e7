"""``posttrain rloo``: RLOO (and REINFORCE++) training from the command line.

Every ``RLOOConfig`` field is a flag, next to the script arguments ``posttrain grpo`` also takes
(:mod:`posttrain.cli.online`): a built-in task or a dataset, reward functions or a reward model,
the held-out evaluation. With no arguments it trains the embedded SmolLM2-135M-Instruct on the
built-in arithmetic task, on CPU, prints the greedy accuracy on held-out problems before and
after, and saves the result. ``--normalize_advantages true`` is REINFORCE++.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.online import build_online_trainer
from posttrain.cli.training import builtin_task_accuracy, run_training

# Settings of the no-argument run: GRPO's laptop run with RLOO's KL penalty (beta=0.05, the
# reference's default) and four completions per prompt, so each step sees two prompts.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "rloo-smollm2-arithmetic",
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 64,
    "learning_rate": 2e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


def _build_rloo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import RLOOConfig, RLOOTrainer

    summary = "Train with RLOO (REINFORCE Leave-One-Out; REINFORCE++ with --normalize_advantages true)."
    return build_online_trainer(argv, "rloo", summary, RLOOConfig, RLOOTrainer, LAPTOP_DEFAULTS)


def rloo(argv: list[str]) -> Any:
    """Train with RLOO (every RLOOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the embedded
    SmolLM2-135M-Instruct on the built-in arithmetic task, with the held-out accuracy before and
    after (``--evaluate false`` skips it). The ``--accelerate_*`` flags relaunch it under
    ``accelerate launch`` as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("rloo", argv, _build_rloo, builtin_task_accuracy)
