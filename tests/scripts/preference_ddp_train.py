"""Run by tests/test_preference_distributed.py under torchrun: a preference trainer on 2 CPU
processes (DDP, gloo) and, for comparison, the same global batches on one process.

Usage: ``preference_ddp_train.py OUT_DIR FAMILY`` (a key of :data:`FAMILIES`). Each rank trains
3 SGD steps of 2 rows (the 12 pairs of :func:`dataset`, rows of varied lengths so the ranks'
batches differ; KTO splits them into 24 examples, 12 chosen then 12 rejected, and a row is one
example) and writes OUT_DIR/rank{r}.json with a digest of its parameters and its logs; rank 0
writes OUT_DIR/ddp.pt with the parameters. SGD without clipping keeps the update linear in the
gradient, so a wrong loss scale across processes shows in the parameters.

The families: DPO (sigmoid + SFT), KTO (``kto``, with its KL reference point z₀, and
``apo_zero_unpaired``, without it), ORPO, CPO (SimPO with the chosen NLL) and reward modelling
(Bradley-Terry with centering, on a sequence classifier: :data:`MODELS`). Their settings make
every term of the loss count: KTO's ``desirable_weight=1.3`` with ``learning_rate=0.5`` makes
z₀ positive at step 3 (it is clamped to 0 while the pairs' mean log-ratio is negative).
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


def _kto() -> tuple[Any, Any, dict[str, Any]]:
    """KTO with its KL reference point z₀, estimated per micro-batch (the ranks' batches differ)."""
    from posttrain import KTOConfig, KTOTrainer

    return KTOConfig, KTOTrainer, {"beta": 0.5, "loss_type": "kto", "desirable_weight": 1.3}


def _kto_apo_zero_unpaired() -> tuple[Any, Any, dict[str, Any]]:
    """KTO's trainer without z₀ (APO-zero on unpaired data): every example's loss is its own."""
    from posttrain import KTOConfig, KTOTrainer

    return KTOConfig, KTOTrainer, {"beta": 0.5, "loss_type": "apo_zero_unpaired", "desirable_weight": 1.2}


def _orpo() -> tuple[Any, Any, dict[str, Any]]:
    from posttrain import ORPOConfig, ORPOTrainer

    return ORPOConfig, ORPOTrainer, {"beta": 0.5}


def _cpo() -> tuple[Any, Any, dict[str, Any]]:
    """SimPO's length-normalised margin loss plus the chosen completions' NLL (cpo_alpha > 0)."""
    from posttrain import CPOConfig, CPOTrainer

    own = {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.5}
    return CPOConfig, CPOTrainer, own


def _reward() -> tuple[Any, Any, dict[str, Any]]:
    """Bradley-Terry with the centering term, so both of its parts are exercised."""
    from posttrain import RewardConfig, RewardTrainer

    return RewardConfig, RewardTrainer, {"center_rewards_coefficient": 0.01, "learning_rate": 0.05}


#: family -> () -> (config class, trainer class, the family's config fields)
FAMILIES = {
    "dpo": _dpo,
    "kto": _kto,
    "kto_apo_zero_unpaired": _kto_apo_zero_unpaired,
    "orpo": _orpo,
    "cpo": _cpo,
    "reward": _reward,
}


def build_reward_model(tok: Any, seed: int = 0) -> Any:
    """The tiny Llama of ``conftest.build_tiny_model`` as a one-label sequence classifier.

    The same seed gives the same weights on every rank; the score head is drawn with unit scale
    (as in tests/test_reward_trainer.py) so the body's gradients are not vanishingly small.
    """
    from transformers import LlamaForSequenceClassification

    config = build_tiny_model(tok, seed=seed).config
    config.num_labels = 1
    config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


#: family -> (tokenizer, seed) -> the initial model; a causal LM unless named here
MODELS = {"reward": build_reward_model}


def train(out_dir: str, family: str, trainer_class: type | None = None, **overrides: Any) -> Any:
    """Train ``family`` on :func:`dataset` from the same initial weights; return the trainer.

    ``trainer_class`` replaces the family's trainer class (a subclass of it, for the comparison).
    """
    config_class, family_trainer, own = FAMILIES[family]()
    trainer_class = trainer_class or family_trainer
    tok = build_tiny_tokenizer()
    model = MODELS.get(family, build_tiny_model)(tok, seed=0)
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
