"""Packing tokenised SFT rows into fixed-length bins, and collating rows into ``Sequences``.

Rows are ``{"input_ids": [...], "loss_mask": [...]}`` dicts (see ``posttrain.data.sft``); a
packed bin adds ``seq_lengths``, the lengths of the sequences laid end to end in it.

Strategies (``SFTConfig.packing_strategy``):

* ``"bfd"``: best-fit decreasing. Rows longer than ``max_length`` are truncated (their tail is
  lost), then, longest first, each row goes into the open bin with the least room that still
  fits it, or a new bin. Sequence boundaries are kept.
* ``"bfd_split"`` (alias ``"bfd-requeue"``): as ``"bfd"``, but over-long rows are first split
  into ``max_length`` fragments, so no token is lost (Ding et al. 2024, "Fewer Truncations
  Improve Language Modeling"). Each fragment is its own sequence.
* ``"wrapped"``: concatenate every row and cut every ``max_length`` tokens (T5-style). A bin
  is then one sequence: tokens attend across the documents it joins, as in the reference, and a
  joined document's first token is a target when its row's mask says so (rows prepared with
  ``first_token_target=True``); only each bin's own first token is not.

A packed batch has no padding to attend to, but its sequences must not see each other:
``position_ids`` restart at 0 at each sequence's start, which is what flash-attention's varlen
kernels read (``cu_seqlens``); on CPU (SDPA or eager attention) ``packed_attention_mask``
builds the block-diagonal causal mask that keeps attention inside each sequence. (transformers
5 infers that mask from ``position_ids`` alone only when no cache is in play, i.e. with
``use_cache=False``; with the default ``use_cache=True`` a packed row without the 4D mask lets
its sequences attend to each other. Pass the mask, or ``use_cache=False``.)
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from posttrain.core.batch import Sequences

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")
STRATEGY_ALIASES = {"bfd-requeue": "bfd_split"}

Row = Mapping[str, Any]


def resolve_strategy(strategy: str) -> str:
    """The canonical name of a packing strategy (``"bfd-requeue"`` -> ``"bfd_split"``).

    Raises:
        ValueError: an unknown strategy; the message lists the valid ones.
    """
    name = STRATEGY_ALIASES.get(strategy, strategy)
    if name not in PACKING_STRATEGIES:
        valid = list(PACKING_STRATEGIES) + list(STRATEGY_ALIASES)
        raise ValueError(f"packing_strategy={strategy!r} is not supported; use one of {valid}.")
    return name


def pack(rows: Iterable[Row], max_length: int, strategy: str = "bfd") -> list[dict[str, list[int]]]:
    """Pack tokenised rows into bins of at most ``max_length`` tokens.

    Args:
        rows: dicts with ``input_ids`` and ``loss_mask`` of equal length (a list, or any iterable
            of rows such as a ``datasets.Dataset``). Empty rows are skipped.
        max_length: the bin size, at least 1.
        strategy: ``"bfd"``, ``"bfd_split"`` (alias ``"bfd-requeue"``) or ``"wrapped"``.

    Returns:
        Bins ``{"input_ids", "loss_mask", "seq_lengths"}`` with ``sum(seq_lengths) ==
        len(input_ids) <= max_length``. BFD bins come in the order they were opened; each keeps
        its rows in the order they were placed (longest first). The loss masks are copied as
        they are; ``collate_packed`` clears the first token of every sequence.

    Raises:
        ValueError: an unknown strategy, a bad ``max_length``, or a malformed row.
    """
    name = resolve_strategy(strategy)
    if not isinstance(max_length, int) or max_length < 1:
        raise ValueError(f"max_length={max_length!r} must be a positive integer to pack rows.")
    items = [item for item in _checked_rows(rows) if item[0]]
    if name == "wrapped":
        return _wrap(items, max_length)
    if name == "bfd_split":
        items = [piece for item in items for piece in _fragments(item, max_length)]
    else:
        items = [(ids[:max_length], mask[:max_length]) for ids, mask in items]
    return [
        _join([items[i] for i in bin_])
        for bin_ in best_fit_decreasing([len(i[0]) for i in items], max_length)
    ]


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Assign items to bins by best-fit decreasing.

    Items are taken longest first (ties in input order); each goes into the open bin whose free
    room is the smallest that still holds it (ties: the bin opened first), else into a new bin.
    Free rooms are kept as a sorted list of distinct values (at most ``capacity`` of them), each
    with a heap of bin indices, so a placement costs ``O(log n)`` plus a short list insert.

    Args:
        lengths: item sizes, each in ``[1, capacity]``.
        capacity: the bin size.

    Returns:
        For each bin, in opening order, the indices of its items in placement order.
    """
    if any(not 1 <= n <= capacity for n in lengths):
        raise ValueError(f"Every item length must lie in [1, {capacity}] to be packed; got {list(lengths)}.")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    rooms: list[int] = []  # sorted distinct free rooms > 0 that some open bin has
    by_room: dict[int, list[int]] = {}  # room -> heap of the bins that have it
    for item in order:
        n = lengths[item]
        k = bisect.bisect_left(rooms, n)
        if k < len(rooms):
            room = rooms[k]
            b = heapq.heappop(by_room[room])
            if not by_room[room]:
                rooms.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(item)
        _add_room(rooms, by_room, room - n, b)
    return bins


