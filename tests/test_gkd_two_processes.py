"""GKD on two processes: one on-policy step and one step on the dataset's completions (seed 1
draws the student first, then the dataset), each giving one process's parameters and metrics."""

from __future__ import annotations

import pytest
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, two_processes_against_one
from test_invariance import SCRIPT

from posttrain import GKDConfig, GKDTrainer


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> GKDTrainer:
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    args = GKDConfig(
        output_dir=out_dir,
        **{**CPU_TEST_ARGS, **SGD_ARGS, "per_device_train_batch_size": per_device, "max_steps": 2},
        max_new_tokens=8, lmbda=0.5, seed=1, shuffle_dataset=False, **overrides,
    )  # fmt: skip
    rows = Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": f"What is {i} plus one?"},
                    {"role": "assistant", "content": str(i + 1)},
                ]
                for i in range(16)
            ]
        }
    )
    return GKDTrainer(
        build_tiny_model(tok, seed=1),
        build_tiny_model(tok, seed=2),
        args,
        train_dataset=rows,
        processing_class=tok,
    )


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    logs = two_processes_against_one(
        "test_gkd_two_processes",
        ddp_comparable_trainer,
        SCRIPT,
        tmp_path,
        29591,
        (2, 4),
        ("loss", "entropy", "num_tokens"),
    )
    assert "on_policy_loss" in logs[0] and "off_policy_loss" in logs[1]
