"""Run by tests/test_preference_distributed.py under torchrun: a preference trainer on 2 CPU
processes (DDP, gloo) and, for comparison, the same global batches on one process.

Usage: ``preference_ddp_train.py OUT_DIR FAMILY`` (a key of :data:`FAMILIES`). Each rank trains
3 SGD steps of 2 pairs (the 12 pairs of :func:`dataset`, rows of varied lengths so the ranks'
batches differ) and writes OUT_DIR/rank{r}.json with a digest of its parameters and its logs;
rank 0 writes OUT_DIR/ddp.pt with the parameters. SGD without clipping keeps the update linear
in the gradient, so a wrong loss scale across processes shows in the parameters.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from conftest import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import CPU_TEST_ARGS  # noqa: E402

from posttrain.models import distributed  # noqa: E402

NUM_ROWS = 12

BASE_ARGS: dict[str, Any] = {
    **CPU_TEST_ARGS,
    "per_device_train_batch_size": 2,
    "max_steps": 3,
    "optim": "sgd",
    "learning_rate": 0.5,
    "lr_scheduler_type": "constant",
    "max_grad_norm": 1e9,
    "seed": 1,
    "max_length": 64,
}


def dataset() -> Dataset:
    """Preference pairs with prompts and completions of varied lengths."""
    words = "one two three four five six seven eight nine ten".split()
    return Dataset.from_dict(
        {
            "prompt": [f"{'Hi. ' * (i % 3)}What is {i} plus {i}?" for i in range(NUM_ROWS)],
            "chosen": [f" {' '.join(words[: (7 * i) % 8 + 1])}" for i in range(NUM_ROWS)],
            "rejected": [f" {' '.join(words[: (3 * i) % 5 + 1])} no" for i in range(NUM_ROWS)],
        }
    )


def _dpo() -> tuple[Any, Any, dict[str, Any]]:
    from posttrain import DPOConfig, DPOTrainer

    return DPOConfig, DPOTrainer, {"beta": 0.5, "loss_type": ["sigmoid", "sft"]}


#: family -> () -> (config class, trainer class, the family's config fields)
FAMILIES = {"dpo": _dpo}


def train(out_dir: str, family: str, **overrides: Any) -> Any:
    """Train ``family`` on :func:`dataset` from the same initial weights; return the trainer."""
    config_class, trainer_class, own = FAMILIES[family]()
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    args = config_class(output_dir=out_dir, **{**BASE_ARGS, **own, **overrides})
    trainer = trainer_class(model=model, args=args, train_dataset=dataset(), processing_class=tok)
    trainer.train()
    return trainer


def summary(trainer: Any) -> dict[str, Any]:
    digest = hashlib.sha256()
    state = trainer.model.state_dict()
    for name in sorted(state):
        digest.update(name.encode() + state[name].float().numpy().tobytes())
    logs = [
        {k: v for k, v in h.items() if k != "step_time"} for h in trainer.state.log_history if "loss" in h
    ]
    return {"params": digest.hexdigest(), "logs": logs}


def main() -> None:
    out_dir, family = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    trainer = train(os.path.join(out_dir, "run"), family, ddp_backend="gloo")
    if rank == 0:
        torch.save(
            {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
            os.path.join(out_dir, "ddp.pt"),
        )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(summary(trainer), f)
    distributed.end_process_group()
    os._exit(0)  # a gloo group can abort the interpreter at teardown


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(base: Path, family: str) -> Path:
    """Run this script for ``family`` under torchrun (2 processes) unless this session already did."""
    out_dir = base / f"preference-{family}"
    if all((out_dir / f"rank{r}.json").is_file() for r in range(2)):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), __file__, str(out_dir), family]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out_dir


if __name__ == "__main__":
    main()
