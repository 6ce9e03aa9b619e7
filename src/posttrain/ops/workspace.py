"""Scratch buffers kept between calls, so that large CPU temporaries do not touch fresh pages.

On the CPU every tensor is a ``malloc`` block, and glibc serves a block above its mapping
threshold (``ops/memory.py`` sets 4 MB; glibc never keeps blocks above 32 MB in its heap) with a
fresh anonymous mapping that is unmapped when the tensor dies. Each first touch of such a page is
a page fault. The chunked LM head (``ops/chunked.py``) creates its largest tensors chunk after
chunk, call after call: a ``[256, 49152]`` float32 logits block is 50 MB, the bf16 copy of
SmolLM2's head weight 57 MB. On a virtual machine whose freed pages go back to the host, a fault
cost 5 to 6 us a 4 KB page (1.5 ms a MB) once training had run a step, against 0.8 us on a page
the guest still held: the head's temporaries alone made 300 to 400 thousand faults a GRPO step
(docs/performance.md, "The chunked head's scratch buffers").

``scratch(name, shape, dtype, device)`` returns a tensor over a buffer kept for ``name``: the same
pages each time, grown when a larger shape is asked for. Its contents are whatever the last user
left. The contract is the caller's: a scratch tensor is dead when the caller returns; nothing
that outlives the call (an output, a tensor saved for backward) may be, or view, a scratch
tensor; and two live scratch tensors need two names. The buffers are per thread (a trainer's
generation thread and its training thread never share one), CPU only (CUDA's caching allocator
already reuses its blocks: there ``scratch`` returns a fresh ``torch.empty``), and stay allocated
until ``release`` is called from the thread that made them. Threads that take turns may share
one set (``adopt``).
"""

from __future__ import annotations

import math
import threading

import torch

_LOCAL = threading.local()


def _pool() -> dict[tuple[str, torch.dtype, torch.device], torch.Tensor]:
    pool = getattr(_LOCAL, "pool", None)
    if pool is None:
        pool = _LOCAL.pool = {}
    return pool


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous ``shape`` tensor over the buffer kept for ``(name, dtype)``.

    Args:
        name: the buffer's role; two scratch tensors alive at once need two names.
        shape: the tensor's shape; the buffer grows to the largest one asked for.
        dtype: its dtype (each dtype has its own buffer per name).
        device: a CPU device uses the kept buffer; any other gets a fresh ``torch.empty``.
    """
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    key = (name, dtype, torch.device(device))
    pool = _pool()
    buffer = pool.get(key)
    if buffer is None or buffer.numel() < numel:
        pool.pop(key, None)  # the smaller one goes before the larger one is allocated
        buffer = pool[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


def adopt(pool: dict | None = None) -> dict:
    """Make the calling thread's scratch buffers ``pool`` (a new one when None); returns it.

    For threads that never compute at the same time, such as a sweep's runs taking turns: handing
    each the same pool keeps one set of buffers instead of one per thread.
    """
    _LOCAL.pool = {} if pool is None else pool
    return _LOCAL.pool


def held_bytes() -> int:
    """Bytes this thread's scratch buffers hold."""
    return sum(b.numel() * b.element_size() for b in _pool().values())


def release() -> None:
    """Free this thread's scratch buffers (the next ``scratch`` call allocates afresh)."""
    _pool().clear()
