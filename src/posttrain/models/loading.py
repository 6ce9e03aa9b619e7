"""Loading the policy and its tokenizer from a hub id, a local path or an embedded name."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch


def resolve_model_path(name: str) -> str:
    """Map an embedded model name to its cached folder; check that a local path exists.

    A string that looks like a path (starts with ``.``, ``/`` or ``~``, or has more than one
    ``/``) must exist. Anything else is left to the hub.
    """
    from posttrain.models.embedded import is_embedded_name, resolve_embedded

    if is_embedded_name(name):
        return resolve_embedded(name)
    expanded = os.path.expanduser(name)
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local and not os.path.isdir(expanded):
        raise FileNotFoundError(
            f"The model path '{name}' does not exist. Pass an existing folder saved with save_pretrained, "
            "a hub id such as 'Qwen/Qwen2.5-0.5B-Instruct', or the embedded name 'smollm2-135m-instruct'."
        )
    return expanded if os.path.isdir(expanded) else name


def _dtype(value: Any) -> Any:
    if value is None:
        return torch.float32
    if isinstance(value, str) and value != "auto":
        return getattr(torch, value)
    return value


def load_policy(
    name: str,
    init_kwargs: Mapping[str, Any] | None,
    trust_remote_code: bool,
    quantization_config: Any = None,
    device: torch.device | None = None,
) -> Any:
    """Load a causal LM by name with ``model_init_kwargs``; float32 unless a dtype is given.

    Args:
        name: hub id, local path or embedded name.
        init_kwargs: ``model_init_kwargs`` (``dtype``, ``revision``, ``attn_implementation``, ...).
        trust_remote_code: allow the model's own code from the hub.
        quantization_config: e.g. ``BitsAndBytesConfig(load_in_4bit=True)`` to load the weights
            quantized (QLoRA); ``init_kwargs["quantization_config"]`` is used when this is ``None``.
        device: the process's device. A quantized model is loaded straight onto it when it is
            an accelerator (each process onto its own), unless ``device_map`` is given.
    """
    from transformers import AutoModelForCausalLM

    kwargs = dict(init_kwargs or {})
    kwargs["dtype"] = _dtype(kwargs.pop("dtype", kwargs.pop("torch_dtype", None)))
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    if kwargs.get("quantization_config") is not None and device is not None and device.type != "cpu":
        kwargs.setdefault("device_map", {"": device})
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(name), **kwargs)


def load_tokenizer(source: str, revision: str | None, trust_remote_code: bool) -> Any:
    """Load the tokenizer for a model name or path (embedded names resolved)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    return AutoTokenizer.from_pretrained(resolve_model_path(source), **kwargs)


def prepare_tokenizer(tokenizer: Any) -> Any:
    """Left padding for generation; the pad token falls back to EOS."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a pad token nor an EOS token. Set tokenizer.pad_token before "
                "passing it as processing_class."
            )
        tok.pad_token = tok.eos_token
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
