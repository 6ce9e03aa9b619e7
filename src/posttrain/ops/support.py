"""The sampler's truncated support: top-k, top-p and min-p as a mask, and log-probs renormalised on it.

A sampler with ``top_k``, ``top_p`` or ``min_p`` draws each token from a truncated support
``S_t``, the tokens left after the filters (applied, as ``generation/decode.py`` applies them, to
the temperature-scaled scores: top-k, then top-p, then min-p). Its distribution is the softmax
restricted to ``S_t``. The paper index's Keep Sampling Mask (DeepSeek-V3.2) renormalises the
policy on the same support, ``log pi_S(o_t) = z_{o_t} - logsumexp_{v in S_t} z_v``, so that the
importance ratio ``pi_S / mu_S`` compares two distributions over the same tokens; without it the
ratio is biased low and the gradient keeps moving mass to tokens the sampler never draws.

A support is carried as token ids padded with ``-1``: ``[..., M]`` with ``M`` the largest
support in the batch. Everything here is pure tensor math.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: The id that pads a support's token ids.
PAD_ID = -1


@dataclass(frozen=True)
class Truncation:
    """The sampler's filters (``GRPOConfig`` semantics): ``top_k`` 0 and ``top_p`` 1.0 are off,
    ``min_p`` ``None`` (or 0) is off."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None

    @property
    def active(self) -> bool:
        """Whether any filter truncates the distribution."""
        return bool(self.top_k) or self.top_p < 1.0 or bool(self.min_p)


def truncate_scores(
    scores: torch.Tensor, top_k: int | None, top_p: float | None, min_p: float | None
) -> torch.Tensor:
    """Scores [N, V] (temperature already applied) with the tokens the filters remove at ``-inf``.

    Top-k keeps the ``top_k`` highest scores (ties with the k-th kept); top-p keeps the smallest
    set of highest scores whose probability reaches ``top_p`` (at least one token); min-p removes
    the tokens whose probability is below ``min_p`` times the highest (never the highest). Each
    filter reads the scores the previous one left.
    """
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1]))[0][..., -1, None]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[..., -1:] = False  # keep at least one token
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    if min_p:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def support_mask(scores: torch.Tensor, targets: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """[N, V] bool: the tokens the sampler could draw at each position, the drawn one always included
    (a token sampled was in the support; a teacher-forced recomputation that rounds it out at the
    boundary must not give it probability zero)."""
    kept = torch.isfinite(truncate_scores(scores, truncation.top_k, truncation.top_p, truncation.min_p))
    return kept.scatter(1, targets.unsqueeze(1), True)


def support_ids(kept: torch.Tensor) -> torch.Tensor:
    """[N, V] bool -> [N, M] the kept token ids in increasing order, padded with ``PAD_ID``."""
    count = kept.sum(dim=1)
    width = max(int(count.max().item()) if count.numel() else 0, 1)
    vocab = torch.arange(kept.shape[1], device=kept.device)
    keys = torch.where(kept, vocab, vocab + kept.shape[1])  # kept ids first, in order
    ids = keys.topk(width, dim=1, largest=False).values
    return torch.where(torch.arange(width, device=kept.device) < count.unsqueeze(1), ids, PAD_ID)


def pad_support(ids: list[torch.Tensor]) -> torch.Tensor:
    """Row blocks of support ids [n_i, M_i] -> one [sum n_i, max M_i], padded with ``PAD_ID``."""
    width = max(t.shape[1] for t in ids)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD_ID) for t in ids])


def truncated_topk(
    scores: torch.Tensor, targets: torch.Tensor, k: int, truncation: Truncation
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampler's report on its truncated distribution, from its scaled scores [N, V].

    Returns:
        ``(logps [N], top_logps [N, k], top_ids [N, k], support [N, M])``: the drawn token's
        log-prob and the ``k`` most likely tokens' under the softmax restricted to the support
        (slots past the support's size have log-prob ``-inf``), and the support's ids.
    """
    kept = support_mask(scores, targets, truncation)
    masked = scores.masked_fill(~kept, -math.inf)
    log_norm = torch.logsumexp(masked, dim=-1, keepdim=True)  # [N, 1]
    logps = masked.gather(1, targets.unsqueeze(1)).squeeze(1) - log_norm.squeeze(1)
    top = masked.topk(min(k, masked.shape[-1]), dim=-1)
    return logps, top.values - log_norm, top.indices, support_ids(kept)


def support_log_mass(logps_at_support: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """``log sum_{v in S} pi(v)`` per position from the policy's log-probs at the support's ids.

    Args:
        logps_at_support: [..., M] ``log pi`` at ``support``'s ids (any value at the padding).
        support: [..., M] token ids, ``PAD_ID`` past each support's size.
    """
    return torch.logsumexp(logps_at_support.masked_fill(support == PAD_ID, -math.inf), dim=-1)


def gather_ids(support: torch.Tensor) -> torch.Tensor:
    """Support ids that are safe to gather with (padding read as token 0, to be masked)."""
    return support.clamp(min=0)
