"""``posttrain distill``: self-distillation (SDFT) from the command line.

Every ``SDFTConfig`` field is a flag, next to the script arguments ``posttrain grpo`` also takes
(:mod:`posttrain.cli.online`): a built-in task or a dataset with ``prompt`` and
``privileged_context`` columns, reward functions (only logged) or a reward model, the held-out
evaluation. With no arguments the embedded SmolLM2-135M-Instruct is its own teacher on the
built-in arithmetic task, on CPU: the student samples completions of each problem, the teacher
(its start weights) reads them after the problem and its worked answer, and the student learns
the teacher's token distributions. It prints the greedy accuracy on held-out problems before
and after, and saves the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.online import OnlineScriptArguments, build_online_trainer
from posttrain.cli.training import builtin_task_accuracy, run_training

# Settings of the no-argument run: two prompts per step, four completions each (a prompt's
# prefix, most of a step's tokens, is shared by its four), 64 tokens, 25 steps (docs/cli.md has
# the measured run). The signal is dense (every token's distribution), so the learning rate is
# SFT's (1e-5), not GRPO's. The teacher is the start weights; its prompt names the worked answer
# as the correct one: with the embedded model that teacher answers 44 of 50 held-out problems
# right (greedy), 40 of 50 with the bare "{prompt}\n\n{privileged_context}".
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "distill-smollm2-arithmetic",
    "max_steps": 25,
    "per_device_train_batch_size": 8,
    "num_generations": 4,
    "max_completion_length": 64,
    "learning_rate": 1e-5,
    "teacher_model_kind": "base",
    "teacher_prompt_template": "{prompt}\n\nThe correct answer: {privileged_context}",
    "distillation_mode": "topk_logits",
    "distillation_alpha": 0.5,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


@dataclass
class DistillScriptArguments(OnlineScriptArguments):
    """What ``posttrain distill`` trains on, besides ``SDFTConfig``'s flags.

    As ``OnlineScriptArguments``, except that the built-in task is ``arithmetic_distill`` (each
    problem's worked answer is its ``privileged_context``) and that rewards are optional: they
    are only logged.
    """

    task: str = field(
        default="arithmetic_distill",
        metadata={
            "help": "Built-in task used when no dataset_name is given (its rows need a privileged_context)."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of such files "
            "(needs 'prompt' and 'privileged_context' columns). Default: the built-in task."
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions, only logged (SDFT does not train on them): built-in names or dotted "
            "import paths. Default: answer_accuracy_reward answer_format_reward on the built-in task, "
            "none on a dataset."
        },
    )


def _build_distill(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import SDFTConfig, SDFTTrainer

    summary = (
        "Train with self-distillation (SDFT: the model as its own teacher, reading a privileged context)."
    )
    return build_online_trainer(
        argv,
        "distill",
        summary,
        SDFTConfig,
        SDFTTrainer,
        LAPTOP_DEFAULTS,
        script_class=DistillScriptArguments,
        rewards_optional=True,
    )


def distill(argv: list[str]) -> Any:
    """Train with self-distillation, SDFT (every SDFTConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the embedded
    SmolLM2-135M-Instruct distilled from itself reading each built-in arithmetic problem's worked
    answer, with the held-out accuracy before and after (``--evaluate false`` skips it). The
    ``--accelerate_*`` flags relaunch it under ``accelerate launch`` as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("distill", argv, _build_distill, builtin_task_accuracy)
