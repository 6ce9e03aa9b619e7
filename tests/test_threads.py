"""OpenMP teams of threads that take turns computing (ops/threads.py; a sweep's runs)."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

from posttrain.ops.threads import release_thread_pool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not torch.backends.openmp.is_available(),
    reason="counts the process's threads in /proc; torch without OpenMP has no teams",
)


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def settled(count: int, target: int) -> int:
    """The thread count once it reaches ``target`` (workers leave asynchronously), or after 2 s."""
    deadline = time.monotonic() + 2.0
    while count != target and time.monotonic() < deadline:
        time.sleep(0.01)
        count = native_threads()
    return count


def test_a_released_team_ends_its_workers_and_the_thread_computes_again():
    """A thread that ran a parallel region keeps its team's worker docked; releasing the team ends
    the worker, and the thread's next parallel region builds a new team with the same results."""
    seen: dict[str, object] = {}

    def work() -> None:
        previous = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            x = torch.arange(1 << 20, dtype=torch.float32)
            first = x * 3  # large enough for a parallel region
            seen["with_team"] = native_threads()
            seen["released"] = release_thread_pool()
            seen["after"] = settled(native_threads(), seen["with_team"] - 1)
            seen["same"] = torch.equal(x * 3, first)
            seen["again"] = native_threads()
            seen["twice"] = release_thread_pool()  # no team: nothing to release, no error
        finally:
            torch.set_num_threads(previous)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["released"] is True and seen["twice"] is True
    assert seen["after"] == seen["with_team"] - 1
    assert seen["same"] and seen["again"] == seen["with_team"]
