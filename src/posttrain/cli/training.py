"""The life of a training subcommand: relaunch, build, train, save.

A ``posttrain <trainer>`` command gives :func:`run_training` its name and a function that parses
the arguments and builds the trainer; everything else (the accelerate relaunch, turning
configuration errors into :class:`CLIError`, the compact console and ``log.jsonl``, the held-out
measurement before and after, resuming, saving, the closing message, the end of the process
group) is the same for every trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.launch import relaunch_if_requested
from posttrain.cli.options import CLIError, given_fields, one_paragraph, parse_config

#: Parses a command's arguments (launcher flags removed) and returns ``(trainer, config)``.
Builder = Callable[[list[str]], tuple[Any, Any]]


#: Measures the trained model on the command's task: ``evaluate(trainer) -> {"accuracy": ...}``,
#: or ``None`` when the run has no built-in task to measure.
Evaluator = Callable[[Any], "dict[str, float] | None"]

#: The file in ``output_dir`` that receives every logged metric dict, one JSON object a line.
LOG_FILE = "log.jsonl"


@dataclass(frozen=True)
class HeldOut:
    """Held-out problems a command measures its model on before and after training.

    A command's builder sets ``trainer.heldout`` to one (or ``None``: nothing to measure), and
    :func:`builtin_task_accuracy` reads it.

    Attributes:
        problems: rows with ``prompt`` and ``solution`` (``data.tasks.arithmetic_heldout``).
        max_new_tokens: the most tokens of a greedy completion.
    """

    problems: Any
    max_new_tokens: int = 40


@dataclass
class TaskScriptArguments:
    """What an offline trainer's command trains on, besides its config's flags.

    Attributes:
        model_name_or_path: hub id, local folder, or an embedded name.
        task_size: problems the built-in task generates (used without ``dataset_name``).
        task_seed: seed of the built-in task.
        dataset_name: a hub dataset id, or a local ``.json``/``.jsonl``/``.csv``/``.parquet``
            file or a folder of such files, instead of the built-in task.
        dataset_config: the hub dataset's configuration name.
        dataset_train_split: the split to train on.
        evaluate: measure the held-out accuracy before and after (built-in task only).
    """

    model_name_or_path: str = field(
        default="smollm2-135m-instruct", metadata={"help": "Hub id, local folder, or embedded model name."}
    )
    task_size: int = field(default=2000, metadata={"help": "Problems the built-in task generates."})
    task_seed: int = field(default=1, metadata={"help": "Seed of the built-in task."})
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of such files "
            "in the trainer's format. Default: the built-in task."
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "Configuration name of a hub dataset."}
    )
    dataset_train_split: str = field(default="train", metadata={"help": "Dataset split to train on."})
    evaluate: bool = field(
        default=True,
        metadata={"help": "Print the built-in task's held-out accuracy before and after training."},
    )


@dataclass
class PairTaskScriptArguments(TaskScriptArguments):
    """What a preference command trains on, besides its config's flags (see ``TaskScriptArguments``)."""

    task_seed: int = field(default=2, metadata={"help": "Seed of the built-in preference pairs."})


def laptop_defaults(command: str, learning_rate: float, **extra: Any) -> dict[str, Any]:
    """The settings of an offline command's no-argument run on the built-in task (a few CPU minutes).

    30 steps of 8 rows at a constant ``learning_rate``, rows of at most 512 tokens, no gradient
    checkpointing, one final checkpoint, into ``<command>-smollm2-arithmetic``; ``extra`` adds or
    overrides fields.
    """
    return {
        "output_dir": f"{command}-smollm2-arithmetic",
        "max_steps": 30,
        "per_device_train_batch_size": 8,
        "learning_rate": learning_rate,
        "lr_scheduler_type": "constant",
        "max_length": 512,
        "logging_steps": 5,
        "save_steps": 30,
        "save_total_limit": 1,
        "gradient_checkpointing": False,
        "report_to": "none",
        **extra,
    }


