"""posttrain's SFTTrainer against TRL's, side by side, reported as ratios.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/sft_compare.py --rounds 1 --steps 4 --lengths 512 2048
    benchmarks/.venv/bin/python benchmarks/sft_compare.py --lengths 512 --packing 0 --bf16 0 1   # bf16 beside float32

For each ``max_length`` and with and without packing, each library runs in a fresh process
(``sft_step.py``), alternating (posttrain, TRL, posttrain, ...) so drifts of a shared machine hit
both alike. The first step of every run is warm-up and left out. Tokens per second are real
(non-padding) tokens trained per second of step time; ratios are posttrain / TRL (above 1 is
better for tokens per second, below 1 for memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import host, model_folder  # noqa: E402
from steps import run_step_script, summarise  # noqa: E402


def run(
    library: str, model: str, steps: int, length: int, packing: int, batch: int, checkpointing: int, bf16: int
) -> dict:
    return run_step_script(
        os.path.join(HERE, "sft_step.py"),
        ["--library", library, "--model", model, "--steps", str(steps), "--max_length", str(length),
         "--packing", str(packing), "--batch_size", str(batch), "--gradient_checkpointing", str(checkpointing),
         "--bf16", str(bf16)],
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--packing", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument(
        "--bf16", type=int, nargs="+", default=[0], help="0, 1, or both (0 1): alternating within a round"
    )
    opts = parser.parse_args()
    model = opts.model or model_folder()
    machine = host()
    table = []
    for length in opts.lengths:
        for packing in opts.packing:
            runs = {(lib, b): [] for b in opts.bf16 for lib in ("posttrain", "trl")}
            for _ in range(opts.rounds):
                for lib, b in runs:
                    runs[lib, b].append(
                        run(
                            lib,
                            model,
                            opts.steps,
                            length,
                            packing,
                            opts.batch_size,
                            opts.gradient_checkpointing,
                            b,
                        )
                    )
            for b in opts.bf16:
                summary = {lib: summarise(runs[lib, b]) for lib in ("posttrain", "trl")}
                p, t = summary["posttrain"], summary["trl"]
                row = {
                    "host": machine, "max_length": length, "packing": bool(packing), "bf16": bool(b), **summary,
                    "ratio": {k: p[k] / t[k] for k in p if k != "steps_measured"},
                }  # fmt: skip
                table.append(row)
                print(json.dumps(row), flush=True)
    print()
    print(f"Host: {machine['cpu']}, {machine['cores']} cores, PyTorch CPU capability {machine['isa']}")
    print()
    print("| max_length | packing | bf16 | metric | posttrain | TRL | posttrain / TRL |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        for key in ("tokens_per_s", "step_time_s", "peak_rss_mb"):
            print(
                f"| {row['max_length']} | {row['packing']} | {row['bf16']} | {key} | {row['posttrain'][key]:.1f} | "
                f"{row['trl'][key]:.1f} | {row['ratio'][key]:.2f} |"
            )


if __name__ == "__main__":
    main()