def _add_room(rooms: list[int], by_room: dict[int, list[int]], room: int, b: int) -> None:
    """Record that bin ``b`` has ``room`` free tokens (full bins are forgotten)."""
    if room <= 0:
        return
    heap = by_room.setdefault(room, [])
    if not heap:
        bisect.insort(rooms, room)
    heapq.heappush(heap, b)


def _checked_rows(rows: Iterable[Row]) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, loss_mask)`` of every row, checked."""
    items = []
    for i, row in enumerate(rows):
        if "input_ids" not in row or "loss_mask" not in row:
            raise ValueError(
                f"Row {i} has columns {list(row)}; packing needs 'input_ids' and 'loss_mask'. Tokenise the "
                "dataset first (posttrain.data.sft.prepare_dataset)."
            )
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        if len(ids) != len(mask):
            raise ValueError(
                f"Row {i}: 'input_ids' has {len(ids)} tokens but 'loss_mask' has {len(mask)}. Give one mask "
                "value per token."
            )
        items.append((ids, mask))
    return items


def _fragments(item: tuple[list[int], list[int]], size: int) -> list[tuple[list[int], list[int]]]:
    """An over-long row cut into pieces of ``size`` tokens (the last one shorter)."""
    ids, mask = item
    return [(ids[s : s + size], mask[s : s + size]) for s in range(0, len(ids), size)]


def _join(items: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """One bin from its items laid end to end."""
    return {
        "input_ids": [t for ids, _ in items for t in ids],
        "loss_mask": [m for _, mask in items for m in mask],
        "seq_lengths": [len(ids) for ids, _ in items],
    }


def _wrap(items: list[tuple[list[int], list[int]]], size: int) -> list[dict[str, list[int]]]:
    """Concatenate every row and cut every ``size`` tokens; each cut is one sequence.

    Masks travel with their tokens, except that each cut's first token is never a target.
    """
    ids = [t for item, _ in items for t in item]
    mask = [m for _, item in items for m in item]
    return [
        {
            "input_ids": ids[s : s + size],
            "loss_mask": [0, *mask[s + 1 : s + size]],
            "seq_lengths": [len(ids[s : s + size])],
        }
        for s in range(0, len(ids), size)
    ]


# ----------------------------------------------------------------------------- collation


def collate_padded(
    rows: Sequence[Row], pad_token_id: int, pad_to_multiple_of: int | None = None
) -> Sequences:
    """Right-pad rows into a batch with an attention mask.

    Args:
        rows: dicts with ``input_ids`` and ``loss_mask``; a packed bin must hold one sequence
            (several need ``collate_packed``, or their tokens would attend across sequences).
        pad_token_id: the padding token.
        pad_to_multiple_of: round the batch length up to a multiple of this.

    Returns:
        ``Sequences`` with ``input_ids``, ``loss_mask`` (0 on padding and on column 0, which is
        never a target), ``attention_mask`` (1 on real tokens) and ``position_ids`` (0, 1, ...).
    """
    items = _checked_rows(rows)
    if not items:
        raise ValueError("collate_padded got no rows; pass at least one.")
    for i, row in enumerate(rows):
        if len(row.get("seq_lengths") or [0]) > 1:
            raise ValueError(
                f"Row {i} is a packed bin of {len(row['seq_lengths'])} sequences; a padded batch would let them "
                "attend to each other. Use collate_packed for packed bins."
            )
    width = _round_up(max(len(ids) for ids, _ in items), pad_to_multiple_of)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((len(items), width), dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for r, (ids, mask) in enumerate(items):
        input_ids[r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        loss_mask[r, : len(ids)] = torch.tensor(mask, dtype=torch.long)
        attention_mask[r, : len(ids)] = 1
    loss_mask[:, 0] = 0
    position_ids = torch.arange(width, dtype=torch.long).expand(len(items), width).clone()
    return Sequences(input_ids, loss_mask, attention_mask, position_ids)


def collate_packed(
    rows_or_bins: Sequence[Row],
    *,
    flatten: bool = False,
    pad_token_id: int = 0,
    pad_to_multiple_of: int | None = None,
) -> Sequences:
    """Collate packed bins (or plain rows, one sequence each) without an attention mask.

    Every sequence's ``position_ids`` restart at 0 and its first token's ``loss_mask`` is set to
    0, so no sequence learns to predict its first token from the one before it.

    Args:
        rows_or_bins: dicts with ``input_ids``, ``loss_mask`` and, for bins, ``seq_lengths``
            (a row without it is one sequence).
        flatten: lay every bin end to end in a single row ``[1, total]`` (flash-attention's
            varlen layout, the reference's padding-free batch). Default: one row per bin
            ``[N, longest]``, which keeps the CPU block-diagonal mask at ``N * L * L``.
        pad_token_id: fills the rows shorter than the longest (and the ``pad_to_multiple_of``
            tail). The padding is its own sequence (positions from 0, loss mask 0), so real tokens
            never attend to it.
        pad_to_multiple_of: round the row length up to a multiple of this.

    Returns:
        ``Sequences`` with ``attention_mask=None`` and restarting ``position_ids``.
    """
    items = _checked_rows(rows_or_bins)
    if not items:
        raise ValueError("collate_packed got no rows; pass at least one.")
    lengths = [
        _seq_lengths(row, len(ids), i)
        for i, (row, (ids, _)) in enumerate(zip(rows_or_bins, items, strict=True))
    ]
    if flatten:
        items = [([t for ids, _ in items for t in ids], [m for _, mask in items for m in mask])]
        lengths = [[n for bin_ in lengths for n in bin_]]
    width = _round_up(max(len(ids) for ids, _ in items), pad_to_multiple_of)
    rows = [
        _packed_row(ids, mask, seqs, width, pad_token_id)
        for (ids, mask), seqs in zip(items, lengths, strict=True)
    ]
    input_ids, loss_mask, position_ids = (
        torch.tensor([r[k] for r in rows], dtype=torch.long) for k in range(3)
    )
    return Sequences(input_ids, loss_mask, None, position_ids)


def _seq_lengths(row: Row, length: int, index: int) -> list[int]:
    """A bin's sequence lengths (a plain row is one sequence), checked against its length."""
    seqs = list(row.get("seq_lengths") or [length])
    if sum(seqs) != length or any(n < 1 for n in seqs):
        raise ValueError(
            f"Row {index}: seq_lengths {seqs} do not split its {length} tokens into non-empty sequences. Build "
            "bins with posttrain.data.packing.pack."
        )
    return seqs


def _packed_row(
    ids: list[int], mask: list[int], seqs: list[int], width: int, pad_token_id: int
) -> tuple[list[int], list[int], list[int]]:
    """One packed row padded to ``width``: ids, loss mask (first tokens cleared), positions."""
    pad = width - len(ids)
    positions = position_ids_from_seq_lengths(seqs + ([pad] if pad else []))
    mask = list(mask) + [0] * pad
    for start, pos in enumerate(positions):
        if pos == 0:
            mask[start] = 0
    return list(ids) + [pad_token_id] * pad, mask, positions


def _round_up(n: int, multiple: int | None) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (unchanged when ``None``)."""
    return -(-n // multiple) * multiple if multiple else n


# ----------------------------------------------------------------------------- boundaries and masks


def position_ids_from_seq_lengths(seq_lengths: Sequence[int]) -> list[int]:
    """Positions restarting at 0 for each sequence: ``[3, 2] -> [0, 1, 2, 0, 1]``."""
    return [p for n in seq_lengths for p in range(n)]


def seq_lengths_from_position_ids(position_ids: torch.Tensor) -> list[list[int]]:
    """Recover each row's sequence lengths from restarting positions.

    A sequence starts wherever the position is 0 (column 0 always starts one).

    Args:
        position_ids: [N, L] (or [L]) positions from ``collate_packed`` or ``collate_padded``.

    Returns:
        For each row, the lengths of its sequences, padding segment included.
    """
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    out = []
    for row in pos:
        starts = (row == 0).nonzero().flatten().tolist()
        if not starts or starts[0] != 0:
            starts = [0, *starts]
        ends = starts[1:] + [row.numel()]
        out.append([e - s for s, e in zip(starts, ends, strict=True)])
    return out


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[N, L] the index of the sequence each token belongs to, counted per row from 0."""
    starts = (position_ids == 0).long()
    starts[:, 0] = 1
    return starts.cumsum(dim=-1) - 1


def cu_seqlens(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cumulative sequence boundaries for varlen attention kernels (flash-attention's layout).

    Args:
        position_ids: [N, L] restarting positions; rows are read one after the other, as if
            flattened into a single row.

    Returns:
        ``cu_seqlens`` [S + 1] int32 (``0, len_0, len_0 + len_1, ...``) and the longest length.
    """
    lengths = [n for row in seq_lengths_from_position_ids(position_ids) for n in row]
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return cu, max(lengths)


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive block-diagonal causal mask that keeps attention inside each packed sequence.

    Token ``i`` may attend to token ``j`` when both lie in the same sequence and ``j <= i``:
    the entry is 0 there and the dtype's lowest value elsewhere. transformers uses a 4D mask as
    given, and adds it to the attention scores (eager) or passes it to SDPA.

    Args:
        position_ids: [N, L] restarting positions (``Sequences.position_ids`` of a packed batch).
        dtype: the model's compute dtype.

    Returns:
        [N, 1, L, L] additive mask (``[1, 1, L, L]`` for one packed row).
    """
    if position_ids.dim() == 1:
        position_ids = position_ids[None]
    seg = segment_ids(position_ids)  # [N, L]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal  # [N, L, L]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
