"""DAPO dynamic sampling: groups without reward spread are replaced."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.core.batch import Rollout
from posttrain.sampling.dynamic_sampling import group_means, groups_with_spread, select_groups, take_groups


def test_groups_with_spread_uses_the_weighted_sum():
    # 3 groups of 2: [1, 1] no spread; [0, 2] spread; f1 and f2 cancel in the second function's
    # weighting: rows (1, 0) and (0, 2) with weights (2, 1) both sum to 2 -> no spread
    rewards = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    spread = groups_with_spread(rewards, torch.tensor([2.0, 1.0]), group_size=2)
    assert spread.tolist() == [False, True, False]


def test_select_groups_replaces_in_order_and_keeps_positions():
    spread = [
        torch.tensor([True, False, True, False]),
        torch.tensor([False, True]),
        torch.tensor([True, True]),
    ]
    # slot 1 <- round 1 group 1; slot 3 <- round 2 group 0
    assert select_groups(spread, 4) == [(0, 0), (1, 1), (0, 2), (2, 0)]


def test_select_groups_keeps_zero_spread_groups_when_short():
    spread = [torch.tensor([False, False, True]), torch.tensor([True, False])]
    assert select_groups(spread, 3) == [(1, 0), (0, 1), (0, 2)]


def test_select_groups_takes_over_sampled_groups_before_later_rounds():
    # 2 slots, round 0 holds 2 own groups and 2 over-sampled ones
    spread = [torch.tensor([False, True, False, True]), torch.tensor([True])]
    assert select_groups(spread, 2) == [(0, 3), (0, 1)]


def test_select_groups_hardest_first():
    spread = [torch.tensor([True, True, False, True]), torch.tensor([True, False])]
    means = [torch.tensor([0.9, 0.5, 0.0, 0.2]), torch.tensor([0.2, 0.0])]
    # lowest mean with spread first; the tie at 0.2 goes to the earlier round
    assert select_groups(spread, 3, means) == [(0, 3), (1, 0), (0, 1)]
    # not enough groups with spread: the batch's own zero-spread groups keep the rest
    short = [torch.tensor([False, False, True]), torch.tensor([False])]
    assert select_groups(short, 3, [torch.tensor([1.0, 0.0, 0.5]), torch.tensor([0.0])]) == [
        (0, 2),
        (0, 0),
        (0, 1),
    ]


def test_group_means_use_the_weighted_sum():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    assert group_means(rewards, torch.tensor([2.0, 1.0]), 2).tolist() == [1.5, 1.5]


def test_take_groups_repads_rows():
    a = Rollout(
        prompt_ids=torch.tensor([[0, 5], [0, 5]]),
        prompt_mask=torch.tensor([[0, 1], [0, 1]]),
        completion_ids=torch.tensor([[7, 2], [8, 0]]),
        completion_mask=torch.tensor([[1, 1], [1, 0]]),
        is_terminated=torch.tensor([True, False]),
    )
    b = Rollout(
        prompt_ids=torch.tensor([[4, 6], [4, 6]]),
        prompt_mask=torch.tensor([[1, 1], [1, 1]]),
        completion_ids=torch.tensor([[9, 9, 2], [3, 0, 0]]),
        completion_mask=torch.tensor([[1, 1, 1], [1, 0, 0]]),
        is_terminated=torch.tensor([True, False]),
    )
    out = take_groups([a, b], [(1, 0), (0, 0)], group_size=2, pad_token_id=0)
    assert out.prompt_ids.tolist() == [[4, 6], [4, 6], [0, 5], [0, 5]]
    assert out.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert out.completion_ids.tolist() == [[9, 9, 2], [3, 0, 0], [7, 2, 0], [8, 0, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert out.is_terminated.tolist() == [True, False, True, False]


def half_flat_reward(prompts, completion_ids, **kwargs):
    """Prompts with an even question number get a constant reward; odd ones vary."""
    out = []
    for p, ids in zip(prompts, completion_ids, strict=True):
        number = int(p.split()[1].rstrip(":"))
        out.append(1.0 if number % 2 == 0 else float(sum(ids) % 7))
    return out


def half_flat_trainer(tmp_path, **config):
    """A tiny model trained with ``half_flat_reward`` on 32 prompts."""
    tok = build_tiny_tokenizer()
    return GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=half_flat_reward,
        args=make_config(tmp_path, **config),
        train_dataset=standard_dataset(32),
        processing_class=tok,
    )


@pytest.mark.parametrize("enabled", [False, True])
def test_zero_spread_groups_are_replaced(tmp_path, enabled):
    trainer = half_flat_trainer(
        tmp_path,
        per_device_train_batch_size=8,
        num_generations=2,
        max_steps=3,
        dynamic_sampling=enabled,
        dynamic_sampling_max_rounds=4,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    if not enabled:
        assert all("dynamic_sampling/dropped_groups" not in h for h in logs)
        assert any(h["frac_reward_zero_std"] > 0 for h in logs)
        return
    for h in logs:
        assert h["dynamic_sampling/dropped_groups"] >= 1  # about half the prompts are flat
        assert h["dynamic_sampling/refilled_groups"] == h["dynamic_sampling/dropped_groups"]
        assert h["dynamic_sampling/unfilled_groups"] == 0
        assert h["frac_reward_zero_std"] == 0.0  # every group of the trained batch has spread


def test_dynamic_sampling_needs_whole_groups_per_process(tmp_path, monkeypatch):
    # 2 processes x 2 completions = 4 per step: groups of 4 straddle the processes
    monkeypatch.setattr(GRPOConfig, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match="dynamic_sampling=True refills each process's own groups"):
        GRPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2,
            num_generations=4, dynamic_sampling=True,
        )  # fmt: skip


def test_oversampling_trains_on_the_hardest_groups_in_one_generation_call(tmp_path):
    trainer = half_flat_trainer(
        tmp_path,
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=2,
        dynamic_sampling=True,
        dynamic_sampling_oversample=3,
        dynamic_sampling_prefer="hardest",
    )
    generated, offered = [], []
    generate = trainer.sampler.generate

    def counting(prompts, *rest):
        generated.append(len(prompts))
        return generate(prompts, *rest)

    trainer.sampler.generate = counting
    refill = trainer.sampler.refill

    def recording(rollout, rewards, group, weights, *rest, **options):
        out = refill(rollout, rewards, group, weights, *rest, **options)
        offered.append((group_means(rewards, weights, group), groups_with_spread(rewards, weights, group)))
        offered[-1] += (group_means(out[1], weights, group),)
        return out

    trainer.sampler.refill = recording
    trainer.train()
    assert generated[:1] == [12]  # the batch's 2 prompts and 4 over-sampled ones, in one call
    assert any(int(spread.sum()) >= 2 for _, spread, _ in offered)
    for means, spread, trained in offered:
        if int(spread.sum()) >= 2:  # the batch holds the 2 lowest means among the groups with spread
            assert sorted(trained.tolist()) == sorted(means[spread].tolist())[:2]
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert all(h["dynamic_sampling/unfilled_groups"] == 0 for h in logs)


def test_oversampling_needs_dynamic_sampling(tmp_path):
    with pytest.raises(
        ValueError, match="dynamic_sampling_oversample=4 shapes dynamic sampling, which is off"
    ):
        make_config(tmp_path, dynamic_sampling_oversample=4)
    with pytest.raises(ValueError, match="dynamic_sampling_prefer"):
        make_config(tmp_path, dynamic_sampling=True, dynamic_sampling_prefer="easiest")
