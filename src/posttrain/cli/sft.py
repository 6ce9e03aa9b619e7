"""``posttrain sft``: supervised fine-tuning from the command line.

Every ``SFTConfig`` field is a flag, next to the :class:`SFTScriptArguments` below. With no
arguments it fine-tunes the embedded SmolLM2-135M-Instruct on the built-in worked arithmetic
answers (``data.tasks.arithmetic_sft_dataset``), on CPU, prints the held-out accuracy before
and after (100 fixed problems the training rows never contain, greedy), writes it to
``output_dir/accuracy.json``, and saves the model, which ``posttrain grpo
--model_name_or_path <output_dir>`` can then train further.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.cli.options import parse_config
from posttrain.cli.training import (
    TaskScriptArguments,
    builtin_heldout,
    builtin_task_accuracy,
    run_training,
    task_dataset,
    with_cpu_precision,
)

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
class SFTScriptArguments(TaskScriptArguments):
    """What to train on, besides the ``SFTConfig`` flags (see ``TaskScriptArguments``)."""


def _build_sft(argv: list[str]) -> tuple[Any, Any]:
    """Parse ``argv`` and build the trainer; every error here is a configuration error."""
    from posttrain import SFTConfig, SFTTrainer

    # The CPU precision rule of `posttrain grpo`, measured for SFT's own default run too: on an
    # AVX512-BF16 host, seeds 42, 1 and 2 took 0.80x float32's wall time and ended at 0.66, 0.72
    # and 0.74 against float32's 0.70, 0.68 and 0.73 (BENCHMARKS.md, "The SFT default run in bf16").
    defaults = with_cpu_precision("sft", argv, LAPTOP_DEFAULTS)
    script, config = parse_config(
        argv,
        SFTScriptArguments,
        SFTConfig,
        command="sft",
        summary="Fine-tune with SFT.",
        defaults=defaults,
    )
    from posttrain.data.tasks import arithmetic_sft_dataset

    dataset = task_dataset(script, arithmetic_sft_dataset)
    trainer = SFTTrainer(model=script.model_name_or_path, args=config, train_dataset=dataset)
    trainer.heldout = builtin_heldout(script)
    return trainer, config


def sft(argv: list[str]) -> Any:
    """Fine-tune with SFT (every SFTConfig field is a flag; --config RECIPE.yaml reads a recipe).

    Parses ``argv``, trains and saves the model; returns the trainer. With no flags: the
    embedded SmolLM2-135M-Instruct on the built-in worked arithmetic answers, with the held-out
    accuracy before and after. The ``--accelerate_*`` launcher flags work as for ``posttrain grpo``.

    Raises:
        CLIError: bad input, found before training starts.
    """
    return run_training("sft", argv, _build_sft, builtin_task_accuracy)
