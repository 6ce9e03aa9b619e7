"""What the generation paths ask of a model: its core under a PEFT wrapper, what its forward accepts,
and what its KV cache is made of. A leaf of ``generation/``: it imports no other generation module,
so the prefill, the lean loop and the fused step can all read it.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def core_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a PEFT wrapper (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _forward_accepts(model: torch.nn.Module, name: str) -> bool:
    return name in inspect.signature(core_model(model).forward).parameters


def _supports_dynamic_cache(core: torch.nn.Module) -> bool:
    supports = getattr(core, "_supports_default_dynamic_cache", None)
    return bool(supports()) if callable(supports) else False


def _only_full_attention_layers(model: torch.nn.Module) -> bool:
    """Whether the model's dynamic cache is made of plain full-attention layers only.

    Sliding-window, linear-attention and other layer kinds keep state that a row copy of the
    prompt's keys and values does not describe, so they take the plain path.
    """
    text_config = core_model(model).config.get_text_config(decoder=True)
    layers = DynamicCache(config=text_config).layers
    return all(type(layer) is DynamicLayer for layer in layers)
