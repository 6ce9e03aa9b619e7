"""The KTO family's losses: pure functions of summed completion log-probabilities.

Inputs, per micro-batch of ``N`` unpaired examples (every tensor ``[N]``): ``logps`` (ℓ) are the
policy's log-probabilities of each example's completion, summed over its tokens; ``ref_logps``
(ℓʳ) the same under the reference model; ``labels`` say which examples are *desirable* (True)
and which *undesirable* (False).

Notation: ``u = ℓ - ℓʳ`` is an example's log-ratio, σ the sigmoid, β ``beta``, λ_D and λ_U the
desirable and undesirable weights, and z₀ the KL estimate (``kl_estimate``):

    z₀ = max(0, mean_j [ℓ(y_j' | x_j) - ℓʳ(y_j' | x_j)])

over *mismatched* pairs (a prompt ``x_j`` with another example's completion ``y_j'``), with no
gradient. It is the reference point of the prospect-theory value function: an example is judged
by how far its log-ratio lies above (desirable) or below (undesirable) the policy's typical drift
from the reference.

``LOSS_TYPES`` is the one table of loss types; each row gives the desirable and undesirable
per-example losses:

- ``kto``: desirable λ_D (1 - σ(β(u - z₀))), undesirable λ_U (1 - σ(β(z₀ - u))); uses z₀.
- ``apo_zero_unpaired``: desirable λ_D (1 - σ(βu)), undesirable λ_U σ(βu); no z₀ (APO-zero,
  D'Oosterlinck et al. 2024, on unpaired data).

The micro-batch's loss is the mean of its examples' losses (``kto_loss``); the trainer rescales
it so that gradient accumulation and several processes give the mean over the optimizer step.

``balance_advice`` holds the paper's rule for imbalanced data: λ_D n_D / (λ_U n_U) should lie in
[1, 4/3] (Ethayarajh et al. 2024).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: The paper's range for λ_D n_D / (λ_U n_U): desirable examples weigh at least as much in total
#: as undesirable ones, and at most a third more.
BALANCE_RANGE: tuple[float, float] = (1.0, 4.0 / 3.0)

TermsFn = Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class LossSpec:
    """One row of ``LOSS_TYPES``.

    Attributes:
        terms: ``terms(u, z0, beta) -> (desirable, undesirable)``, each ``[N]``: the unweighted
            loss every example would have if it were desirable, and if it were undesirable.
        uses_kl: whether the loss reads the KL estimate z₀ (and so needs mismatched pairs).
        doc: one line: the formula.
    """

    terms: TermsFn
    uses_kl: bool
    doc: str


def _kto_terms(u: Tensor, z0: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """KTO: 1 - σ(β(u - z₀)) if desirable, 1 - σ(β(z₀ - u)) if undesirable."""
    return 1.0 - torch.sigmoid(beta * (u - z0)), 1.0 - torch.sigmoid(beta * (z0 - u))


def _apo_zero_unpaired_terms(u: Tensor, z0: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """APO-zero, unpaired: 1 - σ(βu) if desirable, σ(βu) if undesirable (no z₀)."""
    s = torch.sigmoid(beta * u)
    return 1.0 - s, s


LOSS_TYPES: dict[str, LossSpec] = {
    "kto": LossSpec(_kto_terms, True, "λ_D(1 - σ(β(u - z₀))) desirable, λ_U(1 - σ(β(z₀ - u))) undesirable"),
    "apo_zero_unpaired": LossSpec(
        _apo_zero_unpaired_terms, False, "λ_D(1 - σ(βu)) desirable, λ_U σ(βu) undesirable"
    ),
}


@dataclass(frozen=True)
class KTOOutput:
    """The loss of a micro-batch and what its metrics need.

    Attributes:
        loss: the mean of ``losses`` (a scalar).
        losses: [N] each example's weighted loss.
        rewards: [N] β u, the implicit reward of each example (no gradient).
        kl: z₀ (a scalar, no gradient); ``None`` for a loss type that does not use it.
    """

    loss: Tensor
    losses: Tensor
    rewards: Tensor
    kl: Tensor | None


def kl_estimate(
    kl_logps: Tensor, ref_kl_logps: Tensor, all_reduce: Callable[[Tensor], Tensor] | None = None
) -> Tensor:
    """z₀ = max(0, mean of ``kl_logps - ref_kl_logps``), detached.

    Args:
        kl_logps: [M] the policy's summed log-probs of mismatched prompt/completion pairs.
        ref_kl_logps: [M] the reference's, of the same pairs.
        all_reduce: sums a ``[2]`` tensor (the difference sum and the pair count) over processes,
            so that z₀ is the mean over every process's pairs; ``None`` on one process.

    Returns:
        A float32 scalar, at least 0, with no gradient.
    """
    diffs = (kl_logps.detach().float() - ref_kl_logps.detach().float()).reshape(-1)
    totals = torch.stack([diffs.sum(), torch.tensor(float(diffs.numel()), device=diffs.device)])
    if all_reduce is not None:
        totals = all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1.0)).clamp(min=0.0)


def kto_loss(
    logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    *,
    loss_type: str = "kto",
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: Tensor | None = None,
) -> KTOOutput:
    """The KTO-family loss of a micro-batch of unpaired examples.

    Args:
        logps: [N] ℓ, the policy's summed completion log-probs.
        ref_logps: [N] ℓʳ, the reference's.
        labels: [N] True for a desirable example, False for an undesirable one.
        loss_type: a key of ``LOSS_TYPES``.
        beta: β > 0.
        desirable_weight: λ_D.
        undesirable_weight: λ_U.
        kl: z₀ from ``kl_estimate``; required when the loss type uses it, ignored otherwise.

    Returns:
        A ``KTOOutput``; ``loss`` is the mean over the ``N`` examples.

    Raises:
        ValueError: an unknown loss type, a missing z₀, or tensors of different lengths.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} is not a KTO loss type; use one of {list(LOSS_TYPES)}.")
    spec = LOSS_TYPES[loss_type]
    if not (logps.shape == ref_logps.shape == labels.shape):
        raise ValueError(
            f"logps {tuple(logps.shape)}, ref_logps {tuple(ref_logps.shape)} and labels {tuple(labels.shape)} "
            "must hold one value per example."
        )
    if spec.uses_kl and kl is None:
        raise ValueError(f"loss_type={loss_type!r} needs the KL estimate z₀: pass kl=kl_estimate(...).")
    u = logps.float() - ref_logps.float()
    z0 = kl.detach().float() if (spec.uses_kl and kl is not None) else u.new_zeros(())
    desirable, undesirable = spec.terms(u, z0, beta)
    labels = labels.to(torch.bool)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    return KTOOutput(losses.mean(), losses, beta * u.detach(), z0 if spec.uses_kl else None)