def build_task_trainer(
    argv: list[str],
    *,
    command: str,
    summary: str,
    trainer: str,
    builtin: Callable[..., Any],
    defaults: dict[str, Any],
    script_class: type = PairTaskScriptArguments,
) -> tuple[Any, Any]:
    """Parse an offline command's ``argv`` and build its trainer on the user's data or the built-in task.

    Args:
        argv: the arguments (launcher flags removed).
        command: the command's name (``dpo``), for the messages.
        summary: the command's one-line description (``--help``).
        trainer: the public name of the trainer (``"DPOTrainer"``); its config is the matching
            ``...Config`` of ``posttrain``.
        builtin: the built-in task's dataset function (``n=..., seed=...``).
        defaults: the no-argument run's settings (``laptop_defaults``).
        script_class: the command's script arguments.

    Returns:
        ``(trainer, config)``; ``trainer.heldout`` holds the problems the held-out accuracy is
        measured on, or ``None``.
    """
    import posttrain

    trainer_class = getattr(posttrain, trainer)
    config_class = getattr(posttrain, trainer.replace("Trainer", "Config"))
    script, config = parse_config(
        argv, script_class, config_class, command=command, summary=summary, defaults=defaults
    )
    dataset = task_dataset(script, builtin)
    built = trainer_class(model=script.model_name_or_path, args=config, train_dataset=dataset)
    built.heldout = builtin_heldout(script)
    return built, config


def task_dataset(script: TaskScriptArguments, builtin: Callable[..., Any]) -> Any:
    """The user's dataset split, or the built-in task's rows from ``builtin(n=..., seed=...)``."""
    if script.dataset_name is not None:
        from posttrain.cli.datasets import load_dataset_split

        return load_dataset_split(script.dataset_name, script.dataset_config, script.dataset_train_split)
    return builtin(n=script.task_size, seed=script.task_seed)


def builtin_heldout(script: TaskScriptArguments) -> HeldOut | None:
    """The built-in task's held-out problems; ``None`` with a user's dataset or ``--evaluate false``."""
    if script.dataset_name is not None or not script.evaluate:
        return None
    from posttrain.data.tasks import arithmetic_heldout

    return HeldOut(arithmetic_heldout())


def builtin_task_accuracy(trainer: Any) -> dict[str, float] | None:
    """The greedy accuracy and ``<answer>`` format on ``trainer.heldout`` (none when it is ``None``)."""
    heldout: HeldOut | None = getattr(trainer, "heldout", None)
    if heldout is None:
        return None
    from posttrain.rewards.evaluate import task_accuracy

    return task_accuracy(
        trainer.model,
        trainer._tokenizer,
        heldout.problems,
        max_new_tokens=heldout.max_new_tokens,
        progress="held-out accuracy" if trainer.is_world_process_zero() else None,
    )


