"""Tokenising one SFT row: ``input_ids`` and the ``loss_mask`` of its target tokens, per format.

``tokenize_row`` dispatches on the format ``data/sft.py`` detected (language modelling,
conversational, prompt-completion, tokenised), truncates, and sets ``loss_mask[0] = 0`` unless
``first_token_target`` (``data/sft.py`` explains the mask). ``check_loss_options`` checks the
loss options against the tokenizer up front; ``with_eos``, ``row_tools`` and
``row_template_kwargs`` are shared with the other data paths.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.data import chat
from posttrain.data.sft_messages import MESSAGE_COLUMNS, Message, Row, check_messages, row_label, to_messages

FORMATS = ("language_modeling", "conversational", "prompt_completion", "tokenized")
TRUNCATION_MODES = ("keep_start", "keep_end")


@dataclass(frozen=True)
class _Options:
    """What tokenising a row needs besides the row (resolved once per call)."""

    tokenizer: Any
    eos_token: str
    completion_only_loss: bool | None
    assistant_only_loss: bool
    text_field: str
    formatting_func: Callable[[Row], str] | None
    tools: Any
    template_kwargs: Mapping[str, Any]
    index: int | None


def tokenize_row(
    row: Row,
    tokenizer: Any,
    fmt: str,
    *,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    completion_only_loss: bool | None = None,
    assistant_only_loss: bool = False,
    eos_token: str | None = None,
    formatting_func: Callable[[Row], str] | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    dataset_text_field: str = "text",
    index: int | None = None,
    first_token_target: bool = False,
) -> dict[str, list[int]]:
    """Tokenise one row and mark its target tokens.

    Args:
        row: one dataset row.
        tokenizer: a transformers tokenizer (with a chat template for message rows).
        fmt: the row's format, one of ``FORMATS`` (see ``detect_format``).
        max_length: keep at most this many tokens (``None``: no truncation).
        truncation_mode: ``"keep_start"`` drops the end of a long row, ``"keep_end"`` its start.
        completion_only_loss: train only on the completion. ``None`` means True for prompt-completion
            rows and for tokenised rows that carry ``completion_mask`` (the reference ignores that
            column unless True is given), False otherwise.
        assistant_only_loss: train only on the assistant's tokens, from the chat template's
            ``{% generation %}`` markers (message rows only).
        eos_token: appended to plain text and string completions (default: the tokenizer's).
        formatting_func: turns a row into its text (language modelling); must return a string.
        tools: tool schemas for the chat template; a row's own ``tools`` column wins.
        chat_template_kwargs: extra template variables; a row's ``chat_template_kwargs`` column
            is merged over them.
        dataset_text_field: the text column of language-modelling rows.
        index: the row's position, named in error messages.
        first_token_target: keep the first token's mask as the format gives it (``"wrapped"``
            packing, where a row's first token follows the previous row's last); else it is 0.

    Returns:
        ``{"input_ids": [...], "loss_mask": [...]}``, equal lengths, ``loss_mask[0] == 0`` unless
        ``first_token_target``.

    Raises:
        ValueError: an unknown format or truncation mode, an empty completion or conversation,
            misordered messages, a formatting_func that returns no string, a mask option the format
            cannot honour, or a chat template without generation markers under assistant_only_loss.
    """
    _check_row_settings(fmt, tokenizer, completion_only_loss, assistant_only_loss, chat_template_kwargs)
    opts = _Options(
        tokenizer=tokenizer,
        eos_token=eos_token if eos_token is not None else tokenizer.eos_token,
        completion_only_loss=completion_only_loss,
        assistant_only_loss=assistant_only_loss,
        text_field=dataset_text_field,
        formatting_func=formatting_func,
        **_row_settings(row, tools, chat_template_kwargs, index),
    )
    return _finished_row(_TOKENIZERS[fmt](row, opts), max_length, truncation_mode, first_token_target)


def _check_row_settings(
    fmt: str,
    tokenizer: Any,
    completion_only_loss: bool | None,
    assistant_only_loss: bool,
    chat_template_kwargs: Mapping[str, Any] | None,
) -> None:
    """None, once ``fmt`` is a known format and the loss-mask options apply to it."""
    if fmt not in _TOKENIZERS:
        raise ValueError(f"Unknown SFT format {fmt!r}; expected one of {list(FORMATS)}.")
    check_loss_options(fmt, tokenizer, completion_only_loss, assistant_only_loss, chat_template_kwargs)


def _row_settings(
    row: Row, tools: Any, chat_template_kwargs: Mapping[str, Any] | None, index: int | None
) -> dict[str, Any]:
    """The ``_Options`` fields that depend on the row: its tools, its template variables, its index."""
    return {
        "tools": row_tools(row, tools),
        "template_kwargs": row_template_kwargs(row, chat_template_kwargs),
        "index": index,
    }


def _finished_row(
    tokens: tuple[list[int], list[int]],
    max_length: int | None,
    truncation_mode: str,
    first_token_target: bool,
) -> dict[str, list[int]]:
    """The ``{"input_ids", "loss_mask"}`` row of ``(ids, mask)``, truncated, position 0 no target."""
    ids, mask = truncate(tokens[0], tokens[1], max_length, truncation_mode)
    if mask and not first_token_target:
        mask[0] = 0  # position 0 is never a target: nothing precedes it
    return {"input_ids": ids, "loss_mask": mask}


def check_loss_options(
    fmt: str,
    tokenizer: Any,
    completion_only_loss: bool | None,
    assistant_only_loss: bool,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Fail early when a loss-mask option cannot apply to the format or the chat template.

    Raises:
        ValueError: ``completion_only_loss=True`` on rows without a completion;
            ``assistant_only_loss=True`` on rows without messages, or with a chat template that has
            no ``{% generation %}`` markers.
    """
    if completion_only_loss and fmt in ("language_modeling", "conversational"):
        raise ValueError(
            f"completion_only_loss=True, but the dataset is {fmt} and has no completion to single out. Use "
            "'prompt' + 'completion' columns, or set completion_only_loss=None (or False)."
        )
    if not assistant_only_loss:
        return
    if fmt in ("language_modeling", "tokenized"):
        raise ValueError(
            f"assistant_only_loss=True needs chat messages, but the dataset is {fmt}. Use a 'messages' column "
            "(or prompt/completion message lists), or set assistant_only_loss=False. Pre-tokenised rows can "
            "carry an 'assistant_masks' column instead."
        )
    template = (chat_template_kwargs or {}).get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not chat.has_generation_markers(template):
        raise ValueError(
            "assistant_only_loss=True needs a chat template that wraps assistant turns in {% generation %} ... "
            "{% endgeneration %}, and this tokenizer's template has no such markers. Set a template with "
            "generation markers (tokenizer.chat_template = ..., or SFTConfig.chat_template_path), or set "
            "assistant_only_loss=False."
        )


