"""Unpaired preference data (KTO): one completion per row, labelled desirable or undesirable.

Formats, named by their columns (TRL 1.16's ``KTOTrainer`` contract):

* ``"unpaired"``: ``prompt``, ``completion`` and ``label`` (a bool: True = desirable).
* ``"paired"``: preference pairs, ``chosen`` and ``rejected`` with or without a ``prompt``
  (``data/preference.py``: an implicit prompt is taken from their shared beginning). Each pair
  becomes two examples, prompt + chosen labelled True and prompt + rejected labelled False; the
  converted dataset holds every chosen example (in the dataset's order), then every rejected one.

Each is *standard* (strings) or *conversational* (lists of ``{"role", "content"}`` messages,
ShareGPT ones converted); a row may carry ``tools`` and ``chat_template_kwargs`` for the chat
template. Every other column is ignored.

Tokenising follows DPO's rule through ``sft.tokenize_row`` (prompt-completion): a standard
prompt is ``tokenizer(prompt)`` and the example ``tokenizer(prompt + completion + EOS)`` (EOS
appended unless the completion ends with it); a conversational prompt is rendered with the
generation prompt and the example is the prompt's and the completion's messages rendered
together. ``completion_ids`` are the example's tokens after those it shares with the tokenised
prompt, ``prompt_ids`` the ones before. Truncation to ``max_length`` keeps the start: the
completion is cut, never the prompt; a row whose prompt alone has ``max_length`` tokens or more
is dropped (``prepare_unpaired_dataset`` warns with the count, and raises when none is left).
A row error of a converted pair names the pair's row in the dataset given.

KL pairs (``collate_unpaired``): KTO's reference point z₀ is estimated from *mismatched* pairs,
each example's prompt with another example's completion. They are built when a micro-batch is
collated: row ``i``'s prompt with row ``i - 1``'s completion (row 0 takes the last row's), so
the estimate depends on the micro-batch alone, not on the dataset's order or on how it was cut
into batches before training (the reference library pairs rows at preprocessing time, inside
chunks of the batch size). A pair is truncated to ``max_length`` like an example. A micro-batch
of one row pairs it with itself. When the reference's log-probs are precomputed, the pairs must
be fixed before training: ``kl_partners`` pairs each row with the previous row of its chunk of
``batch_size`` consecutive rows (what collation gives sequentially drawn batches), and the
partner's completion is stored in the row (``kl_completion_ids``), which collation then uses.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from posttrain.core.batch import Sequences, VisionInputs
from posttrain.data import preference
from posttrain.data.packing import collate_padded
from posttrain.data.sft import row_label, tokenize_row
from posttrain.data.vision import IMAGE_COLUMNS

UNPAIRED_FORMATS = ("unpaired", "paired")
UNPAIRED_COLUMNS = ("prompt", "completion", "label")
#: Columns a row keeps for the chat template.
TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")
OUTPUT_COLUMNS = ("prompt_ids", "completion_ids", "label")
#: The KL partner's completion, fixed before training when the reference is precomputed.
KL_COLUMN = "kl_completion_ids"
#: Precomputed reference log-probs of the example and of its KL pair.
REF_COLUMNS = ("ref_logps", "ref_kl_logps")

Row = Mapping[str, Any]


# ----------------------------------------------------------------------------- format and checks


def detect_unpaired_format(column_names: Sequence[str], first_row: Row) -> str:
    """Name the format of a KTO dataset and check its first row.

    Args:
        column_names: the dataset's columns.
        first_row: the dataset's first row.

    Returns:
        ``"unpaired"`` (``prompt``, ``completion``, ``label``) or ``"paired"`` (``chosen`` and
        ``rejected``, converted by ``unpair``).

    Raises:
        ValueError: a missing column (the message lists the columns and both formats), columns
            of both formats at once, or a malformed first row.
    """
    columns = list(column_names)
    paired = all(c in columns for c in preference.COMPLETION_COLUMNS)
    unpaired_only = [c for c in ("completion", "label") if c in columns]
    if paired and unpaired_only:
        raise ValueError(
            f"The KTO dataset has both preference-pair columns ('chosen', 'rejected') and unpaired ones "
            f"({', '.join(repr(c) for c in unpaired_only)}); its columns are {columns}. Keep one format: remove "
            "'chosen' and 'rejected' to train on the labelled completions, or the others to split the pairs."
        )
    if paired:
        preference.detect_preference_format(columns, first_row)
        return "paired"
    missing = [c for c in UNPAIRED_COLUMNS if c not in columns]
    if missing:
        half = [c for c in preference.COMPLETION_COLUMNS if c in columns]
        hint = (
            f" It has {half[0]!r} without {'rejected' if half[0] == 'chosen' else 'chosen'!r}: pairs need both."
            if half
            else ""
        )
        raise ValueError(
            f"The KTO dataset has no {' or '.join(repr(c) for c in missing)} column; its columns are {columns}. "
            "KTO trains on unpaired examples: 'prompt', 'completion' and a boolean 'label' (True: desirable, "
            "False: undesirable), or on preference pairs 'chosen' and 'rejected' (with an optional 'prompt'), "
            "each split into a desirable and an undesirable example. Rename yours, e.g. "
            "dataset.rename_column('response', 'completion')." + hint
        )
    check_example(first_row, 0)
    return "unpaired"


def check_labels(labels: Sequence[Any], name: str = "The dataset") -> None:
    """Raise on the first label that is not a bool, naming its row.

    Args:
        labels: the ``label`` column.
        name: which dataset this is, for the message.

    Raises:
        ValueError: a label that is not True or False (``None``, 0/1, a string).
    """
    for i, value in enumerate(labels):
        if not isinstance(value, bool) and type(value).__name__ != "bool_":  # numpy's bool is fine
            raise ValueError(
                f"{name}, row {i}: 'label' is {value!r} ({type(value).__name__}), not a bool. KTO's label says "
                "whether the completion is desirable (True) or undesirable (False). Convert the column, e.g. "
                "dataset.map(lambda r: {'label': bool(r['label'])}) for 0/1 labels, or drop the rows without one."
            )


def _kind(value: Any) -> str | None:
    """``"standard"`` for text, ``"conversational"`` for a list of message dicts, else ``None``."""
    if isinstance(value, str):
        return "standard"
    if isinstance(value, Sequence) and all(isinstance(m, Mapping) for m in value):
        return "conversational"
    return None


def check_example(row: Row, index: int | None) -> None:
    """Check one unpaired row's ``prompt`` and ``completion``.

    Raises:
        ValueError: an empty prompt or completion, a value that is neither text nor messages,
            or text mixed with messages; the message names the row.
    """
    kinds = {}
    for column in ("prompt", "completion"):
        value = row.get(column)
        kinds[column] = _kind(value)
        if value is not None and kinds[column] is None:
            raise ValueError(
                f"{row_label(index)}: column '{column}' holds {type(value).__name__}, not text or a list of messages. "
                "Use a string (standard format) or a list of {'role': ..., 'content': ...} dicts "
                "(conversational format)."
            )
        if value is None or len(value) == 0:
            raise ValueError(
                f"{row_label(index)}: column '{column}' is empty, so the example has nothing to score. Drop the row, "
                f"e.g. dataset.filter(lambda r: r['{column}'] is not None and len(r['{column}']) > 0)."
            )
    if kinds["prompt"] != kinds["completion"]:
        raise ValueError(
            f"{row_label(index)}: 'prompt' is {kinds['prompt']} and 'completion' is {kinds['completion']}; use text in "
            "both (standard format) or message lists in both (conversational format), e.g. "
            "completion=[{'role': 'assistant', 'content': text}]."
        )


# ----------------------------------------------------------------------------- pairs to examples


def unpair(dataset: Any) -> Any:
    """Split preference pairs into labelled examples: every chosen one (True), then every rejected one (False).

    Args:
        dataset: a ``datasets.Dataset`` or a list of rows with ``chosen`` and ``rejected`` (and
            optionally ``prompt``, ``tools``, ``chat_template_kwargs``).

    Returns:
        Rows ``{"prompt", "completion", "label"}`` (plus the template columns), twice as many, of
        the type given.

    Raises:
        ValueError: a malformed pair, or an implicit prompt that cannot be found (names the row).
    """
    if isinstance(dataset, list):
        return _unpair_rows(dataset, list(range(len(dataset))))
    return dataset.map(
        _unpair_columns,
        with_indices=True,
        batched=True,
        batch_size=None,  # one batch: all chosen examples come before all rejected ones
        remove_columns=list(dataset.column_names),
    )


def _unpair_rows(rows: Sequence[Row], indices: Sequence[int]) -> list[dict[str, Any]]:
    """Pairs to examples: the chosen ones, then the rejected ones, each in the rows' order."""
    split = [preference.extract_prompt(row, i) for row, i in zip(rows, indices, strict=True)]
    return [
        {
            "prompt": row["prompt"],
            "completion": row[side],
            "label": side == "chosen",
            **{c: row[c] for c in (*TEMPLATE_COLUMNS, *IMAGE_COLUMNS) if c in row},
        }
        for side in preference.COMPLETION_COLUMNS
        for row in split
    ]


