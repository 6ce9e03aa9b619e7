"""Selective activation checkpointing (SAC): checkpointed layers keep their attention output.

``gradient_checkpointing_kwargs={"selective": True}`` asks for the selective recomputation of
"Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), as the
reference accepts it. Full checkpointing runs every op of a checkpointed decoder layer again in
backward, the attention kernel included, although that kernel is a large share of the
recomputation's cost and its output is small (one row of ``heads x head_dim`` per token, plus a
log-sum-exp per head). With SAC the forward saves the output of the fused attention ops
(``ATTENTION_OPS``) and backward takes it from there; every other op of the layer (norms,
projections, rotary embeddings, the MLP) is recomputed as before.

It is built on torch's non-reentrant checkpoint: each checkpointed layer's checkpoint function
gets ``context_fn=selective_context`` (``torch.utils.checkpoint.create_selective_checkpoint_contexts``
with ``attention_policy``: ``MUST_SAVE`` for the ops in ``ATTENTION_OPS``, ``PREFER_RECOMPUTE``
for every other op). transformers' ``Trainer.train`` enables checkpointing with the config's
kwargs, which store the ``selective`` key in each layer's checkpoint function;
``use_selective_checkpointing`` rebuilds that function before the first training step, without
the key (torch never receives it) and with the context. ``every_n_layers`` and ``offload`` keep
working: the rebuilt function is the one transformers chose, with two keywords changed.

``attn_implementation="eager"``: attention is then plain ``matmul`` + ``softmax``, whose
intermediates are ``[batch, heads, query, key]`` tensors. Those are exactly what the paper
recomputes because they are large and cheap; saving them would cost more memory than not
checkpointing the layer at all. So SAC saves nothing there and the layers are recomputed as
with full checkpointing; ``use_selective_checkpointing`` warns so, and the fix is to load the
model with ``attn_implementation="sdpa"`` (transformers' default). The same holds for an
attention kernel that is not one of ``ATTENTION_OPS`` (it is recomputed, the gradients are
unchanged).

Not to be confused with posttrain's CPU optimisation in ``ops/checkpointing.py``
(``POSTTRAIN_SELECTIVE_CHECKPOINTING``), which leaves whole top layers uncheckpointed when the
gradients' memory pays for it. The two combine: the layers that stay checkpointed use SAC.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

#: The key of ``gradient_checkpointing_kwargs`` (``activation_checkpointing_kwargs``) that asks for SAC.
SELECTIVE_KEY = "selective"

#: The fused attention ops whose output SAC saves, as (namespace, op name). aten's scaled dot
#: product attention kernels (CPU flash, CUDA flash, memory-efficient, cuDNN, the backend-overridable
#: one, and the varlen flash / efficient forwards), flex attention (a higher-order op) and the
#: flash-attn package's custom ops (``attn_implementation="flash_attention_2"``) when it is installed.
#: An op missing from this build of torch is skipped.
ATTENTION_OPS: tuple[tuple[str, str], ...] = (
    ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ("aten", "_scaled_dot_product_flash_attention"),
    ("aten", "_scaled_dot_product_efficient_attention"),
    ("aten", "_scaled_dot_product_cudnn_attention"),
    ("aten", "_scaled_dot_product_fused_attention_overrideable"),
    ("aten", "_flash_attention_forward"),
    ("aten", "_efficient_attention_forward"),
    ("higher_order", "flex_attention"),
    ("flash_attn", "_flash_attn_forward"),
    ("flash_attn", "_flash_attn_varlen_forward"),
)

#: Attention implementations that run no fused attention op: SAC has nothing to save there.
UNFUSED_ATTENTION = ("eager",)


def _resolve(namespace: str, name: str) -> list[Any]:
    """The op's overloads (aten, custom ops) or the higher-order op itself; empty when absent."""
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return []
    if isinstance(packet, torch._ops.HigherOrderOperator):
        return [packet]
    return [getattr(packet, overload) for overload in packet.overloads()]


@functools.cache
def _attention_ops(with_flash_attn: bool) -> frozenset[Any]:
    return frozenset(
        op
        for namespace, name in ATTENTION_OPS
        if with_flash_attn or namespace != "flash_attn"
        for op in _resolve(namespace, name)
    )


def attention_ops() -> frozenset[Any]:
    """The ops of ``ATTENTION_OPS`` that exist in this process (flash-attn's once it is imported)."""
    return _attention_ops("flash_attn" in sys.modules)


def attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """SAC's policy: keep the attention ops' outputs, recompute everything else.

    Args:
        ctx: torch's ``SelectiveCheckpointContext`` (unused: the answer is the same in forward
            and in the recomputation, as torch requires).
        op: the op about to run inside a checkpointed region.
        *args: its arguments (unused).
        **kwargs: its keyword arguments (unused).

    Returns:
        ``CheckpointPolicy.MUST_SAVE`` for an attention op, else ``CheckpointPolicy.PREFER_RECOMPUTE``.
    """
    return CheckpointPolicy.MUST_SAVE if op in attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> tuple[Any, Any]:
    """The ``context_fn`` of SAC: a fresh pair of forward and recomputation contexts per checkpoint call."""
    return create_selective_checkpoint_contexts(attention_policy)


def requested(kwargs: dict[str, Any] | None) -> bool:
    """Whether checkpointing kwargs (``activation_checkpointing_kwargs``) ask for SAC."""
    return isinstance(kwargs, dict) and bool(kwargs.get(SELECTIVE_KEY))


def selective_checkpoint_func(func: Callable[..., Any]) -> Callable[..., Any]:
    """A layer's checkpoint function turned into SAC's: non-reentrant, ``context_fn=selective_context``.

    transformers stores ``functools.partial(checkpoint, **kwargs)`` (or its CPU-offloading
    wrapper); the partial is rebuilt without the ``selective`` key. Any other callable is
    wrapped with the two keywords. Applying it twice changes nothing.

    Raises:
        ValueError: the function asks for reentrant checkpointing, or already has a ``context_fn``.
    """
    if isinstance(func, functools.partial):
        keywords = {k: v for k, v in func.keywords.items() if k != SELECTIVE_KEY}
        if keywords.get("context_fn") is selective_context:
            return functools.partial(func.func, *func.args, **keywords)
        if keywords.get("use_reentrant"):
            raise ValueError(
                "Selective activation checkpointing needs non-reentrant checkpointing, but the model's layers "
                "were set up with use_reentrant=True. Drop 'use_reentrant' from gradient_checkpointing_kwargs "
                "or set it to False."
            )
        if "context_fn" in keywords:
            raise ValueError(
                "gradient_checkpointing_kwargs has both 'selective' and 'context_fn'; selective activation "
                "checkpointing brings its own context_fn. Remove one of them."
            )
        keywords.update(use_reentrant=False, context_fn=selective_context)
        return functools.partial(func.func, *func.args, **keywords)
    return functools.partial(func, use_reentrant=False, context_fn=selective_context)


def _attn_implementation(model: nn.Module) -> str | None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation
    return None


def use_selective_checkpointing(model: nn.Module, kwargs: dict[str, Any] | None) -> int:
    """Apply the ``selective`` key of the checkpointing kwargs to the model's checkpointed layers.

    Call it after checkpointing is enabled (``activation_checkpointing_enable``) and before the
    first training forward. Every module that holds a checkpoint function gets SAC's with
    ``selective=True``, and the same function without the key with ``selective=False``; nothing
    happens when the key is absent. Layers whose ``gradient_checkpointing`` flag is off now (as
    ``ops/checkpointing.py`` sets it for one forward) get it too, for when the flag comes back.

    Args:
        model: the model being trained (a wrapper such as a PEFT model is searched through).
        kwargs: the config's ``activation_checkpointing_kwargs``.

    Returns:
        How many modules got SAC's checkpoint function (0 without ``selective=True``).
    """
    if not isinstance(kwargs, dict) or SELECTIVE_KEY not in kwargs:
        return 0
    on = requested(kwargs)
    count = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None:
            continue
        if on:
            module._gradient_checkpointing_func = selective_checkpoint_func(func)
            count += 1
        elif isinstance(func, functools.partial) and SELECTIVE_KEY in func.keywords:
            keywords = {k: v for k, v in func.keywords.items() if k != SELECTIVE_KEY}
            module._gradient_checkpointing_func = functools.partial(func.func, *func.args, **keywords)
    if count and _attn_implementation(model) in UNFUSED_ATTENTION:
        warnings.warn(
            "gradient_checkpointing_kwargs={'selective': True} saves the output of the fused attention ops, but "
            "the model runs attn_implementation='eager' (matmul + softmax, whose [batch, heads, query, key] "
            "intermediates are cheaper to recompute than to keep), so every op is recomputed as with full "
            "checkpointing. Load the model with attn_implementation='sdpa' to benefit from it.",
            UserWarning,
            stacklevel=2,
        )
    return count
