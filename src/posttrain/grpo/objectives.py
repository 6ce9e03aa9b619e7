"""GRPO policy objectives: pure tensor math.

A ``loss_type`` is resolved in one table, ``LOSS_TYPES``, into two composable pieces:

* a *token term*: the per-token loss from log-probs, old log-probs and advantages;
* a *reduction*: how the masked per-token losses of a micro-batch become one scalar.

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens. ``mask`` is 1 on the
completion tokens that count in the loss.
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


@dataclass(frozen=True)
class LossSpec:
    """How one ``loss_type`` is computed.

    Attributes:
        term: per-token loss ``(logps, old_logps, advantages, eps_low, eps_high) -> [B, T]``.
        reduction: how ``reduce_loss`` averages the per-token losses (see there).
    """

    term: Callable[..., torch.Tensor]
    reduction: str


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
    """Token-level ratio ``pi_theta / pi_old = exp(logp - old_logp)``: [B, T]."""
    return torch.exp(logps - old_logps)


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> torch.Tensor:
    """PPO's clipped surrogate, negated for minimisation (DeepSeekMath eq. 3, per token).

    ``l_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)`` with
    ``r_t = exp(logp_t - old_logp_t)``. When ``old_logps`` is ``logps.detach()`` the ratio is 1,
    the clip is inactive and the gradient is REINFORCE's: ``-A * grad logp_t``.

    Args:
        logps: [B, T] log-probs of the sampled tokens under the current policy.
        old_logps: [B, T] log-probs under the policy that sampled them (no gradient).
        advantages: [B] advantage of each completion.
        eps_low: lower clip range (``epsilon``).
        eps_high: upper clip range (``epsilon_high``, DAPO's clip-higher).

    Returns:
        [B, T] per-token losses.
    """
    ratio = importance_ratio(logps, old_logps)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv
    return -torch.min(unclipped, clipped)


LOSS_TYPES: dict[str, LossSpec] = {
    # DAPO: token-level average over every active token of the accumulated global batch.
    "dapo": LossSpec(term=clipped_surrogate, reduction="token"),
    # GRPO (DeepSeekMath): mean over each sequence's tokens, then over sequences.
    "grpo": LossSpec(term=clipped_surrogate, reduction="sequence"),
}


def reduce_loss(
    per_token: torch.Tensor, mask: torch.Tensor, reduction: str, norms: Normalizers
) -> torch.Tensor:
    """Reduce masked per-token losses to the micro-batch's share of the step's loss.

    Args:
        per_token: [B, T] losses.
        mask: [B, T] 1 on tokens that count.
        reduction: ``"token"``: ``sum(l m) / norms.tokens`` (DAPO: every token of the step
            weighs the same); ``"sequence"``: ``sum_i mean_t(l_it) / norms.sequences`` (GRPO:
            every completion weighs the same); ``"token_local"``: ``sum(l m) / (sum(m) *
            accumulation)`` (BNPO: per micro-batch token mean); ``"fixed_length"``:
            ``sum(l m) / (norms.sequences * max_completion_length)`` (Dr. GRPO).
        norms: the counts of the step.

    Returns:
        The scalar loss.
    """
    mask = mask.to(per_token.dtype)
    total = (per_token * mask).sum()
    if reduction == "token":
        return total / norms.tokens
    if reduction == "sequence":
        per_seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # [B]
        return per_seq.sum() / norms.sequences
    if reduction == "token_local":
        return total / (mask.sum().clamp(min=1.0) * norms.accumulation)
    if reduction == "fixed_length":
        return total / (norms.sequences * norms.max_completion_length)
    raise ValueError(f"Unknown reduction {reduction!r}.")


def policy_loss(
    loss_type: str,
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    norms: Normalizers,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss of one micro-batch, and its clipping statistics.

    Args:
        loss_type: a key of ``LOSS_TYPES``.
        logps, old_logps: [B, T] log-probs (current, and of the sampling policy).
        advantages: [B] advantages.
        mask: [B, T] completion tokens that count.
        eps_low, eps_high: clip range.
        norms: the step's counts, see ``reduce_loss``.

    Returns:
        The scalar loss and ``clip_fractions(...)`` of the batch.
    """
    spec = LOSS_TYPES.get(loss_type)
    if spec is None:
        raise NotImplementedError(
            f"loss_type={loss_type!r} is not implemented; use one of {sorted(LOSS_TYPES)}."
        )
    per_token = spec.term(logps, old_logps, advantages, eps_low, eps_high)
    loss = reduce_loss(per_token, mask, spec.reduction, norms)
    stats = clip_fractions(importance_ratio(logps.detach(), old_logps), advantages, mask, eps_low, eps_high)
    return loss, stats


def clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> dict[str, torch.Tensor]:
    """Which tokens the clip acted on, per completion.

    A token is clipped low when ``r < 1 - eps_low`` and ``A < 0``, high when ``r > 1 + eps_high``
    and ``A > 0`` (only then does the clip stop its gradient).

    Returns:
        ``low``, ``high``, ``region``: [B] fractions of each completion's tokens, and
        ``tokens``: [B] token counts (to weight the fractions into batch means).
    """
    mask = mask.to(ratio.dtype)
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - eps_low) & (adv < 0)).to(ratio.dtype) * mask
    high = ((ratio > 1 + eps_high) & (adv > 0)).to(ratio.dtype) * mask
    tokens = mask.sum(dim=1)
    denom = tokens.clamp(min=1.0)
    return {
        "low": low.sum(dim=1) / denom,
        "high": high.sum(dim=1) / denom,
        "region": (low + high).sum(dim=1) / denom,
        "tokens": tokens,
    }
