"""Metric accumulation between two logging steps.

The trainer records values as they arise (once per generation or per micro-batch); at each
logging step the mean of every series is logged and the store is cleared. Values are recorded
already reduced across processes, so every process logs the same numbers.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class MetricStore:
    """Per-mode (``"train"`` / ``"eval"``) series of floats."""

    def __init__(self) -> None:
        self._series: dict[str, dict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    def add(self, mode: str, name: str, value: float) -> None:
        """Record one value of ``name``."""
        self._series[mode][name].append(float(value))

    def add_all(self, mode: str, values: dict[str, float]) -> None:
        """Record several values."""
        for name, value in values.items():
            self.add(mode, name, value)

    def pop_means(self, mode: str) -> dict[str, float]:
        """The mean of each series since the last call, then clear them."""
        series = self._series[mode]
        means = {name: sum(v) / len(v) for name, v in series.items() if v}
        series.clear()
        return means


def clip_ratios(
    low: torch.Tensor, high: torch.Tensor, region: torch.Tensor, weight: torch.Tensor
) -> dict[str, float]:
    """The ``clip_ratio/*`` metrics: one definition for every trainer that clips a ratio.

    As the GRPO spec defines them: ``low_mean`` / ``high_mean`` / ``region_mean`` are the share
    of tokens (or of completions, for a sequence-level ratio) clipped at the lower bound with a
    negative advantage, at the upper bound with a positive one, or either; ``low_min`` is the
    smallest per-completion fraction clipped at the lower bound, ``high_max`` the largest at the
    upper bound. GRPO, RLOO and asynchronous GRPO all log these.

    Args:
        low, high, region: [N] per-completion fractions of counted tokens (0 or 1 when one ratio
            covers the completion), gathered from every process.
        weight: [N] each completion's share of the means (its counted tokens over all of them;
            ``1 / N`` at sequence level); sums to 1.
    """
    return {
        "clip_ratio/low_mean": (low * weight).sum().item(),
        "clip_ratio/low_min": low.min().item(),
        "clip_ratio/high_mean": (high * weight).sum().item(),
        "clip_ratio/high_max": high.max().item(),
        "clip_ratio/region_mean": (region * weight).sum().item(),
    }
