"""GRPO against a real Harbor sandbox: 2 steps of the tiny model on one Harbor task, the reward from
Harbor's verifier running inside a Docker container that Harbor builds and starts.

Needs Python >= 3.12 with ``harbor`` (>= 0.26), a running Docker daemon with ``docker compose``, and
a local base image (Docker Hub is not reachable here: the task's Dockerfile builds FROM ``--image``,
by default ``local/debian:bookworm``). docs/agents.md (Harbor) gives the setup that ran this.

The tiny model cannot write tool calls, so a scripted generator writes them, as in
tests/test_env_hubs.py (whose task tree and script this reuses): in every group one episode runs
``bash`` to write ``hello`` to /workdir/answer.txt (the verifier's reward: 1.0) and the other writes
``bye`` (0.0). Everything past the generator (the adapter, Harbor, docker compose, the container,
the verifier) is real. Prints each step's ``rewards/{Class}/mean``, the tool outputs the model saw
(PID 1 of the sandbox, then the answer file) and the containers still running afterwards.

    python benchmarks/harbor_grpo.py [--image local/debian:bookworm] [--steps 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", default="local/debian:bookworm", help="the task's base image (local)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for the task tree and the trainer's output")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import importlib.metadata as metadata

    import torch
    from test_env_hubs import AlternatingBash, harbor_task_tree, hub_trainer, qwen_tokenizer

    import posttrain
    from posttrain.agents.hubs import harbor_environment, harbor_tasks

    out = Path(args.out or tempfile.mkdtemp(prefix="harbor_grpo_"))
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, harbor {metadata.version('harbor')}, "
        f"posttrain from {Path(posttrain.__file__).parent}"
    )
    dataset = harbor_tasks(harbor_task_tree(out, image=args.image))
    dockerfile = (out / "tasks" / "hello" / "environment" / "Dockerfile").read_text()
    print(f"task tree {out / 'tasks'}, Dockerfile {dockerfile!r}")

    Env = harbor_environment(environment_type="docker")  # Harbor's preflight of the docker backend
    tok = qwen_tokenizer()
    trainer = hub_trainer(
        out / "trainer", tok, Env, dataset, per_device_train_batch_size=2, max_steps=args.steps
    )
    script = AlternatingBash(tok)
    trainer.generator = script
    before = [p.detach().clone() for p in trainer.model.parameters()]
    start = time.monotonic()
    trainer.train()
    seconds = time.monotonic() - start

    key = f"rewards/{Env.__name__}/mean"
    rewards = [e[key] for e in trainer.state.log_history if key in e]
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    running = subprocess.run(
        ["docker", "ps", "--format", "{{.Names}} ({{.Status}})"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    print(f"{key} per step: {rewards}")
    print(f"training: {args.steps} steps in {seconds:.1f} s; parameters changed: {changed}")
    print(f"tool outputs the model saw: {script.tool_outputs()}")
    print(f"containers running after training: {[r for r in running if r]}")


if __name__ == "__main__":
    main()
