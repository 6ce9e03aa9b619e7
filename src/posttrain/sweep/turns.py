"""Turns: the runs of a sweep use the shared model one at a time, in a fixed order.

Each run trains in its own thread (its trainer's own loop, unchanged). A run holds the turn from
fetching a step's batch to the end of that step's logging, saving and evaluation, then hands it
to the next run still training. While it holds the turn, its adapter is the active one and the
process's random generators are its own: every draw a run makes (sampling, dropout, shuffling
through the global generators) comes from its own stream, as if it trained alone.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class RandomState:
    """The process's random generators at one moment: torch (CPU and CUDA), NumPy and Python's."""

    torch_cpu: torch.Tensor
    python: Any
    numpy: Any
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RandomState:
        """The generators' state now."""
        import numpy as np

        cuda = (
            torch.cuda.get_rng_state_all()
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )
        return cls(torch.get_rng_state(), random.getstate(), np.random.get_state(), cuda)

    def restore(self) -> None:
        """Put the generators back to this state."""
        import numpy as np

        torch.set_rng_state(self.torch_cpu)
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


class Turns:
    """Round-robin turns between named runs; a run that ends leaves the rotation.

    Args:
        names: the runs, in the order they take their turns; the first holds the first turn.
    """

    def __init__(self, names: list[str]) -> None:
        self._live = list(names)
        self._current: str | None = self._live[0] if self._live else None
        self._cond = threading.Condition()

    @property
    def current(self) -> str | None:
        """The run holding the turn (None once every run has left)."""
        return self._current

    def wait(self, name: str) -> None:
        """Block until ``name`` holds the turn."""
        with self._cond:
            self._cond.wait_for(lambda: self._current == name)

    def pass_on(self, name: str) -> None:
        """``name`` (holding the turn) hands it to the next live run; with none other, it keeps it."""
        with self._cond:
            self._check_holder(name)
            index = self._live.index(name)
            self._current = self._live[(index + 1) % len(self._live)]
            self._cond.notify_all()

    def leave(self, name: str) -> None:
        """``name`` (holding the turn) leaves the rotation; the next live run gets the turn."""
        with self._cond:
            self._check_holder(name)
            index = self._live.index(name)
            self._live.pop(index)
            self._current = self._live[index % len(self._live)] if self._live else None
            self._cond.notify_all()

    def _check_holder(self, name: str) -> None:
        if self._current != name:
            raise RuntimeError(
                f"run {name!r} handed over a turn it does not hold (held by {self._current!r})"
            )
