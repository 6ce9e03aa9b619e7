"""Preference data (DPO, and later KTO, ORPO, CPO and reward models): pairs of completions.

Every row holds a *chosen* (preferred) and a *rejected* (dispreferred) completion of one prompt
(the contract of TRL 1.16's ``DPOTrainer``).

Formats, named by their columns:

* ``"explicit"`` prompt: ``prompt``, ``chosen`` and ``rejected`` columns.
* ``"implicit"`` prompt: ``chosen`` and ``rejected`` only, each holding the whole example; the
  prompt is their shared beginning (``extract_prompt``, rule below). A row whose ``prompt`` is
  ``None`` (Arrow's fill when datasets with and without prompts are joined) is treated the same.

Each format is *standard* (all three values are strings) or *conversational* (lists of
``{"role", "content"}`` messages: the prompt's messages, then the completion's assistant
message(s); ShareGPT ``{"from", "value"}`` messages are converted). A row may carry ``tools``
(tool schemas, JSON text allowed) and ``chat_template_kwargs`` (template variables) for the chat
template. Precomputed reference log-probs, ``ref_chosen_logps`` and ``ref_rejected_logps``, are
carried through unchanged; every other column is ignored.

The implicit-prompt rule (``extract_prompt``):

* Conversations: the prompt is the longest run of leading messages both completions share that
  is followed, in both, by an assistant message; the completions are the rest (from that
  assistant message on, so a completion may span several turns). Each completion keeps at least
  its last message, so identical conversations split before their final assistant turn.
* Strings: take the longest common character prefix of ``chosen`` and ``rejected``, at most one
  character shorter than the shorter of the two (each completion keeps at least one character);
  if it ends with a space, that one space goes back to the completions (``"Sky is blue"`` /
  ``"Sky is red"`` give the prompt ``"Sky is"`` and the completions ``" blue"`` / ``" red"``),
  so the completions' first words keep their leading space, as a BPE tokenizer writes them. The
  reference moves the space only when the strings differ before the shorter one ends; here the
  rule holds in every case.
* An empty prompt (nothing shared) is an error naming the row: add a ``prompt`` column.

Tokenising (``tokenize_pair``): a standard prompt is ``tokenizer(prompt)`` (with the tokenizer's
usual special tokens) and each side is ``tokenizer(prompt + completion + EOS)`` (the EOS text is
appended unless the completion already ends with it). A conversational prompt is rendered with
the generation prompt (``chat.tokenize(..., add_generation_prompt=True)``) and each side is the
prompt's and the completion's messages rendered together (the template writes the end-of-turn
token; no EOS is appended). The pair's ``prompt_ids`` are the tokens the tokenised prompt shares
with *both* tokenised sides (``sft.common_prefix_length``), and ``chosen_ids`` / ``rejected_ids``
are the rest of each side; so ``prompt_ids + chosen_ids`` is exactly the tokenised prompt +
chosen, and the prompt is the same in both. When a side tokenises the prompt's last tokens
differently (a merge across the boundary, e.g. a prompt ending with a space), a warning names the
row and the prompt is cut to the shared tokens.

Truncation to ``max_length`` tokens (``None``: none):

* ``"keep_start"`` (the only supported mode): each side, prompt + completion, keeps its first
  ``max_length`` tokens (chosen and rejected separately; the prompt is never cut). A row whose
  prompt alone has ``max_length`` tokens or more would keep no completion token: it is dropped,
  and ``prepare_preference_dataset`` warns with the count (and raises when every row goes).
* ``"keep_end"`` is deprecated, as in the reference (a ``FutureWarning``): the shared prompt
  loses its start until the longer side fits; a completion longer than ``max_length`` on its own
  keeps its last ``max_length`` tokens and leaves the prompt empty. Nothing is dropped.

``prepare_preference_dataset`` also warns with the count of rows whose chosen and rejected tokens
are identical (after truncation) and raises when every row is such a pair: DPO's loss has no
gradient on them. ``collate_pairs`` turns tokenised rows into ``core.batch.Pairs``.

One row's format, implicit prompt and tokens are in ``data/preference_tokenize.py``; this module
prepares whole datasets and collates them, and imports the row-level public names.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.core.batch import Pairs, PromptRows, Sequences
from posttrain.data.packing import collate_packed, collate_padded
from posttrain.data.preference_tokenize import (  # noqa: F401  (re-exported)
    COMPLETION_COLUMNS,
    OUTPUT_COLUMNS,
    PREFERENCE_FORMATS,
    REF_COLUMNS,
    TRUNCATION_MODES,
    Message,
    Row,
    _encode_pair,
    _Options,
    _truncate_pair,
    check_truncation,
    detect_preference_format,
    extract_prompt,
    pair_kind,
    tokenize_pair,
)
from posttrain.ops.padding import left_pad, right_pad

# ----------------------------------------------------------------------------- whole datasets


def prepare_preference_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    truncation_mode: str = "keep_start",
    eos_token: str | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
) -> Any:
    """Check, tokenise and truncate every row of a preference dataset; drop the rows that do not fit.

    Works on a ``datasets.Dataset`` (``.map`` and ``.filter``; returns a Dataset with the columns
    ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` and the ref columns it had) and on a list of
    dicts (returns a list of dicts with the same keys).

    Args:
        dataset: a ``datasets.Dataset`` or a list of row dicts.
        tokenizer: a transformers tokenizer.
        max_length, truncation_mode, eos_token, tools, chat_template_kwargs: as in ``tokenize_pair``.
        num_proc: worker processes for ``Dataset.map`` (Datasets only).

    Returns:
        The tokenised dataset, of the type given, without the dropped rows.

    Raises:
        ValueError: an empty dataset, bad options, missing columns or a bad row (see
            ``detect_preference_format`` and ``tokenize_pair``), every row dropped by
            ``max_length``, or every row a pair with identical chosen and rejected tokens.
    """
    rows_in = _num_pairs(dataset)
    first = dataset[0]
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(first)
    detect_preference_format(columns, first)
    check_truncation(max_length, truncation_mode)
    opts = _Options(tokenizer, max_length, truncation_mode, eos_token, tools, chat_template_kwargs)
    out = _encode_rows(dataset, opts, num_proc)
    chosen, rejected = (
        [r[c] for r in out] if isinstance(out, list) else list(out[c]) for c in ("chosen_ids", "rejected_ids")
    )
    # The reports are called from here: their warnings' stacklevel points at this function's caller.
    dropped = [i for i, ids in enumerate(chosen) if not ids]
    _report_dropped(out, dropped, rows_in, max_length)
    identical = [i for i, (c, r) in enumerate(zip(chosen, rejected, strict=True)) if c and c == r]
    _report_identical(identical, rows_in - len(dropped), max_length)
    if isinstance(out, list):
        return [r for r in out if r["chosen_ids"]]
    return out.filter(lambda r: len(r["chosen_ids"]) > 0, num_proc=num_proc) if dropped else out


def _num_pairs(dataset: Any) -> int:
    """Row count of a list or a map-style Dataset, which must have a row."""
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"prepare_preference_dataset needs a datasets.Dataset or a list of dicts, got {type(dataset).__name__}. "
            "Materialise a streaming dataset first, e.g. Dataset.from_list(list(stream))."
        )
    rows_in = len(dataset)
    if rows_in == 0:
        raise ValueError("The preference dataset has no rows. Pass a dataset with at least one pair.")
    return rows_in


def _encode_rows(dataset: Any, opts: _Options, num_proc: int | None) -> Any:
    """Every row tokenised and truncated (a dropped row without completion tokens), as a list or a Dataset."""

    def one(row: Row, i: int) -> dict[str, Any]:
        pair = _encode_pair(row, opts, i)
        kept = _truncate_pair(pair, opts.max_length, opts.truncation_mode)
        # A dropped row keeps its prompt (for the report) and no completion tokens.
        return kept if kept is not None else {**pair, "chosen_ids": [], "rejected_ids": []}

    if isinstance(dataset, list):
        return [one(row, i) for i, row in enumerate(dataset)]
    return dataset.map(
        one,
        with_indices=True,
        remove_columns=list(dataset.column_names),
        features=_output_features(dataset),
        num_proc=num_proc,
    )


def _output_features(dataset: Any) -> Any:
    """The Dataset features of the tokenised columns (typed, so all-dropped batches still fit)."""
    from datasets import Features, List, Value

    features = {c: List(Value("int64")) for c in OUTPUT_COLUMNS}
    features.update({c: dataset.features[c] for c in REF_COLUMNS if c in dataset.column_names})
    return Features(features)


def _report_dropped(out: Any, dropped: list[int], rows_in: int, max_length: int | None) -> None:
    """Warn with the count of rows whose prompt reaches ``max_length``; raise when none is left."""
    if not dropped:
        return
    prompt_ids = [r["prompt_ids"] for r in out] if isinstance(out, list) else out["prompt_ids"]
    shortest = min(len(prompt_ids[i]) for i in dropped)
    why = (
        f"a prompt of max_length={max_length} tokens or more (truncation_mode='keep_start'), which leaves no "
        "room for the completions"
    )
    fix = f"raise max_length above the prompt lengths (the shortest dropped prompt has {shortest} tokens), or shorten the prompts"
    if len(dropped) == rows_in:
        raise ValueError(
            f"All {rows_in} rows of the preference dataset have {why}, so none is left. Fix: {fix}."
        )
    warnings.warn(
        f"{len(dropped)} of {rows_in} rows have {why}; they were dropped (rows {_some(dropped)}). To keep them: "
        f"{fix}.",
        stacklevel=3,
    )


def _report_identical(identical: list[int], kept: int, max_length: int | None) -> None:
    """Warn with the count of pairs whose chosen and rejected tokens are equal; raise when all are."""
    if not identical:
        return
    after = (
        "tokenisation" if max_length is None else f"tokenisation and truncation to max_length={max_length}"
    )
    if len(identical) == kept:
        raise ValueError(
            f"In every row ({kept} rows, e.g. rows {_some(identical)}) 'chosen' and 'rejected' are identical after "
            f"{after}, so the dataset teaches nothing (a pair of equal completions gives no gradient). Check that "
            "'chosen' and 'rejected' are not the same column, or raise max_length if only the ends differ."
        )
    warnings.warn(
        f"{len(identical)} of {kept} rows have identical 'chosen' and 'rejected' after {after} (rows "
        f"{_some(identical)}); they teach nothing. Drop them, e.g. dataset.filter(lambda r: r['chosen'] != "
        "r['rejected']).",
        stacklevel=3,
    )


def _some(indices: list[int], shown: int = 5) -> str:
    """The first few row indices: ``"1, 4, 7, ..."``."""
    head = ", ".join(str(i) for i in indices[:shown])
    return head + (", ..." if len(indices) > shown else "")


# ----------------------------------------------------------------------------- collation


def collate_pairs(rows: Sequence[Row], pad_token_id: int, pad_to_multiple_of: int | None = None) -> Pairs:
    """Right-pad tokenised pairs into a chosen and a rejected batch of the same width.

    Each side's row is ``prompt_ids + chosen_ids`` (or ``+ rejected_ids``); its loss mask is 1
    exactly on the completion's tokens. Both sides are padded to the same width, so a trainer
    may stack them into one forward pass.

    Args:
        rows: dicts with ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` (what
            ``prepare_preference_dataset`` returns).
        pad_token_id: the padding token.
        pad_to_multiple_of: round the width up to a multiple of this.

    Returns:
        ``Pairs`` of two ``Sequences`` with ``input_ids``, ``loss_mask``, ``attention_mask``
        (1 on real tokens) and ``position_ids=None`` (right padding: the model's default
        positions are the right ones).

    Raises:
        ValueError: no rows, no pad token, or a row with an empty prompt or completion.
    """
    if not rows:
        raise ValueError("collate_pairs got no rows; pass at least one.")
    if pad_token_id is None:
        raise ValueError(
            "collate_pairs needs a pad_token_id and got None. Set tokenizer.pad_token (e.g. to the EOS token)."
        )
    sides = []
    for column in ("chosen_ids", "rejected_ids"):
        side_rows = []
        for i, row in enumerate(rows):
            prompt, completion = list(row["prompt_ids"]), list(row[column])
            if not prompt or not completion:
                empty = "prompt_ids" if not prompt else column
                raise ValueError(
                    f"Row {i}: '{empty}' is empty. Collate rows from prepare_preference_dataset, which drops the "
                    "rows without room for a completion."
                )
            side_rows.append(
                {"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion)}
            )
        sides.append(collate_padded(side_rows, pad_token_id))
    width = max(s.input_ids.shape[1] for s in sides)
    if pad_to_multiple_of:
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
    return Pairs(*(_widen(s, width, pad_token_id) for s in sides))


def _sides(rows: Sequence[Row]) -> list[tuple[list[int], list[int]]]:
    """Every (prompt, completion) of the rows: the chosen sides, then the rejected sides."""
    return [
        (list(row["prompt_ids"]), list(row[column]))
        for column in ("chosen_ids", "rejected_ids")
        for row in rows
    ]


def collate_pair_prompts(rows: Sequence[Row], pad_token_id: int) -> PromptRows:
    """The pairs split at their prompts: ``[2N, P]`` left-padded prompts and ``[2N, T]`` completions.

    Row ``i`` and row ``N + i`` are pair ``i``'s chosen and rejected sides (``Pairs.stacked``'s
    order) and carry the same prompt, so ``ops.logprobs.score_completions`` runs it once.

    Args:
        rows: dicts with ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``.
        pad_token_id: the padding token.
    """
    sides = _sides(rows)
    prompt_ids, prompt_mask = left_pad([p for p, _ in sides], pad_token_id)
    completions = [c for _, c in sides]
    completion_ids = right_pad(completions, pad_token_id, torch.long)
    completion_mask = right_pad([[1] * len(c) for c in completions], 0, torch.long)
    return PromptRows(prompt_ids, prompt_mask, completion_ids, completion_mask)


def collate_pairs_packed(
    rows: Sequence[Row], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> Sequences:
    """Every side of the pairs laid end to end in one row ``[1, S]`` (padding-free batches).

    The order is ``Pairs.stacked``'s (chosen sides, then rejected sides); positions restart at
    every sequence and no sequence's first token is a target (``data/packing.collate_packed``).
    Each sequence's length is its row's in the padded batch (``attention_mask.sum(1)``), which
    ``ops.logprobs.unpack_scores`` takes to cut the scores back into rows.

    Args:
        rows: dicts with ``prompt_ids``, ``chosen_ids`` and ``rejected_ids``.
        pad_token_id: fills the ``pad_to_multiple_of`` tail.
        pad_to_multiple_of: round the row up to a multiple of this.
    """
    sequences = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c)} for p, c in _sides(rows)]
    return collate_packed(
        sequences, flatten=True, pad_token_id=pad_token_id, pad_to_multiple_of=pad_to_multiple_of
    )


def _widen(batch: Sequences, width: int, pad_token_id: int) -> Sequences:
    """Right-pad a padded batch to ``width`` columns; drop its position ids."""
    extra = width - batch.input_ids.shape[1]

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, extra), value=value)

    return Sequences(
        pad(batch.input_ids, pad_token_id), pad(batch.loss_mask, 0), pad(batch.attention_mask, 0)
    )


def pair_lengths(rows: Sequence[Row]) -> list[int]:
    """Each pair's longer side in tokens (prompt + completion), e.g. to group rows by length."""
    return [len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"])) for r in rows]


def collate_ref_logps(rows: Sequence[Row]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The precomputed reference log-probs of a batch, ``([N], [N])``; ``None`` when rows have none.

    Raises:
        ValueError: some rows carry them and others do not.
    """
    has = [all(row.get(c) is not None for c in REF_COLUMNS) for row in rows]
    if not any(has):
        return None
    if not all(has):
        missing = has.index(False)
        raise ValueError(
            f"Row {missing} has no {' / '.join(REF_COLUMNS)} while other rows have them. Precompute them for "
            "every row, or for none."
        )
    chosen, rejected = (
        torch.tensor([float(row[c]) for row in rows], dtype=torch.float32) for c in REF_COLUMNS
    )
    return chosen, rejected
