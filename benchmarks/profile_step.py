"""Where a posttrain step on the anchor config goes: wall time per phase, per step.

Usage::

    benchmarks/.venv/bin/python benchmarks/profile_step.py --steps 4 [--completion_length 64]
        [--gradient_checkpointing 1] [--bf16 0] [--share_prompts 1] [--lean 1] [--fused 1] [--heap 0]
        [--device cpu|cuda] [--lora_r 0]

Wraps the trainer's phases with timers (generation, rewards and advantages, loss forward,
backward, optimizer step; inside generation, the shared prompt's prefill, the fused step's build
with its weight copy, and the sampling loop) and prints, per phase, the median over the steps after the first
(warm-up) of its wall time and of its minor page faults (``median_minor_faults``), the peak RSS, and the largest anonymous and file-backed resident memory seen in each
phase (sampled every 5 ms). ``--heap 1`` adds, per phase, the most bytes glibc's malloc had in
use (heap and mmapped blocks, ``mallinfo2``) and the heap's size and free bytes at that moment:
resident memory above what malloc has in use is freed heap that stays resident. Same config
as ``grpo_step.py``. With ``--device cuda`` every timer waits for the GPU's queue at its start
and end, so a phase's time is its own kernels' (the JSON adds the GPU's peak allocated memory).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import ctypes.util
import json
import os
import resource
import statistics
import tempfile
import threading
import time
from typing import Any

CURRENT = {"phase": "setup"}
SYNC: list[Any] = [lambda: None]  # torch.cuda.synchronize with --device cuda
FAULTS: collections.defaultdict[str, int] = collections.defaultdict(int)  # minor page faults per phase


def timed(store: dict[str, float], name: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        SYNC[0]()
        start, outer = time.perf_counter(), CURRENT["phase"]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        CURRENT["phase"] = name
        try:
            return fn(*args, **kwargs)
        finally:
            SYNC[0]()
            store[name] += time.perf_counter() - start
            FAULTS[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            CURRENT["phase"] = outer

    return wrapper


#: Phases inside others ("prepare inputs" holds generation and rewards): left out of "other".
NESTED = {"generation", "rewards", "prefill", "fused step build", "sampling loop"}


def time_generation_parts(store: dict[str, float]) -> None:
    """Time generation's parts: the prompts' prefill run once, the fused decode step's build (its
    packed or reduced-precision weight copy), and the sampling loop around the decode steps."""
    from posttrain.generation import fused_step, transformers_backend

    for name in ("prefill_shared_prefix", "prefill_common_prefix"):
        setattr(transformers_backend, name, timed(store, "prefill", getattr(transformers_backend, name)))
    for name in ("lean_generate", "lean_generate_with_logps"):
        setattr(
            transformers_backend, name, timed(store, "sampling loop", getattr(transformers_backend, name))
        )
    fused_step.FusedDecoder.__init__ = timed(store, "fused step build", fused_step.FusedDecoder.__init__)


def resident() -> dict[str, int]:
    """RssAnon and RssFile of this process, in MB (Linux)."""
    values = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon", "RssFile")):
                key, amount = line.split(":")
                values[key] = int(amount.split()[0]) // 1024
    return values


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (all arenas): ``arena`` heap bytes, ``hblkhd`` mmapped blocks, ``uordblks`` in use."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def heap_stats() -> dict[str, int]:
    """malloc's view, in MB: heap size, bytes in use (heap + mmapped blocks), free heap bytes (glibc only)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return {
        "heap": info.arena >> 20,
        "malloc_in_use": (info.uordblks + info.hblkhd) >> 20,
        "heap_free": info.fordblks >> 20,
    }


