"""Run by tests/test_fsdp.py and tests/test_deepspeed.py under torchrun: 2 CPU processes (gloo),
2 GRPO steps, with the model replicated (DDP) or sharded (FSDP2, DeepSpeed ZeRO-2/3).

Usage: ``sharded_train.py OUT_DIR MODE`` with MODE one of ``ddp``, ``fsdp``, ``zero2``,
``zero3``, ``zero3-nogather`` (ZeRO-3 with ``ds3_gather_for_generation=False``), and
``fsdp-kl`` / ``zero3-kl`` (the model loaded by name, ``beta=0.04``: a KL reference).

Each rank writes OUT_DIR/rank{r}.json: a digest of the full (gathered) parameters after
training, whether each ``generate`` call saw full parameters, whether the trained model is
sharded, and the logged metrics. Rank 0 also writes the gathered parameters to
OUT_DIR/params.pt. A checkpoint is saved at step 2.

The tests start it through :func:`run_once`, which runs each mode once per test session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from conftest import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from helpers import leave_without_teardown, make_config, standard_dataset  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from posttrain import GRPOTrainer  # noqa: E402
from posttrain.models import distributed  # noqa: E402


def reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def backend_args(mode: str) -> dict:
    """The GRPOConfig fields that select the backend."""
    if mode.startswith("fsdp"):
        layers = ["LlamaDecoderLayer"]
        return {
            "fsdp": True,
            "fsdp_config": {
                "version": 2,
                "transformer_layer_cls_to_wrap": layers,
                "state_dict_type": "FULL_STATE_DICT",
            },
        }
    if mode.startswith("zero"):
        zero = {
            "stage": int(mode[4]),
            "stage3_param_persistence_threshold": 0,  # shard even the tiny model's small parameters
            "stage3_gather_16bit_weights_on_model_save": True,
        }
        config = {
            "zero_optimization": zero,
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
        return {"deepspeed": config, "ds3_gather_for_generation": not mode.endswith("nogather")}
    return {}


def is_full(param: torch.Tensor) -> bool:
    """Whether a parameter holds its full value (not an FSDP2 shard, not a ZeRO-3 placeholder)."""
    return not isinstance(param, DTensor) and param.numel() == getattr(param, "ds_numel", param.numel())


def spy_on_generation(trainer: GRPOTrainer, seen: list[bool]) -> None:
    """Record, at each generate call, whether every parameter of the model is full."""
    gather = trainer.generator.full_parameters

    @contextlib.contextmanager
    def spy(model):
        with gather(model):
            seen.append(all(is_full(p) for p in model.parameters()))
            yield

    trainer.generator.full_parameters = spy


def full_state(trainer: GRPOTrainer, mode: str) -> dict[str, torch.Tensor]:
    """The whole model's parameters, gathered on every rank."""
    model = trainer.model
    if mode.startswith("fsdp"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if mode.startswith("zero3"):
        with distributed.zero3_full_parameters(model):
            return {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main() -> None:
    out_dir, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)  # same initial weights on both ranks
    kl = mode.endswith("-kl")
    if kl:  # loaded by name: under ZeRO-3, partitioned as it loads
        path = os.path.join(out_dir, f"model-rank{rank}")  # one folder per rank: no write race
        model.save_pretrained(path)
        model = path
    args = make_config(
        out_dir,
        per_device_train_batch_size=2,
        num_generations=4,
        max_steps=2,
        ddp_backend="gloo",
        seed=1,
        gradient_checkpointing=True,
        save_strategy="steps",
        save_steps=2,
        beta=0.04 if kl else 0.0,
        **backend_args(mode.removesuffix("-kl")),
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=standard_dataset(), processing_class=tok
    )
    # Every mode samples with generate: the lean loop is not used for ZeRO-3 or FSDP across
    # processes (it falls back to generate), and the DDP reference must draw the same samples.
    trainer.generator.lean = False
    full_at_generation: list[bool] = []
    spy_on_generation(trainer, full_at_generation)
    trainer.train()
    state = full_state(trainer, mode)
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].float().numpy().tobytes())
    if rank == 0:
        torch.save(state, os.path.join(out_dir, "params.pt"))
    logs = [
        {k: v for k, v in h.items() if k != "step_time"} for h in trainer.state.log_history if "reward" in h
    ]
    result = {
        "params": digest.hexdigest(),
        "sharded": not all(is_full(p) for p in trainer.model.parameters()),
        "backend": str(trainer.accelerator.distributed_type),
        "full_at_generation": full_at_generation,
        "logs": logs,
    }
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
        The output folder, with ``rank0.json``, ``rank1.json``, ``params.pt`` and ``checkpoint-2``.

    Raises:
        AssertionError: the run failed (the message ends with its output).
    """
    out_dir = base / f"sharded-{mode}"
    if (out_dir / "rank1.json").is_file() and (out_dir / "rank0.json").is_file():
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
