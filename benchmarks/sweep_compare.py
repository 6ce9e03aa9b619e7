"""A sweep of N LoRA runs against the same N runs as separate ``posttrain grpo --use_peft`` processes.

Usage (posttrain's environment, nothing else running)::

    .venv/bin/python benchmarks/sweep_compare.py [--runs 4] [--steps 5] [--evaluate true] [--order sweep-first]
        [--shared_generation false|true|both] [--use_vllm false|true]

The runs are the default GRPO task (``posttrain grpo``'s no-argument settings, ``--max_steps
STEPS``), each a rank-16 LoRA adapter on every linear layer, at the learning rates of
``recipes/sweeps/lora-rates.yaml`` (5e-5, 2e-4, 2e-4 with beta 0.04, 5e-4; more runs repeat
them with other seeds). Side A: one ``posttrain sweep`` process. Side B: the same runs, one
``posttrain grpo --use_peft`` process after another. Each process runs under ``/usr/bin/time -v``
(wall time, peak resident memory). Prints the totals and the ratios as JSON: the sweep's wall time
against the sum of the separate runs', and its peak memory against the sum of their peaks (what
N runs at once as separate processes would need). ``--shared_generation both`` runs the sweep
twice, without and with one shared generation call per round, around the separate side (sweep
without, separate, sweep with), and reports a ratio for each. ``--use_vllm true`` (run it with the
interpreter of an environment holding vLLM, such as CI's ``.venv-vllm``) samples with a colocated
vLLM engine on both sides: the sweep's runs share one engine, each its adapter in a slot of its own;
each separate process builds its own.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

RATES = [
    ("lr-5e-5", 5e-5, {}),
    ("lr-2e-4", 2e-4, {}),
    ("lr-2e-4-kl", 2e-4, {"beta": 0.04}),
    ("lr-5e-4", 5e-4, {}),
]
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": "all-linear"}


def runs(count: int) -> list[tuple[str, dict]]:
    """``count`` runs: the four of the recipe, then the same with seeds 1, 2, ..."""
    out = []
    for index in range(count):
        name, rate, extra = RATES[index % len(RATES)]
        seed = index // len(RATES)
        out.append((f"{name}-s{seed}", {"learning_rate": rate, "seed": seed, **extra}))
    return out


def timed(command: list[str], log: str) -> dict[str, float]:
    """Run ``command`` under ``/usr/bin/time -v``; its wall seconds and peak RSS in MB."""
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(["/usr/bin/time", "-v", *command], stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    text = open(log).read()
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1)) / 1024
    return {"seconds": round(wall, 1), "peak_mb": round(peak)}


#: ``--use_vllm true``: the flags both sides add (a colocated engine in the trainer's process)
VLLM: dict[str, object] = {}


def sweep_side(folder: str, steps: int, count: int, evaluate: str, shared: bool) -> dict[str, float]:
    import yaml

    spec = {"output_dir": os.path.join(folder, "sweep"), "lora": LORA, "shared": {"max_steps": steps, **VLLM},
            "runs": dict(runs(count)), "shared_generation": shared}  # fmt: skip
    path = os.path.join(folder, "sweep.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    command = [
        os.path.join(os.path.dirname(sys.executable), "posttrain"),
        "sweep",
        path,
        "--evaluate",
        evaluate,
    ]
    return timed(command, os.path.join(folder, "sweep.log"))


def separate_side(folder: str, steps: int, count: int, evaluate: str, shared: bool) -> dict[str, float]:
    total = {"seconds": 0.0, "peak_mb_sum": 0, "peak_mb_max": 0}
    for name, flags in runs(count):
        command = [os.path.join(os.path.dirname(sys.executable), "posttrain"), "grpo", "--use_peft", "true",
                   "--lora_r", "16", "--lora_alpha", "32", "--lora_dropout", "0.05",
                   "--lora_target_modules", "all-linear", "--max_steps", str(steps), "--evaluate", evaluate,
                   "--output_dir", os.path.join(folder, name), "--disable_tqdm", "true"]  # fmt: skip
        for key, value in {**flags, **VLLM}.items():
            command += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        one = timed(command, os.path.join(folder, f"{name}.log"))
        total["seconds"] += one["seconds"]
        total["peak_mb_sum"] += one["peak_mb"]
        total["peak_mb_max"] = max(total["peak_mb_max"], one["peak_mb"])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--evaluate", default="true", choices=["true", "false"])
    parser.add_argument("--order", default="sweep-first", choices=["sweep-first", "separate-first"])
    parser.add_argument("--shared_generation", default="false", choices=["true", "false", "both"])
    parser.add_argument("--use_vllm", default="false", choices=["true", "false"])
    args = parser.parse_args()
    if args.use_vllm == "true":
        VLLM.update(use_vllm=True, vllm_mode="colocate")
    folder = tempfile.mkdtemp(prefix="sweep-compare-")
    modes = {"both": ["false", "true"]}.get(args.shared_generation, [args.shared_generation])
    sweeps = [("sweep" if len(modes) == 1 else f"sweep_shared_{mode}", mode) for mode in modes]
    order = (
        [*sweeps, ("separate", "false")] if args.order == "sweep-first" else [("separate", "false"), *sweeps]
    )
    if len(sweeps) == 2:  # the separate side between the two sweeps
        order = [sweeps[0], ("separate", "false"), sweeps[1]]
    result = {}
    for side, mode in order:
        os.makedirs(os.path.join(folder, side), exist_ok=True)
        run = separate_side if side == "separate" else sweep_side
        result[side] = run(os.path.join(folder, side), args.steps, args.runs, args.evaluate, mode == "true")
        print(side, result[side], flush=True)
    separate = result["separate"]
    for side, _ in sweeps:
        suffix = "" if side == "sweep" else side[len("sweep") :]
        result[f"time_ratio{suffix}"] = round(result[side]["seconds"] / separate["seconds"], 3)
        result[f"memory_ratio_vs_summed_peaks{suffix}"] = round(
            result[side]["peak_mb"] / separate["peak_mb_sum"], 3
        )
        result[f"memory_ratio_vs_one_run{suffix}"] = round(
            result[side]["peak_mb"] / separate["peak_mb_max"], 3
        )
    result["settings"] = {"runs": args.runs, "steps": args.steps, "evaluate": args.evaluate, "folder": folder,
                          "shared_generation": args.shared_generation, "use_vllm": args.use_vllm}  # fmt: skip
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
