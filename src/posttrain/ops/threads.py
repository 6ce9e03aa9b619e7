"""OpenMP thread teams of OS threads that take turns computing (the runs of a sweep).

torch's CPU kernels run their parallel regions on an OpenMP team that belongs to the calling OS
thread: every thread that computes gets its own team, and its workers stay docked after it stops.
libgomp counts the docked workers of every team; once the threads outnumber the CPUs it no longer
spins between parallel regions but puts its workers to sleep and wakes them around each one. On a
2-core host, a second thread's team ran small element-wise kernels 3x slower than the first's, and
a sweep of two runs took 1.3x a lone run's time a step (docs/performance.md, "Threads that take
turns"). A thread that hands the CPU to another releases its team first
(``release_thread_pool``, OpenMP 5's ``omp_pause_resource_all``); its next parallel region
builds a new one, which costs tens of microseconds.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Callable

#: ``omp_pause_soft`` of OpenMP 5's ``omp_pause_resource_t``.
OMP_PAUSE_SOFT = 1

#: File names of the OpenMP runtimes torch builds link (GNU, Intel, LLVM).
_RUNTIMES = ("libgomp", "libiomp", "libomp")


@functools.lru_cache(maxsize=1)
def _pause_function() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime loaded in this process, or None.

    The runtime is found among the process's mapped files (Linux), so the call reaches the very
    library torch's kernels use, not another copy of it.
    """
    import torch  # noqa: F401  (loads torch's OpenMP runtime)

    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if not os.path.basename(path).startswith(_RUNTIMES):
            continue
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_thread_pool() -> bool:
    """Release the calling thread's OpenMP team: its docked workers exit.

    Call it from a thread that stops computing while another starts (a sweep's run at the end of
    its turn). Outside a parallel region only; harmless where the thread has no team.

    Returns:
        Whether the runtime released it (False: no OpenMP runtime with ``omp_pause_resource_all``
        was found, or it refused).
    """
    pause = _pause_function()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
