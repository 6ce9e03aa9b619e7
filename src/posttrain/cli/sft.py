"""``posttrain sft``: supervised fine-tuning from the command line.

Every ``SFTConfig`` field is a flag, next to the :class:`SFTScriptArguments` below. With no
arguments it fine-tunes the embedded SmolLM2-135M-Instruct on the built-in worked arithmetic
answers (``data.tasks.arithmetic_sft_dataset``), on CPU, prints the held-out accuracy before
and after (100 fixed problems the training rows never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model, which ``posttrain grpo
--model_name_or_path <output_dir>`` can then train further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.cli.datasets import load_dataset_split
from posttrain.cli.options import parse_config
from posttrain.cli.training import run_training

# Settings of the no-argument run: a real SFT job that ends within minutes on a laptop CPU.
LAPTOP_DEFAULTS: dict[str, Any] = {
    "output_dir": "sft-smollm2-arithmetic",
    "max_steps": 20,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-5,
    "lr_scheduler_type": "constant",
    "max_length": 512,
    "logging_steps": 5,
    "save_steps": 20,
    "save_total_limit": 1,
    "gradient_checkpointing": False,
    "report_to": "none",
}


@dataclass
class SFTScriptArguments:
    """What to train on, besides the ``SFTConfig`` flags.

    Attributes:
        model_name_or_path: hub id, local folder, or an embedded name.
        task_size: worked answers the built-in task generates (used without ``dataset_name``).
        task_seed: seed of the built-in task.
        dataset_name: a hub dataset id, or a local ``.json``/``.jsonl``/``.csv``/``.parquet``
            file or a folder of such files, in an SFT format, instead of the built-in task.
        dataset_config: the hub dataset's configuration name.
        dataset_train_split: the split to train on.
        evaluate: measure the held-out accuracy before and after (built-in task only).
    """

    model_name_or_path: str = field(
        default="smollm2-135m-instruct", metadata={"help": "Hub id, local folder, or embedded model name."}
    )
    task_size: int = field(default=2000, metadata={"help": "Worked answers the built-in task generates."})
    task_seed: int = field(default=1, metadata={"help": "Seed of the built-in task."})
    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Hub dataset id, or a local .json/.jsonl/.csv/.parquet file or folder of such files "
            "(text, messages, prompt/completion or input_ids columns). Default: the built-in task."
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


def _build_sft(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import SFTConfig, SFTTrainer

    script, config = parse_config(
        argv,
        SFTScriptArguments,
        SFTConfig,
        command="sft",
        summary="Fine-tune with SFT.",
        defaults=LAPTOP_DEFAULTS,
    )
    if script.dataset_name is not None:
        dataset = load_dataset_split(script.dataset_name, script.dataset_config, script.dataset_train_split)
    else:
        from posttrain.data.tasks import arithmetic_sft_dataset

        dataset = arithmetic_sft_dataset(n=script.task_size, seed=script.task_seed)
    trainer = SFTTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.builtin_task = script.dataset_name is None and script.evaluate
    return trainer, config


def _evaluate(trainer: Any) -> dict[str, float] | None:
    """The held-out accuracy of the built-in task (none for a user's dataset)."""
    if not getattr(trainer, "builtin_task", False):
        return None
    from posttrain.data.tasks import arithmetic_heldout
    from posttrain.rewards.evaluate import task_accuracy

    return task_accuracy(trainer.model, trainer._tokenizer, arithmetic_heldout(), max_new_tokens=40)


def sft(argv: list[str]) -> Any:
    """Fine-tune with SFT (every SFTConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct on the built-in worked arithmetic answers, with the held-out
    accuracy before and after. The ``--accelerate_*`` launcher flags work as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("sft", argv, _build_sft, _evaluate)
