"""posttrain's GKDTrainer against TRL's (``trl.experimental.gkd``), side by side, reported as ratios.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/gkd_compare.py --rounds 2 --steps 3 --lengths 256 1024
    benchmarks/.venv/bin/python benchmarks/gkd_compare.py --bf16 0 1 --lengths 256  # bf16 beside float32

For each conversation length, each library runs in a fresh process (``gkd_step.py``),
alternating (posttrain, TRL, posttrain, ...) so drifts of a shared machine hit both alike. Every
step is off-policy (``lmbda=0``: the dataset's completions, nothing generated) with the
generalised JSD (``beta=0.5``); the student and a separately loaded teacher are both the
embedded SmolLM2-135M-Instruct in float32 on the CPU (the teacher sharpened, see
``gkd_step.py``), trained in float32 or, with ``--bf16 1``, under bf16 autocast (both libraries). The first step of every run is warm-up and left out. Ratios are posttrain /
TRL (below 1 is better). The step-1 losses of both libraries are printed with the completion
tokens each divides by.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import host, model_folder  # noqa: E402
from steps import run_step_script, summarise  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--teacher_sharpen", type=float, default=1.5)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument(
        "--bf16", type=int, nargs="+", default=[0], help="0 float32, 1 bf16 autocast; both: side by side"
    )
    opts = parser.parse_args()
    model = opts.model or model_folder()
    machine = host()
    load_before = os.getloadavg()
    table = []
    for length, bf16 in [(n, b) for n in opts.lengths for b in opts.bf16]:
        runs: dict[str, list[dict]] = {"posttrain": [], "trl": []}
        for _ in range(opts.rounds):
            for lib in runs:
                runs[lib].append(
                    run_step_script(
                        os.path.join(HERE, "gkd_step.py"),
                        [
                            "--library",
                            lib,
                            "--model",
                            model,
                            "--steps",
                            str(opts.steps),
                            "--length",
                            str(length),
                            "--batch_size",
                            str(opts.batch_size),
                            "--gradient_checkpointing",
                            str(opts.gradient_checkpointing),
                            "--teacher_sharpen",
                            str(opts.teacher_sharpen),
                            "--bf16",
                            str(bf16),
                        ],
                    )  # fmt: skip
                )
        summary = {lib: summarise(r) for lib, r in runs.items()}
        p, t = summary["posttrain"], summary["trl"]
        for lib, r in runs.items():
            summary[lib]["loss_step1"] = statistics.median(x["losses"][0] for x in r)
            summary[lib]["step_times_all"] = [x["step_times"] for x in r]
            for key in ("row_tokens", "loss_tokens", "last_loss_tokens"):
                summary[lib][key] = r[0][key]
        row = {
            "host": machine, "length": length, "bf16": bool(bf16), "batch_size": opts.batch_size, **summary,
            "ratio": {k: p[k] / t[k] for k in ("step_time_s", "peak_rss_mb")},
        }  # fmt: skip
        table.append(row)
        print(json.dumps(row), flush=True)
    load_after = os.getloadavg()
    print()
    print(f"Host: {machine['cpu']}, {machine['cores']} cores, PyTorch CPU capability {machine['isa']}")
    print(f"Load average (1, 5, 15 min) before: {load_before}, after: {load_after}")
    print()
    print("| tokens per row | bf16 | metric | posttrain | TRL | posttrain / TRL |")
    print("|---|---|---|---|---|---|")
    for row in table:
        for key in ("step_time_s", "peak_rss_mb"):
            print(
                f"| {row['length']} | {int(row['bf16'])} | {key} | {row['posttrain'][key]:.1f} | "
                f"{row['trl'][key]:.1f} | {row['ratio'][key]:.2f} |"
            )
    print()
    print("| tokens per row | library | row tokens | loss tokens | step-1 loss | loss x loss tokens |")
    print("|---|---|---|---|---|---|")
    for row in table:
        for lib in ("posttrain", "trl"):
            s = row[lib]
            print(
                f"| {row['length']} | {lib} | {s['row_tokens']} | {s['loss_tokens']} | "
                f"{s['loss_step1']:.6f} | {s['loss_step1'] * s['loss_tokens']:.4f} |"
            )


if __name__ == "__main__":
    main()
