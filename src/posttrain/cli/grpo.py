"""``posttrain grpo``: GRPO training from the command line.

Every ``GRPOConfig`` field is a flag (transformers' ``HfArgumentParser``), next to the
:class:`GRPOScriptArguments` below. With no arguments it trains the embedded
SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, prints the greedy accuracy on
held-out problems before and after, and saves the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.datasets import load_dataset_split
from posttrain.cli.options import parse_config
from posttrain.cli.rewards import resolve_reward_funcs
from posttrain.cli.training import HeldOut, builtin_task_accuracy, run_training

# Settings of the no-argument run: small enough for a laptop CPU, still a real GRPO job.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "grpo-smollm2-arithmetic",
    "max_steps": 60,
    "per_device_train_batch_size": 8,
    "num_generations": 8,
    "max_completion_length": 64,
    "learning_rate": 1e-6,
    "logging_steps": 1,
    "save_steps": 25,
    "save_total_limit": 2,
    "gradient_checkpointing": False,
}


@dataclass
class GRPOScriptArguments:
    """What to train on, besides the ``GRPOConfig`` flags.

    Attributes:
        model_name_or_path: hub id, local folder, or an embedded name.
        task: a built-in task (``arithmetic``) used when no ``dataset_name`` is given.
        task_size: number of prompts the built-in task draws, before the held-out problems are
            left out.
        task_seed: seed of the built-in task.
        task_few_shot: worked examples shown before each problem of the built-in task.
        task_max_value: largest operand of the built-in task's problems.
        task_system_prompt: whether the built-in task's prompts start with its system message
            (which asks for the ``<answer>`` tag).
        dataset_name: a hub dataset id, or a local ``.json``/``.jsonl``/``.csv``/``.parquet``
            file or a folder of such files, with a ``prompt`` column, instead of the built-in task.
        dataset_config: the hub dataset's configuration name.
        dataset_train_split: the split to train on.
        reward_funcs: built-in reward names or dotted import paths (``pkg.mod.func`` or
            ``pkg.mod:func``); ``None``: the built-in answer rewards, or none when a reward model
            is given.
        reward_model_name_or_path: a sequence-classification reward model (hub id or folder)
            appended to the reward functions.
        evaluate: measure the greedy accuracy on 100 held-out problems of the built-in task
            before and after training (drawn with the task's options; the training prompts
            leave them out).
    """

    model_name_or_path: str = field(
        default="smollm2-135m-instruct", metadata={"help": "Hub id, local folder, or embedded model name."}
    )
    task: str = field(
        default="arithmetic", metadata={"help": "Built-in task used when no dataset_name is given."}
    )
    task_size: int = field(
        default=1000,
        metadata={
            "help": "Number of prompts the built-in task draws (before the held-out ones are left out)."
        },
    )
    task_seed: int = field(default=0, metadata={"help": "Seed of the built-in task."})
    task_few_shot: int = field(
        default=1, metadata={"help": "Worked examples shown before each problem of the built-in task."}
    )
    task_max_value: int = field(default=20, metadata={"help": "Largest operand of the built-in task."})
    task_system_prompt: bool = field(
        default=False,
        metadata={
            "help": "Start the built-in task's prompts with its system message (asks for the answer tag)."
        },
    )
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of such files "
            "(needs a 'prompt' column). Default: the built-in task."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of a hub dataset."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: built-in names or dotted import paths (my_pkg.rewards.my_reward or "
            "my_pkg.rewards:my_reward). Default: answer_accuracy_reward answer_format_reward, or none "
            "when --reward_model_name_or_path is given."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Sequence-classification reward model (hub id or folder) appended to the reward functions."
        },
    )
    evaluate: bool = field(
        default=True,
        metadata={
            "help": "Print the built-in task's held-out accuracy before and after training (and leave "
            "the held-out problems out of the training prompts)."
        },
    )


def _task_options(script: GRPOScriptArguments) -> dict[str, Any]:
    """How the built-in task draws its prompts, shared by the training and held-out problems."""
    from posttrain.data.tasks import ARITHMETIC_SYSTEM_PROMPT

    return {
        "few_shot": script.task_few_shot,
        "max_value": script.task_max_value,
        "system_prompt": ARITHMETIC_SYSTEM_PROMPT if script.task_system_prompt else None,
    }


def _heldout(script: GRPOScriptArguments, config: Any) -> HeldOut | None:
    """The built-in task's held-out problems, or ``None`` (user data, ``--evaluate false``).

    100 different problems drawn like the training prompts (same worked examples, operands and
    system message), measured with greedy completions as long as the training ones.
    """
    if script.dataset_name is not None or not script.evaluate:
        return None
    from posttrain.data.tasks import arithmetic_heldout

    problems = arithmetic_heldout(distinct=True, **_task_options(script))
    return HeldOut(problems, max_new_tokens=config.max_completion_length)


def _dataset(script: GRPOScriptArguments, heldout: HeldOut | None) -> Any:
    """The training prompts: ``dataset_name`` when given, else the built-in task without ``heldout``."""
    if script.dataset_name is not None:
        return load_dataset_split(script.dataset_name, script.dataset_config, script.dataset_train_split)
    from posttrain.data.tasks import load_task, without_problems

    data = load_task(script.task, n=script.task_size, seed=script.task_seed, **_task_options(script))
    if heldout is None:
        return data
    data = without_problems(data, heldout.problems)
    if len(data) == 0:
        raise ValueError(
            f"every one of the {script.task_size} prompts of the built-in task is a held-out problem; "
            "raise --task_size or --task_max_value, or pass --evaluate false"
        )
    return data


def _build_grpo(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import GRPOConfig, GRPOTrainer

    script, config = parse_config(
        argv,
        GRPOScriptArguments,
        GRPOConfig,
        command="grpo",
        summary="Train with GRPO.",
        defaults=LAPTOP_DEFAULTS,
    )
    funcs = resolve_reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
    heldout = _heldout(script, config)
    dataset = _dataset(script, heldout)
    trainer = GRPOTrainer(
        model=script.model_name_or_path, reward_funcs=funcs, args=config, train_dataset=dataset
    )
    trainer.heldout = heldout
    return trainer, config


def grpo(argv: list[str]) -> Any:
    """Train with GRPO (every GRPOConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, runs GRPO training and saves the model; returns the trainer. With no flags:
    the embedded SmolLM2-135M-Instruct on the built-in arithmetic task, with the held-out
    accuracy before and after (``--evaluate false`` skips it).

    ``--accelerate_config NAME_OR_PATH`` (a bundled config: ``single``, ``multi_gpu``, ... or the
    user's accelerate config file), with ``--accelerate_num_processes N``,
    ``--accelerate_main_process_port PORT`` and ``--accelerate_mixed_precision no|fp16|bf16``,
    reruns the command under ``accelerate launch`` and exits with its code, unless this process
    already runs under accelerate launch or torchrun (then the launcher flags are ignored).

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("grpo", argv, _build_grpo, builtin_task_accuracy)
