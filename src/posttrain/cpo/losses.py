"""CPO's losses (with SimPO and AlphaPO): pure functions of summed completion log-probabilities.

CPO (Xu et al. 2024, "Contrastive Preference Optimization", arXiv 2401.08417) is DPO without a
reference model plus a negative log-likelihood term on the chosen completions. SimPO (Meng et
al. 2024, arXiv 2405.14734) takes the mean token log-probability as the reward and asks for a
margin γ; AlphaPO (Gupta et al. 2025, arXiv 2501.03884) reshapes the reward with α. Per pair:

```
ℓ        summed completion log-probability (sigmoid, hinge) or its token mean ℓ / n (ipo, simpo, alphapo)
r(ℓ)     = ℓ if α = 0, else (1 - e^{-αℓ}) / α            AlphaPO's reward shape, any loss type
z        = r_w - r_l   (simpo, alphapo: z - γ/β)
sigmoid, simpo, alphapo:  -(1-ε) log σ(βz) - ε log σ(-βz)
hinge:                    max(0, 1 - βz)
ipo:                      (z - 1/(2β))²
L        = mean_pairs(loss) + cpo_alpha · NLL_w,   NLL_w = -Σ ℓ_w / Σ n_w (chosen tokens, token mean)
```

``LOSS_TYPES`` is the one table of loss types: each row (a ``CPOLossSpec``) holds the per-pair
loss of the margin, whether the log-probabilities are length-normalised, whether the SimPO
margin applies, whether label smoothing is used, and the ``cpo_alpha`` used when none is given.
``cpo_loss`` is the entry point; ``check_loss_settings`` validates a configuration up front.

Choices and departures from the reference (TRL 1.16, experimental CPO):

- ``alphapo`` is its own row (SimPO's loss on length-normalised log-probabilities) whose
  ``cpo_alpha`` *defaults* to 0; the reference rewrites it to ``simpo`` and overwrites
  ``cpo_alpha`` with 0 even when the user set it. Here a ``cpo_alpha`` that is given is kept.
- The AlphaPO reward is ``-expm1(-αℓ) / α`` with the exponent ``-αℓ`` capped at
  ``ALPHA_EXPONENT_CLAMP`` (80, ``e^80`` fits float32; the cap f-DPO's alpha divergence uses),
  so a long completion's summed log-probability (sigmoid, hinge with ``α > 0``) gives a finite
  reward and loss instead of ``inf - inf = NaN``. Past the cap the reward stops changing (no
  gradient): length-normalised loss types are the ones to shape.
- ``label_smoothing`` > 0 with ``hinge`` or ``ipo``, which do not use it, is an error (the
  reference warns and ignores it).
- The two means take their denominators as arguments (``num_pairs``, ``num_tokens``): a trainer
  divides by the optimizer step's pairs and chosen tokens, so accumulation equals one batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.orpo.losses import checked_pair_logps
from posttrain.pairs.logps import ALPHA_EXPONENT_CLAMP, PairLogps

__all__ = ["LOSS_TYPES", "CPOLossOutput", "CPOLossSpec", "check_loss_settings", "cpo_loss", "shaped_reward"]

MarginLoss = Callable[[Tensor, float, float], Tensor]


@dataclass(frozen=True)
class CPOLossSpec:
    """One row of ``LOSS_TYPES``.

    Attributes:
        fn: ``fn(z, beta, label_smoothing) -> [N]`` per-pair losses of the margins ``z``.
        length_normalised: the rewards use the mean token log-probability ``ℓ / n``.
        target_margin: subtract SimPO's ``γ / β`` from the margin.
        uses_label_smoothing: whether ``label_smoothing`` changes the loss.
        default_cpo_alpha: the NLL weight when ``cpo_alpha`` is not given.
        doc: one line: the formula and its source.
    """

    fn: MarginLoss
    length_normalised: bool
    target_margin: bool
    uses_label_smoothing: bool
    default_cpo_alpha: float
    doc: str = ""


@dataclass(frozen=True)
class CPOLossOutput:
    """What ``cpo_loss`` returns; every tensor but ``loss`` is detached.

    Attributes:
        loss: the scalar ``Σ loss / num_pairs + cpo_alpha · NLL_w``, with its gradient.
        nll_loss: the scalar ``NLL_w`` (unweighted).
        chosen_logps: [N] the chosen log-probabilities the rewards use (summed or token mean).
        rejected_logps: [N] the same for the rejected completions.
        chosen_rewards: [N] β·r_w.
        rejected_rewards: [N] β·r_l.
        pair_metrics: per-pair values averaged into the logs (none for CPO).
    """

    loss: Tensor
    nll_loss: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    pair_metrics: dict[str, Tensor]


# --------------------------------------------------------------------------- per-pair losses


def _logistic(z: Tensor, beta: float, eps: float) -> Tensor:
    """``-(1-ε) log σ(βz) - ε log σ(-βz)``: the logistic loss with labels flipped at rate ε."""
    return -(1.0 - eps) * F.logsigmoid(beta * z) - eps * F.logsigmoid(-beta * z)


def _hinge(z: Tensor, beta: float, eps: float) -> Tensor:
    return torch.relu(1.0 - beta * z)


def _ipo(z: Tensor, beta: float, eps: float) -> Tensor:
    return (z - 1.0 / (2.0 * beta)) ** 2


LOSS_TYPES: dict[str, CPOLossSpec] = {
    "sigmoid": CPOLossSpec(
        _logistic,
        length_normalised=False,
        target_margin=False,
        uses_label_smoothing=True,
        default_cpo_alpha=1.0,
        doc="-(1-ε) log σ(βz) - ε log σ(-βz) on summed log-probs + NLL: CPO (Xu et al. 2024).",
    ),
    "hinge": CPOLossSpec(
        _hinge,
        length_normalised=False,
        target_margin=False,
        uses_label_smoothing=False,
        default_cpo_alpha=1.0,
        doc="max(0, 1 - βz) on summed log-probs + NLL: the SLiC hinge (Zhao et al. 2023) without a reference.",
    ),
    "ipo": CPOLossSpec(
        _ipo,
        length_normalised=True,
        target_margin=False,
        uses_label_smoothing=False,
        default_cpo_alpha=1.0,
        doc="(z - 1/(2β))² on mean token log-probs + NLL: IPO (Azar et al. 2023) without a reference.",
    ),
    "simpo": CPOLossSpec(
        _logistic,
        length_normalised=True,
        target_margin=True,
        uses_label_smoothing=True,
        default_cpo_alpha=1.0,
        doc="-(1-ε) log σ(β(z - γ/β)) - ε log σ(-β(z - γ/β)) on mean token log-probs: SimPO (Meng et al. 2024).",
    ),
    "alphapo": CPOLossSpec(
        _logistic,
        length_normalised=True,
        target_margin=True,
        uses_label_smoothing=True,
        default_cpo_alpha=0.0,
        doc="SimPO's loss on the α-shaped reward (1 - e^{-αℓ̄})/α, no NLL by default: AlphaPO (Gupta et al. 2025).",
    ),
}


# --------------------------------------------------------------------------- the reward shape


def shaped_reward(logps: Tensor, alpha: float) -> Tensor:
    """AlphaPO's reward ``r = (1 - e^{-αℓ}) / α``; ``α = 0`` is its limit ``r = ℓ``.

    Computed as ``-expm1(-αℓ) / α`` (accurate for small ``αℓ``) with the exponent capped at
    ``ALPHA_EXPONENT_CLAMP``: the reward stays finite for any ``ℓ`` (``|r| <= e^80 / |α|``)
    and has no gradient past the cap. ``α < 0`` never reaches it (``ℓ <= 0``).

    Args:
        logps: log-probabilities ``ℓ`` (summed or token means), any shape.
        alpha: α, a finite number.
    """
    if alpha == 0.0:
        return logps
    exponent = (-alpha * logps).clamp(max=ALPHA_EXPONENT_CLAMP)
    return -torch.expm1(exponent) / alpha


# --------------------------------------------------------------------------- validation


def check_loss_settings(
    loss_type: str,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    cpo_alpha: float | None = None,
) -> CPOLossSpec:
    """Validate a CPO loss configuration; fail early with the parameter at fault and its fix.

    Returns:
        The loss type's row of ``LOSS_TYPES``.

    Raises:
        ValueError: an unknown loss type (the message lists the valid ones), ``beta <= 0``,
            ``label_smoothing`` outside ``[0, 0.5)`` or > 0 with a loss type that ignores it
            (``hinge``, ``ipo``), a non-finite ``simpo_gamma`` or ``alpha``, or a negative
            ``cpo_alpha``.
    """
    spec = LOSS_TYPES.get(loss_type)
    if spec is None:
        raise ValueError(f"loss_type={loss_type!r} is not supported; use one of {list(LOSS_TYPES)}.")
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"beta={beta} must be a finite number > 0 (0.1 for CPO; SimPO and AlphaPO use 2.5).")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(
            f"label_smoothing={label_smoothing} must lie in [0, 0.5): it is the assumed rate of flipped labels "
            "(0.5 makes the labels carry no preference)."
        )
    if label_smoothing > 0 and not spec.uses_label_smoothing:
        using = [name for name, row in LOSS_TYPES.items() if row.uses_label_smoothing]
        raise ValueError(
            f"label_smoothing={label_smoothing} has no effect with loss_type={loss_type!r}; set label_smoothing=0.0, "
            f"or use a loss type that smooths the labels: {using}."
        )
    for name, value in (("simpo_gamma", simpo_gamma), ("alpha", alpha)):
        if not math.isfinite(value):
            raise ValueError(f"{name}={value} must be a finite number.")
    if cpo_alpha is not None and not (math.isfinite(cpo_alpha) and cpo_alpha >= 0):
        raise ValueError(
            f"cpo_alpha={cpo_alpha} must be a finite number >= 0 (the weight of the chosen completions' NLL), "
            "or None for the loss type's default."
        )
    return spec


# --------------------------------------------------------------------------- entry point


def cpo_loss(
    logps: PairLogps,
    loss_type: str = "sigmoid",
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    alpha: float = 0.0,
    cpo_alpha: float | None = None,
    num_pairs: float | Tensor | None = None,
    num_tokens: float | Tensor | None = None,
) -> CPOLossOutput:
    """The CPO-family loss of a batch of pairs (formulas in the module doc).

    Half-precision log-probabilities are computed in float32.

    Args:
        logps: summed completion log-probabilities with ``chosen_lengths`` and
            ``rejected_lengths`` (the reference fields are not read).
        loss_type: a name of ``LOSS_TYPES``.
        beta: β > 0.
        label_smoothing: ε in [0, 0.5), for the loss types that use it.
        simpo_gamma: γ, SimPO's target reward margin (simpo, alphapo).
        alpha: AlphaPO's reward shape α (0: the log-probability itself).
        cpo_alpha: the NLL weight; ``None`` takes the loss type's ``default_cpo_alpha``.
        num_pairs: the pairs the preference term is averaged over (default: this batch's).
        num_tokens: the chosen completion tokens ``NLL_w`` is averaged over (default: this
            batch's ``Σ n_w``).

    Returns:
        A ``CPOLossOutput``.

    Raises:
        ValueError: a setting ``check_loss_settings`` rejects, a missing length, or mismatched shapes.
    """
    spec = check_loss_settings(loss_type, beta, label_smoothing, simpo_gamma, alpha, cpo_alpha)
    chosen, rejected, n_w, n_l = checked_pair_logps(logps, "CPO")
    used_w, used_l = chosen, rejected  # [N]
    if spec.length_normalised:
        used_w, used_l = chosen / n_w.clamp(min=1.0), rejected / n_l.clamp(min=1.0)
    r_w, r_l = shaped_reward(used_w, alpha), shaped_reward(used_l, alpha)  # [N]
    z = r_w - r_l
    if spec.target_margin:
        z = z - simpo_gamma / beta
    per_pair = spec.fn(z, beta, label_smoothing)  # [N]
    pairs = chosen.shape[0] if num_pairs is None else num_pairs
    tokens = n_w.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    nll = -chosen.sum() / tokens
    weight = spec.default_cpo_alpha if cpo_alpha is None else cpo_alpha
    loss = per_pair.sum() / pairs + weight * nll
    return CPOLossOutput(
        loss=loss,
        nll_loss=nll.detach(),
        chosen_logps=used_w.detach(),
        rejected_logps=used_l.detach(),
        chosen_rewards=(beta * r_w).detach(),
        rejected_rewards=(beta * r_l).detach(),
        pair_metrics={},
    )
