"""posttrain against TRL on the anchor config, side by side, reported as ratios.

Usage (after ``bash benchmarks/setup.sh``)::

    benchmarks/.venv/bin/python benchmarks/compare.py --rounds 2 --steps 4
    benchmarks/.venv/bin/python benchmarks/compare.py --lengths 64 256 1024 --rounds 1 --steps 2
    benchmarks/.venv/bin/python benchmarks/compare.py --trainer rloo --rounds 2 --steps 4
    benchmarks/.venv/bin/python benchmarks/compare.py --bf16 0 1 --rounds 2 --steps 4  # bf16 beside float32
    benchmarks/.venv/bin/python benchmarks/compare.py --lora_r 16 --rounds 2 --steps 4  # both train LoRA
    python benchmarks/compare.py --device cuda --bf16 1 --model /tmp/smollm2 --lengths 64 256

``--model`` takes any SmolLM2-135M folder (on a machine without the embedded package, one built
by ``benchmarks/random_model.py``: same architecture, random weights, the same work per step,
since every completion is exactly N tokens long).

Each measurement is a fresh process (``grpo_step.py``); the libraries alternate
(posttrain, TRL, posttrain, TRL, ...) so drifts of a shared machine hit both alike. The first
step of every run is warm-up and left out of the medians. Ratios are posttrain / TRL: below 1
is better for time and memory, above 1 for throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def model_folder() -> str:
    """The embedded SmolLM2-135M-Instruct as a safetensors folder (converted once)."""
    from posttrain.models.embedded import resolve_embedded

    return resolve_embedded("smollm2-135m-instruct")


def host() -> dict:
    """The CPU the ratios were measured on: they move with it (vector width, memory, BLAS paths)."""
    import platform

    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return {"cpu": name, "cores": os.cpu_count(), "isa": torch.backends.cpu.get_cpu_capability()}


def run(
    library: str,
    model: str,
    steps: int,
    length: int,
    checkpointing: int,
    device: str,
    bf16: int,
    trainer: str = "grpo",
    sampler_precision: str = "float32",
    lora_r: int = 0,
) -> dict:
    cmd = [
        sys.executable,
        os.path.join(HERE, "grpo_step.py"),
        "--library", library,
        "--model", model,
        "--steps", str(steps),
        "--completion_length", str(length),
        "--gradient_checkpointing", str(checkpointing),
        "--device", device,
        "--bf16", str(bf16),
        "--trainer", trainer,
        "--sampler_precision", sampler_precision,
        "--lora_r", str(lora_r),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{library} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    steps = [t for r in runs for t in r["step_times"][1:]] or [t for r in runs for t in r["step_times"]]
    step = statistics.median(steps)
    return {
        "step_time_s": step,
        "generated_tokens_per_s": runs[0]["generated_tokens_per_step"] / step,
        "trained_tokens_per_s": runs[0]["trained_tokens_per_step"] / step,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        **({"peak_gpu_mb": max(r["peak_gpu_mb"] for r in runs)} if "peak_gpu_mb" in runs[0] else {}),
        "steps_measured": len(steps),
        **_sampler_summary(runs),
    }


def _sampler_summary(runs: list[dict]) -> dict:
    """The reduced-precision sampler's |log p_sampler - log p_trainer| over every logged step, and its rebuilds."""
    logged = [e for r in runs for e in r.get("sampler_logp_difference", [])]
    if not logged:
        return {}
    return {
        "sampler_logp_difference_mean": statistics.fmean(e["sampling_logp_difference/mean"] for e in logged),
        "sampler_logp_difference_max": max(e["sampling_logp_difference/max"] for e in logged),
        "sampler_last_refresh_s": [r["sampler_last_refresh_s"] for r in runs],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64])
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--libraries", nargs="+", default=["posttrain", "trl"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--bf16",
        type=int,
        nargs="+",
        default=[0],
        help="0, 1, or both (0 1): each library runs at each value, alternating within a round",
    )
    parser.add_argument("--trainer", choices=["grpo", "rloo"], default="grpo")
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    parser.add_argument(
        "--sampler_precision",
        default="float32",
        help="posttrain's GRPOConfig.sampler_precision for its runs (TRL samples as it does)",
    )
    parser.add_argument(
        "--lora_r",
        type=int,
        default=0,
        help="R > 0: both libraries train a LoRA adapter of rank R (grpo_step.py)",
    )
    opts = parser.parse_args()
    model = opts.model or model_folder()
    table = []
    machine = host()  # the CPU the ratios belong to
    for length in opts.lengths:
        runs: dict[tuple[str, int], list[dict]] = {(lib, b): [] for b in opts.bf16 for lib in opts.libraries}
        for _ in range(opts.rounds):
            for lib, bf16 in runs:
                runs[(lib, bf16)].append(
                    run(
                        lib,
                        model,
                        opts.steps,
                        length,
                        opts.gradient_checkpointing,
                        opts.device,
                        bf16,
                        opts.trainer,
                        opts.sampler_precision,
                        opts.lora_r,
                    )
                )
        for bf16 in opts.bf16:
            summary = {lib: summarise(runs[(lib, bf16)]) for lib in opts.libraries}
            row = {
                "host": machine,
                "trainer": opts.trainer,
                "completion_length": length,
                "device": opts.device,
                "bf16": bool(bf16),
                "sampler_precision": opts.sampler_precision,
                "lora_r": opts.lora_r,
                **{lib: s for lib, s in summary.items()},
            }
            if {"posttrain", "trl"} <= set(summary):
                p, t = summary["posttrain"], summary["trl"]
                shared = [k for k in p if k in t and k != "steps_measured"]  # TRL has no sampler figures
                row["ratio"] = {key: p[key] / t[key] for key in shared}
            table.append(row)
            print(json.dumps(row), flush=True)
        if {0, 1} <= set(opts.bf16):  # bf16 against float32, each library, and against the peer's float32
            step = {key: summarise(r)["step_time_s"] for key, r in runs.items()}
            cross = {
                f"{lib} bf16 / {other} float32": step[(lib, 1)] / step[(other, 0)]
                for lib in opts.libraries
                for other in opts.libraries
            }
            print(json.dumps({"completion_length": length, "step_time_ratio": cross}), flush=True)
    print()
    print(f"Host: {machine['cpu']}, {machine['cores']} cores, PyTorch CPU capability {machine['isa']}")
    print()
    print("| length | bf16 | metric | posttrain | TRL | posttrain / TRL |")
    print("|---|---|---|---|---|---|")
    for row in table:
        if "ratio" not in row:
            continue
        keys = ("step_time_s", "generated_tokens_per_s", "trained_tokens_per_s", "peak_rss_mb")
        for key in keys + (("peak_gpu_mb",) if "peak_gpu_mb" in row["ratio"] else ()):
            print(
                f"| {row['completion_length']} | {int(row['bf16'])} | {key} | {row['posttrain'][key]:.2f} | {row['trl'][key]:.2f} "
                f"| {row['ratio'][key]:.2f} |"
            )


if __name__ == "__main__":
    main()
