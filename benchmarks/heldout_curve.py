"""The held-out accuracy of a `posttrain grpo` run, measured at chosen steps during training.

Usage:
    .venv/bin/python benchmarks/heldout_curve.py --at 20,30,40 [posttrain grpo flags ...]

Builds the trainer exactly as `posttrain grpo` does with the given flags (the built-in task,
its held-out problems left out of the training prompts), trains, and at each step of ``--at``
measures the greedy accuracy on the 100 held-out problems (the same measurement as the
command's "after"), split by operation. Prints one line per measurement and, at the end, one
JSON line with every measurement. The before figure is the command's own (0.70 for the embedded
model with the default task); it is not measured again here.

This is how the default run's learning rate, temperature and step count were chosen
(BENCHMARKS.md, "The default run").
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from transformers import TrainerCallback

from posttrain.cli.grpo import _build_grpo
from posttrain.data.tasks import arithmetic_question
from posttrain.rewards.answer import answer_accuracy_reward
from posttrain.rewards.evaluate import task_accuracy


def by_operation(problems: Any, completions: list[str]) -> dict[str, str]:
    """Right answers per operator, as ``"right/total"``."""
    right = answer_accuracy_reward(
        [[{"role": "assistant", "content": c}] for c in completions], solution=problems["solution"]
    )
    counts: dict[str, list[int]] = {}
    for prompt, ok in zip(problems["prompt"], right, strict=True):
        operator = re.search(r"\d+ ([+*-]) ", arithmetic_question(prompt)).group(1)
        entry = counts.setdefault(operator, [0, 0])
        entry[0] += int(ok)
        entry[1] += 1
    return {op: f"{a}/{b}" for op, (a, b) in counts.items()}


def measure(trainer: Any) -> dict[str, Any]:
    """Greedy held-out accuracy, format and the per-operation split."""
    tokenizer = trainer._tokenizer
    decoded: list[str] = []
    decode = tokenizer.batch_decode

    def keep(*args: Any, **kwargs: Any) -> list[str]:
        out = decode(*args, **kwargs)
        decoded.extend(out)
        return out

    tokenizer.batch_decode = keep
    try:
        result = task_accuracy(
            trainer.model, tokenizer, trainer.heldout.problems, max_new_tokens=trainer.heldout.max_new_tokens
        )
    finally:
        tokenizer.batch_decode = decode
    return {**result, "by_operation": by_operation(trainer.heldout.problems, decoded)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--at", required=True, help="comma-separated steps to measure at")
    known, flags = parser.parse_known_args()
    steps = {int(s) for s in known.at.split(",")}
    trainer, _ = _build_grpo(["--save_strategy", "no", *flags])
    if trainer.heldout is None:
        sys.exit("heldout_curve.py measures the built-in task: drop --dataset_name / --evaluate false")
    points: list[dict[str, Any]] = []
    start = time.time()

    class Measure(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in steps:
                point = {
                    "step": state.global_step,
                    "elapsed_s": round(time.time() - start),
                    **measure(trainer),
                }
                points.append(point)
                print(f"heldout_curve: {point}", flush=True)

    trainer.add_callback(Measure())
    trainer.train()
    print(json.dumps({"flags": flags, "points": points}))


if __name__ == "__main__":
    main()
