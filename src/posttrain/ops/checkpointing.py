"""Gradient checkpointing that skips the recomputation the gradients' memory pays for anyway.

With ``gradient_checkpointing=True`` every decoder layer keeps only its input in the forward
pass and recomputes its activations in backward: about a quarter of the training FLOPs on the
anchor config. Backward runs the layers from the last to the first. While it does, the
parameters' gradients are allocated layer by layer, and all of them stay until the optimizer
step (clipping needs their global norm), so the end of backward holds every gradient at once.

A top layer whose activations were kept is finished, and its activations freed, in the first
moments of backward, while most gradients do not exist yet. So the last ``u`` layers can keep
their activations without raising the peak, as long as the activations of those ``u`` layers
are no larger than the gradients still to be allocated when the forward starts. That is the
rule here: ``uncheckpointed_layers`` estimates one layer's saved activations for the forward
about to run (``activation_bytes``, from the layer's shapes), and ``gradient_budget`` sums the
decoder layers' gradients that are not allocated yet (none with gradient accumulation after the
first micro-batch, few with LoRA). ``within_gradient_budget`` turns checkpointing off on that
many top layers for one forward and back on after it; the backward of that forward is unchanged
(the recorded graph decides what is recomputed).

On the anchor (SmolLM2-135M, 8 x 64 tokens) it leaves 13 of 30 layers uncheckpointed. It is
used on the CPU only, where it was measured (docs/performance.md); ``POSTTRAIN_SELECTIVE_CHECKPOINTING=0``
turns it off.

This is not selective *activation* checkpointing (SAC, ``gradient_checkpointing_kwargs=
{"selective": True}``, ``ops/sac.py``), which keeps the attention ops' outputs inside every
checkpointed layer. The two combine: the layers this module leaves checkpointed run with SAC's
checkpoint function, and the activations of the layers it uncheckpoints are all kept anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from posttrain.ops import switches
from posttrain.ops.memory import decoder_layers

#: Share of the unallocated gradients' bytes that kept activations may take (the rest covers
#: what the estimate leaves out, such as the head's chunked buffers at the start of backward).
BUDGET_SHARE = 0.9

#: One forward through the layers: (rows, query positions per row, key positions per row).
Forward = tuple[int, int, int]


def _layer_dims(layer: nn.Module) -> tuple[int, int, int, int, bool] | None:
    """(hidden, query width, intermediate, heads, has q/k norms) of a Llama-style layer, else None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if any(norm is None for norm in norms) or not all(isinstance(p, nn.Linear) for p in projections):
        return None
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return None
    q, gate = projections[0], projections[4]
    has_qk_norm = getattr(attn, "q_norm", None) is not None
    return q.in_features, q.out_features, gate.out_features, q.out_features // head_dim, has_qk_norm


def activation_bytes(layer: nn.Module, forwards: Sequence[Forward], element_size: int) -> int | None:
    """Bytes one Llama-style decoder layer saves for backward over ``forwards``, or None.

    Counted per query position: the input and post-attention RMSNorms' input, normalised and
    weighted rows (3 x hidden each); the query, the attention output and the output
    projection's input (3 x query width, plus a log-sum-exp per head); the MLP's gate, its
    activation, the up projection and their product (4 x intermediate); Qwen3's per-head
    norms (3 x query width more). Per key position: the keys and values repeated to every
    query head (2 x query width). Per query and key pair: the attention mask (4 bytes).
    None for a layer of another shape.
    """
    dims = _layer_dims(layer)
    if dims is None:
        return None
    hidden, width, intermediate, heads, has_qk_norm = dims
    per_query = 6 * hidden + 3 * width + heads + 4 * intermediate + (3 * width if has_qk_norm else 0)
    total = 0
    for rows, queries, keys in forwards:
        total += element_size * rows * (queries * per_query + keys * 2 * width) + 4 * rows * queries * keys
    return total


def gradient_budget(layers: Sequence[nn.Module]) -> int:
    """Bytes of the layers' gradients that are not allocated yet (trainable, ``grad`` None)."""
    return sum(
        p.numel() * p.element_size()
        for layer in layers
        for p in layer.parameters()
        if p.requires_grad and p.grad is None
    )


def enabled() -> bool:
    """Whether ``POSTTRAIN_SELECTIVE_CHECKPOINTING`` allows it (unset or 1; 0 turns it off).

    Raises:
        ValueError: the variable holds something else.
    """
    return switches.switched_on(
        "POSTTRAIN_SELECTIVE_CHECKPOINTING", "set it to 0 to recompute every checkpointed layer, or unset it."
    )


def _layers_to_keep(model: nn.Module, forwards: Sequence[Forward]) -> list[nn.Module]:
    if not torch.is_grad_enabled() or not enabled():
        return []
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return []
    layers = decoder_layers(model)
    if not layers or not all(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        return []
    weight = next(layers[-1].parameters(), None)
    if weight is None or weight.device.type != "cpu":
        return []
    per_layer = activation_bytes(layers[-1], forwards, weight.element_size())
    if not per_layer:
        return []
    count = min(len(layers), int(BUDGET_SHARE * gradient_budget(layers)) // per_layer)
    return layers[len(layers) - count :] if count else []


def uncheckpointed_layers(model: nn.Module, forwards: Sequence[Forward]) -> int:
    """How many of the model's last checkpointed decoder layers may keep their activations.

    Zero unless gradients are on, the model trains on the CPU in a single process, every
    decoder layer is checkpointed and has the Llama shape ``activation_bytes`` knows, and
    ``POSTTRAIN_SELECTIVE_CHECKPOINTING`` is not 0.

    Args:
        model: the model about to run a forward (a wrapper such as a PEFT model is searched through).
        forwards: the passes of that forward through the layers, as (rows, query positions,
            key positions): one for a plain forward, two with a shared prompt prefix.
    """
    return len(_layers_to_keep(model, forwards))


@contextlib.contextmanager
def within_gradient_budget(model: nn.Module, forwards: Sequence[Forward]) -> Iterator[int]:
    """Turn checkpointing off on the last ``uncheckpointed_layers`` layers for one forward.

    Yields that number. The layers' ``gradient_checkpointing`` flags are restored on exit; the
    graph recorded inside keeps its activations whatever the flags say afterwards.
    """
    kept = _layers_to_keep(model, forwards)
    for layer in kept:
        layer.gradient_checkpointing = False
    try:
        yield len(kept)
    finally:
        for layer in kept:
            layer.gradient_checkpointing = True
