"""Scoring the completions of one prompt with the prompt run through the model once.

GRPO scores ``G`` completions of each prompt. Run naively, the model's forward (and backward,
and the recomputation of gradient checkpointing) repeats the prompt ``G`` times, although every
copy yields the same hidden states. Here a micro-batch is scored in two calls of the model:

1. the *prompt pass*: each distinct prompt once, ``[U, P]``. A recording cache keeps every
   layer's keys and values (with their autograd history) instead of storing them for decoding;
2. the *completion pass*: the ``[N, T]`` completions, attending to their prompt's keys and values
   (``index_select``-ed from the ``U`` recorded ones) through a read-only cache, with the full
   ``[N, P + T]`` attention mask and positions that continue the prompt's.

The log-prob of completion token 0 comes from the prompt's last hidden state, token ``t`` from
the completion pass's position ``t - 1``. In backward, the gradients of the ``G`` users of a
prompt's keys and values sum into its one prompt pass. The result is the naive computation's,
reordered (tests compare values and every parameter's gradient to 1e-5): it saves ``(N - U) * P``
token rows of forward, backward and recomputation, and their activations.

Both caches are idempotent: the recorder overwrites, the reader never writes. That is what lets
gradient checkpointing (non-reentrant, transformers' default) replay a layer with the cache
passed, which transformers otherwise drops (``_can_checkpoint_with_cache``, set for the duration
of the two calls only).

Used where ``supported`` holds: a transformers causal LM of a family whose attention reads its
cache in the standard way (``SUPPORTED_MODEL_TYPES``), with full (not sliding-window) attention,
not a Mixture-of-Experts model (its router loss would count each prompt once instead of ``G``
times), not wrapped by DDP, FSDP or DeepSpeed, and without prompt-learning PEFT adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache, DynamicLayer

from posttrain.models.compat import cache_argument
from posttrain.ops import chunked

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""Model families whose decoder reads keys and values through ``cache.update`` and builds its
mask from the cache's length: the ones checked by ``tests/test_shared_prefix.py``."""


@dataclass
class PromptGroups:
    """The distinct prompts of a micro-batch.

    Attributes:
        ids: [U, P'] the distinct prompts, left padding common to all of them removed.
        mask: [U, P'] their attention mask.
        inverse: [N] the distinct prompt of each row.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    inverse: torch.Tensor


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> PromptGroups | None:
    """Group the rows of a micro-batch by prompt; ``None`` when no two rows share one.

    Args:
        prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
    """
    keys = torch.where(prompt_mask.bool(), prompt_ids, -1)  # padding tokens do not matter
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)
    num = unique.shape[0]
    if num == prompt_ids.shape[0]:
        return None
    rows = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    first = torch.full((num,), prompt_ids.shape[0], dtype=rows.dtype, device=rows.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # one representative row per prompt
    ids, mask = prompt_ids[first], prompt_mask[first]
    start = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # columns that are padding in all
    return PromptGroups(ids=ids[:, start:], mask=mask[:, start:], inverse=inverse)


class _RecordingLayer(DynamicLayer):
    """Keeps the last keys and values it was given and returns them unchanged (no past)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.recorded = (key_states, value_states)
        return key_states, value_states


class _ReadOnlyLayer(DynamicLayer):
    """Holds a prompt's keys and values; returns them followed by the new ones, storing nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _recording_cache() -> DynamicCache:
    cache = DynamicCache()
    cache.layers = []
    cache.layer_class_to_replicate = _RecordingLayer
    return cache


def _read_only_cache(recorder: DynamicCache, inverse: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [
        _ReadOnlyLayer(layer.recorded[0].index_select(0, inverse), layer.recorded[1].index_select(0, inverse))
        for layer in recorder.layers
    ]
    cache.layer_class_to_replicate = None
    return cache


def _decoder_layers(lm: nn.Module) -> list[nn.Module]:
    layers = getattr(lm.get_decoder(), "layers", None)
    return list(layers) if layers is not None else []


def _reentrant_checkpointing(layers: list[nn.Module]) -> bool:
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if getattr(func, "keywords", {}).get("use_reentrant", False):
                return True
    return False


def supported(model: nn.Module) -> bool:
    """Whether ``model`` can be scored with a shared prompt pass (see the module docstring)."""
    if isinstance(model, nn.parallel.DistributedDataParallel) or hasattr(model, "module"):
        return False  # DDP / DeepSpeed / FSDP v1: one forward call per backward
    lm = chunked.causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_decoder"):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    if getattr(text, "sliding_window", None) is not None and getattr(text, "use_sliding_window", True):
        return False
    if any(getattr(text, name, None) for name in ("num_experts", "num_local_experts")):
        return False
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, dict) and any(
        getattr(c, "is_prompt_learning", False) for c in peft_config.values()
    ):
        return False
    if any(type(p).__name__ == "DTensor" or hasattr(p, "ds_id") for p in lm.parameters()):
        return False
    layers = _decoder_layers(lm)
    return bool(layers) and not _reentrant_checkpointing(layers)


@contextlib.contextmanager
def _cache_through_checkpointing(lm: nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers receive the (idempotent) caches of this module."""
    layers = [layer for layer in _decoder_layers(lm) if getattr(layer, "gradient_checkpointing", False)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache  # back to the class's value


def hidden_states(
    model: nn.Module,
    groups: PromptGroups,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The final hidden states that predict each completion token, prompts run once.

    Args:
        model: a model for which ``supported`` holds.
        groups: the micro-batch's distinct prompts (``prompt_groups``).
        completion_ids: [N, T] right-padded completions; completion_mask: [N, T].

    Returns:
        The completion pass's output (its ``logits`` cover the last position only), that pass's
        final hidden states [N, T, H], and the hidden states [N, T, H] that predict the
        completion tokens (the prompt's last position, then the completion's positions 0..T-2).
    """
    lm = chunked.causal_lm(model)
    name = cache_argument(lm) or "past_key_values"
    recorder = _recording_cache()
    prompt_positions = (groups.mask.long().cumsum(dim=1) - 1).clamp(min=0)
    mask = torch.cat([groups.mask[groups.inverse], completion_mask], dim=1)  # [N, P' + T]
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)[:, groups.mask.shape[1] :]
    with _cache_through_checkpointing(lm):
        _, prompt_hidden = chunked.run_with_hidden(
            model,
            input_ids=groups.ids,
            attention_mask=groups.mask,
            position_ids=prompt_positions,
            use_cache=False,
            **{name: recorder},
        )  # [U, P', H]
        reader = _read_only_cache(recorder, groups.inverse)
        del recorder
        out, completion_hidden = chunked.run_with_hidden(
            model,
            input_ids=completion_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            **{name: reader},
        )  # [N, T, H]
    first = prompt_hidden[:, -1:].index_select(0, groups.inverse)  # [N, 1, H]: predicts token 0
    return out, completion_hidden, torch.cat([first, completion_hidden[:, :-1]], dim=1)
