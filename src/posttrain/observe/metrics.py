"""Metric accumulation between two logging steps.

The trainer records values as they arise (once per generation or per micro-batch); at each
logging step the mean of every series is logged and the store is cleared. Values are recorded
already reduced across processes, so every process logs the same numbers.
"""

from __future__ import annotations

from collections import defaultdict


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
