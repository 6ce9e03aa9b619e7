"""Reward modelling's loss and metrics: pure functions of the scores of preference pairs.

Inputs, per batch of ``N`` pairs (every tensor ``[N]``, float): ``chosen`` (r_w) and
``rejected`` (r_l) are the model's scores of the chosen and the rejected sequences, ``margin``
(m) an optional per-pair margin the chosen score must beat the rejected one by.

The loss (Bradley-Terry, with the margin of Llama 2's reward models, arXiv 2307.09288, and the
centering term of arXiv 2312.09244, Eq. 2, weighted by η ``center_rewards_coefficient``):

```
L = -mean(log σ(r_w - r_l - m)) + η * mean((r_w + r_l)^2)
```

Both terms are means over pairs, so ``pair_losses`` returns each pair's share and a trainer may
sum them over any slice of the batch and divide by the pairs of the whole step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["METRIC_NAMES", "pair_losses", "reward_loss", "reward_metrics"]

#: The metrics ``reward_metrics`` returns (the reference's names; ``num_tokens`` is the trainer's).
METRIC_NAMES = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward")


def _check(chosen: Tensor, rejected: Tensor, margin: Tensor | None) -> None:
    if chosen.dim() != 1 or chosen.shape != rejected.shape:
        raise ValueError(
            f"chosen and rejected must be [N] scores of the same N pairs; got shapes {tuple(chosen.shape)} and "
            f"{tuple(rejected.shape)}."
        )
    if margin is not None and margin.shape != chosen.shape:
        raise ValueError(
            f"margin must hold one value per pair, shape {tuple(chosen.shape)}; got {tuple(margin.shape)}."
        )


def pair_losses(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """Each pair's term of the loss: ``-log σ(r_w - r_l - m) + η (r_w + r_l)^2``.

    Args:
        chosen: [N] r_w, scores of the chosen sequences.
        rejected: [N] r_l, scores of the rejected sequences.
        margin: [N] m, or ``None`` for 0.
        center_rewards_coefficient: η, or ``None`` for no centering term.

    Returns:
        [N] per-pair losses (float32 or wider); their mean is the loss.

    Raises:
        ValueError: the shapes do not agree.
    """
    _check(chosen, rejected, margin)
    chosen, rejected = chosen.float(), rejected.float()
    delta = chosen - rejected
    if margin is not None:
        delta = delta - margin.to(delta)
    losses = -F.logsigmoid(delta)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (chosen + rejected).pow(2)
    return losses


def reward_loss(
    chosen: Tensor,
    rejected: Tensor,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> Tensor:
    """The batch's loss: the mean of ``pair_losses`` (a scalar)."""
    return pair_losses(chosen, rejected, margin, center_rewards_coefficient).mean()


@torch.no_grad()
def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """The reference's metrics of a batch of pairs (pass every process's pairs for global values).

    ``accuracy``: share of pairs with r_w > r_l (a tie counts as wrong); ``margin``: mean of
    r_w - r_l; ``min_reward`` / ``mean_reward`` / ``max_reward``: over every score, chosen and
    rejected.

    Raises:
        ValueError: the shapes do not agree, or there is no pair.
    """
    _check(chosen, rejected, None)
    if chosen.numel() == 0:
        raise ValueError("reward_metrics needs at least one pair.")
    chosen, rejected = chosen.double(), rejected.double()
    every = torch.cat([chosen, rejected])
    return {
        "accuracy": (chosen > rejected).double().mean().item(),
        "margin": (chosen - rejected).mean().item(),
        "min_reward": every.min().item(),
        "mean_reward": every.mean().item(),
        "max_reward": every.max().item(),
    }