def balance_advice(
    num_desirable: int, num_undesirable: int, desirable_weight: float, undesirable_weight: float
) -> str | None:
    """The paper's rule for imbalanced data, as advice; ``None`` when the weights fit the data.

    λ_D n_D / (λ_U n_U) should lie in ``BALANCE_RANGE`` ([1, 4/3]). Outside it, the advice names
    the counts, the ratio and the ``desirable_weight`` range that brings it back (keeping
    ``undesirable_weight``).

    Args:
        num_desirable: n_D, the desirable examples of the training set.
        num_undesirable: n_U, the undesirable ones.
        desirable_weight: λ_D.
        undesirable_weight: λ_U.
    """
    if num_desirable == 0 or num_undesirable == 0:
        if num_desirable == num_undesirable:
            return None
        only, missing = ("desirable", "undesirable") if num_undesirable == 0 else ("undesirable", "desirable")
        return (
            f"The training set holds only {only} examples ({num_desirable + num_undesirable} of them, no {missing} "
            f"one), so KTO learns from one side of the value function only. Add {missing} examples (label="
            f"{missing == 'desirable'}) if you have them."
        )
    desirable_total = desirable_weight * num_desirable
    undesirable_total = undesirable_weight * num_undesirable
    if undesirable_total == 0:
        return None
    ratio = desirable_total / undesirable_total
    low, high = BALANCE_RANGE
    if low <= ratio <= high:
        return None
    lo = low * undesirable_weight * num_undesirable / num_desirable
    hi = high * undesirable_weight * num_undesirable / num_desirable
    return (
        f"The training set has {num_desirable} desirable and {num_undesirable} undesirable examples; with "
        f"desirable_weight={desirable_weight} and undesirable_weight={undesirable_weight}, desirable_weight * "
        f"{num_desirable} / (undesirable_weight * {num_undesirable}) = {ratio:.3g}, outside the range [1, 4/3] the "
        f"KTO paper recommends. Set desirable_weight between {lo:.3g} and {hi:.3g} (e.g. {(lo + hi) / 2:.3g}) with "
        f"undesirable_weight={undesirable_weight}."
    )
