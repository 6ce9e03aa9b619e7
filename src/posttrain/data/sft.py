"""Supervised fine-tuning data: detect a dataset's format, tokenise rows, mark the target tokens.

Four formats, named by their columns (TRL 1.16's ``SFTTrainer`` contract):

* ``"language_modeling"``: a ``text`` column (or the one ``dataset_text_field`` names), or
  whatever a ``formatting_func`` returns for the row. The EOS token is appended.
* ``"conversational"``: a ``messages`` column of ``{"role", "content"}`` dicts, rendered with the
  tokenizer's chat template. ShareGPT rows (``conversations`` of ``{"from", "value"}``) are
  converted to roles and contents.
* ``"prompt_completion"``: ``prompt`` and ``completion`` columns, both strings (the completion
  gets the EOS token) or both message lists (rendered with the chat template).
* ``"tokenized"``: an ``input_ids`` column, with optional ``completion_mask``,
  ``assistant_masks`` and ``labels`` (``-100`` = not a target).

Every tokenised row is ``{"input_ids": [...], "loss_mask": [...]}``. ``loss_mask[t] == 1`` means
token ``t`` is a prediction *target*: the model is trained to predict it from tokens ``< t``. The
trainer shifts (the logits at ``t - 1`` score token ``t``), so position 0 of a row is never a
target; this module sets ``loss_mask[0] = 0``, which makes ``sum(loss_mask)`` the row's exact
number of targets. The one exception is ``first_token_target=True``, for ``"wrapped"`` packing:
rows are then laid end to end and cut, so a row's first token is predicted from the row before
it, and it keeps the mask its format gives it (1 in a language-modelling row, 0 on a prompt's or
a chat template's opening token); the packing clears the first token of each cut instead.

This module detects the format and prepares whole datasets (``prepare_dataset``); the messages'
conversion and checks are in ``data/sft_messages.py`` and the tokenising of one row in
``data/sft_tokenize.py``, whose public names are imported here.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.data.sft_messages import (  # noqa: F401  (re-exported)
    MESSAGE_COLUMNS,
    SHAREGPT_ROLES,
    Message,
    Row,
    check_messages,
    row_label,
    to_messages,
)
from posttrain.data.sft_tokenize import (  # noqa: F401  (re-exported)
    FORMATS,
    TRUNCATION_MODES,
    check_loss_options,
    common_prefix_length,
    row_template_kwargs,
    row_tools,
    tokenize_row,
    truncate,
    with_eos,
)

# ----------------------------------------------------------------------------- format detection


def detect_format(column_names: Sequence[str], first_row: Row, *, dataset_text_field: str = "text") -> str:
    """Name the SFT format of a dataset from its columns (and check its first row).

    Args:
        column_names: the dataset's columns.
        first_row: the dataset's first row, used to check the column types.
        dataset_text_field: the column holding plain text (``SFTConfig.dataset_text_field``).

    Returns:
        One of ``FORMATS``. A tokenised dataset (``input_ids``) wins over any text columns it kept.

    Raises:
        ValueError: no usable column, several formats at once (e.g. both ``text`` and
            ``messages``), a ``prompt`` without ``completion``, or a first row of the wrong type.
    """
    columns = list(column_names)
    if "input_ids" in columns:
        return "tokenized"
    found = _formats_present(columns, dataset_text_field)
    if len(found) > 1:
        named = ", ".join(f"{fmt} ({cols})" for fmt, cols in found.items())
        raise ValueError(
            f"The dataset has columns for several SFT formats: {named}; its columns are {columns}. Keep the "
            "columns of one format, e.g. dataset.remove_columns([...]) for the others."
        )
    if not found:
        raise ValueError(
            f"The dataset has no column SFT can train on; its columns are {columns}. Provide "
            f"'{dataset_text_field}' (text, or set dataset_text_field), 'messages' (chat), 'prompt' + "
            "'completion', or 'input_ids' (pre-tokenised); or pass a formatting_func that returns the text."
        )
    fmt = next(iter(found))
    _check_first_row(fmt, first_row, dataset_text_field)
    return fmt


def _formats_present(columns: list[str], text_field: str) -> dict[str, list[str]]:
    """Which formats the columns announce, with the columns that announce each."""
    found: dict[str, list[str]] = {}
    if text_field in columns:
        found["language_modeling"] = [text_field]
    message_cols = [c for c in MESSAGE_COLUMNS if c in columns]
    if message_cols:
        found["conversational"] = message_cols
    if "prompt" in columns or "completion" in columns:
        if not ("prompt" in columns and "completion" in columns):
            present = "prompt" if "prompt" in columns else "completion"
            missing = "completion" if present == "prompt" else "prompt"
            raise ValueError(
                f"The dataset has a '{present}' column but no '{missing}' column; its columns are {columns}. "
                "SFT trains on prompt + completion pairs: add the missing column (a prompt-only dataset suits "
                "GRPO or on-policy distillation, not SFT)."
            )
        found["prompt_completion"] = ["prompt", "completion"]
    return found


def _check_first_row(fmt: str, row: Row, text_field: str) -> None:
    """Check the column types of the first row for the detected format."""
    if fmt == "language_modeling" and not isinstance(row.get(text_field), str):
        raise ValueError(
            f"Row 0: column '{text_field}' holds {type(row.get(text_field)).__name__}, not text. Put strings "
            "there, or move chat messages to a 'messages' column."
        )
    if fmt == "prompt_completion":
        kinds = {type(row.get("prompt")) is str, type(row.get("completion")) is str}
        if len(kinds) > 1:
            raise ValueError(
                "Row 0: 'prompt' and 'completion' must both be strings or both be lists of messages; got "
                f"{type(row.get('prompt')).__name__} and {type(row.get('completion')).__name__}. Convert one "
                "of them, e.g. completion=[{'role': 'assistant', 'content': text}]."
            )


# ----------------------------------------------------------------------------- whole datasets


def prepare_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    dataset_text_field: str = "text",
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
    formatting_func: Callable[[Row], str] | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
    first_token_target: bool = False,
) -> Any:
    """Tokenise every row and drop the rows left without a target token.

    Works on a ``datasets.Dataset`` (``.map`` and ``.filter``, returns a Dataset with the columns
    ``input_ids`` and ``loss_mask``) and on a list of dicts (returns a list of dicts). A row can
    end with no target when truncation removes its completion (e.g. a prompt longer than
    ``max_length`` with completion_only_loss); such rows are dropped with a warning giving the count.

    Args:
        dataset: a ``datasets.Dataset`` or a list of row dicts.
        tokenizer: a transformers tokenizer.
        dataset_text_field, max_length, truncation_mode, completion_only_loss, assistant_only_loss,
            eos_token, formatting_func, tools, chat_template_kwargs: as in ``tokenize_row``.
        num_proc: worker processes for ``Dataset.map`` (Datasets only).
        first_token_target: as in ``tokenize_row`` (``"wrapped"`` packing); a row is then kept
            when any of its tokens is a target, its first included.

    Returns:
        The tokenised dataset, of the type given.

    Raises:
        ValueError: bad columns or rows (see ``detect_format`` and ``tokenize_row``), an empty
            dataset, or every row without a target.
    """
    rows_in = _nonempty_num_rows(dataset)
    fmt = _dataset_format(dataset, dataset_text_field, formatting_func)
    check_loss_options(fmt, tokenizer, completion_only_loss, assistant_only_loss, chat_template_kwargs)
    kwargs = {
        "tokenizer": tokenizer,
        "fmt": fmt,
        "max_length": max_length,
        "truncation_mode": truncation_mode,
        "completion_only_loss": completion_only_loss,
        "assistant_only_loss": assistant_only_loss,
        "eos_token": eos_token,
        "formatting_func": formatting_func if fmt == "language_modeling" else None,
        "tools": tools,
        "chat_template_kwargs": chat_template_kwargs,
        "dataset_text_field": dataset_text_field,
        "first_token_target": first_token_target,
    }
    kept = _tokenize_rows(dataset, kwargs, num_proc)
    _report_dropped(rows_in, len(kept), max_length, truncation_mode)
    return kept


def _nonempty_num_rows(dataset: Any) -> int:
    """Row count of a list or a map-style Dataset, which must have a row."""
    rows_in = _num_rows(dataset)
    if rows_in == 0:
        raise ValueError("The SFT dataset has no rows. Pass a dataset with at least one example.")
    return rows_in


def _tokenize_rows(dataset: Any, kwargs: dict[str, Any], num_proc: int | None) -> Any:
    """The rows tokenised by ``tokenize_row(**kwargs)`` that keep a target, as a list or a Dataset."""
    if isinstance(dataset, list):
        out = [tokenize_row(row, index=i, **kwargs) for i, row in enumerate(dataset)]
        return [row for row in out if any(row["loss_mask"])]
    mapped = dataset.map(
        lambda row, i: tokenize_row(row, index=i, **kwargs),
        with_indices=True,
        remove_columns=list(dataset.column_names),
        num_proc=num_proc,
    )
    return mapped.filter(lambda row: any(row["loss_mask"]), num_proc=num_proc)


def _num_rows(dataset: Any) -> int:
    """Row count of a list or a map-style Dataset."""
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"prepare_dataset needs a datasets.Dataset or a list of dicts, got {type(dataset).__name__}. "
            "Materialise a streaming dataset first, e.g. Dataset.from_list(list(stream))."
        )
    return len(dataset)


def _dataset_format(dataset: Any, text_field: str, formatting_func: Callable | None) -> str:
    """The dataset's format; a formatting_func makes it language modelling (unless pre-tokenised)."""
    first = dataset[0]
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(first)
    if "input_ids" in columns:
        if formatting_func is not None:
            warnings.warn(
                "The dataset is already tokenised (it has 'input_ids'), so formatting_func is ignored. Remove "
                "the formatting_func, or pass the dataset before tokenisation.",
                stacklevel=3,
            )
        return "tokenized"
    if formatting_func is not None:
        return "language_modeling"
    return detect_format(columns, first, dataset_text_field=text_field)


def _report_dropped(rows_in: int, rows_out: int, max_length: int | None, mode: str) -> None:
    """Warn with the count of dropped rows; raise when none is left."""
    dropped = rows_in - rows_out
    if dropped == 0:
        return
    why = (
        f"no target token left after truncation to max_length={max_length} (truncation_mode={mode!r}) "
        "and the loss masks"
    )
    fix = (
        "raise max_length, use truncation_mode='keep_end', shorten the prompts, or check the loss masks "
        "(completion_only_loss, assistant_only_loss, labels)"
    )
    if rows_out == 0:
        raise ValueError(f"All {rows_in} rows of the SFT dataset have {why}, so none is left. Fix: {fix}.")
    warnings.warn(
        f"{dropped} of {rows_in} rows have {why}; they were dropped. To keep them: {fix}.", stacklevel=3
    )
