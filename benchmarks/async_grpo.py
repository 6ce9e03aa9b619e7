"""Asynchronous against synchronous GRPO on the embedded model: wall time per 100 optimizer steps
and the reward curves, at equal settings.

Usage: python benchmarks/async_grpo.py [--steps 100] [--staleness 1] [--out /tmp/async_bench]

Runs ``posttrain grpo`` and ``posttrain grpo-async --max_staleness S`` one after the other, in
fresh processes, with the same no-flag laptop settings (the arithmetic task, 1 prompt x 8
completions of up to 64 tokens per step, lr 1e-6, a constant schedule for both) and
``--max_steps``, each with its held-out
accuracy before and after with ``--evaluate true``. Reads each run's ``log.jsonl`` (and
``accuracy.json``) and prints a
JSON summary: wall time per 100 steps (``train_runtime`` scaled), peak RSS, the reward of each
step, the mean reward of the first and last 10 steps, and the held-out figures.

TRL's AsyncGRPOTrainer needs a running vLLM server (a CUDA GPU), so it is not run here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from typing import Any


def run(command: list[str], out: str) -> dict[str, Any]:
    """One CLI run under /usr/bin/time -v; its figures."""
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    timed = ["/usr/bin/time", "-v", *command, "--output_dir", out, "--save_strategy", "no"]
    proc = subprocess.run(timed, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    logs = [json.loads(line) for line in open(os.path.join(out, "log.jsonl"))]
    steps = [h for h in logs if "loss" in h and "reward" in h]
    runtime = next(h["train_runtime"] for h in logs if "train_runtime" in h)
    path = os.path.join(out, "accuracy.json")
    accuracy = json.load(open(path)) if os.path.isfile(path) else None
    rewards = [h["reward"] for h in steps]
    return {
        "steps": len(steps),
        "train_runtime_s": runtime,
        "seconds_per_100_steps": runtime / max(len(steps), 1) * 100,
        "peak_rss_mb": int(peak.group(1)) / 1024 if peak else None,
        "reward_first_10": sum(rewards[:10]) / max(len(rewards[:10]), 1),
        "reward_last_10": sum(rewards[-10:]) / max(len(rewards[-10:]), 1),
        "rewards": rewards,
        "staleness": [h.get("batch/staleness") for h in steps if "batch/staleness" in h][:5],
        "accuracy": accuracy,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--staleness", type=int, default=1)
    parser.add_argument("--out", default="/tmp/async_bench")
    parser.add_argument("--evaluate", default="false", help="held-out accuracy before and after (true/false)")
    args = parser.parse_args()
    cli = [sys.executable, "-m", "posttrain.cli.main"]
    common = ["--max_steps", str(args.steps), "--lr_scheduler_type", "constant", "--evaluate", args.evaluate]
    result = {
        "sync": run([*cli, "grpo", *common], os.path.join(args.out, "sync")),
        "async": run(
            [*cli, "grpo-async", *common, "--max_staleness", str(args.staleness)],
            os.path.join(args.out, "async"),
        ),
    }
    result["async_over_sync_time"] = result["async"]["train_runtime_s"] / result["sync"]["train_runtime_s"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
