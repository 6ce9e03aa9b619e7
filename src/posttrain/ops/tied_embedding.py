"""A trained input embedding tied to the LM head: its rows' gradient added into the head's, in place.

The tied weight ``W`` [V, H] gets two kinds of gradient in one backward: the head's, dense
(every vocabulary row), and each embedding lookup's, which touches only the looked-up rows.
The embedding's own backward builds a dense ``[V, H]`` gradient (113 MB for SmolLM2) of zeros
but those rows; a sparse one avoids that, but autograd (torch 2.13) sums a sparse gradient into a
dense one out of place: a fresh ``[V, H]`` block, copied and added to, for every lookup (two with
a shared prompt prefix; about 40 ms each, more with the page faults of a fresh block in a
training process).

Within ``tied_embedding_grad(model)`` the embedding's lookups record their backward nodes per
weight. When the chunked head's backward (``ops/chunked.py``; the distillation engine's,
``ops/divergence.py``, for a student's head) has the weight's gradient, it asks
``hand_over``: if recorded lookups will run later in this backward, the gradient is left with
them instead of returned; each lookup adds its rows into it in place (``index_add_``) and the
last one returns it as the weight's gradient, so autograd receives one dense gradient and
accumulates it as it would the head's alone. A lookup with nothing handed over returns the
sparse gradient, as before. The weight's gradient is the same sum either way (the rows are added
in another order: equal to float rounding), through ``.backward()`` and ``torch.autograd.grad``
alike.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops.head_forward import causal_lm

#: id(weight) -> (the weight, the backward nodes of its recorded lookups), both held weakly.
_LOOKUPS: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}
_LOCK = threading.Lock()


@dataclass
class _Handed:
    """The head's gradient of a tied weight, waiting for ``remaining`` lookups to add their rows."""

    total: torch.Tensor | None
    remaining: int


class _TiedLookup(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose backward adds into a handed-over gradient."""

    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.rows, ctx.padding_idx, ctx.handed = weight.shape[0], padding_idx, None
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor | None, None]:
        (ids,) = ctx.saved_tensors
        _forget(ctx)
        handed, ctx.handed = ctx.handed, None
        padding = -1 if ctx.padding_idx is None else ctx.padding_idx
        if handed is None:  # nothing handed over: the embedding's own sparse gradient
            return None, torch.ops.aten.embedding_backward(grad, ids, ctx.rows, padding, False, True), None
        flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            rows = rows * (flat != ctx.padding_idx).unsqueeze(-1).to(rows.dtype)
        handed.total.index_add_(0, flat, rows.to(handed.total.dtype))
        handed.remaining -= 1
        if handed.remaining:
            return None, None, None
        total, handed.total = handed.total, None  # drop this reference: autograd may take the tensor over
        return None, total, None


def _record(weight: torch.Tensor, node: Any) -> None:
    with _LOCK:
        entry = _LOOKUPS.get(id(weight))
        if entry is None or entry[0]() is not weight:
            entry = _LOOKUPS[id(weight)] = (weakref.ref(weight), [])
        entry[1][:] = [ref for ref in entry[1] if ref() is not None]
        entry[1].append(weakref.ref(node))


def _forget(node: Any) -> None:
    with _LOCK:
        for key, (weight, refs) in list(_LOOKUPS.items()):
            refs[:] = [ref for ref in refs if ref() is not None and ref() is not node]
            if weight() is None or not refs:
                del _LOOKUPS[key]


def hand_over(weight: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor | None:
    """The head's gradient of ``weight`` to return from its backward: ``grad``, or None once handed over.

    Called during backward. ``grad`` is handed to the recorded lookups of ``weight`` that this
    backward will still run (their rows are added into it, and the last returns it), or added into
    a gradient already handed to them by another head in this backward. Otherwise returned as is.
    """
    if grad is None or not grad.is_contiguous() or torch.is_grad_enabled():  # create_graph: left to autograd
        return grad
    with _LOCK:
        entry = _LOOKUPS.get(id(weight))
        nodes = [ref() for ref in entry[1]] if entry is not None and entry[0]() is weight else []
    pending = [node for node in nodes if node is not None and torch._C._will_engine_execute_node(node)]
    handed = {id(node.handed): node.handed for node in pending}
    if not pending or len(handed) != 1:
        return grad
    current = next(iter(handed.values()))
    if current is None:
        current = _Handed(grad, len(pending))
        for node in pending:
            node.handed = current
    elif (
        current.total is not None and current.total.shape == grad.shape and current.total.dtype == grad.dtype
    ):
        current.total.add_(grad)
    else:
        return grad
    return None


def _lookup_forward(embed: torch.nn.Embedding) -> Any:
    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return torch.nn.functional.embedding(input_ids, embed.weight, embed.padding_idx)
        out = _TiedLookup.apply(input_ids, embed.weight, embed.padding_idx)
        _record(embed.weight, out.grad_fn)
        return out

    return forward


@contextlib.contextmanager
def tied_embedding_grad(model: torch.nn.Module) -> Iterator[None]:
    """While scoring, a trained input embedding tied to the LM head adds its rows into the head's gradient.

    Only for a tied weight and an unwrapped model (DDP and sharding reduce gradients themselves),
    a plain ``nn.Embedding`` without ``max_norm``, ``scale_grad_by_freq`` or ``sparse``. Elsewhere
    nothing changes.
    """
    lm = causal_lm(model)
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    usable = (
        torch.is_grad_enabled()
        and type(embed) is torch.nn.Embedding
        and head is not None
        and getattr(head, "weight", None) is embed.weight
        and embed.weight.requires_grad
        and not embed.sparse
        and not embed.scale_grad_by_freq
        and embed.max_norm is None
        and not hasattr(model, "module")
        and type(embed.weight.data) is torch.Tensor
        and "forward" not in vars(embed)
    )
    if not usable:
        yield
        return
    embed.forward = _lookup_forward(embed)
    try:
        yield
    finally:
        del embed.forward
