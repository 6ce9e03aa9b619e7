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

The blocks below the threshold still fragment the heap in backward: activations freed layer by
layer leave holes that stay resident while the gradients are allocated elsewhere. At the anchor
(64 tokens) glibc held 400 to 450 MB of free heap at the backward peak. ``trim_heap_in_backward``
returns those pages to the system (``malloc_trim``) every few decoder layers of backward's second
half (``TRIM_EVERY_LAYERS``; ``POSTTRAIN_MALLOC_TRIM_LAYERS`` overrides it, 0 turns it off), which
took 400 MB off the anchor's peak resident memory.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

from torch import nn

#: Blocks of at least this many bytes are mapped on their own (4 MB: the SmolLM2 anchor's
#: per-layer tensors stay in the heap, longer sequences' activations do not).
MMAP_THRESHOLD = 4 * 1024 * 1024

#: Backward returns the heap's free pages to the system every this many decoder layers.
TRIM_EVERY_LAYERS = 5

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


def _env_count(name: str, default: int, example: str) -> int:
    """A non-negative integer from the environment variable ``name`` (``default`` when unset)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not value.isdigit():
        raise ValueError(f"{name}={value!r} is not a non-negative integer; set it to {example}.")
    return int(value)


def trim_heap() -> bool:
    """Return the free pages of glibc's heap to the system now (``malloc_trim(0)``); False elsewhere."""
    libc = _libc()
    return bool(libc is not None and libc.malloc_trim(0))


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, in order: its ``_no_split_modules`` classes, else ``*DecoderLayer``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [
        m
        for m in model.modules()
        if type(m).__name__ in names or (not names and type(m).__name__.endswith("DecoderLayer"))
    ]


def trim_heap_in_backward(model: nn.Module, every: int | None = None) -> list[Any]:
    """Trim glibc's heap at the start of the backward of the layers ``trimmed_layers`` picks.

    A forward hook on those layers puts a gradient hook on their output when gradients are on;
    the gradient hook calls ``trim_heap`` as that layer's backward begins: every ``every`` layers
    counted from the last, in the lower half of the stack.
    Forwards without gradients (generation, the reference model) are untouched.

    Args:
        model: the model being trained (a wrapper such as a PEFT model is searched through).
        every: layers between trims; None reads ``POSTTRAIN_MALLOC_TRIM_LAYERS``, else
            ``TRIM_EVERY_LAYERS``; 0 installs nothing.

    Returns:
        The hook handles (empty when nothing was installed: not glibc, ``every`` of 0, or no
        decoder layers found).
    """
    if every is None:
        every = _env_count("POSTTRAIN_MALLOC_TRIM_LAYERS", TRIM_EVERY_LAYERS, "5, or 0 to turn trimming off")
    if every <= 0 or _libc() is None:
        return []
    layers = decoder_layers(model)
    chosen = trimmed_layers(len(layers), every)
    return [layers[index].register_forward_hook(_trim_at_backward) for index in chosen]


def trimmed_layers(count: int, every: int) -> list[int]:
    """Indices of the decoder layers whose backward trims the heap, in ascending order.

    Every ``every``-th layer counted from the last (the first one backward reaches), but only in
    the lower half of the stack: in backward's first half the pages that the top layers'
    activations free are taken again at once by the next layers' gradients and recomputation,
    so returning them only made that reuse page-fault (measured: docs/performance.md, "Free heap
    pages returned during backward"). The lowest such layer is kept when none is in the lower half.
    """
    candidates = list(range(count - 1, -1, -every))[::-1]
    lower = [index for index in candidates if 2 * index < count]
    return lower or candidates[:1]


def _trim_at_backward(module: nn.Module, args: Any, output: Any) -> None:
    hidden = output[0] if isinstance(output, (tuple, list)) else output
    if getattr(hidden, "requires_grad", False) and hidden.grad_fn is not None:
        hidden.register_hook(_trim_hook)


def _trim_hook(grad: Any) -> None:
    trim_heap()