def _unpair_columns(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
    """``_unpair_rows`` on a batch of ``Dataset.map``'s columns."""
    rows = [{name: values[k] for name, values in batch.items()} for k in range(len(indices))]
    examples = _unpair_rows(rows, indices)
    names = [*UNPAIRED_COLUMNS, *(c for c in (*TEMPLATE_COLUMNS, *IMAGE_COLUMNS) if c in batch)]
    return {name: [e[name] for e in examples] for name in names}


# ----------------------------------------------------------------------------- tokenising


def tokenize_example(
    row: Row,
    tokenizer: Any,
    *,
    eos_token: str | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int | None = None,
) -> dict[str, Any]:
    """Tokenise one unpaired row into its prompt and completion tokens (no truncation).

    Args:
        row: a row with ``prompt``, ``completion`` and ``label``.
        tokenizer: a transformers tokenizer (with a chat template for conversational rows).
        eos_token: appended to standard completions (default: the tokenizer's EOS token).
        tools: tool schemas for the chat template; a row's own ``tools`` column wins.
        chat_template_kwargs: extra template variables; a row's column is merged over them.
        index: the row's position, named in error messages.

    Returns:
        ``{"prompt_ids", "completion_ids", "label"}``.

    Raises:
        ValueError: a bad row (``check_example``, message order, no chat template) or a
            completion that adds no tokens after the prompt.
    """
    check_example(row, index)
    out = tokenize_row(
        row,
        tokenizer,
        "prompt_completion",
        max_length=None,
        completion_only_loss=True,
        eos_token=eos_token,
        tools=tools,
        chat_template_kwargs=chat_template_kwargs,
        index=index,
    )
    ids, mask = out["input_ids"], out["loss_mask"]
    start = next((t for t, m in enumerate(mask) if m), len(ids))
    if start == len(ids):
        raise ValueError(
            f"{row_label(index)}: the completion adds no tokens after the prompt. Check that the chat template renders "
            "assistant messages, or drop the row."
        )
    return {"prompt_ids": ids[:start], "completion_ids": ids[start:], "label": bool(row["label"])}


def truncate_example(example: dict[str, Any], max_length: int | None) -> dict[str, Any] | None:
    """Cut an example's completion so prompt + completion fit ``max_length``; ``None``: dropped.

    The prompt is never cut: a prompt of ``max_length`` tokens or more leaves no room for the
    completion, and the example is dropped.
    """
    if max_length is None:
        return example
    room = max_length - len(example["prompt_ids"])
    if room <= 0:
        return None
    return {**example, "completion_ids": example["completion_ids"][:room]}


def prepare_unpaired_dataset(
    dataset: Any,
    tokenizer: Any,
    *,
    max_length: int | None = 1024,
    eos_token: str | None = None,
    tools: list[Any] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    num_proc: int | None = None,
) -> Any:
    """Check, convert (pairs), tokenise and truncate a KTO dataset; drop the rows that do not fit.

    Args:
        dataset: a ``datasets.Dataset`` or a list of row dicts, unpaired or paired.
        tokenizer: a transformers tokenizer.
        max_length: the most tokens of prompt + completion (``None``: no truncation).
        eos_token, tools, chat_template_kwargs: as in ``tokenize_example``.
        num_proc: worker processes for ``Dataset.map`` (Datasets only).

    Returns:
        The examples with ``prompt_ids``, ``completion_ids`` and ``label``, of the type given.

    Raises:
        ValueError: an empty dataset, missing columns, a non-bool label, a bad row, or every row
            dropped by ``max_length``.
    """
    rows_in = _num_rows(dataset)
    first = dataset[0]
    columns = list(dataset.column_names) if hasattr(dataset, "column_names") else list(first)
    paired = detect_unpaired_format(columns, first) == "paired"
    if paired:
        dataset = unpair(dataset)
    else:
        check_labels(column_values(dataset, "label"))
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length={max_length!r} must be a positive integer (or None for no truncation).")
    options = {"eos_token": eos_token, "tools": tools, "chat_template_kwargs": chat_template_kwargs}

    def one(row: Row, i: int) -> dict[str, Any]:
        source = i % rows_in if paired else i  # errors name the row of the dataset given
        example = tokenize_example(row, tokenizer, index=source, **options)
        kept = truncate_example(example, max_length)
        return kept if kept is not None else {**example, "completion_ids": []}  # dropped: reported below

    if isinstance(dataset, list):
        out = [one(row, i) for i, row in enumerate(dataset)]
    else:
        out = dataset.map(
            one,
            with_indices=True,
            remove_columns=list(dataset.column_names),
            features=_output_features(),
            num_proc=num_proc,
        )
    dropped = [i for i, ids in enumerate(column_values(out, "completion_ids")) if not ids]
    _report_dropped(out, dropped, len(out), max_length)
    if isinstance(out, list):
        return [r for r in out if r["completion_ids"]]
    return out.filter(lambda r: len(r["completion_ids"]) > 0, num_proc=num_proc) if dropped else out


def _num_rows(dataset: Any) -> int:
    """Row count of a list or a map-style Dataset.

    Raises:
        ValueError: a stream (no length) or an empty dataset.
    """
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"prepare_unpaired_dataset needs a datasets.Dataset or a list of dicts, got {type(dataset).__name__}. "
            "Materialise a streaming dataset first, e.g. Dataset.from_list(list(stream))."
        )
    if len(dataset) == 0:
        raise ValueError("The KTO dataset has no rows. Pass a dataset with at least one example.")
    return len(dataset)


