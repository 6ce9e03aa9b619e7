"""One preference row: its format (explicit or implicit prompt, standard or conversational), the
implicit prompt split off the two completions, and its tokens, truncated.

``detect_preference_format`` names a dataset's format from its columns and first row,
``extract_prompt`` applies the implicit-prompt rule and ``tokenize_pair`` tokenises and
truncates one pair; ``data/preference.py`` states the rules and prepares whole datasets.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.data import chat
from posttrain.data.sft import (
    check_messages,
    common_prefix_length,
    row_label,
    row_template_kwargs,
    row_tools,
    to_messages,
    with_eos,
)

PREFERENCE_FORMATS = ("explicit", "implicit")
TRUNCATION_MODES = ("keep_start", "keep_end")
COMPLETION_COLUMNS = ("chosen", "rejected")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
OUTPUT_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")

Message = dict[str, Any]
Row = Mapping[str, Any]


# ----------------------------------------------------------------------------- format detection


def detect_preference_format(column_names: Sequence[str], first_row: Row) -> str:
    """Name the prompt format of a preference dataset and check its first row.

    Args:
        column_names: the dataset's columns.
        first_row: the dataset's first row, checked for its value types.

    Returns:
        ``"explicit"`` (a ``prompt`` column) or ``"implicit"`` (the prompt is taken from the
        shared beginning of ``chosen`` and ``rejected``).

    Raises:
        ValueError: ``chosen`` or ``rejected`` is missing (the message lists the columns), or
            the first row is empty, of the wrong type, mixes text and messages, or (implicit)
            has no shared prompt.
    """
    columns = list(column_names)
    missing = [c for c in COMPLETION_COLUMNS if c not in columns]
    if missing:
        hint = ""
        if "completion" in columns and "label" in columns:
            hint = (
                " The dataset looks unpaired ('completion' + 'label', one completion per row): that suits "
                "KTO, or pair each prompt's good and bad completions into one row first."
            )
        raise ValueError(
            f"The preference dataset has no {' or '.join(repr(c) for c in missing)} column; its columns are "
            f"{columns}. Preference training needs 'chosen' and 'rejected' columns (and optionally 'prompt'): "
            "rename yours, e.g. dataset.rename_column('response_a', 'chosen')." + hint
        )
    pair_kind(extract_prompt(first_row, 0), 0)
    return "explicit" if "prompt" in columns else "implicit"


def _kind(value: Any) -> str | None:
    """``"standard"`` for text, ``"conversational"`` for a list of messages, else ``None``."""
    if isinstance(value, str):
        return "standard"
    if isinstance(value, Sequence) and all(isinstance(m, Mapping) for m in value):
        return "conversational"
    return None


def _is_empty(value: Any) -> bool:
    """Whether a prompt or completion value holds nothing (``None``, ``""``, ``[]``)."""
    return value is None or (isinstance(value, (str, Sequence)) and len(value) == 0)


def pair_kind(row: Row, index: int | None) -> str:
    """Check a row's ``prompt`` (when present), ``chosen`` and ``rejected``; return their kind.

    Raises:
        ValueError: an empty completion, a value that is neither text nor messages, or text
            mixed with messages.
    """
    kinds: dict[str, str] = {}
    for column in ("prompt", *COMPLETION_COLUMNS):
        if column not in row:
            continue
        value = row[column]
        if column != "prompt" and (_is_empty(value) or _only_empty_messages(value)):
            raise ValueError(
                f"{row_label(index)}: column '{column}' is empty, so the pair has nothing to compare. Drop the row, "
                f"e.g. dataset.filter(lambda r: len(r['{column}']) > 0), or fill in the completion."
            )
        kind = _kind(value)
        if kind is None:
            raise ValueError(
                f"{row_label(index)}: column '{column}' holds {type(value).__name__}, not text or a list of messages. "
                "Use a string (standard format) or a list of {'role': ..., 'content': ...} dicts "
                "(conversational format), e.g. wrap a single message in a list."
            )
        kinds[column] = kind
    if len(set(kinds.values())) > 1:
        named = ", ".join(
            f"'{c}' is {'text' if k == 'standard' else 'a list of messages'}" for c, k in kinds.items()
        )
        raise ValueError(
            f"{row_label(index)}: the columns mix formats: {named}. Use text in all of them (standard format) or "
            "message lists in all (conversational format), e.g. chosen=[{'role': 'assistant', 'content': "
            "text}] and prompt=[{'role': 'user', 'content': text}]."
        )
    return next(iter(kinds.values()))


def _only_empty_messages(value: Any) -> bool:
    """Whether a message list has messages but none with content or tool calls."""
    if _kind(value) != "conversational":
        return False
    return all(not m.get("content", m.get("value")) and not m.get("tool_calls") for m in value)


# ----------------------------------------------------------------------------- implicit prompts


def extract_prompt(row: Row, index: int | None = None) -> dict[str, Any]:
    """Split an implicit-prompt row into its prompt and completions (rule in the module doc).

    A row that already has a prompt (not ``None``) is returned as it is.

    Args:
        row: a row with ``chosen`` and ``rejected`` (strings, or lists of messages).
        index: the row's position, named in error messages.

    Returns:
        A copy of the row with ``prompt``, ``chosen`` and ``rejected`` set (message lists come
        back as role/content dicts).

    Raises:
        ValueError: an empty or malformed completion, text mixed with messages, or no shared
            prompt (fix: add a ``prompt`` column).
    """
    if row.get("prompt") is not None:
        return dict(row)
    pair = {c: row.get(c) for c in COMPLETION_COLUMNS}
    kind = pair_kind(pair, index)
    chosen, rejected = pair["chosen"], pair["rejected"]
    if kind == "standard":
        cut = min(common_prefix_length(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        if cut > 0 and chosen[cut - 1] == " ":
            cut -= 1
        shared = "text"
    else:
        chosen = to_messages(chosen, "chosen", index)
        rejected = to_messages(rejected, "rejected", index)
        cut = _message_split(chosen, rejected)
        shared = "messages followed, in both, by an assistant message"
    if cut <= 0:
        raise ValueError(
            f"{row_label(index)}: 'chosen' and 'rejected' share no leading {shared}, so no prompt can be taken from "
            "them (the dataset has no 'prompt' column: implicit prompt). Add a 'prompt' column holding each "
            "row's prompt, with the completions alone in 'chosen' and 'rejected'."
        )
    return {**row, "prompt": chosen[:cut], "chosen": chosen[cut:], "rejected": rejected[cut:]}


def _message_split(chosen: list[Message], rejected: list[Message]) -> int:
    """How many leading messages form the prompt of two conversations (0: none)."""
    limit = min(common_prefix_length(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
    for cut in range(limit, 0, -1):
        if chosen[cut].get("role") == "assistant" and rejected[cut].get("role") == "assistant":
            return cut
    return 0


# ----------------------------------------------------------------------------- tokenising


@dataclass(frozen=True)
class _Options:
    """What tokenising a pair needs besides the row (resolved once per dataset)."""

    tokenizer: Any
    max_length: int | None
    truncation_mode: str
    eos_token: str | None
    tools: Any
    chat_template_kwargs: Mapping[str, Any] | None


def check_truncation(max_length: int | None, truncation_mode: str) -> None:
    """Check the truncation options; warn that ``"keep_end"`` is deprecated.

    Raises:
        ValueError: an unknown mode, or a ``max_length`` below 1.
    """
    if truncation_mode not in TRUNCATION_MODES:
        raise ValueError(
            f"truncation_mode={truncation_mode!r} is not supported for preference data; use 'keep_start'."
        )
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length={max_length!r} must be a positive integer (or None for no truncation).")
    if truncation_mode == "keep_end":
        warnings.warn(
            "truncation_mode='keep_end' is deprecated for preference data and will be removed: it cuts the start "
            "of the prompt. Use truncation_mode='keep_start' (the default), with a max_length that fits the "
            "prompts.",
            FutureWarning,
            stacklevel=3,
        )


def tokenize_pair(
    row: Row,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    eos_token: str | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int | None = None,
) -> dict[str, Any] | None:
    """Tokenise one preference row into its prompt and completion tokens, then truncate it.

    Args:
        row: a row with ``chosen``, ``rejected`` and, unless its prompt is implicit, ``prompt``.
        tokenizer: a transformers tokenizer (with a chat template for conversational rows).
        max_length: the most tokens of prompt + completion per side (``None``: no truncation).
        truncation_mode: ``"keep_start"``; ``"keep_end"`` is deprecated (``FutureWarning``).
        eos_token: appended to standard completions (default: the tokenizer's EOS token).
        tools: tool schemas for the chat template; a row's own ``tools`` column wins.
        chat_template_kwargs: extra template variables; a row's ``chat_template_kwargs`` column
            is merged over them (a ``chat_template`` key picks another template).
        index: the row's position, named in error messages.

    Returns:
        ``{"prompt_ids", "chosen_ids", "rejected_ids"}`` (lists of token ids; the completions
        hold only their own tokens) plus the row's ``ref_chosen_logps`` / ``ref_rejected_logps``
        when it has them; ``None`` when the row is dropped (its prompt alone reaches
        ``max_length`` under ``"keep_start"``).

    Raises:
        ValueError: bad options, an empty or malformed completion, text mixed with messages,
            misordered messages, no chat template for a conversation, no shared implicit prompt,
            or a prompt or completion that tokenises to nothing.
    """
    check_truncation(max_length, truncation_mode)
    opts = _Options(tokenizer, max_length, truncation_mode, eos_token, tools, chat_template_kwargs)
    return _truncate_pair(_encode_pair(row, opts, index), max_length, truncation_mode)


def _encode_pair(row: Row, opts: _Options, index: int | None) -> dict[str, Any]:
    """The untruncated ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids`` of a row, ref columns carried."""
    row = extract_prompt(row, index)
    kind = pair_kind(row, index)
    if kind == "standard":
        prompt_ids, sides = _encode_standard(row, opts)
    else:
        prompt_ids, sides = _encode_conversation(row, opts, index)
    start = min(common_prefix_length(prompt_ids, ids) for ids in sides)
    if start < len(prompt_ids):
        warnings.warn(
            f"{row_label(index)}: the tokenised prompt is not a prefix of the tokenised prompt + completion (they part "
            f"at token {start} of {len(prompt_ids)}); the pair's prompt is cut to its first {start} tokens and "
            "the completions start there. End prompts on a token boundary (e.g. without a trailing space), or "
            "use a chat template that renders a prompt alone as it renders it in the full conversation.",
            stacklevel=3,
        )
    if start == 0:
        raise ValueError(
            f"{row_label(index)}: the prompt tokenises to no tokens (or none that the completions' tokens keep), so the "
            "first completion token has nothing to be scored from. Give the row a non-empty prompt, or use a "
            "tokenizer that adds a BOS token."
        )
    out: dict[str, Any] = {"prompt_ids": list(sides[0][:start])}
    for column, ids in zip(COMPLETION_COLUMNS, sides, strict=True):
        if len(ids) == start:
            raise ValueError(
                f"{row_label(index)}: the '{column}' completion adds no tokens after the prompt. Check that the chat "
                "template renders assistant messages, or drop the row."
            )
        out[f"{column}_ids"] = list(ids[start:])
    out.update({c: row[c] for c in REF_COLUMNS if c in row})
    return out


def _encode_standard(row: Row, opts: _Options) -> tuple[list[int], list[list[int]]]:
    """Token ids of the prompt and of prompt + completion + EOS for both sides (strings)."""
    eos = opts.eos_token if opts.eos_token is not None else opts.tokenizer.eos_token
    prompt = row["prompt"]
    prompt_ids = list(opts.tokenizer(prompt)["input_ids"])
    sides = [list(opts.tokenizer(prompt + with_eos(row[c], eos))["input_ids"]) for c in COMPLETION_COLUMNS]
    return prompt_ids, sides


def _encode_conversation(row: Row, opts: _Options, index: int | None) -> tuple[list[int], list[list[int]]]:
    """Token ids of the prompt (with the generation prompt) and of prompt + completion for both sides."""
    tools = row_tools(row, opts.tools)
    variables = row_template_kwargs(row, opts.chat_template_kwargs)
    prompt = to_messages(row["prompt"], "prompt", index)
    full = []
    for column in COMPLETION_COLUMNS:
        messages = prompt + to_messages(row[column], column, index)
        check_messages(messages, f"prompt + {column}", index)
        full.append(messages)
    prompt_ids, _ = chat.tokenize(
        opts.tokenizer, prompt, tools=tools, add_generation_prompt=True, variables=variables
    )
    sides = [chat.tokenize(opts.tokenizer, m, tools=tools, variables=variables)[0] for m in full]
    return prompt_ids, sides


def _truncate_pair(pair: dict[str, Any], max_length: int | None, mode: str) -> dict[str, Any] | None:
    """Cut a tokenised pair to ``max_length`` tokens per side (module doc); ``None`` = dropped."""
    prompt = pair["prompt_ids"]
    sides = [pair["chosen_ids"], pair["rejected_ids"]]
    if max_length is None:
        return pair
    if mode == "keep_start":
        if len(prompt) >= max_length:
            return None
        room = max_length - len(prompt)
        return {**pair, "chosen_ids": sides[0][:room], "rejected_ids": sides[1][:room]}
    overflow = len(prompt) + max(len(s) for s in sides) - max_length
    if overflow <= 0:
        return pair
    prompt = prompt[min(overflow, len(prompt)) :]
    room = max_length - len(prompt)
    chosen, rejected = (s[len(s) - room :] if len(s) > room else s for s in sides)
    return {**pair, "prompt_ids": prompt, "chosen_ids": chosen, "rejected_ids": rejected}