def sample_memory(peaks: dict[str, dict[str, int]], stop: threading.Event, heap: bool) -> None:
    """Every 5 ms: the largest anonymous RSS seen in each phase (and the file-backed RSS then).

    With ``heap``, also the largest bytes in use by malloc in the phase and the heap's size then.
    """
    while not stop.wait(0.005):
        now, phase = resident(), f"{CURRENT['phase']} (step {CURRENT.get('step', '-')})"
        if now.get("RssAnon", 0) > peaks.get(phase, {}).get("RssAnon", -1):
            peaks[phase] = {**peaks.get(phase, {}), **now}
        if heap:
            stats = heap_stats()
            if stats["malloc_in_use"] > peaks.get(phase, {}).get("malloc_in_use", -1):
                peaks.setdefault(phase, {}).update(stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--bf16", type=int, default=0)
    parser.add_argument("--share_prompts", type=int, default=1)
    parser.add_argument("--lean", type=int, default=1, help="the lean sampling loop (0: generate)")
    parser.add_argument(
        "--heap", type=int, default=0, help="also sample glibc malloc's bytes in use and heap size"
    )
    parser.add_argument(
        "--fused", type=int, default=1, help="the lean loop's fused decode step (0: the model's forward)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--lora_r", type=int, default=0, help="R > 0: train a LoRA adapter of rank R (grpo_step.py)"
    )
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    cuda = opts.device == "cuda"
    if cuda:
        SYNC[0] = torch.cuda.synchronize

    from datasets import Dataset
    from grpo_step import QUESTION, anchor_kwargs, digit_reward, length_reward, lora_config
    from transformers import TrainerCallback

    from posttrain import GRPOConfig, GRPOTrainer
    from posttrain.models.embedded import resolve_embedded
    from posttrain.ops import logprobs

    if not opts.share_prompts:
        original = logprobs.completion_logps
        logprobs_fn = lambda *a, **k: original(*a, **{**k, "share_prompts": False})  # noqa: E731
        import posttrain.grpo.trainer as trainer_module

        trainer_module.completion_logps = logprobs_fn

    question = QUESTION
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": question}]] * 64})
    phases: dict[str, float] = collections.defaultdict(float)
    per_step: list[dict[str, float]] = []
    faults: list[dict[str, int]] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            CURRENT["step"] = state.global_step
            SYNC[0]()
            phases.clear()
            FAULTS.clear()
            phases["_start"] = time.perf_counter()
            FAULTS["_start"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt

        def on_step_end(self, args, state, control, **kwargs):
            SYNC[0]()
            total = time.perf_counter() - phases.pop("_start")
            row = dict(phases)
            row["other"] = total - sum(v for k, v in row.items() if k not in NESTED)
            row["step"] = total
            per_step.append(row)
            step_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - FAULTS.pop("_start")
            faults.append({**FAULTS, "step": step_faults})

    n = opts.completion_length
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            **anchor_kwargs(
                out, n, opts.steps, 8, bool(opts.gradient_checkpointing), bool(opts.bf16), use_cpu=not cuda
            )
        )
        trainer = GRPOTrainer(
            model=opts.model or resolve_embedded("smollm2-135m-instruct"),
            reward_funcs=[length_reward, digit_reward],
            args=args,
            train_dataset=dataset,
            callbacks=[Clock()],
            peft_config=lora_config(opts.lora_r) if opts.lora_r else None,
        )
        trainer.generator.lean = bool(opts.lean)
        trainer.generator.fused_step = bool(opts.fused)
        trainer.generator.generate = timed(phases, "generation", trainer.generator.generate)
        time_generation_parts(phases)
        trainer.rewards.score = timed(phases, "rewards", trainer.rewards.score)
        trainer.compute_loss = timed(phases, "loss forward", trainer.compute_loss)
        trainer.accelerator.backward = timed(phases, "backward", trainer.accelerator.backward)
        trainer.accelerator.clip_grad_norm_ = timed(phases, "clip", trainer.accelerator.clip_grad_norm_)
        trainer._prepare_inputs = timed(phases, "prepare inputs", trainer._prepare_inputs)
        create = trainer.create_optimizer

        def create_and_time(*a: Any, **k: Any) -> Any:
            optimizer = create(*a, **k)
            optimizer.step = timed(phases, "optimizer", optimizer.step)
            return optimizer

        trainer.create_optimizer = create_and_time
        peaks: dict[str, dict[str, int]] = {}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_memory, args=(peaks, stop, bool(opts.heap)), daemon=True)
        sampler.start()
        CURRENT["phase"] = "other"
        trainer.train()
        stop.set()
    measured = per_step[1:] or per_step
    names = [k for k in measured[0] if k != "step"] + ["step"]
    summary = {k: statistics.median(r.get(k, 0.0) for r in measured) for k in names}
    summary["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if cuda:
        summary["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    gen = trainer.generator
    path = getattr(gen, "path", None)
    summary["generation_path"] = getattr(path, "taken", None)
    summary["fused_blocker"] = getattr(path, "fused_blocker", None)
    summary["cuda_graph_blocker"] = getattr(path, "cuda_graph_blocker", None)
    measured_faults = faults[1:] or faults
    fault_summary = {k: statistics.median(r.get(k, 0) for r in measured_faults) for k in measured_faults[0]}
    print(
        json.dumps(
            {
                "options": vars(opts),
                "median_s": summary,
                "median_minor_faults": fault_summary,
                "peak_rss_by_phase_mb": peaks,
            }
        )
    )


if __name__ == "__main__":
    main()
