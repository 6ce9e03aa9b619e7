"""Resuming from any checkpoint ends with the same parameters, bit for bit, as not stopping."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer


def varied_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


CASES = {
    "plain": {},
    "inside-generation-buffer": {"steps_per_generation": 2},
    "num-iterations": {"num_iterations": 2},
    "adaptive-entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0},
    "sync-ref-model": {
        "beta": 0.1,
        "sync_ref_model": True,
        "ref_model_sync_steps": 1,
        "ref_model_mixup_alpha": 0.5,
    },
}


def _run(out, tok, max_steps, resume=None, **config):
    torch.manual_seed(0)
    trainer = GRPOTrainer(
        model=build_tiny_model(tok, seed=1),
        reward_funcs=varied_reward,
        args=make_config(
            out, max_steps=max_steps, save_strategy="steps", save_steps=1, learning_rate=0.05, **config
        ),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.parametrize("case", list(CASES))
def test_resume_is_exact(tmp_path, case):
    tok = build_tiny_tokenizer()
    config = CASES[case]
    start = [p.detach().clone() for p in build_tiny_model(tok, seed=1).parameters()]
    straight = _run(tmp_path / "straight", tok, 4, **config)
    # a run that did nothing would resume "exactly" too: the parameters must have moved
    assert any(
        not torch.equal(a.detach(), b) for a, b in zip(straight.model.parameters(), start, strict=True)
    )
    _run(tmp_path / "stopped", tok, 4, **config)
    # resume the second run from its step-1 checkpoint (inside a buffer when steps_per_generation=2)
    resumed = _run(tmp_path / "stopped", tok, 4, resume=str(tmp_path / "stopped" / "checkpoint-1"), **config)
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert straight.entropy_coef == resumed.entropy_coef
    if straight.ref_model is not None:
        for a, b in zip(straight.ref_model.parameters(), resumed.ref_model.parameters(), strict=True):
            assert torch.equal(a, b)
