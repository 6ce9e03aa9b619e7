"""A*-PO: pure tensor math.

A*-PO ("Accelerating RL for LLM Reasoning with Optimal Advantage Regression", arXiv 2505.20686)
works in two stages with a binary reward ``r`` in {0, 1}:

1. Before training, ``N`` completions of each prompt are sampled from the reference policy and
   scored; the optimal value is estimated as
   ``V*(x) = beta1 * log( (1/N) sum_j exp(r_j / beta1) )``
   (``value_estimates``). It lies between the mean reward (``beta1 -> inf``) and the best reward
   (``beta1 -> 0``); with every ``r_j = 0`` it is 0.
2. Training samples one completion ``y`` per prompt from the policy and regresses the policy's
   log-ratio to the reference onto the optimal advantage:
   ``loss = mean_i ( beta2 * (log pi(y_i|x_i) - log pi_ref(y_i|x_i)) - (r_i - V*(x_i)) )^2``
   with sequence log-probabilities, summed over the completion's tokens (``regression_loss``).
"""

from __future__ import annotations

import math

import torch

from posttrain.ops.reductions import Normalizers

#: How far from 0 or 1 a binary reward may be (float rounding of a weighted sum).
BINARY_TOLERANCE = 1e-6


def value_estimates(rewards: torch.Tensor, beta1: float) -> torch.Tensor:
    """``V*(x) = beta1 * (logsumexp_j(r_j / beta1) - log N)`` of each prompt.

    Args:
        rewards: [P, N] the rewards of ``N`` reference completions of each of ``P`` prompts.
        beta1: the KL temperature (> 0).

    Returns:
        [P] the value estimates, in the dtype of ``rewards``.
    """
    n = rewards.shape[1]
    return beta1 * (torch.logsumexp(rewards / beta1, dim=1) - math.log(n))


def first_non_binary(rewards: torch.Tensor) -> int | None:
    """The index of the first reward that is neither 0 nor 1 (NaN included), or ``None``.

    Args:
        rewards: [n] rewards.
    """
    ok = ((rewards - 0.0).abs() <= BINARY_TOLERANCE) | ((rewards - 1.0).abs() <= BINARY_TOLERANCE)
    bad = (~ok).nonzero().flatten()
    return int(bad[0]) if bad.numel() else None


def regression_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    beta2: float,
    norms: Normalizers,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A*-PO's squared regression loss of one micro-batch.

    Args:
        logps: [B, T] the policy's per-token log-probabilities (with gradient).
        ref_logps: [B, T] the reference's.
        mask: [B, T] the completion tokens that count.
        advantages: [B] ``r - V*(x)``.
        beta2: the KL temperature of the regression.
        norms: ``norms.sequences`` completions per process and optimizer step (the mean's
            denominator, so accumulated micro-batches sum to the step's mean).

    Returns:
        The loss, and [B] the implicit rewards ``beta2 * (log pi - log pi_ref)(y|x)`` (detached).
    """
    mask = mask.to(logps.dtype)
    implicit = beta2 * ((logps - ref_logps.to(logps.dtype)) * mask).sum(dim=1)  # [B]
    errors = implicit - advantages.to(logps.dtype)
    return (errors**2).sum() / norms.sequences, implicit.detach()
