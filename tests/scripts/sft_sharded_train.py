"""Run by tests/test_sft_distributed.py under torchrun: SFT on 2 CPU processes (gloo), with the
model replicated (DDP) or sharded (FSDP2, DeepSpeed ZeRO-2/3).

Usage: ``sft_sharded_train.py OUT_DIR MODE`` with MODE one of ``ddp``, ``fsdp``, ``zero2``,
``zero3``. Every mode trains the ``plain`` variant: a tiny Llama, 3 SGD steps of 2 rows per
process on :func:`dataset` (prompt-completion rows of varied lengths, completion-only loss).
``ddp`` also trains, in the same launch, the variants of :data:`DDP_VARIANTS`: ``padding_free``
(the plain steps without padding), ``whole`` (one step over the whole dataset, unpacked) and
``packed`` (the same step with ``packing=True``).

Each rank writes OUT_DIR/rank{r}.json: for every variant, a digest of the full (gathered)
parameters after training, the logged metrics, and for each micro-batch the rank's target
tokens, the step's target tokens over both ranks (``num_items_in_batch``) and its sequences.
Rank 0 also writes each variant's gathered parameters to OUT_DIR/{variant}.pt.

SGD without clipping (``max_grad_norm`` huge, so ``grad_norm`` is still logged) keeps the
update linear in the gradient: a wrong loss scale shows in the parameters, which Adam's
normalised step would hide. :func:`train` runs the same recipe on one process, in the caller.

The tests start it through :func:`run_once`, which runs each mode once per test session.
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
from helpers import CPU_TEST_ARGS, leave_without_teardown  # noqa: E402
from scripts.sharded_train import full_state, is_full  # noqa: E402

from posttrain import SFTConfig, SFTTrainer  # noqa: E402
from posttrain.models import distributed  # noqa: E402

#: Rows of :func:`dataset`; 3 steps of 2 rows on each of 2 processes see every row once.
NUM_ROWS = 12

#: The SFTConfig fields every run shares (the variants and modes add theirs).
BASE_ARGS: dict[str, Any] = {
    **CPU_TEST_ARGS,
    "per_device_train_batch_size": 2,
    "max_steps": 3,
    "optim": "sgd",
    "learning_rate": 0.5,
    "lr_scheduler_type": "constant",
    "max_grad_norm": 1e9,  # never clips, but the norm is computed and logged
    "seed": 1,
    "gradient_checkpointing": True,  # SFTConfig's default
    "completion_only_loss": True,
    "max_length": 64,
}

#: The variants the ``ddp`` mode trains besides ``plain``: their SFTConfig overrides.
DDP_VARIANTS: dict[str, dict[str, Any]] = {
    "padding_free": {"padding_free": True},
    "whole": {"per_device_train_batch_size": NUM_ROWS // 2, "max_steps": 1},
    # the 12 sequences (15-39 tokens) packed into 4 bins of 3 (at most 96 tokens): 2 bins per process
    "packed": {"packing": True, "max_length": 96, "per_device_train_batch_size": 2, "max_steps": 1},
}


def dataset() -> Dataset:
    """Prompt-completion rows whose prompts and completions have varied lengths."""
    words = "one two three four five six seven eight nine ten".split()
    prompts = [f"{'Hi. ' * (i % 3)}What is {i} plus {i}?" for i in range(NUM_ROWS)]  # 12-21 tokens
    completions = [f" {' '.join(words[: (7 * i) % 8 + 1])}" for i in range(NUM_ROWS)]  # 3-22 targets
    return Dataset.from_dict({"prompt": prompts, "completion": completions})


def backend_args(mode: str) -> dict[str, Any]:
    """The SFTConfig fields that select the backend of ``mode`` (none for ``ddp`` and one process)."""
    if mode == "fsdp":
        return {
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "state_dict_type": "FULL_STATE_DICT",
            },
        }
    if mode.startswith("zero"):
        zero = {"stage": int(mode[4]), "stage3_param_persistence_threshold": 0}  # shard even small ones
        return {
            "deepspeed": {
                "zero_optimization": zero,
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
            }
        }
    return {}


def train(out_dir: str, mode: str = "ddp", **overrides: Any) -> tuple[SFTTrainer, list[dict[str, Any]]]:
    """Train the recipe and record each micro-batch of this process.

    Args:
        out_dir: the trainer's output folder.
        mode: the backend (:func:`backend_args`); ``ddp`` on one process is plain training.
        **overrides: SFTConfig fields over :data:`BASE_ARGS` (under torchrun, ``ddp_backend="gloo"``).

    Returns:
        The trained trainer and, per micro-batch, ``targets`` (this process's target tokens),
        ``num_items`` (the step's target tokens over every process) and ``sequences`` (the
        token ids of each sequence of the batch, padding removed).
    """
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)  # same initial weights everywhere
    args = SFTConfig(output_dir=out_dir, **{**BASE_ARGS, **backend_args(mode), **overrides})
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tok)
    batches: list[dict[str, Any]] = []
    compute_loss = trainer.compute_loss

    def recording(model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            batches.append(
                {
                    "targets": int(inputs.loss_mask[:, 1:].sum()),
                    "num_items": int(num_items_in_batch),
                    "sequences": sequences(inputs),
                }
            )
        return compute_loss(model, inputs, return_outputs, num_items_in_batch)

    trainer.compute_loss = recording
    trainer.train()
    return trainer, batches


def sequences(inputs: Any) -> list[list[int]]:
    """The batch's sequences as token id lists, padding dropped (rows, or the pieces of packed rows)."""
    out = []
    for r in range(inputs.input_ids.shape[0]):
        ids = inputs.input_ids[r].tolist()
        if inputs.attention_mask is not None and inputs.attention_mask.dim() == 2:  # right-padded rows
            out.append([t for t, m in zip(ids, inputs.attention_mask[r].tolist(), strict=True) if m])
            continue
        starts = [i for i, p in enumerate(inputs.position_ids[r].tolist()) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            if inputs.loss_mask[r, a:b].any():  # the padding is a sequence without targets
                out.append(ids[a:b])
    return out


def report(trainer: SFTTrainer, mode: str, batches: list[dict[str, Any]]) -> tuple[dict, dict]:
    """The run's JSON summary and its full parameters (gathered from the shards)."""
    state = full_state(trainer, mode)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].float().numpy().tobytes())
    logs = [
        {k: v for k, v in h.items() if k != "step_time"} for h in trainer.state.log_history if "loss" in h
    ]
    summary = {
        "params": digest.hexdigest(),
        "sharded": not all(is_full(p) for p in trainer.model.parameters()),
        "backend": str(trainer.accelerator.distributed_type),
        "logs": logs,
        "batches": batches,
    }
    return summary, state


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    variants = {"plain": {}, **(DDP_VARIANTS if mode == "ddp" else {})}
    result = {}
    for name, overrides in variants.items():
        trainer, batches = train(os.path.join(out_dir, name), mode, ddp_backend="gloo", **overrides)
        result[name], state = report(trainer, mode, batches)
        if rank == 0:
            torch.save(state, os.path.join(out_dir, f"{name}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    distributed.end_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_once(base: Path, mode: str) -> Path:
    """Run this script for ``mode`` under torchrun (2 processes) unless this session already did.

    Returns:
        The output folder, with ``rank0.json``, ``rank1.json`` and ``{variant}.pt``.

    Raises:
        AssertionError: the run failed (the message ends with its output).
    """
    out_dir = base / f"sft-{mode}"
    if (out_dir / "rank0.json").is_file() and (out_dir / "rank1.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(_free_port()), __file__, str(out_dir), mode]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out_dir


def read_ranks(out_dir: Path) -> list[dict]:
    """The two ranks' reports."""
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


if __name__ == "__main__":
    main()
    leave_without_teardown()