def column_values(dataset: Any, name: str) -> list[Any]:
    """The values of one column of a Dataset or a list of dicts, as a list."""
    if isinstance(dataset, list):
        return [row.get(name) for row in dataset]
    return list(dataset[name])


def _output_features() -> Any:
    from datasets import Features, List, Value

    return Features(
        {"prompt_ids": List(Value("int64")), "completion_ids": List(Value("int64")), "label": Value("bool")}
    )


def _report_dropped(out: Any, dropped: list[int], rows_in: int, max_length: int | None) -> None:
    """Warn with the count of rows whose prompt reaches ``max_length``; raise when none is left."""
    if not dropped:
        return
    prompts = column_values(out, "prompt_ids")
    shortest = min(len(prompts[i]) for i in dropped)
    why = f"a prompt of max_length={max_length} tokens or more, which leaves no room for the completion"
    fix = f"raise max_length above the prompt lengths (the shortest dropped prompt has {shortest} tokens), or shorten the prompts"
    if len(dropped) == rows_in:
        raise ValueError(
            f"All {rows_in} examples of the KTO dataset have {why}, so none is left. Fix: {fix}."
        )
    shown = ", ".join(str(i) for i in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
    warnings.warn(
        f"{len(dropped)} of {rows_in} examples have {why}; they were dropped (examples {shown}). To keep them: {fix}.",
        stacklevel=3,
    )


# ----------------------------------------------------------------------------- KL pairs and collation


def kl_partners(num_rows: int, batch_size: int) -> list[int]:
    """For each row, the row whose completion forms its KL pair when batches are consecutive chunks.

    Rows are cut into chunks of ``batch_size`` (the last may be shorter); in each chunk, row
    ``i`` takes row ``i - 1``'s completion and the chunk's first row its last row's: what
    ``collate_unpaired`` does to a batch drawn in order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1.")
    partners = []
    for start in range(0, num_rows, batch_size):
        end = min(start + batch_size, num_rows)
        partners += [end - 1] + list(range(start, end - 1))
    return partners


@dataclass
class UnpairedBatch:
    """A collated micro-batch of unpaired examples.

    Attributes:
        examples: [N, L] prompt + completion rows, right padded (left padded, with their
            ``vision`` inputs, for rows with images); the loss mask is 1 on the completion tokens.
        labels: [N] True for desirable examples.
        kl: [N, L] the mismatched pairs (row ``i``'s prompt, another row's completion), as wide as
            ``examples``; ``None`` when the loss needs no KL estimate.
        ref_logps: [N] precomputed reference log-probs of the examples, if any.
        ref_kl_logps: [N] the same for the KL pairs.
    """

    examples: Sequences
    labels: torch.Tensor
    kl: Sequences | None = None
    ref_logps: torch.Tensor | None = None
    ref_kl_logps: torch.Tensor | None = None

    @property
    def num_examples(self) -> int:
        return int(self.labels.shape[0])

    def stacked(self) -> Sequences:
        """The examples, then the KL pairs when there are any, as one batch for a single forward."""
        if self.kl is None:
            return self.examples
        e, k = self.examples, self.kl
        images = VisionInputs(e.vision.rows + k.vision.rows) if e.vision is not None else None
        return Sequences(
            torch.cat([e.input_ids, k.input_ids]),
            torch.cat([e.loss_mask, k.loss_mask]),
            torch.cat([e.attention_mask, k.attention_mask]),
            torch.cat([e.position_ids, k.position_ids]),
            vision=images,
        )

    def to(self, device: torch.device | str) -> UnpairedBatch:
        """The batch with every tensor on ``device``."""

        def opt(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.to(device) if t is not None else None

        def move(s: Sequences | None) -> Sequences | None:
            if s is None:
                return None
            return Sequences(
                opt(s.input_ids),
                opt(s.loss_mask),
                opt(s.attention_mask),
                opt(s.position_ids),
                vision=s.vision,
            )

        return replace(
            self,
            examples=move(self.examples),
            labels=self.labels.to(device),
            kl=move(self.kl),
            ref_logps=opt(self.ref_logps),
            ref_kl_logps=opt(self.ref_kl_logps),
        )


def collate_unpaired(
    rows: Sequence[Row],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    *,
    with_kl: bool = True,
    max_length: int | None = None,
) -> UnpairedBatch:
    """Right-pad tokenised examples and, with ``with_kl``, their mismatched KL pairs (module doc).

    Args:
        rows: dicts with ``prompt_ids``, ``completion_ids`` and ``label`` (what
            ``prepare_unpaired_dataset`` returns), and the precomputed columns if any.
        pad_token_id: the padding token.
        pad_to_multiple_of: round the width up to a multiple of this.
        with_kl: also build the KL pairs: row ``i``'s prompt with row ``i - 1``'s completion (row
            0 with the last row's), or with the row's ``kl_completion_ids`` when it has them.
        max_length: a KL pair's completion is cut so that the pair fits (``None``: no cut).

    Returns:
        An ``UnpairedBatch``; examples and KL pairs share one width.

    Raises:
        ValueError: no rows, no pad token, an empty prompt or completion, or precomputed columns
            on some rows only.
    """
    if not rows:
        raise ValueError("collate_unpaired got no rows; pass at least one.")
    if pad_token_id is None:
        raise ValueError(
            "collate_unpaired needs a pad_token_id and got None. Set tokenizer.pad_token (e.g. to the EOS token)."
        )
    items = []
    for i, row in enumerate(rows):
        prompt, completion = list(row["prompt_ids"]), list(row["completion_ids"])
        if not prompt or not completion:
            empty = "prompt_ids" if not prompt else "completion_ids"
            raise ValueError(
                f"Row {i}: '{empty}' is empty. Collate rows from prepare_unpaired_dataset, which drops the rows "
                "without room for a completion."
            )
        items.append(_row(prompt, completion))
    n = len(items)
    if with_kl:
        for i, row in enumerate(rows):
            prompt = list(row["prompt_ids"])
            partner = row.get(KL_COLUMN)
            completion = list(partner if partner is not None else rows[i - 1]["completion_ids"])
            if max_length is not None:
                completion = completion[: max(max_length - len(prompt), 1)]
            items.append(_row(prompt, completion))
    padded = collate_padded(items, pad_token_id, pad_to_multiple_of)
    labels = torch.tensor([bool(row["label"]) for row in rows], dtype=torch.bool)
    ref, ref_kl = collate_ref_logps(rows, with_kl)
    return UnpairedBatch(
        _slice(padded, slice(0, n)), labels, _slice(padded, slice(n, None)) if with_kl else None, ref, ref_kl
    )


def _row(prompt: list[int], completion: list[int]) -> dict[str, list[int]]:
    """One row to pad: prompt + completion, the loss mask on the completion."""
    return {"input_ids": prompt + completion, "loss_mask": [0] * len(prompt) + [1] * len(completion)}


def _slice(batch: Sequences, rows: slice) -> Sequences:
    return Sequences(
        batch.input_ids[rows], batch.loss_mask[rows], batch.attention_mask[rows], batch.position_ids[rows]
    )


def collate_ref_logps(rows: Sequence[Row], with_kl: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The precomputed reference log-probs of a batch (``[N]`` each), ``None`` when rows have none.

    Raises:
        ValueError: some rows carry them and others do not.
    """
    needed = REF_COLUMNS if with_kl else REF_COLUMNS[:1]
    has = [all(row.get(c) is not None for c in needed) for row in rows]
    if not any(has):
        return None, None
    if not all(has):
        raise ValueError(
            f"Row {has.index(False)} has no {' / '.join(needed)} while other rows have them. Precompute them for every "
            "row, or for none."
        )
    ref = torch.tensor([float(row[REF_COLUMNS[0]]) for row in rows], dtype=torch.float32)
    ref_kl = (
        torch.tensor([float(row[REF_COLUMNS[1]]) for row in rows], dtype=torch.float32) if with_kl else None
    )
    return ref, ref_kl
