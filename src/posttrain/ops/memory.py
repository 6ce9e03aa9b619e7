"""glibc ``malloc`` settings for CPU training: large activations go back to the system when freed.

On the CPU, PyTorch allocates through glibc's ``malloc``. By default glibc serves every block
below a threshold from its heap, and raises that threshold (up to 32 MB) each time it frees a
mapped block. A training step allocates and frees many activation tensors of a few to a few
tens of MB (``[tokens, hidden]`` rows: 19 MB for 8 x 1077 tokens of SmolLM2) in between the
parameters' gradients, which stay until the optimizer step. The heap then holds freed blocks
it cannot reuse for the next allocations and grows: at 1024 completion tokens a profile of the
embedded model (``benchmarks/profile_step.py --heap 1``) showed a 5.1 GB heap of which 3.9 GB
was free but resident.

``map_large_blocks`` fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``): blocks of at least
``MMAP_THRESHOLD`` bytes get their own mapping and are unmapped when freed, so they never
fragment the heap. The cost is the page faults of touching fresh pages, paid by large blocks
only. ``GRPOTrainer`` applies it once, on the CPU; where the environment already sets
``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable), or ``POSTTRAIN_MALLOC_MMAP_THRESHOLD`` is set
(bytes; 0 leaves glibc's default), that choice wins. Nothing is done on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

#: Blocks of at least this many bytes are mapped on their own (4 MB: the SmolLM2 anchor's
#: per-layer tensors stay in the heap, longer sequences' activations do not).
MMAP_THRESHOLD = 4 * 1024 * 1024

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # glibc


def map_large_blocks(threshold: int | None = None) -> int:
    """Have glibc map blocks of at least ``threshold`` bytes on their own (see the module docstring).

    Args:
        threshold: bytes; None reads ``POSTTRAIN_MALLOC_MMAP_THRESHOLD``, else ``MMAP_THRESHOLD``.

    Returns:
        The threshold set, or 0 when nothing was done (not glibc, ``MALLOC_MMAP_THRESHOLD_`` set in
        the environment, or a threshold of 0).
    """
    if threshold is None:
        if "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return 0
        value = os.environ.get("POSTTRAIN_MALLOC_MMAP_THRESHOLD", "").strip()
        threshold = int(value) if value.isdigit() else MMAP_THRESHOLD if not value else -1
        if threshold < 0:
            raise ValueError(
                f"POSTTRAIN_MALLOC_MMAP_THRESHOLD={value!r} is not a number of bytes; "
                "set it to an integer such as 4194304, or to 0 to leave glibc's default."
            )
    libc = _libc()
    if threshold <= 0 or libc is None:
        return 0
    # Fixing the mmap threshold also stops glibc adjusting the trim threshold; keep the ratio
    # glibc's own adjustment uses (twice the mmap threshold) so the heap top is not trimmed and
    # regrown at every step.
    if not libc.mallopt(_M_MMAP_THRESHOLD, int(threshold)):
        return 0
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * int(threshold))
    return int(threshold)
