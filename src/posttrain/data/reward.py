"""Reward modelling's data: preference pairs tokenised into whole sequences, and their collation.

The contract of TRL 1.16's ``RewardTrainer``: ``chosen`` and ``rejected``, with an optional
``prompt`` put before each, standard (strings; the EOS token is appended) or conversational
(messages rendered with the chat template); or pre-tokenised ``chosen_ids`` / ``rejected_ids``
taken as they are. An optional ``margin`` column holds a float per pair. A pair with a side longer
than ``max_length`` tokens is dropped, not truncated (the score is read at the last token).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.core.batch import Pairs, Sequences
from posttrain.data import chat
from posttrain.data.packing import collate_padded
from posttrain.data.preference import pair_kind
from posttrain.data.sft import (
    check_messages,
    row_label,
    row_template_kwargs,
    row_tools,
    to_messages,
    with_eos,
)

__all__ = ["RewardBatch", "collate_reward_pairs", "prepare_reward_dataset", "tokenize_reward_row"]

TOKENISED_COLUMNS = ("chosen_ids", "rejected_ids")
TEXT_COLUMNS = ("chosen", "rejected")


@dataclass
class RewardBatch:
    """A collated micro-batch of preference pairs.

    Attributes:
        pairs: the chosen and the rejected sequences, right padded to one width.
        margin: [N] the margin of each pair, or ``None`` when the dataset has none.
    """

    pairs: Pairs
    margin: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.pairs.num_pairs


def _text_row(row: Mapping[str, Any], index: int) -> tuple[str, dict[str, Any]]:
    """The row's ``prompt`` (unless ``None``), ``chosen`` and ``rejected``, and their kind (checked)."""
    values = {
        c: row[c] for c in ("prompt", *TEXT_COLUMNS) if c in row and (c != "prompt" or row[c] is not None)
    }
    return pair_kind(values, index), values


