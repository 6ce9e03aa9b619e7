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
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.data import chat

FORMATS = ("language_modeling", "conversational", "prompt_completion", "tokenized")
TRUNCATION_MODES = ("keep_start", "keep_end")
MESSAGE_COLUMNS = ("messages", "conversations")

#: ShareGPT speaker names (``from``) and the chat role each becomes.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

#: Which roles may come right before each role (``None`` = first message).
_ALLOWED_BEFORE = {
    "system": (None,),
    "developer": (None,),
    "user": (None, "system", "developer", "assistant"),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}

Message = dict[str, Any]
Row = Mapping[str, Any]


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


def row_label(index: int | None) -> str:
    """How messages name a row: ``"Row 3"``, or ``"A row"`` when its index is unknown."""
    return "A row" if index is None else f"Row {index}"


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


# ----------------------------------------------------------------------------- message checks


def to_messages(value: Any, column: str, index: int | None) -> list[Message]:
    """Return a column's chat messages as ``{"role", "content", ...}`` dicts.

    ShareGPT messages (``{"from", "value"}``) are converted; other keys (``tool_calls``, ...) kept.

    Raises:
        ValueError: the value is not a list of dicts, or a ShareGPT speaker is unknown.
    """
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(
            f"{row_label(index)}: column '{column}' holds {type(value).__name__}, not a list of messages. Use a list "
            "of {'role': ..., 'content': ...} dicts."
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{row_label(index)}: message {i} of column '{column}' is a {type(message).__name__}, not a dict. Use "
                "{'role': ..., 'content': ...} dicts."
            )
        messages.append(
            _from_sharegpt(dict(message), column, index, i) if "from" in message else dict(message)
        )
    return messages


def _from_sharegpt(message: Message, column: str, index: int | None, position: int) -> Message:
    """Convert one ShareGPT message to a role/content one."""
    speaker = message.pop("from")
    if speaker not in SHAREGPT_ROLES:
        raise ValueError(
            f"{row_label(index)}: message {position} of column '{column}' comes from {speaker!r}, which is not a known "
            f"ShareGPT speaker ({sorted(SHAREGPT_ROLES)}). Rename it, or convert the rows to role/content."
        )
    message["role"] = SHAREGPT_ROLES[speaker]
    message["content"] = message.pop("value", message.get("content"))
    return message


def check_messages(messages: Sequence[Message], column: str, index: int | None) -> None:
    """Check that a conversation has roles in a trainable order.

    Rules: a system (or developer) message only first; then a user message; user and assistant
    alternate; ``tool`` messages only after an assistant message with ``tool_calls`` (or after
    another tool message), and an assistant message after them.

    Raises:
        ValueError: an empty conversation, a message without a role or without content, or roles
            out of order; the message names the row, the column and the message's position.
    """
    if not messages:
        raise ValueError(
            f"{row_label(index)}: column '{column}' is an empty conversation. Drop the row, e.g. "
            f"dataset.filter(lambda r: len(r['{column}']) > 0)."
        )
    previous: Message | None = None
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ALLOWED_BEFORE:
            raise ValueError(
                f"{row_label(index)}: message {i} of column '{column}' has role {role!r}; expected one of "
                f"{sorted(_ALLOWED_BEFORE)}. Give every message a 'role' (ShareGPT rows use 'from')."
            )
        if message.get("content") is None and not message.get("tool_calls"):
            raise ValueError(
                f"{row_label(index)}: message {i} ('{role}') of column '{column}' has no 'content' (the key is "
                "missing or None; only an assistant message with 'tool_calls' may go without). Give it a 'content' "
                "(text, or a list of content blocks), or drop the row."
            )
        _check_order(role, previous, column, index, i)
        previous = message


def _check_order(role: str, previous: Message | None, column: str, index: int | None, i: int) -> None:
    """Raise when ``role`` may not follow ``previous``."""
    before = None if previous is None else previous.get("role")
    allowed = _ALLOWED_BEFORE[role]
    ok = before in allowed
    if role == "tool" and before == "assistant":
        ok = bool(previous.get("tool_calls"))
    if ok:
        return
    after = "at the start" if before is None else f"after a '{before}' message"
    hint = {
        "system": "a system message may only come first",
        "developer": "a developer message may only come first",
        "user": "a user message follows the system message or an assistant reply",
        "assistant": "an assistant message answers a user message or tool results",
        "tool": "a tool message answers an assistant message that has 'tool_calls'",
    }[role]
    raise ValueError(
        f"{row_label(index)}: message {i} of column '{column}' is a '{role}' message {after}; {hint}. Fix the order "
        "of the conversation, or drop the row."
    )


# ----------------------------------------------------------------------------- tokenising


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
