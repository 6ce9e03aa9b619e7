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
The table and its loss functions live in ``dpo/loss_table.py``, the checks in
``dpo/loss_checks.py``; both are imported here, so every name keeps its ``dpo.losses`` path.

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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from posttrain.dpo.loss_checks import _checked_dpo_inputs, check_loss_settings
from posttrain.dpo.loss_table import (  # noqa: F401  (re-exported)
    F_DIVERGENCE_TYPES,
    LOSS_TYPES,
    LossFn,
    LossInputs,
    LossSpec,
    _at_least_float32,
    f_divergence_score,
)
from posttrain.pairs.logps import ALPHA_EXPONENT_CLAMP, PairLogps  # noqa: F401  (re-exported)


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
