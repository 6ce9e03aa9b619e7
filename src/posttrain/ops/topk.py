"""The ``k`` most likely tokens of each position, from hidden states, chunk by chunk (no gradient).

Distillation and the sampler-side top-k log-probs need, besides each target's log-prob, the
``k`` largest log-probs of each position and their ids. Like ``chunked.token_stats`` this
projects ``chunk_size`` rows onto the vocabulary at a time and uses its accurate log-softmax
(``log p = u - log1p(S)``, the argmax left out of ``S``); ``token_topk_truncated`` renormalises
on a truncated sampler's support (``ops/support.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.ops import support
from posttrain.ops.chunked import DEFAULT_CHUNK_SIZE, _scaled_logits, _stats_dtype, _sum_but_argmax


@torch.no_grad()
def token_topk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    k: int,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each target's log-prob and the ``k`` most likely tokens of each position, without gradient.

    Args:
        hidden: [..., H] final hidden states in the head's dtype; targets: [...] token ids.

    Returns:
        ``(logps [...], top_logps [..., k], top_ids [..., k])``, log-probs in float32 or wider.
    """
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    dtype = _stats_dtype(weight.dtype)
    logps = flat_h.new_empty(flat_t.shape[0], dtype=dtype)
    top_logps = flat_h.new_empty(flat_t.shape[0], k, dtype=dtype)
    top_ids = flat_t.new_empty(flat_t.shape[0], k)
    for start in range(0, flat_t.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        u = _scaled_logits(flat_h[rows], weight, bias, temperature)  # [c, V], z for now
        top = u.topk(k, dim=-1)  # its first column: the row maximum m and the argmax a
        peak = top.values[:, :1]  # [c, 1]
        u.sub_(peak)  # z - m
        target_u = u.gather(1, flat_t[rows].unsqueeze(1)).squeeze(1)  # [c]
        # the accurate log-softmax of the module docstring: log p = u - log1p(S)
        log_norm = torch.log1p(_sum_but_argmax(u.exp_(), top.indices[:, 0]))  # [c]
        logps[rows] = target_u - log_norm
        top_logps[rows], top_ids[rows] = (top.values - peak) - log_norm.unsqueeze(1), top.indices
    return logps.view(shape), top_logps.view(*shape, k), top_ids.view(*shape, k)


def token_topk_truncated(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    k: int,
    truncation: Any,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_topk`` on a truncated sampler (``ops/support.py``), without gradient.

    Returns:
        ``(logps [...], top_logps [..., k], top_ids [..., k], support [..., M])``: log-probs under
        the softmax restricted to each position's support, and the support's ids (``-1`` padded).
    """
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    parts = [
        support.truncated_topk(_scaled_logits(flat_h[s : s + chunk_size], weight, bias, temperature),
                               flat_t[s : s + chunk_size], k, truncation)
        for s in range(0, flat_t.shape[0], chunk_size)
    ]  # fmt: skip
    logps, top_logps, top_ids = (torch.cat([p[i] for p in parts]) for i in range(3))
    ids = support.pad_support([p[3] for p in parts])
    k = top_ids.shape[-1]
    return logps.view(shape), top_logps.view(*shape, k), top_ids.view(*shape, k), ids.view(*shape, -1)
