"""Dataset formats: standard (text) and conversational (messages) prompts.

A GRPO dataset has a ``"prompt"`` column. In the *standard* format each prompt is a string; in
the *conversational* format it is a list of ``{"role": ..., "content": ...}`` messages, which
the tokenizer's chat template renders (``data/chat.py``). Completions are handed to reward functions in the same
format as their prompt: a string, or ``[{"role": "assistant", "content": ...}]``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PROMPT_COLUMN = "prompt"

Message = dict[str, Any]
Prompt = str | list[Message]


def is_conversational(prompt: Any) -> bool:
    """Whether ``prompt`` is a list of chat messages (dicts with a ``role``)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    )


def check_prompt(prompt: Any, index: int | str) -> None:
    """Raise a clear ``ValueError`` when a prompt is neither text nor a list of messages.

    Args:
        prompt: the value of the ``"prompt"`` column for one row.
        index: the row's index (or a description), named in the message.
    """
    if prompt is None:
        raise ValueError(
            f"Row {index} of the dataset has prompt=None. Every row needs a 'prompt': a string "
            "(standard format) or a list of {'role', 'content'} messages (conversational format); "
            "drop or fill the empty rows, e.g. dataset.filter(lambda r: r['prompt'] is not None)."
        )
    if isinstance(prompt, str) or is_conversational(prompt):
        return
    raise ValueError(
        f"Row {index} of the dataset has a 'prompt' of type {type(prompt).__name__} ({str(prompt)[:80]!r}), "
        "which is neither text nor a list of chat messages. Use a string, or a list of "
        "{'role': ..., 'content': ...} dicts."
    )


def check_prompt_column(column_names: Sequence[str] | None, name: str, trainer: str = "GRPOTrainer") -> None:
    """Raise when a dataset lacks the ``"prompt"`` column.

    Args:
        column_names: the dataset's columns (``None`` when unknown, e.g. some streams).
        name: which dataset this is ("train_dataset", "eval_dataset['x']"), for the message.
        trainer: the trainer that reads it ("RLOOTrainer"), for the message.
    """
    if column_names is not None and PROMPT_COLUMN not in column_names:
        raise ValueError(
            f"{name} has no 'prompt' column (its columns are {list(column_names)}). {trainer} needs one: "
            "rename the column holding the prompts, e.g. dataset.rename_column('question', 'prompt')."
        )


def as_completion(text: str, prompt: Prompt) -> str | list[Message]:
    """Wrap a decoded completion in the format of its prompt."""
    if isinstance(prompt, str):
        return text
    if prompt[-1].get("role") == "assistant":
        text = str(prompt[-1].get("content", "")) + text
    return [{"role": "assistant", "content": text}]
