"""GRPO's policy terms: importance weights and the per-token losses, pure tensor math.

The importance weights (``importance_ratio``; GSPO's sequence level, ``sequence_old_logps``) and
each loss type's term, the per-token loss ``[B, T]`` from log-probs, old log-probs and advantages
(``clipped_surrogate``, ``cispo_surrogate``, ``sapo_surrogate``, ``vespo_surrogate``,
``gmpo_surrogate``). ``grpo/objectives.py`` puts each in its row of ``LOSS_TYPES``; shapes and
masks are as it states.
"""

from __future__ import annotations

import torch

from posttrain.ops.reductions import masked_mean

# Numerical guard for VESPO's sequence log-weight: above it phi(W) underflows to 0 anyway.
_MAX_LOG_SEQUENCE_WEIGHT = 50.0


# ---- importance weights ------------------------------------------------------------------


def importance_ratio(logps: torch.Tensor, old_logps: torch.Tensor) -> torch.Tensor:
    """Token-level ratio ``pi_theta / pi_old = exp(logp - old_logp)``: [B, T]."""
    return torch.exp(logps - old_logps)


def sequence_old_logps(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level weight written per token, as the "old" log-probs of a token term.

    GSPO (Zheng et al. 2025, arXiv 2507.18071) eq. 7: ``s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|)
    = exp(mean_t(logp_t - old_logp_t))``. Its token form (GSPO-token, eq. 14) is
    ``s_it = sg(s_i) * pi(y_it) / sg(pi(y_it))``. Returning
    ``old'_t = sg(logp_t) - sg(log s_i)`` makes ``exp(logp_t - old'_t)`` equal ``s_i`` in value
    while its gradient is ``s_i * grad logp_t``; every term built on ``exp(logp - old)`` then
    becomes sequence-level. With the advantage shared by all tokens of a completion (as here)
    GSPO-token's gradient equals GSPO's eq. 10,
    ``s_i A_i (1/|y_i|) sum_t grad logp_t``, under the per-sequence token mean.

    Args:
        logps: [B, T] current log-probs (may carry gradient; it is not used here).
        old_logps: [B, T] log-probs of the sampling policy.
        mask: [B, T] float, 1 on the tokens that count.

    Returns:
        [B, T] log-probs without gradient.
    """
    current = logps.detach()
    log_s = masked_mean(current - old_logps, mask)  # [B]
    return current - log_s.unsqueeze(1)  # [B, T]


def importance_old_logps(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """The "old" log-probs a term sees: ``old_logps`` at token level, GSPO's at sequence level."""
    if level == "token":
        return old_logps
    if level == "sequence":
        return sequence_old_logps(logps, old_logps, mask)
    raise ValueError(f"importance_sampling_level={level!r} is invalid; use 'token' or 'sequence'.")


# ---- per-token terms ---------------------------------------------------------------------


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """PPO's clipped surrogate, negated for minimisation (DeepSeekMath eq. 3, per token).

    ``l_t = -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A)`` with
    ``r_t = exp(logp_t - old_logp_t)``; DAPO (arXiv 2503.14476, eq. 8) decouples ``eps_low`` and
    ``eps_high`` (clip-higher). With ``delta`` (INTELLECT-2, arXiv 2505.07291, two-sided GRPO
    clipping) the unclipped branch uses ``min(r_t, delta)``:
    ``l_t = -min(min(r_t, delta) * A, clip(r_t, ...) * A)``. For ``A > 0`` and
    ``delta >= 1 + eps_high`` (the report's advice) the cap never changes the minimum, so it
    only bounds the loss, and removes the gradient, of tokens with ``A < 0`` and ``r_t > delta``.
    When ``old_logps`` is ``logps.detach()`` the ratio is 1, the clip is inactive and the
    gradient is REINFORCE's: ``-A * grad logp_t``.

    Args:
        logps: [B, T] log-probs of the sampled tokens under the current policy.
        old_logps: [B, T] log-probs under the policy that sampled them (no gradient).
        advantages: [B] advantage of each completion.
        eps_low: lower clip range (``epsilon``).
        eps_high: upper clip range (``epsilon_high``, DAPO's clip-higher).
        delta: INTELLECT-2's cap of the unclipped ratio; None for the plain clip.

    Returns:
        [B, T] per-token losses.
    """
    ratio = importance_ratio(logps, old_logps)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    capped = ratio if delta is None else torch.clamp(ratio, max=delta)  # [B, T]
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)  # [B, T]
    return -torch.min(capped * adv, clipped * adv)


