"""SFT losses and metrics: pure functions of per-token target log-probabilities.

Layout: ``logps[n, t]`` is the log-probability the model gives the *target* token at ``(n, t)``
and ``mask[n, t]`` (float) is 1 where that token is a target. Both come from the trainer already
aligned (for a row of tokens ``x``, ``logps[:, t - 1] = log p(x_t | x_<t)`` with
``mask = loss_mask[:, 1:]``), so nothing here shifts.

Normalisation: both losses divide by ``num_items``, the number of target tokens in the *whole*
gradient-accumulation batch (all micro-batches, all processes), not in the micro-batch. Summing
the micro-batch losses then gives exactly the loss, and the gradient, of one big batch; this is
the reference's ``num_items_in_batch``.

``SFTConfig.loss_type`` names a row of ``LOSS_TYPES``; resolve it with ``resolve_loss_type``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor, "int | float | torch.Tensor"], torch.Tensor]


def nll_loss(logps: torch.Tensor, mask: torch.Tensor, num_items: int | float | torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the targets, summed and divided by the batch's target count.

    ``L = sum_{n,t} -logp[n,t] * mask[n,t] / num_items``.

    Args:
        logps: [N, L] target log-probabilities.
        mask: [N, L] 1.0 on targets.
        num_items: target tokens in the whole accumulation batch (> 0).

    Returns:
        A scalar.
    """
    _check(logps, mask, num_items)
    return -(logps * mask).sum() / num_items


def dft_loss(logps: torch.Tensor, mask: torch.Tensor, num_items: int | float | torch.Tensor) -> torch.Tensor:
    """Dynamic Fine-Tuning: each token's NLL weighted by its detached probability.

    ``L = sum_{n,t} -sg(exp(logp[n,t])) * logp[n,t] * mask[n,t] / num_items``, so the gradient
    is ``-p * grad(logp)`` per token: SFT's gradient rescaled by the probability, which Wu et al.
    2025 ("On the Generalization of SFT: A Reinforcement Learning Perspective with Reward
    Rectification") derive as the fix of SFT's implicit ``1/p`` reward.

    Departure from the paper: the paper sums over each sequence's tokens and averages over
    sequences (``E_(x,y)[ -sum_t sg(p) log p ]``); this, like the reference (TRL 1.16), averages
    over all target tokens of the accumulation batch, so long sequences weigh more per sequence
    and the scale is ``1 / mean length`` of the paper's.

    Args:
        logps: [N, L] target log-probabilities.
        mask: [N, L] 1.0 on targets.
        num_items: target tokens in the whole accumulation batch (> 0).

    Returns:
        A scalar.
    """
    _check(logps, mask, num_items)
    weight = logps.detach().exp()  # [N, L] sg(p)
    return -(weight * logps * mask).sum() / num_items


LOSS_TYPES: dict[str, LossFn] = {"nll": nll_loss, "dft": dft_loss}

#: Names the reference still accepts, and the loss each now means.
DEPRECATED_LOSS_TYPES = {"chunked_nll": "nll"}


def resolve_loss_type(loss_type: str) -> LossFn:
    """The loss function ``SFTConfig.loss_type`` names.

    ``"chunked_nll"`` is a deprecated alias of ``"nll"`` (the NLL is always computed without
    materialising the logits); it resolves with a ``FutureWarning``.

    Raises:
        ValueError: an unknown name; the message lists the valid ones.
    """
    if loss_type in DEPRECATED_LOSS_TYPES:
        new = DEPRECATED_LOSS_TYPES[loss_type]
        warnings.warn(
            f"loss_type={loss_type!r} is deprecated and means {new!r}; set loss_type={new!r}.",
            FutureWarning,
            stacklevel=2,
        )
        loss_type = new
    if loss_type not in LOSS_TYPES:
        valid = list(LOSS_TYPES) + list(DEPRECATED_LOSS_TYPES)
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {valid}.")
    return LOSS_TYPES[loss_type]


def mean_token_accuracy(correct: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Share of target tokens the model's argmax predicts (0 when there is no target).

    Args:
        correct: [N, L] bool (or 0/1), argmax == target.
        mask: [N, L] 1 on targets.

    Returns:
        A scalar in [0, 1].
    """
    return _masked_mean(correct.to(torch.float32), mask)


def entropy_mean(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean entropy of the predictive distributions over the target tokens (0 when none).

    Args:
        entropy: [N, L] per-token entropy of the model's next-token distribution.
        mask: [N, L] 1 on targets.
    """
    return _masked_mean(entropy.detach().to(torch.float32), mask)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)``, 0 on an empty mask."""
    if values.shape != mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape."
        )
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _check(logps: torch.Tensor, mask: torch.Tensor, num_items: int | float | torch.Tensor) -> None:
    """Fail on mismatched shapes or a non-positive target count."""
    if logps.shape != mask.shape:
        raise ValueError(
            f"logps {tuple(logps.shape)} and mask {tuple(mask.shape)} must have the same shape (both aligned "
            "to the target tokens)."
        )
    if float(num_items) <= 0:
        raise ValueError(
            f"num_items={float(num_items)}: the accumulation batch has no target token, so the loss is undefined. "
            "Check the loss masks (completion_only_loss, assistant_only_loss, truncation) or drop such batches."
        )
