"""RLOO and REINFORCE++: pure tensor math.

REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
Optimization for Learning from Human Feedback in LLMs", arXiv 2402.14740) samples ``G``
completions per prompt and gives each the baseline of the *other* completions' mean reward::

    A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_j r_j)

The reward of a completion is its weighted task reward (optionally clipped to
``reward_clip_range``) minus the KL penalty summed over its tokens, estimated with the
sampling policy's log-probs: ``r_i = clip(sum_k w_k R_ik) - beta * sum_t (log pi_old - log
pi_ref)(y_i,t)``. REINFORCE++ (Hu 2025, arXiv 2501.03262) normalises the advantages over the
whole batch: ``(A - mean A) / (std A + 1e-4)`` (``normalize_advantages``).

The policy term is PPO's clipped surrogate on one importance ratio per completion, the ratio of
the completion's probabilities (sum of the token log-ratios)::

    rho_i = exp(sum_t log pi(y_i,t) - sum_t log pi_old(y_i,t))
    loss  = -mean_i min(rho_i A_i, clip(rho_i, 1 - eps, 1 + eps_high) A_i)

Conventions follow the reference so that numbers compare: Bessel's standard deviation,
``1e-4`` added to it, the KL summed over the tokens that count in the loss. Shapes: ``N``
completions (grouped consecutively by prompt), ``F`` reward functions, ``B`` rows of a
micro-batch, ``T`` completion tokens.
"""

from __future__ import annotations

import torch

from posttrain.ops.reductions import Normalizers
from posttrain.rewards.runner import weighted_sum

#: Added to the batch standard deviation by ``normalize_advantages`` (as the reference does).
EPS = 1e-4


def leave_one_out(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each completion's reward minus the mean reward of the other completions of its prompt.

    Args:
        rewards: [N] rewards, grouped consecutively by prompt.
        group_size: completions per prompt ``G`` (at least 2).

    Returns:
        [N] advantages ``r_i - (sum_g r - r_i) / (G - 1)``.
    """
    if group_size < 2:
        raise ValueError(
            f"The leave-one-out baseline needs at least 2 completions per prompt, got {group_size}."
        )
    if rewards.shape[0] % group_size != 0:
        raise ValueError(
            f"{rewards.shape[0]} completions do not form whole groups of num_generations={group_size}."
        )
    grouped = rewards.view(-1, group_size)  # [P, G]
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)  # [P, G]
    return (grouped - others).flatten()


def normalize_batch(advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE++'s global normalisation: ``(A - mean A) / (std A + EPS)`` over the batch (Bessel).

    A batch of one completion has no spread: it is only centred (its advantage becomes 0).
    """
    centred = advantages - advantages.mean()
    if advantages.numel() < 2:
        return centred
    return centred / (advantages.std() + EPS)


def rloo_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    kl_sums: torch.Tensor | None = None,
    beta: float = 0.0,
    clip_range: tuple[float, float] | None = None,
    normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The advantages of a generation batch (see the module docstring).

    Args:
        rewards: [N, F] per-function rewards, NaN where a function returned ``None``.
        weights: [F] reward weights.
        group_size: completions per prompt.
        kl_sums: [N] ``sum_t (log pi_old - log pi_ref)`` of each completion over its counted
            tokens; ``None`` when ``beta == 0``.
        beta: the KL coefficient.
        clip_range: ``(low, high)`` bounds of the weighted task reward, or ``None``.
        normalize: REINFORCE++'s batch normalisation.

    Returns:
        [N] advantages, and ``{"frac_reward_zero_std": ...}``: the fraction of completions whose
        group's task rewards all agree (measured before the KL penalty).
    """
    task = weighted_sum(rewards, weights)  # [N]
    if clip_range is not None:
        task = task.clamp(min=clip_range[0], max=clip_range[1])
    total = task if kl_sums is None or beta == 0.0 else task - beta * kl_sums.to(task.dtype)
    advantages = leave_one_out(total, group_size)
    if normalize:
        advantages = normalize_batch(advantages)
    spread = task.view(-1, group_size).std(dim=1)  # [P]
    zero = torch.isclose(spread, torch.zeros_like(spread)).repeat_interleave(group_size)
    return advantages, {"frac_reward_zero_std": zero.float().mean().item()}


def kl_sums(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum_t (log pi_old - log pi_ref)`` over each completion's counted tokens: [B, T] -> [B]."""
    return ((old_logps - ref_logps) * mask).sum(dim=1)


def sequence_clipped_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    norms: Normalizers,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate on one ratio per completion (the module docstring's ``loss``).

    Args:
        logps: [B, T] log-probs of the sampled tokens under the policy (with gradient).
        old_logps: [B, T] the same under the sampling policy (``logps.detach()`` on-policy).
        advantages: [B] advantages.
        mask: [B, T] 1 on the tokens that count.
        epsilon_low, epsilon_high: the clipping range ``[1 - eps_low, 1 + eps_high]``.
        norms: ``norms.sequences`` completions in the whole optimizer step (the mean over them).

    Returns:
        The loss (this micro-batch's share of the step's mean) and [B] per-completion
        statistics: ``low`` / ``high`` (1 where the ratio was clipped below with a negative
        advantage / above with a positive one), ``region`` (either), ``log_ratio``.
    """
    mask = mask.to(logps.dtype)
    log_ratio = ((logps - old_logps) * mask).sum(dim=1)  # [B]
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype)
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_completion = -torch.minimum(ratio * adv, clipped * adv)  # [B]
    loss = per_completion.sum() / norms.sequences
    r = ratio.detach()
    low = ((r < 1.0 - epsilon_low) & (adv < 0)).to(logps.dtype)
    high = ((r > 1.0 + epsilon_high) & (adv > 0)).to(logps.dtype)
    stats = {"low": low, "high": high, "region": torch.maximum(low, high), "log_ratio": log_ratio.detach()}
    return loss, stats
