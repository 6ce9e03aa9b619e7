"""``posttrain a2po``: A*-PO training from the command line.

Every ``A2POConfig`` field is a flag, next to the script arguments ``posttrain grpo`` also takes
(:mod:`posttrain.cli.online`): a built-in task or a dataset, reward functions or a reward model,
the held-out evaluation. With no arguments it trains the embedded SmolLM2-135M-Instruct on the
built-in arithmetic task, on CPU: stage 1 samples eight reference completions of each training
prompt (cached in the output folder), stage 2 trains on one completion per prompt; it prints the
greedy accuracy on held-out problems before and after, and saves the result.
"""

from __future__ import annotations

from typing import Any

from posttrain.cli.online import build_online_trainer
from posttrain.cli.training import builtin_task_accuracy, run_training

# Settings of the no-argument run: the reference's beta1, beta2 and num_value_samples; a binary
# reward (the answer's accuracy alone: A*-PO needs r in {0, 1}); 64 training prompts, so stage 1
# samples 8 x 64 completions before the first step; 4 prompts per step, one completion each (the
# prompts differ, so no prefill is shared: a step costs about what GRPO's 8-completion step does).
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "a2po-smollm2-arithmetic",
    "task_size": 64,
    "reward_funcs": ["answer_accuracy_reward"],
    "max_steps": 40,
    "per_device_train_batch_size": 4,
    "max_completion_length": 64,
    "learning_rate": 2e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


def _build_a2po(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import A2POConfig, A2POTrainer

    summary = (
        "Train with A*-PO (V*(x) from reference samples, then one-completion regression; binary rewards)."
    )
    return build_online_trainer(argv, "a2po", summary, A2POConfig, A2POTrainer, LAPTOP_DEFAULTS)


def a2po(argv: list[str]) -> Any:
    """Train with A*-PO (every A2POConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the embedded
    SmolLM2-135M-Instruct on the built-in arithmetic task with its binary accuracy reward, with
    the held-out accuracy before and after (``--evaluate false`` skips it). The
    ``--accelerate_*`` flags relaunch it under ``accelerate launch`` as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("a2po", argv, _build_a2po, builtin_task_accuracy)
