"""rollout_func: completions from the user's own function, and the sampler correction."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer
from posttrain.generation.rollout_func import RolloutFuncError

G = 4


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def make_rollout_func(tok, calls, logprob=-1.0, **overrides):
    eos = tok.eos_token_id

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "source": []}
        for p in prompts:
            ids = tok(p)["input_ids"]
            for k in range(G):
                completion = [5 + k, 6 + (k * 3) % 7, eos]
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(completion)
                out["logprobs"].append([logprob] * len(completion))
                out["source"].append(f"{p}#{k}")
        out.update(overrides)
        return out

    return rollout_func


def _trainer(tmp_path, tok, rollout_func, reward, **config):
    args = make_config(tmp_path, per_device_train_batch_size=8, num_generations=G, **config)
    return GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
        rollout_func=rollout_func,
    )


def source_reward(completion_ids, source, **kwargs):
    """Uses the extra field the rollout_func returned."""
    assert len(source) == len(completion_ids)
    return [float(s.endswith(("#1", "#3"))) for s in source]


def test_rollout_func_gets_each_prompt_once_and_feeds_the_rewards(tmp_path, tok):
    calls = []
    trainer = _trainer(tmp_path, tok, make_rollout_func(tok, calls), source_reward, max_steps=2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert [len(c) for c in calls] == [2, 2]  # 8 completions = 2 prompts x 4, each prompt passed once
    assert all(len(set(c)) == 2 for c in calls)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    log = trainer.state.log_history[0]
    assert log["rewards/source_reward/mean"] == 0.5
    assert log["completions/mean_length"] == 3.0 and log["completions/clipped_ratio"] == 0.0
    # the sampler said log-prob -1 per token; the tiny model's are near -log(320) = -5.77
    assert log["sampling/sampling_logp_difference/mean"] == pytest.approx(5.77 - 1.0, abs=0.2)
    assert 0.0 <= log["sampling/importance_sampling_ratio/max"] <= 3.0


def test_masked_importance_sampling_drops_every_token_far_from_the_sampler(tmp_path, tok):
    calls = []
    trainer = _trainer(
        tmp_path,
        tok,
        make_rollout_func(tok, calls, logprob=-0.01),
        source_reward,
        max_steps=1,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    # every ratio is about exp(-5.76) < 0.5: all tokens masked, nothing moves
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert trainer.state.log_history[0]["sampling/importance_sampling_ratio/max"] == 0.0


def test_correction_off_trains_on_the_same_rollouts(tmp_path, tok):
    calls = []
    trainer = _trainer(
        tmp_path,
        tok,
        make_rollout_func(tok, calls, logprob=-0.01),
        source_reward,
        max_steps=1,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_correction=False,
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert not any(k.startswith("sampling/") for k in trainer.state.log_history[0])


def _without_logprobs(tok):
    inner = make_rollout_func(tok, [])

    def func(prompts, trainer):
        out = inner(prompts, trainer)
        del out["logprobs"]
        return out

    return func


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (_without_logprobs, "returned no \\['logprobs'\\]"),
        (
            lambda tok: make_rollout_func(tok, [], completion_ids=[[5, 2]] * 7),
            "returned 7 'completion_ids' for 2 prompts; it must return 4 completions",
        ),
        (
            lambda tok: make_rollout_func(tok, [], logprobs=[[-1.0]] * 8),
            "completion 0 has 3 tokens but 1 logprobs",
        ),
        (
            lambda tok: make_rollout_func(tok, [], logprob_token_ids=[[1, 1, 1]] * 8),
            "logprob_token_ids differ from its completion_ids",
        ),
        (lambda tok: lambda prompts, trainer: [1, 2], "must return a dict"),
    ],
    ids=["missing", "count", "length", "token-ids", "not-a-dict"],
)
def test_rollout_func_contract_errors(tmp_path, tok, make, pattern):
    trainer = _trainer(tmp_path, tok, make(tok), source_reward, max_steps=1)
    with pytest.raises(RolloutFuncError, match=pattern):
        trainer.train()
    assert trainer.state.global_step == 0


def test_rollout_func_needs_whole_groups_per_process(tmp_path, tok, monkeypatch):
    from posttrain import GRPOConfig

    # 2 processes x 2 completions: each prompt's 4 completions would straddle the processes
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    args = make_config(tmp_path, per_device_train_batch_size=2, num_generations=4)
    with pytest.raises(ValueError, match="per-process generation batch .* = 2\\) must be a multiple"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=source_reward,
            args=args,
            train_dataset=standard_dataset(),
            processing_class=tok,
            rollout_func=make_rollout_func(tok, []),
        )
