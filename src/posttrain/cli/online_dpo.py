"""``posttrain online-dpo``: online DPO from the command line.

Every ``OnlineDPOConfig`` field is a flag, next to the script arguments ``posttrain grpo`` also
takes (:mod:`posttrain.cli.online`): a built-in task or a dataset, reward functions or a reward
model (a judge object is for the Python API), the held-out evaluation. With no arguments it
trains the embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, prints the
greedy accuracy on held-out problems before and after, and saves the result.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.online import build_online_trainer
from posttrain.cli.training import builtin_task_accuracy, run_training

# Settings of the no-argument run: 4 prompts per step, each sampled twice (8 completions, as in
# posttrain grpo's run), the reference's beta=0.1 and loss, a learning rate for a short run.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "online-dpo-smollm2-arithmetic",
    "max_steps": 60,
    "per_device_train_batch_size": 4,
    "max_new_tokens": 64,
    "learning_rate": 2e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


def _build_online_dpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer

    summary = "Train with online DPO (two completions per prompt from the policy, ordered by the rewards)."
    return build_online_trainer(
        argv, "online-dpo", summary, OnlineDPOConfig, OnlineDPOTrainer, LAPTOP_DEFAULTS
    )


def online_dpo(argv: list[str]) -> Any:
    """Train with online DPO (every OnlineDPOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the embedded
    SmolLM2-135M-Instruct on the built-in arithmetic task, each prompt's two completions ordered
    by the task's rewards, with the held-out accuracy before and after (``--evaluate false``
    skips it). The ``--accelerate_*`` flags relaunch it under ``accelerate launch`` as for
    ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("online-dpo", argv, _build_online_dpo, builtin_task_accuracy)
