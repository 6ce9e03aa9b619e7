"""posttrain's DPOTrainer against TRL's, side by side, reported as ratios.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/dpo_compare.py --rounds 1 --steps 3 --lengths 256 1024
    benchmarks/.venv/bin/python benchmarks/dpo_compare.py --lengths 256 --bf16 0 1   # bf16 beside float32

For each completion length, each library runs in a fresh process (``dpo_step.py``),
alternating (posttrain, TRL, posttrain, ...) so drifts of a shared machine hit both alike. The
first step of every run is warm-up and left out. Ratios are posttrain / TRL (below 1 is better
for step time and memory).
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch_size", type=int, default=2)
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
        runs = {(lib, b): [] for b in opts.bf16 for lib in ("posttrain", "trl")}
        for _ in range(opts.rounds):
            for lib, b in runs:
                runs[lib, b].append(
                    run_step_script(
                        os.path.join(HERE, "dpo_step.py"),
                        [
                            "--library",
                            lib,
                            "--model",
                            model,
                            "--steps",
                            str(opts.steps),
                            "--completion_length",
                            str(length),
                            "--batch_size",
                            str(opts.batch_size),
                            "--gradient_checkpointing",
                            str(opts.gradient_checkpointing),
                            "--bf16",
                            str(b),
                        ],
                    )  # fmt: skip
                )
        for b in opts.bf16:
            summary = {lib: summarise(runs[lib, b]) for lib in ("posttrain", "trl")}
            p, t = summary["posttrain"], summary["trl"]
            row = {
                "host": machine, "completion_length": length, "bf16": bool(b), **summary,
                "ratio": {k: p[k] / t[k] for k in p if k != "steps_measured"},
            }  # fmt: skip
            table.append(row)
            print(json.dumps(row), flush=True)
    print()
    print(f"Host: {machine['cpu']}, {machine['cores']} cores, PyTorch CPU capability {machine['isa']}")
    print()
    print("| completion tokens | bf16 | metric | posttrain | TRL | posttrain / TRL |")
    print("|---|---|---|---|---|---|")
    for row in table:
        for key in ("step_time_s", "peak_rss_mb"):
            print(
                f"| {row['completion_length']} | {row['bf16']} | {key} | {row['posttrain'][key]:.1f} | "
                f"{row['trl'][key]:.1f} | {row['ratio'][key]:.2f} |"
            )


if __name__ == "__main__":
    main()
