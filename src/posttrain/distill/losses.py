"""Pure losses of self-distillation (SDFT) on per-token tensors; the full-vocabulary divergences
are ``ops/divergence.py``'s.

``distillation_mode`` selects how the per-token divergence between the student and the teacher
(the same model reading a privileged context) is estimated (``MODES``):

- ``full_logits``: the generalised JSD over the whole vocabulary (``ops/divergence.py``);
- ``topk_logits``: the JSD over the student's ``k`` most likely tokens, both distributions
  renormalised on them, or, with ``add_tail``, with one more category holding the rest of each
  distribution's mass (``topk_divergence``);
- ``sampled_token``: the single-sample estimate of the reverse KL's gradient,
  ``sg(log p_S(y) - log p_T(y)) * log p_S(y)`` at the sampled token ``y`` (``alpha = 1`` only).

Off-policy micro-batches (``num_iterations > 1``) weight each token by the truncated importance
ratio ``min(p_S(y) / p_old(y), clip)``, without gradient. The loss is the mean over samples of
each sample's token mean (the reference's reduction).
"""

from __future__ import annotations

import torch

from posttrain.ops.divergence import divergence_from_logps

__all__ = [
    "MODES",
    "iw_opd_token_losses",
    "iw_opd_weights",
    "per_sample_means",
    "sampled_token_loss",
    "topk_divergence",
    "truncated_is_weights",
]

MODES = {
    "full_logits": "the generalised JSD over the whole vocabulary",
    "topk_logits": "the JSD over the student's distillation_topk tokens (renormalised, or with a tail bucket)",
    "sampled_token": "the sampled token's estimate of the reverse KL's gradient (distillation_alpha=1)",
}

_TINY = 1e-30  # the tail of a top-k that holds (nearly) all the mass: log of this, not of 0
_NO_MASS = -1e30  # the log-prob of a column that does not count: exp() is 0, differences stay finite


def _with_tail(logps: torch.Tensor) -> torch.Tensor:
    """[n, k] log-probs of k tokens -> [n, k + 1] with the rest of the mass as the last category."""
    covered = torch.logsumexp(logps, dim=-1, keepdim=True)  # log of the top-k's mass, <= 0
    tail = torch.log((-torch.expm1(covered.clamp(max=0.0))).clamp_min(_TINY))
    return torch.cat([logps, tail], dim=-1)


def topk_divergence(
    student_logps: torch.Tensor,
    teacher_logps: torch.Tensor,
    alpha: float,
    add_tail: bool,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The JSD_alpha of the two distributions reduced to the same k tokens: [n, k] x 2 -> [n].

    Args:
        student_logps, teacher_logps: each model's full-vocabulary log-probs of the same k token
            ids per position (the student's top k, say).
        alpha: 0 forward KL, 1 reverse KL, in between the generalised JSD.
        add_tail: keep the rest of each distribution's mass as a (k+1)-th category; otherwise
            renormalise each over the k tokens.
        valid: [n, k] which of the k columns count (``None``: all); a token listed twice (two
            supports joined) counts once, its other column holding no mass.
    """
    if valid is not None:
        student_logps = student_logps.masked_fill(~valid, _NO_MASS)
        teacher_logps = teacher_logps.masked_fill(~valid, _NO_MASS)
    if add_tail:
        s, t = _with_tail(student_logps), _with_tail(teacher_logps)
    else:
        s = student_logps - torch.logsumexp(student_logps, dim=-1, keepdim=True)
        t = teacher_logps - torch.logsumexp(teacher_logps, dim=-1, keepdim=True)
    return divergence_from_logps(s, t.detach(), alpha)


def sampled_token_loss(student_logps: torch.Tensor, teacher_logps: torch.Tensor) -> torch.Tensor:
    """``sg(log p_S(y) - log p_T(y)) * log p_S(y)``: its gradient is the reverse KL's, sampled at ``y``."""
    return (student_logps - teacher_logps).detach() * student_logps


def truncated_is_weights(student_logps: torch.Tensor, old_logps: torch.Tensor, clip: float) -> torch.Tensor:
    """``min(exp(log p_S(y) - log p_old(y)), clip)`` per token, without gradient."""
    return torch.exp(student_logps.detach() - old_logps).clamp(max=clip)


def per_sample_means(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over its masked tokens: [B, T] x 2 -> [B] (0 for a row with none)."""
    return (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def iw_opd_weights(
    advantages: torch.Tensor, mask: torch.Tensor, gamma: float, epsilon: float
) -> torch.Tensor:
    """IW-OPD's position weights: ``1 + gamma (1 - sum_{k<t} |a_k| / (sum_k |a_k| + epsilon))``.

    Args:
        advantages: [n, T] ``log p_T(y_t) - log p_rollout(y_t)`` (0 outside the mask).
        mask: [n, T] the completion tokens that count.

    Returns:
        [n, T] weights: ``1 + gamma`` up to the first discrepancy, falling toward 1 as the prefix's
        share of the sample's total discrepancy grows; no gradient.
    """
    size = (advantages.abs() * mask).detach()
    before = torch.cumsum(size, dim=-1) - size  # sum over k < t
    total = size.sum(dim=-1, keepdim=True)
    return 1.0 + gamma * (1.0 - before / (total + epsilon))


def iw_opd_token_losses(
    student_logps: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``-w_t a_t log p_S(y_t)``: a policy gradient with the teacher's log-ratio as the advantage."""
    return -student_logps * (weights * advantages).detach()