def run_training(command: str, argv: list[str], build: Builder, evaluate: Evaluator | None = None) -> Any:
    """Run the training subcommand ``command``: build the trainer from ``argv``, train, save.

    Args:
        command: the subcommand's name (``grpo``), for the relaunch and the messages.
        argv: the arguments after the subcommand's name, launcher flags included.
        build: parses the arguments and builds the trainer; its ``ValueError``, ``OSError``
            and ``ImportError`` are configuration errors.
        evaluate: measures the model before and after training; the figures are printed and
            written to ``output_dir/accuracy.json``.

    While it trains, each logging step prints one compact line (``observe.console``) instead of
    transformers' metric dict, and the full dict goes to ``output_dir/log.jsonl``.

    Returns:
        The trainer, trained and saved to ``config.output_dir``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    argv = relaunch_if_requested(command, argv)
    try:
        trainer, config = build(argv)
    except (ValueError, OSError, ImportError) as exc:
        raise CLIError(one_paragraph(exc)) from exc
    from posttrain.observe.console import use_compact_console

    use_compact_console(trainer, os.path.join(config.output_dir, LOG_FILE))
    before = evaluate(trainer) if evaluate is not None else None
    trainer.train(resume_from_checkpoint=_resume(config.resume_from_checkpoint))
    trainer.save_model(config.output_dir)
    trainer.save_state()  # trainer_state.json in output_dir, for `posttrain plot` / `report`
    if before is not None:
        _report_accuracy(
            command, before, evaluate(trainer), config.output_dir, trainer.is_world_process_zero()
        )
    if trainer.is_world_process_zero():
        print(f"posttrain {command}: saved the trained model to {config.output_dir}")
    from posttrain.models.distributed import end_process_group

    # a live gloo group can abort the process at exit; a colocated vLLM engine shuts down first
    end_process_group(before_destroy=getattr(trainer, "close_generators", None))
    return trainer


def _resume(value: Any) -> Any:
    """``--resume_from_checkpoint true`` resumes from the newest complete checkpoint."""
    if isinstance(value, str) and value.lower() == "true":
        return True
    return value


def _report_accuracy(
    command: str, before: dict[str, float], after: dict[str, float] | None, output_dir: str, main: bool
) -> None:
    """Print the task's figures before and after training and write them to ``accuracy.json``."""
    if not main or after is None:
        return
    import json

    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "accuracy.json"), "w") as f:
        json.dump({"before": before, "after": after}, f, indent=1)
    for name in before:
        print(
            f"posttrain {command}: held-out {name} {before[name]:.2f} before training, {after[name]:.2f} after"
        )


def cpu_precision_defaults(argv: list[str]) -> dict[str, Any]:
    """``bf16=True`` (with ``use_cpu=True``) for a run on a CPU with bf16 instructions, else nothing.

    Decided by measurement on an AMD EPYC with AVX512-BF16 (BENCHMARKS.md, "The default run in
    bf16"): over seeds 0, 2 and 3 the no-argument run took 0.85x float32's wall time, and its
    held-out accuracy after training (0.77, 0.77, 0.82) stayed within float32's (0.83, 0.75,
    0.81); its peak memory was about 0.6 GB higher (the sampler's bf16 copy). Elsewhere (no bf16 instructions:
    emulated bf16 is slower than float32; a GPU: the trainer's own ``bf16=None`` rule) nothing
    changes, and so it does when the user chose ``bf16``, ``fp16``, ``use_cpu`` or ``use_vllm``.

    Args:
        argv: the command's arguments (flags and ``--config`` recipe keys count as chosen).
    """
    return cpu_precision_choice(given_fields(argv))


def cpu_precision_choice(given: set[str]) -> dict[str, Any]:
    """``cpu_precision_defaults`` for a run whose chosen fields are ``given`` (``posttrain sweep``'s
    runs: the keys of its ``shared`` and ``runs`` mappings)."""
    import torch

    from posttrain.ops.precision import native_bf16

    if given & {"bf16", "fp16", "use_cpu", "use_vllm"}:
        return {}
    if torch.cuda.is_available() or not native_bf16():
        return {}
    return {"bf16": True, "use_cpu": True}


def announce_cpu_bf16(command: str) -> None:
    """Say that ``command`` trains in bf16 by the CPU rule, and how to train in float32."""
    print(
        f"posttrain {command}: training in bf16, since this CPU has bf16 instructions "
        "(docs/performance.md, 'bf16 on the CPU'). Pass --bf16 false to train in float32.",
        flush=True,
    )


def with_cpu_precision(command: str, argv: list[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``cpu_precision_defaults(argv)`` on top, said on the console when it is bf16.

    For the commands whose default run was measured in bf16 on such a host (``posttrain grpo``,
    ``posttrain sft``; BENCHMARKS.md).
    """
    chosen = {**defaults, **cpu_precision_defaults(argv)}
    if chosen.get("bf16"):
        announce_cpu_bf16(command)
    return chosen
