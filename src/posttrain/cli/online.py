"""What the online training subcommands share (``posttrain grpo``, ``posttrain rloo``).

Their script arguments (model, built-in task or dataset, reward functions or model, held-out
evaluation), the built-in task's training prompts with the held-out problems left out, and the
trainer built from the parsed flags. Each subcommand adds its config and trainer classes and
its laptop defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.datasets import load_dataset_split
from posttrain.cli.options import parse_config
from posttrain.cli.rewards import resolve_reward_funcs
from posttrain.cli.training import HeldOut


@dataclass
class OnlineScriptArguments:
    """What to train on, besides the config's flags (``GRPOConfig``, ``RLOOConfig``).

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
        use_peft: train a LoRA adapter (``peft``) instead of every weight; ``lora_r``,
            ``lora_alpha``, ``lora_dropout`` and ``lora_target_modules`` describe it (TRL's
            ``ModelConfig`` names and defaults).
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
    use_peft: bool = field(
        default=False, metadata={"help": "Train a LoRA adapter instead of every weight (needs peft)."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (with --use_peft)."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (with --use_peft)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout (with --use_peft)."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "Modules the adapter wraps (with --use_peft), or all-linear. Default: peft's choice for "
            "the architecture (q_proj and v_proj for Llama)."
        },
    )


def lora_config(script: OnlineScriptArguments) -> Any:
    """The ``peft.LoraConfig`` the LoRA flags describe (``None`` without ``--use_peft``)."""
    if not script.use_peft:
        given = [
            f"--{name}"
            for name, default in (
                ("lora_r", 16),
                ("lora_alpha", 32),
                ("lora_dropout", 0.05),
                ("lora_target_modules", None),
            )
            if getattr(script, name) != default
        ]
        if given:
            raise ValueError(
                f"{', '.join(given)} describe a LoRA adapter, which only --use_peft true trains: add it."
            )
        return None
    from posttrain.models.peft import _import_peft

    targets = script.lora_target_modules
    if targets is not None and len(targets) == 1:
        targets = targets[0]  # "all-linear" is a string to peft
    return _import_peft().LoraConfig(
        r=script.lora_r,
        lora_alpha=script.lora_alpha,
        lora_dropout=script.lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )


def _task_options(script: OnlineScriptArguments) -> dict[str, Any]:
    """How the built-in task draws its prompts, shared by the training and held-out problems."""
    from posttrain.data.tasks import ARITHMETIC_SYSTEM_PROMPT

    return {
        "few_shot": script.task_few_shot,
        "max_value": script.task_max_value,
        "system_prompt": ARITHMETIC_SYSTEM_PROMPT if script.task_system_prompt else None,
    }


def heldout_problems(script: OnlineScriptArguments, config: Any) -> HeldOut | None:
    """The built-in task's held-out problems, or ``None`` (user data, ``--evaluate false``).

    100 different problems drawn like the training prompts (same worked examples, operands and
    system message), measured with greedy completions as long as the training ones.
    """
    if script.dataset_name is not None or not script.evaluate:
        return None
    from posttrain.data.tasks import arithmetic_heldout

    problems = arithmetic_heldout(distinct=True, **_task_options(script))
    return HeldOut(problems, max_new_tokens=config.max_completion_length)


def training_prompts(script: OnlineScriptArguments, heldout: HeldOut | None) -> Any:
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


def build_online_trainer(
    argv: list[str],
    command: str,
    summary: str,
    config_class: type,
    trainer_class: type,
    defaults: dict[str, Any],
    script_class: type = OnlineScriptArguments,
    rewards_optional: bool = False,
) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error.

    Args:
        argv: the subcommand's arguments.
        command: its name (``"grpo"``), for the help and the messages.
        summary: one line for ``--help``.
        config_class, trainer_class: the family's (``GRPOConfig``, ``GRPOTrainer``).
        defaults: the config values of the no-argument run (flags and recipes win).
        script_class: the script arguments (``OnlineScriptArguments`` or a subclass).
        rewards_optional: the trainer only logs rewards (distillation): on a user's dataset with
            neither ``--reward_funcs`` nor a reward model, it gets none instead of the built-in
            answer rewards (which need a ``solution`` column).

    Returns:
        The trainer (with its ``heldout`` problems, or ``None``) and the config.
    """
    script, config = parse_config(
        argv, script_class, config_class, command=command, summary=summary, defaults=defaults
    )
    no_reward_given = script.reward_funcs is None and not script.reward_model_name_or_path
    if rewards_optional and no_reward_given and script.dataset_name is not None:
        funcs: list[Any] = []
    else:
        funcs = resolve_reward_funcs(script.reward_funcs, script.reward_model_name_or_path)
    heldout = heldout_problems(script, config)
    dataset = training_prompts(script, heldout)
    peft_config = lora_config(script)
    trainer = trainer_class(
        model=script.model_name_or_path,
        reward_funcs=funcs,
        args=config,
        train_dataset=dataset,
        **({"peft_config": peft_config} if peft_config is not None else {}),
    )
    trainer.heldout = heldout
    return trainer, config
