"""Asynchronous GRPO: pure tensor math.

The batch trained on was sampled by a sampler ``mu`` (older weights) and is scored under the
trained policy ``pi``. With ``r = pi / mu`` per token and the masked importance weight of the
paper index ("Masked Importance Sampling"), ``f(r) = r`` inside ``[C_min, C_max]`` and ``0``
outside:

- **Score centering** ("Score Centering Stabilizes Off-policy RL", the default objective). The
  gradient is ``-E_{o ~ mu}[ A (f(r_t) grad log pi(o_t) - E_{v ~ mu}[f(r_v) grad log pi(v)]) ]``:
  the sampler's expected score is subtracted at each position, so a constant advantage leaves
  the policy unmoved in expectation. The inner expectation runs over the sampler's top ``K``
  tokens ``H``, whose log-probs it reports; on the rest of the vocabulary the sampler is modelled
  as the policy rescaled to the remaining mass, ``mu(v) = rho pi(v)`` with
  ``rho = (1 - sum_H mu) / (1 - sum_H pi)``. For ``v`` in ``H``, ``mu(v) f(r_v) = pi(v) [r_v in
  bounds]``; the tail's ``sum mu(v) f(r_v) grad log pi(v) = [1/rho in bounds] grad sum_tail pi =
  -[1/rho in bounds] sum_H pi(v) grad log pi(v)``. So the per-token surrogate, whose gradient is
  the formula, is ``sg(f(r_t)) log pi(o_t) - sum_H sg(c_v) log pi(v)`` with
  ``c_v = pi(v) ([r_v in bounds] - [1/rho in bounds])``.
- **The clipped objective** (``score_centering=False``): PPO's token-level clip of ``r`` against
  ``[1 - epsilon, 1 + epsilon_high]``, tokens with ``r`` outside ``[C_min, C_max]`` masked out.

With a truncated sampler (top-k / top-p / min-p) every log-prob here, the policy's and the
sampler's, is of the distribution restricted to the position's support (the paper index's Keep
Sampling Mask, ``ops/support.py``); the top slots past a support's size carry ``-inf`` and count
for nothing, and the tail is the rest of the support.

Both losses are summed over the counted tokens and divided by the step's token count (as the
reference's asynchronous trainer does). The advantages are the reference's: ``(r - mean_g) /
(std_g + 1e-8)`` with the population standard deviation of each group.
"""

from __future__ import annotations

import torch

from posttrain.ops.reductions import Normalizers

#: The reference's constant in the advantage's denominator.
ADVANTAGE_EPS = 1e-8
#: The floor of the policy's tail mass (the denominator of ``rho``).
TAIL_FLOOR = 1e-6


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``(r - mean_g) / (std_g + 1e-8)`` with each group's population standard deviation.

    Args:
        rewards: [N] weighted rewards, groups of ``group`` consecutive rows.
    """
    if rewards.numel() % group:
        raise ValueError(f"{rewards.numel()} rewards are not whole groups of {group}.")
    grouped = rewards.view(-1, group)
    mean = grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True, unbiased=False)
    return ((grouped - mean) / (std + ADVANTAGE_EPS)).flatten()


def _in_bounds(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (ratio >= low) & (ratio <= high)


def score_centred_loss(
    logps: torch.Tensor,
    top_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    sampler_top_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_min: float,
    clip_max: float,
    norms: Normalizers,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The score-centred surrogate of one micro-batch (see the module docstring).

    Args:
        logps: [B, T] the policy's log-probs of the sampled tokens (with gradient).
        top_logps: [B, T, K] the policy's log-probs of the sampler's top tokens (with gradient).
        sampler_logps: [B, T] the sampler's log-probs of the sampled tokens.
        sampler_top_logps: [B, T, K] the sampler's log-probs of its top tokens.
        advantages: [B]; mask: [B, T] the counted tokens.
        clip_min, clip_max: the masked importance weight's bounds.
        norms: ``norms.tokens``, the step's counted tokens per process.

    Returns:
        The loss and, per token, ``ratio`` (``pi / mu``) and ``masked`` (the token's weight is 0).
    """
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps.detach() - sampler_logps.to(logps.dtype))  # [B, T]
    inside = _in_bounds(ratio, clip_min, clip_max)
    weight = ratio * inside  # f(r_t)
    # top slots past a truncated support's size are no tokens of the sampler (log-prob -inf)
    valid = torch.isfinite(sampler_top_logps).to(top_logps.dtype)  # [B, T, K]
    p_top = top_logps.detach().exp() * valid  # [B, T, K]
    q_top = sampler_top_logps.to(p_top.dtype).exp()
    tail_q = (1.0 - q_top.sum(dim=-1)).clamp(min=0.0)  # [B, T]
    tail_p = (1.0 - p_top.sum(dim=-1)).clamp(min=TAIL_FLOOR)
    tail_ratio = tail_p / tail_q.clamp(min=torch.finfo(tail_q.dtype).tiny)  # 1 / rho: pi / mu on the tail
    tail_inside = _in_bounds(tail_ratio, clip_min, clip_max) & (tail_q > 0)
    top_ratio = p_top / q_top.clamp(min=torch.finfo(q_top.dtype).tiny)
    coef = p_top * (
        _in_bounds(top_ratio, clip_min, clip_max).to(p_top.dtype) - tail_inside.unsqueeze(-1).to(p_top.dtype)
    )
    centred = weight * logps - (coef * top_logps.masked_fill(valid == 0, 0.0)).sum(dim=-1)  # [B, T]
    per_token = -advantages.to(logps.dtype).unsqueeze(1) * centred
    loss = (per_token * mask).sum() / norms.tokens
    return loss, {"ratio": ratio, "masked": ~inside}


def masked_clipped_loss(
    logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    clip_min: float,
    clip_max: float,
    norms: Normalizers,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped objective against the sampler, tokens outside ``[clip_min, clip_max]`` masked.

    Returns:
        The loss and, per token, ``ratio``, ``masked``, and the clip indicators of the tokens that
        count: ``low`` (``r < 1 - epsilon_low`` with ``A < 0``) and ``high`` (``r > 1 + epsilon_high``
        with ``A > 0``).
    """
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - sampler_logps.to(logps.dtype))  # [B, T], with gradient
    adv = advantages.to(logps.dtype).unsqueeze(1)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    inside = _in_bounds(ratio.detach(), clip_min, clip_max)
    loss = (per_token * mask * inside).sum() / norms.tokens
    r = ratio.detach()
    return loss, {
        "ratio": r,
        "masked": ~inside,
        "low": (r < 1.0 - epsilon_low) & (adv < 0) & inside,
        "high": (r > 1.0 + epsilon_high) & (adv > 0) & inside,
    }
