"""One GRPO trainer on the anchor config; its steps alternate two versions of ``ops/chunked.py``.

Usage::

    git show REV:src/posttrain/ops/chunked.py > /tmp/previous_chunked.py
    benchmarks/.venv/bin/python benchmarks/head_alternation.py --previous /tmp/previous_chunked.py \\
        --bf16 1 --steps 14

Even steps score with the module at ``--previous`` (loaded under another name), odd steps with
the installed ``posttrain.ops.chunked``; the loss forward and backward of every step are timed
(wall, process CPU time, minor page faults). Both versions run in the same process on the same
weights and the same kind of batch, so a shared machine's drift and the process's memory state
fall on both alike, which separate processes on this project's noisy 2-core hosts do not give.
The first two steps are warm-up. Printed per version: the medians and the minimum.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--previous", required=True, help="path of the other ops/chunked.py")
    parser.add_argument("--bf16", type=int, default=1)
    parser.add_argument("--steps", type=int, default=14)
    opts = parser.parse_args()

    from datasets import Dataset
    from grpo_step import QUESTION, anchor_kwargs, digit_reward, length_reward
    from transformers import TrainerCallback

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.models.embedded import resolve_embedded
    from posttrain.ops import chunked, online_logps, sequence_stats, shared_prefix

    spec = importlib.util.spec_from_file_location("previous_chunked", opts.previous)
    previous = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(previous)
    versions = {"previous": previous, "current": chunked}
    now = {"name": "previous"}
    rows: list[tuple[str, float, float, int]] = []

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            now["name"] = "previous" if state.global_step % 2 == 0 else "current"
            for caller in (online_logps, shared_prefix, sequence_stats):
                caller.chunked = versions[now["name"]]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": QUESTION}]] * 64})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(**anchor_kwargs(out, 64, opts.steps, 8, True, bool(opts.bf16)))
        trainer = GRPOTrainer(
            model=resolve_embedded("smollm2-135m-instruct"),
            reward_funcs=[length_reward, digit_reward],
            args=args,
            train_dataset=dataset,
            callbacks=[Alternate()],
        )
        loss, backward, start = trainer.compute_loss, trainer.accelerator.backward, {}

        def timed_loss(*a, **k):
            start["usage"], start["wall"] = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            return loss(*a, **k)

        def timed_backward(*a, **k):
            result = backward(*a, **k)
            usage, before = resource.getrusage(resource.RUSAGE_SELF), start["usage"]
            cpu = usage.ru_utime - before.ru_utime + usage.ru_stime - before.ru_stime
            faults = usage.ru_minflt - before.ru_minflt
            rows.append((now["name"], time.perf_counter() - start["wall"], cpu, faults))
            return result

        trainer.compute_loss, trainer.accelerator.backward = timed_loss, timed_backward
        trainer.train()
    for name in versions:
        mine = [r for r in rows[2:] if r[0] == name]
        print(
            f"{name}: {'bf16' if opts.bf16 else 'float32'}, {len(mine)} steps, loss forward + backward "
            f"median {statistics.median(r[1] for r in mine):.3f} s (min {min(r[1] for r in mine):.3f}), "
            f"CPU {statistics.median(r[2] for r in mine):.3f} s, page faults {statistics.median(r[3] for r in mine):.0f}"
        )


if __name__ == "__main__":
    main()