def cispo_surrogate(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, eps_max: float
) -> torch.Tensor:
    """CISPO: the truncated importance weight, detached, times ``A * logp`` (negated).

    ScaleRL (Khatri et al. 2025, arXiv 2510.13786, the CISPO loss of Sec. 3):
    ``l_t = -sg(min(r_t, eps_max)) * A * logp_t``, so ``grad l_t = -sg(min(r_t, eps_max)) * A *
    grad logp_t``: every token keeps its gradient, only its weight is truncated. MiniMax-M1
    (arXiv 2506.13585, eqs. 4-5) writes the weight as ``clip(r, 1 - eps_low_IS, 1 + eps_high_IS)``
    but sets no lower bound (``eps_low_IS`` large); ScaleRL's form has an upper cap only too,
    and so does this one. Departure kept from TRL: the cap is ``eps_max`` itself (ScaleRL,
    default 5.0), not MiniMax's ``1 + eps_high_IS``.

    Args:
        logps: [B, T] log-probs under the current policy (with gradient).
        old_logps: [B, T] log-probs of the sampling policy.
        advantages: [B] advantages.
        eps_max: cap of the importance weight.

    Returns:
        [B, T] per-token losses.
    """
    weight = torch.clamp(importance_ratio(logps, old_logps), max=eps_max).detach()  # [B, T]
    return -weight * advantages.unsqueeze(1) * logps


