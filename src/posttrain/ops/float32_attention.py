"""Short attention in float32 under CPU bf16 autocast, where it is faster than bf16.

CPU autocast runs ``scaled_dot_product_attention`` in bfloat16. On the anchor config (SmolLM2-135M,
8 completions of 64 tokens after a 53-token prompt, Intel Xeon with AMX) a ``torch.profiler`` trace
of a bf16 training step put the flash-attention kernel's backward at 4.4 ms a call, 260 ms a step,
more than any single product: for short sequences the bf16 kernel is slower than the float32
one. Forward and backward of one layer's completion attention on that host (8 rows, 9 heads, a
53-token prompt before the completion, bf16 against float32, ms): 117 keys 9.6 / 4.1, 181 keys
16.3 / 7.7, 309 keys 20.0 / 19.9, 437 keys 35.9 / 38.9, 821 keys 104 / 140, 1077 keys 178 / 241.
Float32 wins by half below about 200 keys; from about 300 on the two are even, then bf16 wins.

``float32_short_attention`` puts a wrapper in front of transformers' ``"sdpa"`` attention function
for the duration of training (``BaseTrainer.train``): under CPU bf16 autocast, with at most
``MAX_KEYS`` key positions, it runs the same function with autocast off on float32 queries, keys
and values (the queries and keys usually are float32 already: the rotary embedding promotes
them). Longer attention, other devices and other precisions pass through unchanged. The
attention is also more precise (float32 scores and softmax inputs); its output goes on to
``o_proj``, which autocast casts to bf16 as before.

Grouped-query attention with a mask (every training pass: padding, a shared prompt's cache) is
called with each key head's query heads stacked as its query positions (``_folded``), where
transformers repeats every key and value head for its query heads first (``repeat_kv``, a copy,
and in backward a sum over the copies): one layer's forward and backward at the anchor (8 rows,
9 query and 3 key heads, 64 queries against 117 keys, float32) 3.87 against 2.64 ms. The output
and gradients equal the repeated call's to float32 rounding (the output bit for bit at the
anchor's shapes; the keys' and values' gradients are summed over the group inside the kernel
instead of after it; ``tests/test_float32_attention.py``).

``POSTTRAIN_FLOAT32_SHORT_ATTENTION=0`` turns it off. Figures: docs/performance.md, "Short attention
in float32 under bf16".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.ops import switches

ENV = "POSTTRAIN_FLOAT32_SHORT_ATTENTION"

#: The most key positions attended in float32: below, float32 takes half of bf16's time; from
#: about 300 keys on the two are even, and bf16 wins at 800 (measured above).
MAX_KEYS = 256

_installed: dict[str, Any] = {"depth": 0, "had_local": False, "previous": None}
_lock = threading.Lock()  # a sweep's runs may train in threads


def enabled() -> bool:
    """Whether ``POSTTRAIN_FLOAT32_SHORT_ATTENTION`` allows it (unset or 1; 0 turns it off).

    Raises:
        ValueError: the variable holds something else.
    """
    return switches.switched_on(ENV, "set it to 0 to let autocast run every attention in bf16, or unset it.")


def applies(args: Any) -> bool:
    """Whether a trainer with these ``TrainingArguments`` attends in float32 when short: bf16 on the CPU.

    Raises:
        ValueError: ``POSTTRAIN_FLOAT32_SHORT_ATTENTION`` holds something else than 0 or 1 (read
            first, whatever the precision, so a typo fails when the trainer is built).
    """
    return enabled() and bool(getattr(args, "bf16", False)) and args.device.type == "cpu"


def _short_cpu_bf16(query: torch.Tensor, key: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and torch.is_autocast_enabled("cpu")
        and torch.get_autocast_dtype("cpu") == torch.bfloat16
        and key.shape[-2] <= MAX_KEYS
    )


def wrap(attention: Callable[..., Any]) -> Callable[..., Any]:
    """``attention`` (transformers' signature) that runs short CPU bf16-autocast calls in float32."""

    def float32_when_short(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not _short_cpu_bf16(query, key):
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        if attention_mask is not None and attention_mask.is_floating_point():
            attention_mask = attention_mask.float()
        with torch.autocast("cpu", enabled=False):
            if _foldable(query, key, value, attention_mask, args, kwargs):
                return _folded(
                    query.float(), key.float(), value.float(), attention_mask, kwargs.get("scaling")
                )
            return attention(
                module, query.float(), key.float(), value.float(), attention_mask, *args, **kwargs
            )

    float32_when_short.wrapped = attention  # type: ignore[attr-defined]
    return float32_when_short


def _foldable(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bool:
    """Whether ``_folded`` computes what transformers' sdpa function would: grouped heads, several
    queries, one mask for every head, and nothing else asked of the call (no dropout, position
    bias, soft-capping or attention weights)."""
    rows, heads, queries, _ = query.shape
    asked = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux"))
    return (
        not args
        and not asked
        and not kwargs.get("dropout")
        and not kwargs.get("output_attentions")
        and mask is not None
        and mask.dim() == 4
        and mask.shape[1] == 1
        and mask.shape[2] == queries > 1
        and key.shape[0] == rows == mask.shape[0]
        and heads > key.shape[1]
        and heads % key.shape[1] == 0
        and key.shape[-1] == value.shape[-1]
    )


def _folded(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float | None
) -> tuple[torch.Tensor, None]:
    """Grouped-query attention as one call over the key heads: query [B, H, T, d] viewed as
    [B, K, (H / K) T, d] (transformers' heads are ordered key head by key head), the mask
    repeated for each group; transformers' output layout [B, T, H, d]."""
    rows, heads, queries, _ = query.shape
    groups = heads // key.shape[1]
    stacked = query.reshape(rows, key.shape[1], groups * queries, query.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask.repeat(1, 1, groups, 1), scale=scaling
    )
    return out.view(rows, heads, queries, value.shape[-1]).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def float32_short_attention() -> Iterator[None]:
    """Within the block, transformers' ``"sdpa"`` attention runs short CPU bf16 calls in float32.

    Nested blocks (one trainer's ``train`` inside another's, a sweep's runs) install the wrapper
    once; the outermost block's exit restores what was there before.
    """
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _lock:
        if _installed["depth"] == 0:
            local = ALL_ATTENTION_FUNCTIONS._local_mapping
            _installed["had_local"] = "sdpa" in local
            _installed["previous"] = local.get("sdpa")
            ALL_ATTENTION_FUNCTIONS["sdpa"] = wrap(ALL_ATTENTION_FUNCTIONS["sdpa"])
        _installed["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _installed["depth"] -= 1
            if _installed["depth"] == 0:
                if _installed["had_local"]:
                    ALL_ATTENTION_FUNCTIONS["sdpa"] = _installed["previous"]
                else:
                    del ALL_ATTENTION_FUNCTIONS["sdpa"]
