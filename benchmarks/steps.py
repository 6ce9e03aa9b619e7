"""Shared pieces of the offline trainers' side-by-side benchmarks (SFT, DPO).

``StepClock`` times each optimizer step of a run (a ``TrainerCallback``); ``run_step_script``
starts one library's measured run in a fresh process (so its peak memory is its own) and reads
the JSON line it prints; ``summarise`` reduces a list of runs, leaving out each run's first
(warm-up) step.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from transformers import TrainerCallback


class StepClock(TrainerCallback):
    """Records the wall time and the tokens seen at the start and end of every optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(int(state.num_input_tokens_seen))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())
        self.tokens.append(int(state.num_input_tokens_seen))

    def step_times(self) -> list[float]:
        return [b - a for a, b in zip(self.times[0::2], self.times[1::2], strict=False)]

    def step_tokens(self) -> list[int]:
        return [b - a for a, b in zip(self.tokens[0::2], self.tokens[1::2], strict=False)]


def run_step_script(script: str, args: list[str]) -> dict:
    """Run ``python script ARGS`` and return the JSON object of its last output line."""
    out = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    """Median step time (and tokens per second when counted) and the largest peak RSS, warm-up left out."""
    times = [t for r in runs for t in r["step_times"][1:]]
    out = {"step_time_s": statistics.median(times), "peak_rss_mb": max(r["peak_rss_mb"] for r in runs)}
    if all(r.get("step_tokens") for r in runs):
        rates = [
            n / t for r in runs for t, n in list(zip(r["step_times"], r["step_tokens"], strict=True))[1:]
        ]
        out["tokens_per_s"] = statistics.median(rates)
    out["steps_measured"] = len(times)
    return out
