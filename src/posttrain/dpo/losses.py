"""The DPO family's losses: pure functions of summed completion log-probabilities.

Inputs, per batch of ``N`` preference pairs (every tensor ``[N]``, float), are gathered in
``PairLogps``: ``chosen`` (ℓ_w) and ``rejected`` (ℓ_l) are the policy's log-probabilities of the
chosen and rejected completions, summed over the completion tokens; ``ref_chosen`` and
``ref_rejected`` (ℓʳ) are the same for the reference model; ``chosen_lengths`` and
``rejected_lengths`` (n_w, n_l) count the completion tokens.

Notation: ``u = ℓ - ℓʳ`` is a completion's log-ratio (``u_w`` chosen, ``u_l`` rejected), σ the
sigmoid, β ``beta`` and ε ``label_smoothing``. The f-divergence regulariser (f-DPO, Wang et al.
2023, "Beyond Reverse KL") replaces each log-ratio by a score ``s(u) = f'(e^u)`` (constants
dropped), see ``f_divergence_score``; ``Δ = s_w - s_l`` (``u_w - u_l`` with the default
``reverse_kl``).

``LOSS_TYPES`` is the one table of loss types: each row (a ``LossSpec``) holds the per-pair loss
function and what it needs (the reference, label smoothing) and accepts (an f-divergence). A
list of loss types with weights gives ``sum_k w_k * mean(L_k)`` (MPO-style mixtures).
``dpo_loss`` is the entry point; ``check_loss_settings`` validates a configuration up front.

Helpers for the trainer: ``wpo_weights`` (WPO, Zhou et al. 2024: per-sequence weights whose
products per pair multiply every per-pair loss), ``ld_logps`` (LD-DPO, Liu et al. 2024: the
summed log-probability with the tokens beyond the pair's shared length down-weighted) and
``RunningMean`` (the BCO reward shift δ, Jung et al. 2024).

Departures from the reference (TRL 1.16):

- ``sigmoid`` applies ``label_smoothing`` (conservative DPO); the reference ignores it there.
- ``robust`` (and ``udpo``) refuse ``label_smoothing >= 0.5`` where the reference only warns:
  the loss divides by ``1 - 2ε``.
- ``bco_pair`` takes the paper's reward shift δ (``bco_delta``); 0.0, the default, is the
  reference's loss, which omits it.
- ``udpo`` is not in the reference.
- ``sft`` reads ``chosen`` as given; with LD-DPO the reference's SFT term uses the plain
  (un-weighted) token log-probabilities, so a trainer mixing the two should give those.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.pairs.logps import ALPHA_EXPONENT_CLAMP, PairLogps

#: The f-divergences ``f_divergence_type`` may name (f-DPO).
F_DIVERGENCE_TYPES: tuple[str, ...] = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

# ``alpha_divergence`` clamps its exponent ``(α - 1) u`` at ALPHA_EXPONENT_CLAMP (pairs/logps.py).


@dataclass(frozen=True)
class LossInputs:
    """Everything a per-pair loss function of ``LOSS_TYPES`` reads.

    Attributes:
        logps: the batch's log-probabilities.
        chosen_scores: s_w, the f-divergence scores of the chosen log-ratios (``None`` without a
            reference).
        rejected_scores: s_l, the same for the rejected log-ratios.
        beta: β > 0.
        label_smoothing: ε.
        discopop_tau: τ of ``discopop``.
        bco_delta: δ of ``bco_pair``, the running mean of the rewards (0 = the reference's).
        sft_tokens: the token count ``sft`` divides by; ``None``: the batch's chosen tokens.
    """

    logps: PairLogps
    chosen_scores: Tensor | None
    rejected_scores: Tensor | None
    beta: float
    label_smoothing: float = 0.0
    discopop_tau: float = 0.05
    bco_delta: float = 0.0
    sft_tokens: Tensor | float | None = None

    @property
    def chosen_logratios(self) -> Tensor:
        """u_w = ℓ_w - ℓʳ_w."""
        return self.logps.chosen - _require(self.logps.ref_chosen, "ref_chosen")

    @property
    def rejected_logratios(self) -> Tensor:
        """u_l = ℓ_l - ℓʳ_l."""
        return self.logps.rejected - _require(self.logps.ref_rejected, "ref_rejected")

    @property
    def margin(self) -> Tensor:
        """Δ = s_w - s_l."""
        return _require(self.chosen_scores, "chosen_scores") - _require(
            self.rejected_scores, "rejected_scores"
        )

    def lengths(self, loss_type: str) -> tuple[Tensor, Tensor]:
        """(n_w, n_l), each clamped at 1 so an empty completion divides by 1.

        Raises:
            ValueError: a length is missing; the message names ``loss_type``.
        """
        n_w, n_l = self.logps.chosen_lengths, self.logps.rejected_lengths
        if n_w is None or n_l is None:
            raise ValueError(
                f"loss_type={loss_type!r} normalises by the completion lengths: give PairLogps "
                "chosen_lengths and rejected_lengths."
            )
        return n_w.clamp(min=1.0), n_l.clamp(min=1.0)


LossFn = Callable[[LossInputs], Tensor]


@dataclass(frozen=True)
class LossSpec:
    """One row of ``LOSS_TYPES``.

    Attributes:
        fn: ``fn(inputs) -> [N]`` per-pair losses.
        uses_reference: whether the loss reads the reference log-probabilities.
        accepts_f_divergence: whether ``f_divergence_type`` may differ from ``"reverse_kl"``.
        needs_label_smoothing: whether ``label_smoothing`` must be > 0.
        uses_label_smoothing: whether ``label_smoothing`` changes the loss.
        doc: one line: the formula and its source.
    """

    fn: LossFn
    uses_reference: bool
    accepts_f_divergence: bool
    needs_label_smoothing: bool = False
    uses_label_smoothing: bool = False
    doc: str = ""


@dataclass(frozen=True)
class DPOLossOutput:
    """What ``dpo_loss`` returns.

    Attributes:
        loss: the scalar ``sum_k w_k * mean(L_k)``.
        per_type: each loss type's (pair-weighted) mean, detached, for metrics.
        chosen_rewards: [N] β·u_w, detached (β·ℓ_w without a reference).
        rejected_rewards: [N] β·u_l, detached (β·ℓ_l without a reference).
    """

    loss: Tensor
    per_type: dict[str, Tensor] = field(default_factory=dict)
    chosen_rewards: Tensor | None = None
    rejected_rewards: Tensor | None = None


# --------------------------------------------------------------------------- f-divergences


def f_divergence_score(
    logratios: Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5
) -> Tensor:
    """The f-DPO score ``s(u) = f'(e^u)`` of log-ratios ``u`` (additive constants dropped).

    - ``reverse_kl``: ``s = u`` (standard DPO).
    - ``forward_kl``: ``s = 1 - e^{-u}``.
    - ``js_divergence``: ``s = log 2 + log σ(u) = log(2σ(u))``.
    - ``alpha_divergence``: ``s = (e^{(α-1)u} - 1) / (α - 1)`` with the exponent clamped at
      ``ALPHA_EXPONENT_CLAMP`` (no gradient past the clamp). This parametrisation is continuous
      in α: ``α = 0`` is ``forward_kl`` exactly and ``α -> 1`` tends to ``reverse_kl``, so
      ``α = 1`` returns ``u`` (the limit) instead of dividing by zero; any finite α is accepted.
      (The f-DPO paper's α is one minus this one.)

    Half-precision inputs are computed, and returned, in float32.

    Args:
        logratios: log-ratios ``u`` of any shape.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES``.
        alpha: α of ``alpha_divergence``; ignored otherwise.

    Returns:
        The scores, shaped as ``logratios``.

    Raises:
        ValueError: an unknown ``f_divergence_type`` or a non-finite ``alpha``.
    """
    u = _at_least_float32(logratios)
    if f_divergence_type == "reverse_kl":
        return u
    if f_divergence_type == "forward_kl":
        return -torch.expm1(-u)
    if f_divergence_type == "js_divergence":
        return math.log(2.0) + F.logsigmoid(u)
    if f_divergence_type == "alpha_divergence":
        if not math.isfinite(alpha):
            raise ValueError(f"f_alpha_divergence_coef={alpha} must be a finite number (0.5 is the default).")
        if alpha == 1.0:
            return u
        exponent = ((alpha - 1.0) * u).clamp(max=ALPHA_EXPONENT_CLAMP)
        return torch.expm1(exponent) / (alpha - 1.0)
    raise ValueError(_unknown_f_divergence(f_divergence_type))


# --------------------------------------------------------------------------- per-pair losses


def _smoothed_logistic(z: Tensor, eps: float) -> Tensor:
    """``-(1-ε) log σ(z) - ε log σ(-z)``: the logistic loss with the label flipped with probability ε."""
    return -(1.0 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _sigmoid(x: LossInputs) -> Tensor:
    return _smoothed_logistic(x.beta * x.margin, x.label_smoothing)


def _hinge(x: LossInputs) -> Tensor:
    return torch.relu(1.0 - x.beta * x.margin)


def _ipo(x: LossInputs) -> Tensor:
    n_w, n_l = x.lengths("ipo")
    s_w, s_l = _require(x.chosen_scores, "chosen_scores"), _require(x.rejected_scores, "rejected_scores")
    return (s_w / n_w - s_l / n_l - 1.0 / (2.0 * x.beta)) ** 2


def _exo_pair(x: LossInputs) -> Tensor:
    z = x.beta * x.margin
    eps = x.label_smoothing
    log_q_w, log_q_l = F.logsigmoid(z), F.logsigmoid(-z)
    return log_q_w.exp() * (log_q_w - math.log1p(-eps)) + log_q_l.exp() * (log_q_l - math.log(eps))


def _nca_pair(x: LossInputs) -> Tensor:
    r_w, r_l = x.beta * x.chosen_logratios, x.beta * x.rejected_logratios
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


def _robust(x: LossInputs) -> Tensor:
    z = x.beta * x.margin
    eps = x.label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


def _bco_pair(x: LossInputs) -> Tensor:
    r_w, r_l = x.beta * x.chosen_logratios, x.beta * x.rejected_logratios
    return -F.logsigmoid(r_w - x.bco_delta) - F.logsigmoid(-(r_l - x.bco_delta))


def _sppo_hard(x: LossInputs) -> Tensor:
    half = 0.5 / x.beta
    return (x.chosen_logratios - half) ** 2 + (x.rejected_logratios + half) ** 2


def _aot(x: LossInputs) -> Tensor:
    p = x.logps
    policy = torch.sort(p.chosen - p.rejected).values
    reference = torch.sort(
        _require(p.ref_chosen, "ref_chosen") - _require(p.ref_rejected, "ref_rejected")
    ).values
    return _smoothed_logistic(x.beta * (policy - reference), x.label_smoothing)


def _aot_unpaired(x: LossInputs) -> Tensor:
    d = torch.sort(x.chosen_logratios).values - torch.sort(x.rejected_logratios).values
    return _smoothed_logistic(x.beta * d, x.label_smoothing)


def _apo_zero(x: LossInputs) -> Tensor:
    return 1.0 - torch.sigmoid(x.beta * x.chosen_logratios) + torch.sigmoid(x.beta * x.rejected_logratios)


def _apo_down(x: LossInputs) -> Tensor:
    u_w, u_l = x.chosen_logratios, x.rejected_logratios
    return torch.sigmoid(x.beta * u_w) + 1.0 - torch.sigmoid(x.beta * (u_w - u_l))


def _discopop(x: LossInputs) -> Tensor:
    # (1 - m)(-log σ(z)) + m e^{-z}, m = σ(z/τ); the second term as exp(log σ(z/τ) - z) so that a
    # very negative z gives 0 * inf -> a finite value instead of NaN.
    z = x.beta * x.margin
    tau = x.discopop_tau
    return -torch.sigmoid(-z / tau) * F.logsigmoid(z) + torch.exp(F.logsigmoid(z / tau) - z)


def _sft(x: LossInputs) -> Tensor:
    chosen = x.logps.chosen
    tokens = x.sft_tokens if x.sft_tokens is not None else x.lengths("sft")[0].sum()
    # The token-level mean NLL of the chosen completions; one scalar, expanded so a pair weight
    # multiplies it like any per-pair loss.
    return (-chosen.sum() / tokens).expand(chosen.shape[0])


def _sigmoid_norm(x: LossInputs) -> Tensor:
    n_w, n_l = x.lengths("sigmoid_norm")
    s_w, s_l = _require(x.chosen_scores, "chosen_scores"), _require(x.rejected_scores, "rejected_scores")
    return -F.logsigmoid(x.beta * (s_w / n_w - s_l / n_l))


def _udpo(x: LossInputs) -> Tensor:
    z = x.beta * x.margin
    eps = x.label_smoothing
    if eps == 0.0:  # a = 0, α = 1: exactly DPO
        return -F.logsigmoid(z)
    a = eps / (1.0 - eps)
    scale = (1.0 + math.sqrt(a)) / (1.0 - math.sqrt(a))
    # log((e^z + a) / (e^z + 1)) = logaddexp(z, log a) - softplus(z)
    return -scale * (torch.logaddexp(z, torch.full_like(z, math.log(a))) - F.softplus(z))


LOSS_TYPES: dict[str, LossSpec] = {
    "sigmoid": LossSpec(
        _sigmoid,
        uses_reference=True,
        accepts_f_divergence=True,
        uses_label_smoothing=True,
        doc="-(1-ε) log σ(βΔ) - ε log σ(-βΔ): DPO (Rafailov et al. 2023); ε > 0 is conservative DPO (cDPO).",
    ),
    "hinge": LossSpec(
        _hinge,
        uses_reference=True,
        accepts_f_divergence=True,
        doc="max(0, 1 - βΔ): the SLiC hinge (Zhao et al. 2023).",
    ),
    "ipo": LossSpec(
        _ipo,
        uses_reference=True,
        accepts_f_divergence=True,
        doc="(s_w/n_w - s_l/n_l - 1/(2β))²: IPO (Azar et al. 2023), length-normalised as the reference.",
    ),
    "exo_pair": LossSpec(
        _exo_pair,
        uses_reference=True,
        accepts_f_divergence=True,
        needs_label_smoothing=True,
        uses_label_smoothing=True,
        doc="σ(βΔ)[log σ(βΔ) - log(1-ε)] + σ(-βΔ)[log σ(-βΔ) - log ε]: EXO-pref (Ji et al. 2024), ε > 0.",
    ),
    "nca_pair": LossSpec(
        _nca_pair,
        uses_reference=True,
        accepts_f_divergence=False,
        doc="-log σ(βu_w) - ½ log σ(-βu_w) - ½ log σ(-βu_l): NCA (Chen et al. 2024).",
    ),
    "robust": LossSpec(
        _robust,
        uses_reference=True,
        accepts_f_divergence=True,
        uses_label_smoothing=True,
        doc="[-(1-ε) log σ(βΔ) + ε log σ(-βΔ)] / (1-2ε): robust DPO (Ray Chowdhury et al. 2024), ε < 0.5.",
    ),
    "bco_pair": LossSpec(
        _bco_pair,
        uses_reference=True,
        accepts_f_divergence=False,
        doc="-log σ(βu_w - δ) - log σ(-(βu_l - δ)): BCO (Jung et al. 2024), δ the running reward mean.",
    ),
    "sppo_hard": LossSpec(
        _sppo_hard,
        uses_reference=True,
        accepts_f_divergence=False,
        doc="(u_w - 1/(2β))² + (u_l + 1/(2β))²: SPPO with hard win probabilities (Wu et al. 2024).",
    ),
    "aot": LossSpec(
        _aot,
        uses_reference=True,
        accepts_f_divergence=False,
        uses_label_smoothing=True,
        doc="smoothed logistic of β(sort(ℓ_w-ℓ_l) - sort(ℓʳ_w-ℓʳ_l)): AOT, paired (Melnyk et al. 2024).",
    ),
    "aot_unpaired": LossSpec(
        _aot_unpaired,
        uses_reference=True,
        accepts_f_divergence=False,
        uses_label_smoothing=True,
        doc="smoothed logistic of β(sort(u_w) - sort(u_l)): AOT, unpaired (Melnyk et al. 2024).",
    ),
    "apo_zero": LossSpec(
        _apo_zero,
        uses_reference=True,
        accepts_f_divergence=False,
        doc="1 - σ(βu_w) + σ(βu_l): APO-zero (D'Oosterlinck et al. 2024), chosen better than the policy.",
    ),
    "apo_down": LossSpec(
        _apo_down,
        uses_reference=True,
        accepts_f_divergence=False,
        doc="σ(βu_w) + 1 - σ(β(u_w - u_l)): APO-down (D'Oosterlinck et al. 2024), chosen worse than the policy.",
    ),
    "discopop": LossSpec(
        _discopop,
        uses_reference=True,
        accepts_f_divergence=True,
        doc="(1-m)(-log σ(z)) + m e^{-z}, z = βΔ, m = σ(z/τ): DiscoPOP (Chris Lu et al. 2024).",
    ),
    "sft": LossSpec(
        _sft,
        uses_reference=False,
        accepts_f_divergence=True,
        doc="-Σℓ_w / Σn_w: the token-level NLL of the chosen completions (one scalar per batch).",
    ),
    "sigmoid_norm": LossSpec(
        _sigmoid_norm,
        uses_reference=True,
        accepts_f_divergence=True,
        doc="-log σ(β(s_w/n_w - s_l/n_l)): DPO on length-normalised scores.",
    ),
    "udpo": LossSpec(
        _udpo,
        uses_reference=True,
        accepts_f_divergence=False,
        uses_label_smoothing=True,
        doc="-α log((e^z + a)/(e^z + 1)), z = βΔ, a = ε/(1-ε), α = (1+√a)/(1-√a): UDPO, ε < 0.5.",
    ),
}


# --------------------------------------------------------------------------- validation


def check_loss_settings(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None,
    f_divergence_type: str,
    label_smoothing: float,
    ld_alpha: float | None,
    use_weighting: bool,
) -> tuple[list[str], list[float]]:
    """Validate a DPO loss configuration; fail early with the parameter at fault and its fix.

    Args:
        loss_type: a name of ``LOSS_TYPES`` or a list of them (each at most once).
        loss_weights: one weight per loss type, or ``None`` for 1.0 each.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES``.
        label_smoothing: ε.
        ld_alpha: LD-DPO's α, ``None`` when off.
        use_weighting: whether WPO weights multiply the per-pair losses.

    Returns:
        The loss types as a list and their weights.

    Raises:
        ValueError: an unknown loss type (the message lists the valid ones), a loss type given
            twice, an unknown f-divergence, ``loss_weights`` of the wrong length or with a
            non-finite weight, ``ld_alpha`` outside [0, 1], ``label_smoothing`` outside [0, 1],
            ``exo_pair`` with ``label_smoothing`` not in (0, 1), ``robust`` or ``udpo`` with
            ``label_smoothing >= 0.5`` (both divide by a quantity that vanishes at 0.5; the
            reference only warns for ``robust``), or a non-default ``f_divergence_type`` with a
            loss type that does not accept it.
        NotImplementedError: ``use_weighting`` with ``aot`` or ``aot_unpaired`` (they sort the
            batch, so per-pair weights would not line up with the sorted pairs), as the reference.
    """
    types = _checked_loss_types(loss_type)
    weights = _checked_loss_weights(loss_weights, types)
    _check_f_divergence(f_divergence_type, types)
    _check_ld_alpha(ld_alpha)
    _check_label_smoothing(label_smoothing, types)
    _check_weighting(use_weighting, types)
    return types, weights


def _checked_loss_types(loss_type: str | Sequence[str]) -> list[str]:
    """The loss types as a list, each known and given once."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError(f"loss_type is empty; give one of {list(LOSS_TYPES)} or a list of them.")
    for name in types:
        if name not in LOSS_TYPES:
            raise ValueError(f"loss_type={name!r} is not supported; use one of {list(LOSS_TYPES)}.")
    repeated = sorted({name for name in types if types.count(name) > 1})
    if repeated:
        raise ValueError(
            f"loss_type={types} lists {repeated} more than once; give each loss type once and add their "
            "loss_weights together."
        )
    return types


def _checked_loss_weights(loss_weights: Sequence[float] | None, types: list[str]) -> list[float]:
    """The weights as floats, one finite weight per loss type (1.0 each for ``None``)."""
    if loss_weights is None:
        return [1.0] * len(types)
    weights = [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(
            f"loss_weights has {len(weights)} weight(s) for {len(types)} loss type(s) {types}; give one "
            "weight per loss type, or loss_weights=None for 1.0 each."
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"loss_weights={weights} must be finite numbers.")
    return weights


def _check_f_divergence(f_divergence_type: str, types: list[str]) -> None:
    """None, once ``f_divergence_type`` is known and accepted by every loss type."""
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(_unknown_f_divergence(f_divergence_type))
    if f_divergence_type != "reverse_kl":
        refusing = [name for name in types if not LOSS_TYPES[name].accepts_f_divergence]
        if refusing:
            accepting = [name for name, spec in LOSS_TYPES.items() if spec.accepts_f_divergence]
            raise ValueError(
                f"f_divergence_type={f_divergence_type!r} is not supported by loss_type {refusing}; use "
                f"f_divergence_type='reverse_kl' with them, or a loss type among {accepting}."
            )


def _check_ld_alpha(ld_alpha: float | None) -> None:
    """None, once LD-DPO's α is off or in [0, 1]."""
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise ValueError(
            f"ld_alpha={ld_alpha} must lie in [0, 1] (1.0 weighs every token fully, 0.0 drops the tokens past "
            "the shared length), or be None to turn LD-DPO off."
        )


def _check_label_smoothing(label_smoothing: float, types: list[str]) -> None:
    """None, once ε lies in [0, 1] and in the narrower range each loss type needs."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1].")
    if "exo_pair" in types and not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"label_smoothing={label_smoothing} with loss_type 'exo_pair': it must lie in (0, 1) (EXO takes "
            "log ε and log(1-ε)); the EXO paper recommends label_smoothing=1e-3."
        )
    for name in ("robust", "udpo"):
        if name in types and label_smoothing >= 0.5:
            raise ValueError(
                f"label_smoothing={label_smoothing} with loss_type {name!r}: it must lie in [0, 0.5) (the loss "
                "divides by a factor that vanishes at 0.5); the robust DPO paper suggests 0.1."
            )


def _check_weighting(use_weighting: bool, types: list[str]) -> None:
    """None, once WPO weighting is off or no loss type sorts the batch."""
    if use_weighting:
        sorting = [name for name in types if name in ("aot", "aot_unpaired")]
        if sorting:
            raise NotImplementedError(
                f"use_weighting=True is not implemented for loss_type {sorting}: these losses sort the batch, "
                "so per-pair weights would not line up; set use_weighting=False or use another loss type."
            )


# --------------------------------------------------------------------------- entry point


def dpo_loss(
    logps: PairLogps,
    loss_type: str | Sequence[str],
    *,
    beta: float,
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    pair_weights: Tensor | None = None,
    bco_delta: float = 0.0,
    sft_tokens: Tensor | float | None = None,
) -> DPOLossOutput:
    """The DPO-family loss of a batch of pairs: ``sum_k w_k * mean(pair_weights * L_k)``.

    Half-precision log-probabilities are computed in float32.

    Args:
        logps: the batch's summed log-probabilities; the reference ones may be ``None`` only if
            every loss type is reference-free (``sft``).
        loss_type: a name of ``LOSS_TYPES`` or a list of them.
        beta: β > 0 (IPO's τ).
        loss_weights: one weight per loss type; ``None`` for 1.0 each.
        label_smoothing: ε, used by the loss types whose ``uses_label_smoothing`` is set.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES`` (see ``f_divergence_score``).
        f_alpha_divergence_coef: α of ``alpha_divergence``.
        discopop_tau: τ > 0 of ``discopop``.
        pair_weights: [N] weights multiplying every per-pair loss (WPO: ``w_w * w_l`` from
            ``wpo_weights``); used as given, so pass them detached.
        bco_delta: δ of ``bco_pair`` (``RunningMean.value``); 0.0 is the reference's behaviour.
        sft_tokens: what ``sft`` divides the chosen log-probs by instead of the batch's chosen
            tokens: a trainer splitting a step into micro-batches and processes passes the share
            that makes the step's ``sft`` term the mean over all of the step's chosen tokens.

    Returns:
        A ``DPOLossOutput``.

    Raises:
        ValueError: a setting ``check_loss_settings`` rejects, ``beta <= 0``, ``discopop_tau <= 0``
            with ``discopop``, a missing reference or length, or mismatched shapes.
        NotImplementedError: ``pair_weights`` with ``aot`` or ``aot_unpaired``.
    """
    types, weights = check_loss_settings(
        loss_type, loss_weights, f_divergence_type, label_smoothing, None, pair_weights is not None
    )
    logps = _checked_dpo_inputs(logps, types, beta, discopop_tau, pair_weights)
    rewards, scores = _rewards_and_scores(logps, f_divergence_type, f_alpha_divergence_coef)
    inputs = LossInputs(
        logps=logps,
        chosen_scores=scores[0],
        rejected_scores=scores[1],
        beta=beta,
        label_smoothing=label_smoothing,
        discopop_tau=discopop_tau,
        bco_delta=bco_delta,
        sft_tokens=sft_tokens,
    )
    return _mixed_loss(types, weights, inputs, pair_weights, rewards)


def _checked_dpo_inputs(
    logps: PairLogps, types: list[str], beta: float, discopop_tau: float, pair_weights: Tensor | None
) -> PairLogps:
    """``_checked_logps(logps)``, once β, τ, the reference and the pair weights are checked."""
    if not beta > 0:
        raise ValueError(f"beta={beta} must be > 0 (0.1 is the usual value).")
    if "discopop" in types and not discopop_tau > 0:
        raise ValueError(f"discopop_tau={discopop_tau} must be > 0 (the DiscoPOP paper uses 0.05).")
    logps = _checked_logps(logps)
    has_reference = logps.ref_chosen is not None and logps.ref_rejected is not None
    if not has_reference:
        needing = [name for name in types if LOSS_TYPES[name].uses_reference]
        if needing:
            raise ValueError(
                f"loss_type {needing} needs the reference log-probabilities: give PairLogps ref_chosen and "
                "ref_rejected."
            )
    if pair_weights is not None and pair_weights.shape != logps.chosen.shape:
        raise ValueError(
            f"pair_weights {tuple(pair_weights.shape)} must have the shape of the pairs {tuple(logps.chosen.shape)}."
        )
    return logps


def _rewards_and_scores(
    logps: PairLogps, f_divergence_type: str, f_alpha_divergence_coef: float
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor | None, Tensor | None]]:
    """((u_w, u_l), (s_w, s_l)); without a reference ((ℓ_w, ℓ_l), (None, None))."""
    chosen_scores = rejected_scores = None
    chosen_rewards, rejected_rewards = logps.chosen, logps.rejected
    if logps.ref_chosen is not None and logps.ref_rejected is not None:
        chosen_rewards = logps.chosen - logps.ref_chosen
        rejected_rewards = logps.rejected - logps.ref_rejected
        chosen_scores = f_divergence_score(chosen_rewards, f_divergence_type, f_alpha_divergence_coef)
        rejected_scores = f_divergence_score(rejected_rewards, f_divergence_type, f_alpha_divergence_coef)
    return (chosen_rewards, rejected_rewards), (chosen_scores, rejected_scores)


def _mixed_loss(
    types: list[str],
    weights: list[float],
    inputs: LossInputs,
    pair_weights: Tensor | None,
    rewards: tuple[Tensor, Tensor],
) -> DPOLossOutput:
    """The ``DPOLossOutput`` of ``sum_k w_k * mean(pair_weights * L_k)``, with the rewards scaled by β."""
    total: Tensor | None = None
    per_type: dict[str, Tensor] = {}
    for name, weight in zip(types, weights, strict=True):
        per_pair = LOSS_TYPES[name].fn(inputs)
        if pair_weights is not None:
            per_pair = per_pair * pair_weights
        mean = per_pair.mean()
        per_type[name] = mean.detach()
        total = weight * mean if total is None else total + weight * mean
    assert total is not None  # check_loss_settings refuses an empty list
    chosen_rewards, rejected_rewards = rewards
    return DPOLossOutput(
        loss=total,
        per_type=per_type,
        chosen_rewards=(inputs.beta * chosen_rewards).detach(),
        rejected_rewards=(inputs.beta * rejected_rewards).detach(),
    )


# --------------------------------------------------------------------------- trainer helpers


def wpo_weights(token_logps: Tensor, token_log_sq_norm: Tensor, mask: Tensor) -> Tensor:
    """WPO per-sequence weights (Zhou et al. 2024, Eq. 2), detached.

    ``w = exp(mean over the completion tokens of [log π(y_t) - log Σ_v π(v)²])``: the
    length-normalised probability of the sequence, each token's probability divided by
    ``Σ_v π(v)²`` (the chance that two samples of that position agree), so a sequence the
    policy would likely sample itself weighs more. A pair's weight is ``w_w * w_l``, which multiplies every per-pair loss (``dpo_loss(pair_weights=...)``).
    A row without completion tokens divides by 1 (weight ``exp(0) = 1``).

    Args:
        token_logps: [N, T] log-probabilities of the completion's tokens.
        token_log_sq_norm: [N, T] ``log Σ_v π(v)²`` of the next-token distribution per position.
        mask: [N, T] 1 on completion tokens.

    Returns:
        [N] weights without gradient.

    Raises:
        ValueError: mismatched shapes.
    """
    if not token_logps.shape == token_log_sq_norm.shape == mask.shape or token_logps.dim() != 2:
        raise ValueError(
            f"token_logps {tuple(token_logps.shape)}, token_log_sq_norm {tuple(token_log_sq_norm.shape)} and "
            f"mask {tuple(mask.shape)} must all be [N, T]."
        )
    with torch.no_grad():
        logps = _at_least_float32(token_logps.detach())
        mask = mask.to(logps.dtype)
        aligned = (logps - token_log_sq_norm.detach().to(logps.dtype)) * mask
        return torch.exp(aligned.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))


def ld_logps(token_logps: Tensor, mask: Tensor, public_lengths: Tensor, alpha: float) -> Tensor:
    """LD-DPO's summed log-probabilities (Liu et al. 2024): the verbose tail down-weighted by α.

    ``Σ_{t <= l_p} logp_t + α Σ_{t > l_p} logp_t`` over the completion tokens, ``t`` counted
    from 1 within the completion (the masked tokens) and ``l_p`` the pair's public length
    ``min(n_w, n_l)``. Use it for both the policy and the reference, with the same ``l_p`` for
    the two completions of a pair. ``alpha = 1`` is the plain sum.

    Args:
        token_logps: [N, T] per-token log-probabilities.
        mask: [N, T] 1 on completion tokens (prompt and padding 0).
        public_lengths: [N] the shared length ``min(n_w, n_l)`` of each row's pair.
        alpha: α in [0, 1].

    Returns:
        [N] the weighted sums.

    Raises:
        ValueError: ``alpha`` outside [0, 1] or mismatched shapes.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ld_alpha={alpha} must lie in [0, 1].")
    if (
        token_logps.shape != mask.shape
        or token_logps.dim() != 2
        or public_lengths.shape != token_logps.shape[:1]
    ):
        raise ValueError(
            f"token_logps {tuple(token_logps.shape)} and mask {tuple(mask.shape)} must be [N, T] and "
            f"public_lengths {tuple(public_lengths.shape)} [N]."
        )
    mask = mask.to(token_logps.dtype)
    position = mask.cumsum(dim=1)  # 1, 2, ... on the completion tokens
    shared = (position <= public_lengths.to(token_logps.dtype).unsqueeze(1)).to(token_logps.dtype) * mask
    masked = token_logps * mask
    shared_sum = (masked * shared).sum(dim=1)
    return shared_sum + alpha * (masked.sum(dim=1) - shared_sum)


class RunningMean:
    """The running mean of every reward seen: BCO's shift δ (Jung et al. 2024).

    Feed it each batch's rewards, chosen and rejected together (``β·u``; gathered over the
    processes so they all agree), then pass ``value`` as ``dpo_loss(bco_delta=...)``. The state
    is a float64 sum and a count, so ``state_dict``/``load_state_dict`` resume exactly.
    """

    def __init__(self) -> None:
        self._sum = 0.0
        self._count = 0

    def update(self, rewards: Tensor) -> float:
        """Add a batch of rewards (any shape); return the new mean."""
        values = rewards.detach().to(torch.float64)
        self._sum += float(values.sum())
        self._count += values.numel()
        return self.value

    @property
    def value(self) -> float:
        """The mean of all rewards seen, 0.0 before any."""
        return self._sum / self._count if self._count else 0.0

    @property
    def count(self) -> int:
        """How many rewards were seen."""
        return self._count

    def state_dict(self) -> dict[str, float | int]:
        """The state to checkpoint."""
        return {"sum": self._sum, "count": self._count}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore a ``state_dict``.

        Raises:
            ValueError: a missing key or a negative count.
        """
        if set(state) != {"sum", "count"} or int(state["count"]) < 0:
            raise ValueError(f"RunningMean state must be {{'sum': float, 'count': int >= 0}}; got {state}.")
        self._sum = float(state["sum"])
        self._count = int(state["count"])


# --------------------------------------------------------------------------- internals


def _require(value: Tensor | None, name: str) -> Tensor:
    """``value``, or a ValueError naming the missing field."""
    if value is None:
        raise ValueError(f"{name} is required here but is None.")
    return value


def _at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 if it is half precision, else unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _checked_logps(logps: PairLogps) -> PairLogps:
    """``logps`` with half precision raised to float32 and lengths made float, every field checked ``[N]``."""
    shape = logps.chosen.shape
    if logps.chosen.dim() != 1:
        raise ValueError(f"PairLogps.chosen must be [N]; got {tuple(shape)}.")
    dtype = _at_least_float32(logps.chosen).dtype
    values = {}
    for f in fields(logps):
        value = getattr(logps, f.name)
        if value is not None:
            if value.shape != shape:
                raise ValueError(
                    f"PairLogps.{f.name} {tuple(value.shape)} must have the shape of chosen {tuple(shape)}."
                )
            value = value.to(dtype) if f.name.endswith("_lengths") else _at_least_float32(value)
        values[f.name] = value
    return PairLogps(**values)


def _unknown_f_divergence(name: str) -> str:
    return f"f_divergence_type={name!r} is not supported; use one of {list(F_DIVERGENCE_TYPES)}."
