"""Reward curves of several runs side by side: each run's ``log.jsonl`` (written by ``posttrain
grpo``), the total reward per step as points and its rolling mean as a line, one colour per run.

Usage: ``.venv/bin/python benchmarks/reward_runs_plot.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
[--metric reward]``. Also prints, per run, the mean of ``--metric`` over the first and the last 10
steps, and the mean of every ``sampling/*`` metric the run logged.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from posttrain.observe.plots import rolling_mean, rolling_window


def read_log(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "log.jsonl")) as f:
        return [row for row in map(json.loads, f) if "step" in row and "loss" in row]


def mean(values: list[float]) -> float:
    numbers = [v for v in values if v is not None and not math.isnan(v)]
    return sum(numbers) / len(numbers) if numbers else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("runs", nargs="+", help="LABEL=RUN_DIR")
    parser.add_argument("--metric", default="reward")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for spec in args.runs:
        label, run_dir = spec.split("=", 1)
        rows = read_log(run_dir)
        steps = [r["step"] for r in rows]
        values = [r.get(args.metric, float("nan")) for r in rows]
        (points,) = ax.plot(steps, values, ".", alpha=0.35)
        ax.plot(
            steps,
            rolling_mean(values, rolling_window(len(values))),
            "-",
            color=points.get_color(),
            label=label,
        )
        sampling = sorted({k for r in rows for k in r if k.startswith("sampling/")})
        summary = {k: round(mean([r.get(k) for r in rows]), 4) for k in sampling}
        print(
            f"{label}: {len(rows)} steps; {args.metric} first 10 {mean(values[:10]):.3f}, "
            f"last 10 {mean(values[-10:]):.3f}; {json.dumps(summary)}"
        )
    ax.set_xlabel("step")
    ax.set_ylabel(args.metric)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
