"""Padding token lists into batches."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(
    sequences: list[list[int]], pad_token_id: int, multiple_of: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists to the longest one (rounded up to ``multiple_of``).

    Returns:
        ``ids`` [B, L] and ``mask`` [B, L] (1 on real tokens).
    """
    longest = max((len(s) for s in sequences), default=0)
    if multiple_of:
        longest = -(-longest // multiple_of) * multiple_of
    ids = torch.full((len(sequences), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            ids[i, longest - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[i, longest - len(seq) :] = 1
    return ids, mask


def right_pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different lengths as one ``[N, max length]`` tensor filled with ``value`` past each end."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(list(r), dtype=dtype)
    return out