def _margin(row: Mapping[str, Any], index: int) -> float:
    value = row["margin"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(
            f"{row_label(index)}: 'margin' is {value!r}; it must be a number (the score difference the chosen "
            "sequence must beat the rejected one by). Fill it in, or drop the 'margin' column."
        )
    return float(value)


def tokenize_reward_row(
    row: Mapping[str, Any], tokenizer: Any, eos_token: str | None, index: int, check_only: bool = False
) -> dict[str, Any]:
    """``{"chosen_ids", "rejected_ids"}`` (whole sequences) of one row, plus its ``margin`` if any."""
    out: dict[str, Any] = {"margin": _margin(row, index)} if "margin" in row else {}
    if all(c in row for c in TOKENISED_COLUMNS):
        sides = [list(row[c]) for c in TOKENISED_COLUMNS]
    else:
        kind, values = _text_row(row, index)
        if check_only:
            return out
        if kind == "standard":
            prompt = values.get("prompt", "")
            sides = [
                list(tokenizer(prompt + with_eos(values[c], eos_token))["input_ids"]) for c in TEXT_COLUMNS
            ]
        else:
            sides = [_tokenize_conversation(row, values, c, tokenizer, index) for c in TEXT_COLUMNS]
    for column, ids in zip(TOKENISED_COLUMNS, sides, strict=True):
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(
                f"{row_label(index)}: '{column}' is {'empty' if not ids else 'not a list of token ids'}, so there is no "
                "token to read a score from. Drop the row, or give it a non-empty text."
            )
        out[column] = ids
    return out


def _tokenize_conversation(
    row: Mapping[str, Any], values: Mapping[str, Any], column: str, tokenizer: Any, index: int
) -> list[int]:
    """The prompt's and the side's messages rendered together with the chat template."""
    prompt = to_messages(values["prompt"], "prompt", index) if "prompt" in values else []
    messages = prompt + to_messages(values[column], column, index)
    check_messages(messages, f"prompt + {column}" if prompt else column, index)
    ids, _ = chat.tokenize(
        tokenizer, messages, tools=row_tools(row, None), variables=row_template_kwargs(row, None)
    )
    return list(ids)


def prepare_reward_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    eos_token: str | None = None,
    num_proc: int | None = None,
) -> Any:
    """Tokenise every pair into whole sequences; drop the pairs with a side over ``max_length`` tokens.

    Args:
        dataset: a ``datasets.Dataset`` or a list of row dicts (module doc for the columns).
        tokenizer: a transformers tokenizer (with a chat template for conversations).
        max_length: the most tokens of a sequence; ``None`` keeps every pair.
        eos_token: appended to standard texts unless they end with it (``None``: nothing).
        num_proc: worker processes for ``Dataset.map`` (Datasets only).

    Returns:
        The dataset, of the type given, with ``chosen_ids``, ``rejected_ids`` and ``margin``
        (when the input has one), without the dropped pairs.

    Raises:
        ValueError: a bad row (named), or every pair longer than ``max_length``.
    """
    rows_in = len(dataset)
    if isinstance(dataset, list):
        out: Any = [tokenize_reward_row(row, tokenizer, eos_token, i) for i, row in enumerate(dataset)]
        longest = [max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in out]
    else:
        out = dataset.map(
            lambda row, i: tokenize_reward_row(row, tokenizer, eos_token, i),
            with_indices=True,
            remove_columns=list(dataset.column_names),
            features=_output_features("margin" in dataset.column_names),
            num_proc=num_proc,
        )
        longest = [max(len(c), len(r)) for c, r in zip(out["chosen_ids"], out["rejected_ids"], strict=True)]
    if max_length is None:
        return out
    dropped = [i for i, n in enumerate(longest) if n > max_length]
    if not dropped:
        return out
    why = f"a chosen or rejected sequence longer than max_length={max_length} tokens"
    fix = (
        f"raise max_length to at least {max(longest[i] for i in dropped)} (the longest dropped sequence), set it to "
        "None, or shorten the texts"
    )
    if len(dropped) == rows_in:
        raise ValueError(f"All {rows_in} pairs have {why}, so none is left. Fix: {fix}.")
    warnings.warn(
        f"{len(dropped)} of {rows_in} pairs have {why}; they were dropped, not truncated, as the reference does "
        f"(rows {_some(dropped)}). To keep them: {fix}.",
        UserWarning,
        stacklevel=3,
    )
    keep = set(range(rows_in)) - set(dropped)
    if isinstance(out, list):
        return [r for i, r in enumerate(out) if i in keep]
    return out.select(sorted(keep))


def _output_features(with_margin: bool) -> Any:
    from datasets import Features, List, Value

    features = {c: List(Value("int64")) for c in TOKENISED_COLUMNS}
    if with_margin:
        features["margin"] = Value("float64")
    return Features(features)


def _some(indices: list[int], shown: int = 5) -> str:
    """The first few row indices: ``"1, 4, 7, ..."``."""
    head = ", ".join(str(i) for i in indices[:shown])
    return head + (", ..." if len(indices) > shown else "")


def collate_reward_pairs(
    rows: list[Mapping[str, Any]], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> RewardBatch:
    """Right-pad tokenised pairs into a chosen and a rejected batch of one width, with their margins.

    Raises:
        ValueError: no rows, no pad token, or margins on some rows only.
    """
    if not rows:
        raise ValueError("collate_reward_pairs got no rows; pass at least one.")
    if pad_token_id is None:
        raise ValueError(
            "Padding needs a pad token id and got None. Set tokenizer.pad_token (e.g. to the EOS token)."
        )
    sequences = [
        {"input_ids": list(row[c]), "loss_mask": [1] * len(row[c])} for c in TOKENISED_COLUMNS for row in rows
    ]
    batch = collate_padded(sequences, pad_token_id, pad_to_multiple_of)
    n = len(rows)
    chosen, rejected = (
        Sequences(batch.input_ids[s], batch.loss_mask[s], batch.attention_mask[s])
        for s in (slice(0, n), slice(n, None))
    )
    has = [row.get("margin") is not None for row in rows]
    if any(has) and not all(has):
        raise ValueError(
            f"Row {has.index(False)} has no 'margin' while other rows have one; give every row a margin."
        )
    margin = torch.tensor([float(row["margin"]) for row in rows], dtype=torch.float32) if all(has) else None
    return RewardBatch(Pairs(chosen, rejected), margin)
