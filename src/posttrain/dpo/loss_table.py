"""The DPO loss table: ``LOSS_TYPES``, its per-pair loss functions and the f-divergence scores.

Pure functions of summed completion log-probabilities (``PairLogps``); the notation (``u``, ``s``,
``Δ``, σ, β, ε) and the departures from the reference are those of ``dpo/losses.py``, whose
``dpo_loss`` mixes the rows of this table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


# --------------------------------------------------------------------------- internals


def _require(value: Tensor | None, name: str) -> Tensor:
    """``value``, or a ValueError naming the missing field."""
    if value is None:
        raise ValueError(f"{name} is required here but is None.")
    return value


def _at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32 if it is half precision, else unchanged."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _unknown_f_divergence(name: str) -> str:
    return f"f_divergence_type={name!r} is not supported; use one of {list(F_DIVERGENCE_TYPES)}."