def truncate(
    ids: list[int], mask: list[int], max_length: int | None, mode: str = "keep_start"
) -> tuple[list[int], list[int]]:
    """Cut a row to ``max_length`` tokens, keeping its start or its end.

    Raises:
        ValueError: an unknown mode, or a ``max_length`` below 1.
    """
    if mode not in TRUNCATION_MODES:
        raise ValueError(f"truncation_mode={mode!r} is not supported; use one of {list(TRUNCATION_MODES)}.")
    if max_length is None or len(ids) <= max_length:
        return list(ids), list(mask)
    if max_length < 1:
        raise ValueError(f"max_length={max_length} must be at least 1 (or None for no truncation).")
    cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    return list(ids[cut]), list(mask[cut])


def common_prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens two token lists share."""
    n = 0
    for a, b in zip(ids, other, strict=False):
        if a != b:
            break
        n += 1
    return n


def _tokenize_text(row: Row, opts: _Options) -> tuple[list[int], list[int]]:
    """Language modelling: the text (or formatting_func's output) plus EOS; every token a target."""
    if opts.formatting_func is not None:
        text = opts.formatting_func(row)
        if not isinstance(text, str):
            raise ValueError(
                f"{row_label(opts.index)}: formatting_func returned {type(text).__name__}, not a string. It is called "
                "on one row at a time and must return that row's text."
            )
    else:
        text = row[opts.text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"{row_label(opts.index)}: column '{opts.text_field}' holds {type(text).__name__}, not text. Fix the "
                "row, or drop it."
            )
    ids = _encode(opts.tokenizer, with_eos(text, opts.eos_token))
    return ids, [1] * len(ids)


def _tokenize_conversation(row: Row, opts: _Options) -> tuple[list[int], list[int]]:
    """Conversational: the chat template's rendering; assistant tokens only under assistant_only_loss."""
    column = next((c for c in MESSAGE_COLUMNS if row.get(c) is not None), None)
    if column is None:
        raise ValueError(
            f"{row_label(opts.index)}: no 'messages' (or 'conversations') value. Fill the row's conversation, or drop it."
        )
    messages = to_messages(row[column], column, opts.index)
    check_messages(messages, column, opts.index)
    ids, assistant = _apply_template(messages, opts, assistant_mask=opts.assistant_only_loss)
    return ids, assistant if assistant is not None else [1] * len(ids)


def _tokenize_prompt_completion(row: Row, opts: _Options) -> tuple[list[int], list[int]]:
    """Prompt-completion: the completion starts where tok(prompt) and tok(prompt + completion) part."""
    prompt, completion = row["prompt"], row["completion"]
    if completion is None or len(completion) == 0:
        raise ValueError(
            f"{row_label(opts.index)}: the completion is empty, so the row has nothing to learn. Drop it, e.g. "
            "dataset.filter(lambda r: len(r['completion']) > 0)."
        )
    assistant = None
    if isinstance(prompt, str) and isinstance(completion, str):
        prompt_ids = _encode(opts.tokenizer, prompt)
        ids = _encode(opts.tokenizer, prompt + with_eos(completion, opts.eos_token))
    else:
        prompt_msgs = to_messages(prompt, "prompt", opts.index)
        full_msgs = prompt_msgs + to_messages(completion, "completion", opts.index)
        check_messages(full_msgs, "prompt + completion", opts.index)
        prompt_ids, _ = _apply_template(prompt_msgs, opts, generation_prompt=True)
        ids, assistant = _apply_template(full_msgs, opts, assistant_mask=opts.assistant_only_loss)
    start = common_prefix_length(prompt_ids, ids)
    if start < len(prompt_ids):
        warnings.warn(
            f"{row_label(opts.index)}: the tokenised prompt is not a prefix of the tokenised prompt + completion (they "
            f"part at token {start} of {len(prompt_ids)}); the completion is taken to start there. End prompts "
            "on a token boundary, or use a chat template that renders a prompt alone as it renders it in the "
            "full conversation.",
            stacklevel=3,
        )
    mask = [1] * len(ids)
    if opts.completion_only_loss is not False:
        mask = [0] * start + [1] * (len(ids) - start)
    return ids, _and(mask, assistant)


def _tokenize_ids(row: Row, opts: _Options) -> tuple[list[int], list[int]]:
    """Pre-tokenised: ``input_ids`` with the targets its mask columns and labels allow."""
    ids = [int(t) for t in row["input_ids"]]
    mask = [1] * len(ids)
    if row.get("labels") is not None:
        mask = _and(mask, _labels_mask(ids, row["labels"], opts.index))
    if row.get("assistant_masks") is not None:
        mask = _and(mask, _column_mask(row, "assistant_masks", len(ids), opts.index))
    has_completion_mask = row.get("completion_mask") is not None
    if opts.completion_only_loss and not has_completion_mask:
        raise ValueError(
            f"{row_label(opts.index)}: completion_only_loss=True, but the pre-tokenised row has no 'completion_mask'. "
            "Add that column (1 on completion tokens), or set completion_only_loss=None."
        )
    if has_completion_mask and opts.completion_only_loss is not False:
        mask = _and(mask, _column_mask(row, "completion_mask", len(ids), opts.index))
    return ids, mask


# Called by tokenize_row itself, not through a helper: the tokenisers' warnings (stacklevel=3) point
# at tokenize_row's caller.
_TOKENIZERS: dict[str, Callable[[Row, _Options], tuple[list[int], list[int]]]] = {
    "language_modeling": _tokenize_text,
    "conversational": _tokenize_conversation,
    "prompt_completion": _tokenize_prompt_completion,
    "tokenized": _tokenize_ids,
}


def _labels_mask(ids: list[int], labels: Sequence[int], index: int | None) -> list[int]:
    """1 where ``labels`` keeps the token (``!= -100``); labels must otherwise equal the inputs."""
    if len(labels) != len(ids):
        raise ValueError(
            f"{row_label(index)}: 'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}. Give one label "
            "per input token (-100 where there is no target)."
        )
    for t, (tok, lab) in enumerate(zip(ids, labels, strict=True)):
        if lab != -100 and lab != tok:
            raise ValueError(
                f"{row_label(index)}: labels[{t}] = {lab} differs from input_ids[{t}] = {tok}. SFT labels are the "
                "input tokens themselves (the trainer shifts them); use -100 to exclude a token, and "
                "put any other targets in 'input_ids'."
            )
    return [int(lab != -100) for lab in labels]


def _column_mask(row: Row, column: str, length: int, index: int | None) -> list[int]:
    """A 0/1 mask column, checked against the row's length."""
    values = row[column]
    if len(values) != length:
        raise ValueError(
            f"{row_label(index)}: '{column}' has {len(values)} entries but 'input_ids' has {length}. Give one 0/1 "
            "value per token."
        )
    return [int(bool(v)) for v in values]


def _and(mask: list[int], other: list[int] | None) -> list[int]:
    """Element-wise AND of two 0/1 masks (``other=None``: ``mask`` unchanged)."""
    if other is None:
        return mask
    return [int(a and b) for a, b in zip(mask, other, strict=True)]


def with_eos(text: str, eos_token: str | None) -> str:
    """``text`` ending with the EOS token (appended unless already there)."""
    if not eos_token or text.endswith(eos_token):
        return text
    return text + eos_token


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain string, with the tokenizer's usual special tokens (as the reference)."""
    return list(tokenizer(text)["input_ids"])


def _apply_template(
    messages: list[Message], opts: _Options, *, generation_prompt: bool = False, assistant_mask: bool = False
) -> tuple[list[int], list[int] | None]:
    """Render and tokenise messages with the chat template (``data/chat.py``); the assistant mask when asked."""
    return chat.tokenize(
        opts.tokenizer,
        messages,
        tools=opts.tools,
        add_generation_prompt=generation_prompt,
        variables=opts.template_kwargs,
        assistant_mask=assistant_mask,
    )


def row_tools(row: Row, default: Any) -> Any:
    """The row's ``tools`` column (JSON text allowed) or the default; ``None`` when empty."""
    tools = row.get("tools", None)
    if tools is None:
        tools = default
    if isinstance(tools, str):
        tools = json.loads(tools)
    return tools or None


def row_template_kwargs(row: Row, default: Mapping[str, Any] | None) -> dict[str, Any]:
    """Template variables: the defaults, then the row's own (``None`` values, Arrow's fill, skipped)."""
    merged = dict(default or {})
    own = row.get("chat_template_kwargs") or {}
    merged.update({k: v for k, v in own.items() if v is not None})
    return merged
