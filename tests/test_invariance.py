"""Equivalent batch layouts give the same update.

8 completions in one micro-batch and 4 completions x 2 accumulation steps must move the
parameters identically for the same rollouts: the loss is normalised over the whole
accumulated batch (for "dapo": its number of completion tokens), not per micro-batch.
Plain SGD makes the update proportional to the gradient, so a wrong normaliser shows.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import ScriptedGenerator, make_config, standard_dataset

from posttrain import GRPOTrainer

# completions of different lengths (EOS = 2 in the tiny tokenizer) so token and sequence
# normalisations differ
SCRIPT = [
    [5, 6, 2],
    [7, 8, 9, 10, 11, 2],
    [12, 2],
    [13, 14, 15, 16],
    [17, 18, 2],
    [19, 2],
    [20, 21, 22, 2],
    [23],
]


def token_sum_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def _updated_params(tmp_path, loss_type: str, per_device: int, accumulation: int) -> list[torch.Tensor]:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=3)
    args = make_config(
        tmp_path,
        loss_type=loss_type,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        num_generations=4,
        max_steps=1,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=token_sum_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.generator = ScriptedGenerator(SCRIPT, pad_token_id=0)
    trainer.train()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_accumulation_matches_one_big_batch(tmp_path, loss_type):
    one_batch = _updated_params(tmp_path / "a", loss_type, per_device=8, accumulation=1)
    accumulated = _updated_params(tmp_path / "b", loss_type, per_device=4, accumulation=2)
    initial = [p.detach() for p in build_tiny_model(build_tiny_tokenizer(), seed=3).parameters()]
    moved = max((a - b).abs().max().item() for a, b in zip(one_batch, initial, strict=True))
    assert moved > 1e-4  # the update is real
    for a, b in zip(one_batch, accumulated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
