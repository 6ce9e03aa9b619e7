"""Loss reductions and their normalisers: how the masked per-token losses of a micro-batch
become its share of an optimizer step's scalar loss.

Every trainer divides by counts taken over the whole optimizer step (``Normalizers``), so that
summing the micro-batch losses over gradient accumulation and averaging gradients over
processes (DDP) gives the average over the step, for token-level and sequence-level losses
alike: 1 x 8 accumulation gives the same update as 8 x 1. Shapes: ``B`` rows, ``T`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normalizers:
    """The counts a micro-batch's summed loss may be divided by.

    Each is scaled so that summing the micro-batch losses over gradient accumulation and
    averaging gradients over processes (DDP) gives the average over the optimizer step.

    Attributes:
        tokens: loss-counted completion tokens of the optimizer step over all processes,
            divided by the number of processes.
        sequences: completions per process per optimizer step.
        accumulation: micro-batches per optimizer step.
        max_completion_length: the generation limit (Dr. GRPO's constant).
    """

    tokens: float = 1.0
    sequences: float = 1.0
    accumulation: int = 1
    max_completion_length: int = 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its masked positions: [B, T] -> [B] (0 for an empty row)."""
    return (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def _token_global(per_token: torch.Tensor, mask: torch.Tensor, norms: Normalizers) -> torch.Tensor:
    """DAPO: ``sum(l m) / norms.tokens``; every token of the step weighs the same."""
    return (per_token * mask).sum() / norms.tokens


def _sequence_mean(per_token: torch.Tensor, mask: torch.Tensor, norms: Normalizers) -> torch.Tensor:
    """GRPO: ``sum_i mean_t(l_it) / norms.sequences``; every completion weighs the same."""
    return masked_mean(per_token, mask).sum() / norms.sequences


def _token_local(per_token: torch.Tensor, mask: torch.Tensor, norms: Normalizers) -> torch.Tensor:
    """BNPO: ``sum(l m) / (sum(m) * accumulation)``; the micro-batch's token mean."""
    return (per_token * mask).sum() / (mask.sum().clamp(min=1.0) * norms.accumulation)


def _fixed_length(per_token: torch.Tensor, mask: torch.Tensor, norms: Normalizers) -> torch.Tensor:
    """Dr. GRPO: ``sum(l m) / (norms.sequences * max_completion_length)``."""
    return (per_token * mask).sum() / (norms.sequences * norms.max_completion_length)


def _sequence_sum(per_token: torch.Tensor, mask: torch.Tensor, norms: Normalizers) -> torch.Tensor:
    """LUSPO: ``sum_i sum_t(l_it) / norms.sequences``; each sequence's loss scaled by its length."""
    return (per_token * mask).sum() / norms.sequences


REDUCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor, Normalizers], torch.Tensor]] = {
    "token": _token_global,
    "sequence": _sequence_mean,
    "token_local": _token_local,
    "fixed_length": _fixed_length,
    "sequence_sum": _sequence_sum,
}


#: Reductions that sum the loss over tokens: a completion weighs in proportion to its length.
TOKEN_SUMMED_REDUCTIONS = frozenset({"token", "token_local", "fixed_length"})


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, reduction: str, norms: Normalizers
) -> torch.Tensor:
    """Reduce masked per-token losses to the micro-batch's share of the step's loss.

    Args:
        per_token: [B, T] losses.
        mask: [B, T] 1 on tokens that count.
        reduction: a key of ``REDUCTIONS``: ``"token"`` (DAPO), ``"sequence"`` (GRPO),
            ``"token_local"`` (BNPO), ``"fixed_length"`` (Dr. GRPO), ``"sequence_sum"`` (LUSPO).
            A fully masked row contributes 0.
        norms: the counts of the step.

    Returns:
        The scalar loss.
    """
    reduce = REDUCTIONS.get(reduction)
    if reduce is None:
        raise ValueError(f"Unknown reduction {reduction!r}; use one of {sorted(REDUCTIONS)}.")
    return reduce(per_token, mask.to(per_token.dtype), norms)
