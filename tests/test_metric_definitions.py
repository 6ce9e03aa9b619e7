"""One definition per shared metric name: ``clip_ratio/*`` means the same in GRPO, RLOO and
asynchronous GRPO (``observe.metrics.clip_ratios``, the GRPO spec's wording)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from posttrain.async_grpo.trainer import AsyncGRPOTrainer
from posttrain.observe.metrics import clip_ratios
from posttrain.rloo.trainer import RLOOTrainer

ONE_PROCESS = SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")))


def test_clip_ratios_are_weighted_means_and_per_completion_extremes():
    low = torch.tensor([0.0, 0.5, 1.0])
    high = torch.tensor([0.25, 0.0, 0.0])
    region = torch.maximum(low, high)
    weight = torch.tensor([0.5, 0.25, 0.25])
    m = clip_ratios(low, high, region, weight)
    assert m["clip_ratio/low_mean"] == 0.375  # 0.5 * 0 + 0.25 * 0.5 + 0.25 * 1
    assert m["clip_ratio/low_min"] == 0.0 and m["clip_ratio/high_max"] == 0.25
    assert m["clip_ratio/high_mean"] == 0.125 and m["clip_ratio/region_mean"] == 0.5


def test_rloo_clip_ratios_count_completions_not_processes():
    """RLOO clips one ratio per completion: with one of four clipped low, low_mean is 1/4 and
    low_min is 0, the smallest completion's (the per-process mean it used to take made
    low_min equal low_mean on one process)."""
    stats = {"low": torch.tensor([1.0, 0.0, 0.0, 0.0]), "high": torch.tensor([0.0, 0.0, 0.0, 1.0])}
    stats["region"] = torch.maximum(stats["low"], stats["high"])
    entropy, mask = torch.ones(4, 3), torch.ones(4, 3)
    m = RLOOTrainer._loss_metrics(ONE_PROCESS, entropy, mask, stats)
    assert m["clip_ratio/low_mean"] == 0.25 and m["clip_ratio/low_min"] == 0.0
    assert m["clip_ratio/high_mean"] == 0.25 and m["clip_ratio/high_max"] == 1.0
    assert m["clip_ratio/region_mean"] == 0.5 and m["entropy"] == 1.0


def test_async_grpo_clip_ratios_weight_completions_by_their_tokens():
    """Token-level ratios: the means are shares of all counted tokens; min and max are per
    completion, as in GRPO."""
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    low = torch.tensor([[True, False, False, False], [True, True, False, False]])
    high = torch.zeros(2, 4, dtype=torch.bool)
    m = AsyncGRPOTrainer._clip_ratios(ONE_PROCESS, {"low": low, "high": high}, mask)
    assert m["clip_ratio/low_mean"] == 0.5  # 3 of 6 counted tokens
    assert m["clip_ratio/low_min"] == 0.25 and m["clip_ratio/high_max"] == 0.0
    assert m["clip_ratio/region_mean"] == 0.5