def sapo_gate(ratio: torch.Tensor, temperature: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate ``f(r) = sigmoid(tau (r - 1)) * 4 / tau`` (SAPO, arXiv 2511.20347, Sec. 3).

    ``f'(r) = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1)))`` is 1 at ``r = 1`` for every
    ``tau`` and decays smoothly as ``r`` leaves 1, faster for larger ``tau``.
    """
    return torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature


def sapo_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    tau_pos: float,
    tau_neg: float,
) -> torch.Tensor:
    """SAPO: the hard clip replaced by a temperature-controlled soft gate (negated).

    SAPO (Gao et al. 2025, arXiv 2511.20347, Sec. 3): ``J = E[1/G sum_i 1/|y_i| sum_t
    f_it(r_it) A_i]`` with ``f_it(x) = sigmoid(tau_it (x - 1)) * 4 / tau_it`` and
    ``tau_it = tau_pos`` if ``A_i > 0`` else ``tau_neg``. Per token ``l_t = -f(r_t) * A``; the
    ``1/|y_i|`` mean is the ``"sequence"`` reduction. At ``r = 1`` the value is ``-2 A / tau``
    (not ``-A``) but the gradient is REINFORCE's ``-A * grad logp``.

    Args:
        logps, old_logps: [B, T] current (with gradient) and sampling log-probs.
        advantages: [B] advantages.
        tau_pos, tau_neg: gate temperatures for ``A > 0`` and ``A <= 0``.

    Returns:
        [B, T] per-token losses.
    """
    ratio = importance_ratio(logps, old_logps)  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)  # [B, 1]
    return -sapo_gate(ratio, tau) * adv


def vespo_gamma_weight(
    log_weight: torch.Tensor,
    advantages: torch.Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
) -> torch.Tensor:
    """VESPO's Gamma kernel ``phi(W) = W^k exp(lambda (1 - W))``, computed in log space.

    VESPO (Shen et al. 2026, arXiv 2602.10693, Sec. 3.4; ``k`` and ``lambda`` are its ``c1`` and
    ``c2``): ``phi(1) = 1``; it down-weights sequences with ``W < 1`` (power ``k``) and ``W > 1``
    (decay ``lambda``). ``(k, lambda)`` are the ``_pos`` pair for ``A > 0`` and the ``_neg`` pair
    otherwise (TRL uses the ``_pos`` pair at ``A = 0``; there the loss is 0 either way and only
    the logged phi differs). ``log W`` is capped at 50 as a numerical guard (phi is 0 there).

    Args:
        log_weight: [B] ``log W``, the summed token log-ratios of each sequence.
        advantages: [B] advantages.
        k_pos, lambda_pos, k_neg, lambda_neg: the kernel's parameters.

    Returns:
        [B] ``phi(W)``, without gradient.
    """
    log_w = log_weight.detach().clamp(max=_MAX_LOG_SEQUENCE_WEIGHT)  # [B]
    positive = advantages > 0  # [B]
    k = torch.where(positive, k_pos, k_neg).to(log_w.dtype)  # [B]
    lam = torch.where(positive, lambda_pos, lambda_neg).to(log_w.dtype)  # [B]
    return torch.exp(k * log_w + lam * (1 - torch.exp(log_w)))


def vespo_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    *,
    mask: torch.Tensor,
) -> torch.Tensor:
    """VESPO: the sequence's detached Gamma weight times ``A * logp`` (negated).

    VESPO (arXiv 2602.10693, Sec. 3.4): ``L = -E[sg(phi(W)) * A * log pi_theta(y)]`` with
    ``W = pi_theta(y) / mu(y) = exp(sum_t (logp_t - old_logp_t))``: the sequence-level weight
    without length normalisation, and ``log pi_theta(y) = sum_t logp_t``. Per token
    ``l_t = -phi_i * A_i * logp_t``; like TRL the sum is normalised as DAPO's (``"token"``).

    Args:
        logps, old_logps: [B, T] current (with gradient) and sampling log-probs.
        advantages: [B] advantages.
        k_pos, lambda_pos, k_neg, lambda_neg: the Gamma kernel's parameters.
        mask: [B, T] float, 1 on the tokens that count (they make up ``W``).

    Returns:
        [B, T] per-token losses.
    """
    log_w = ((logps.detach() - old_logps) * mask).sum(dim=1)  # [B]
    phi = vespo_gamma_weight(log_w, advantages, k_pos, lambda_pos, k_neg, lambda_neg)  # [B]
    return -(phi * advantages).unsqueeze(1) * logps


def gmpo_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    mask: torch.Tensor,
) -> torch.Tensor:
    """GMPO: the geometric mean of the clipped token ratios times ``A`` (negated).

    GMPO (Zhao et al. 2025, arXiv 2507.20673, the objective ``J_GMPO``): ``(prod_t min[w_t^s,
    clip(w_t^s, e1, e2)]^s)^(1/|o|) * A`` with ``s = sgn(A)``, computed in log space: a token's
    log-ratio is capped at ``eps_high`` when ``A > 0`` and floored at ``-eps_low`` when
    ``A <= 0`` (PPO's one-sided trust region, before the mean), then
    ``l_i = -exp(mean_t clipped_t) * A_i``. Departure: with ``(e1, e2) = (e^-eps_low, e^eps_high)``
    the paper's ``sgn`` form would floor ``A < 0`` tokens at ``-eps_high``; like TRL's GMPO we
    floor at ``-eps_low`` (identical for the paper's symmetric range ``e^(+-0.4)``). The
    sequence loss is returned on each of its tokens, so the ``"sequence"`` reduction gives
    ``1/G sum_i l_i``.

    Args:
        logps, old_logps: [B, T] current (with gradient) and sampling log-probs.
        advantages: [B] advantages.
        eps_low, eps_high: the log-space clip range.
        mask: [B, T] float, 1 on the tokens that count.

    Returns:
        [B, T] per-token losses (each row constant).
    """
    log_ratio = logps - old_logps  # [B, T]
    adv = advantages.unsqueeze(1)  # [B, 1]
    clipped = torch.where(adv > 0, log_ratio.clamp(max=eps_high), log_ratio.clamp(min=-eps_low))  # [B, T]
    per_sequence = -torch.exp(masked_mean(clipped, mask)) * advantages  # [B]
    return per_sequence.unsqueeze(1).expand_as(logps)
