"""Regularisers and corrections around the GRPO policy term: pure tensor math.

* KL to the reference policy: Schulman's k3 estimator and DeepSeek-V3.2's bias-corrected form.
* Entropy: the bonus, the high-entropy token mask (Beyond the 80/20 Rule) and the adaptive
  coefficient (Skywork-OR1).
* Off-policy sequence masking (DeepSeek-V3.2).
* Importance weights between the sampler (e.g. vLLM) and the trainer (TIS / MIS, token or
  sequence level).
* The TR-DPO soft update of the reference policy lives in ``models/reference.py`` (DPO shares it)
  and is re-exported here.

Every function takes tensors or numbers and returns tensors, numbers or ``(tensor, metrics)``;
no model, trainer or config object enters.

Shapes: ``B`` completions, ``T`` completion tokens. ``mask`` is 1 (or ``True``) on the tokens
that count and 0 on padding.
"""

from __future__ import annotations

import torch

from posttrain.models.reference import mix_into_reference, should_sync_reference  # noqa: F401 (re-exported)

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# torch.quantile refuses inputs with more elements than this.
_QUANTILE_MAX_ELEMENTS = 2**24


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is set; 0 when none is."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


# --------------------------------------------------------------------------------------------
# KL to the reference policy
# --------------------------------------------------------------------------------------------


def kl_k3(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of ``KL(pi_theta || pi_ref)`` (DeepSeekMath eq. 4; Schulman 2020).

    ``k3_t = pi_ref / pi_theta - log(pi_ref / pi_theta) - 1 = exp(d) - d - 1`` with
    ``d = ref_logp_t - logp_t``. It is >= 0 and 0 exactly where the two log-probs agree.

    Args:
        logps: [B, T] log-probs of the sampled tokens under the current policy (with gradient).
        ref_logps: [B, T] log-probs under the reference policy (no gradient).

    Returns:
        [B, T] per-token estimates; padded positions are not masked here.
    """
    delta = ref_logps - logps  # [B, T]
    return torch.exp(delta) - delta - 1


def bias_corrected_kl(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """k3 weighted by the importance ratio (DeepSeek-V3.2, Sec. 3.1, eq. 7, "unbiased KL").

    ``D_t = (pi_theta / pi_old) * k3_t``. The ratio keeps its gradient, so even on-policy,
    where its value is 1, the gradient changes: by the product rule
    ``d D_t / d logp_t = r_t * k3_t + r_t * (1 - exp(ref_logp_t - logp_t))``, which at ``r_t = 1``
    is ``logp_t - ref_logp_t``: the gradient of the reverse KL, unbiased under sampling from
    ``pi_old``. Plain k3 would give ``1 - exp(ref_logp_t - logp_t)``.

    Args:
        logps: [B, T] current log-probs (with gradient).
        old_logps: [B, T] log-probs of the policy that sampled the tokens (no gradient).
        ref_logps: [B, T] reference log-probs (no gradient).
        ratio: the weight to use instead of the token ratio ``exp(logps - old_logps)``; a
            [B, T] tensor or one that broadcasts to it (e.g. [B, 1]). With
            ``importance_sampling_level="sequence"`` pass the (differentiable, length-normalised)
            sequence ratio so that a sequence-level weight multiplies every token's KL (the
            spec's behaviour; the unbiased-gradient property then holds only approximately).

    Returns:
        [B, T] per-token bias-corrected KL estimates.
    """
    if ratio is None:
        ratio = torch.exp(logps - old_logps)  # [B, T]
    return ratio * kl_k3(logps, ref_logps)


# --------------------------------------------------------------------------------------------
# Entropy
# --------------------------------------------------------------------------------------------


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean per-token entropy over the masked tokens, the bonus of entropy regularisation.

    ``H = sum_t(H_t m_t) / sum_t(m_t)`` and the loss becomes ``loss - coef * H``. The spec fixes
    it as the mean per-token entropy whatever the ``loss_type`` (it is not rescaled to a loss
    type's normaliser), so ``entropy_coef`` means the same for every loss type. The gradient
    flows through ``entropy`` when it has one.

    Args:
        entropy: [B, T] entropy of the policy's next-token distribution at each position.
        mask: [B, T] tokens that count.

    Returns:
        The scalar bonus (0 when no token counts).
    """
    return _masked_mean(entropy, mask)


def _quantile(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation) for 1-D inputs of any size.

    Above torch's size limit it interpolates between the two order statistics itself.
    """
    if values.numel() <= _QUANTILE_MAX_ELEMENTS:
        return torch.quantile(values, q)
    position = q * (values.numel() - 1)
    lo = int(position)
    hi = min(lo + 1, values.numel() - 1)
    ordered = torch.sort(values).values  # [N]
    return ordered[lo] + (position - lo) * (ordered[hi] - ordered[lo])


def entropy_quantile_mask(
    entropy: torch.Tensor, mask: torch.Tensor, level: float, population: torch.Tensor | None = None
) -> torch.Tensor:
    """Keep the valid tokens whose entropy is at or above the ``level`` quantile of the population.

    ``tau = torch.quantile(population, level)`` with linear interpolation; ties with ``tau`` are
    kept, so ``level = 0`` keeps every valid token and ``level = 1`` only those equal to the
    maximum. An empty population, or one holding NaN, keeps nothing.

    Args:
        entropy: [B, T] per-token entropies (only their values are used).
        mask: [B, T] valid tokens; padding is never kept.
        level: the quantile in [0, 1] (``1 - top_entropy_quantile``).
        population: 1-D valid entropies the threshold is taken over, e.g. gathered from every
            process so that all ranks share one threshold; defaults to this batch's valid ones.

    Returns:
        [B, T] bool mask.
    """
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"The entropy quantile level {level} must lie in [0, 1].")
    valid = mask.bool()  # [B, T]
    values = entropy.detach()
    pool = values[valid] if population is None else population.detach().flatten()  # [N]
    if pool.numel() == 0 or bool(torch.isnan(pool).any()):
        return torch.zeros_like(valid)
    threshold = _quantile(pool.float(), level)  # scalar
    return (values.float() >= threshold) & valid


def high_entropy_mask(
    entropy: torch.Tensor,
    mask: torch.Tensor,
    quantile: float,
    population: torch.Tensor | None = None,
) -> torch.Tensor:
    """Keep the tokens whose entropy is in the top-``rho`` quantile (Beyond the 80/20 Rule).

    The paper restricts the policy gradient to the "forking" tokens, ``1[H_t >= tau_rho]``, with
    ``tau_rho`` the entropy above which a fraction ``rho`` of the batch's tokens lie (rho = 0.2
    in the paper). Here ``tau = torch.quantile(valid_entropies, 1 - rho)`` with linear
    interpolation, and ties with ``tau`` are kept: ``rho = 1`` keeps every valid token
    (``tau`` is the minimum), ``rho = 0`` keeps only the maximum (and any token equal to it).
    With interpolation the fraction kept is ``rho`` up to rounding. (The authors' code keeps
    exactly ``ceil(rho * N)`` tokens by top-k; the quantile is the reference's rule.)

    Args:
        entropy: [B, T] per-token entropies (only their values are used).
        mask: [B, T] valid tokens; padding is never kept.
        quantile: ``rho`` in [0, 1] (``top_entropy_quantile``).
        population: optional 1-D tensor of the valid entropies the threshold is taken over,
            e.g. gathered from every process so all ranks share one threshold. Defaults to this
            batch's valid entropies.

    Returns:
        [B, T] bool mask.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile={quantile} must lie in [0, 1].")
    return entropy_quantile_mask(entropy, mask, 1.0 - quantile, population)


def next_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """Skywork-OR1's adaptive entropy coefficient after one optimizer step (Sec. 3.3).

    ``c_{k+1} = clip(c_k + delta, c_min, c_max)`` when ``e_k <= target`` and
    ``clip(c_k - delta, c_min, c_max)`` otherwise, ``e_k`` being the mean per-token entropy of
    step ``k``. (The paper leaves ``e_k = target`` unspecified; the spec's "falls to or below"
    increases there.)

    Returns:
        The coefficient for the next step.
    """
    step = delta if entropy <= target else -delta
    return float(min(max(coef + step, coef_min), coef_max))


def applied_entropy_coef(coef: float, entropy: float, target: float) -> float:
    """The coefficient that multiplies the bonus under adaptive control (Skywork-OR1, Sec. 3.3).

    ``alpha_k = c_k * 1[e_k <= target]``: the bonus acts only while the entropy is at or below
    the target (spec wording), otherwise its coefficient is 0.
    """
    return float(coef) if entropy <= target else 0.0


# --------------------------------------------------------------------------------------------
# Off-policy sequence masking
# --------------------------------------------------------------------------------------------


def off_policy_sequence_mask(
    logps_old_sampler: torch.Tensor,
    logps_current: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (Sec. 3.1, eq. 9, threshold ``delta``).

    ``M_i = 0`` if ``A_i < 0`` and ``(1/|o_i|) sum_t log(pi_old(o_it) / pi_theta(o_it)) > delta``,
    else 1. The divergence is the per-sequence Monte-Carlo estimate of ``KL(pi_old || pi_theta)``
    on tokens sampled from ``pi_old``: the mean over the sequence's valid tokens of
    ``old_logp_t - logp_t`` (positive when the current policy has lowered the sampled tokens'
    probability). It is a selection, not a loss: no gradient flows through it.

    Args:
        logps_old_sampler: [B, T] log-probs of the policy that sampled the tokens (the
            sampler's when available, else the old policy's).
        logps_current: [B, T] log-probs under the current policy.
        advantages: [B] advantages (or [B, 1]).
        mask: [B, T] valid tokens; a sequence with none has divergence 0. A NaN log-prob on a
            valid token (one the sampler could not score) counts as 0, as in the reference.
        threshold: ``delta`` (``off_policy_mask_threshold``), positive.

    Returns:
        [B] bool: True for the sequences kept in the policy term.
    """
    m = mask.to(logps_current.dtype)
    # a token the sampler could not score (NaN) gives no evidence: 0; padding never contributes
    log_ratio = torch.nan_to_num((logps_old_sampler - logps_current).detach(), nan=0.0)  # [B, T]
    log_ratio = torch.where(mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    divergence = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # [B]
    dropped = (advantages.reshape(-1) < 0) & (divergence > threshold)  # [B]
    return ~dropped


# --------------------------------------------------------------------------------------------
# Sampler / trainer importance sampling (TIS, MIS)
# --------------------------------------------------------------------------------------------


def _constrain(
    ratio: torch.Tensor, truncate: bool, clip_min: float | None, clip_max: float | None
) -> torch.Tensor:
    """Clamp the ratio to [clip_min, clip_max] (TIS) or zero it outside (MIS); None: unbounded."""
    if truncate:
        if clip_min is None and clip_max is None:
            return ratio
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    inside = torch.ones_like(ratio, dtype=torch.bool)
    if clip_min is not None:
        inside &= ratio >= clip_min
    if clip_max is not None:
        inside &= ratio <= clip_max
    return torch.where(inside, ratio, torch.zeros_like(ratio))


def _stats(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(min, mean, max) of a 1-D tensor, NaN when it is empty."""
    if values.numel() == 0:
        nan = torch.tensor(float("nan"), device=values.device)
        return nan, nan, nan
    return values.min(), values.mean(), values.max()


def sampler_is_weights(
    trainer_logps: torch.Tensor,
    sampler_logps: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights ``pi_train / pi_sampler`` that correct the training-inference mismatch.

    Token level: ``w_t = pi_train(o_t) / pi_sampler(o_t)``. Sequence level: one weight per
    sequence, the ratio of sequence probabilities ``prod_t w_t = exp(sum_t log w_t)`` over its
    valid tokens, not the length-normalised one (the sequence-level IS estimator of Liu et al.,
    "When Speed Kills Stability", and the spec's "a single sequence ratio"), applied to every
    token of the sequence. Then, with ``C = [clip_min, clip_max]``:

    * ``*_truncate`` (TIS, Yao et al. "off-policy RL" blog; two-sided as in IcePop):
      ``clip(w, C_min, C_max)``;
    * ``*_mask`` (MIS, IcePop): ``w * 1[C_min <= w <= C_max]``, bounds inclusive.

    ``None`` drops a bound. A product over a long sequence can overflow to ``inf``; MIS then
    masks it, TIS clamps it (unless ``clip_max`` is None).

    Args:
        trainer_logps: [B, T] log-probs recomputed by the training model for the sampled tokens
            at generation time (``pi_train(theta_old)``).
        sampler_logps: [B, T] log-probs the sampler returned.
        mask: [B, T] tokens the sampler produced and that count.
        mode: one of ``IS_MODES``.
        clip_min, clip_max: ``vllm_importance_sampling_clip_min`` / ``_clip_max``.

    Returns:
        [B, T] weights without gradient, 0 on padded tokens, and the metrics
        ``sampling/sampling_logp_difference/{mean,max}`` (``|trainer - sampler|`` over valid
        tokens) and ``sampling/importance_sampling_ratio/{min,mean,max}`` of the constrained
        weights over valid tokens (token modes) or over sequences with at least one valid token
        (sequence modes), with the ``.../count`` each mean is over. Metrics are 0-dim tensors, NaN
        when nothing is valid.
    """
    if mode not in IS_MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r} is not one of {IS_MODES}.")
    valid = mask.bool()  # [B, T]
    with torch.no_grad():
        log_ratio = torch.where(valid, trainer_logps - sampler_logps, torch.zeros_like(trainer_logps))
        level, constraint = mode.split("_")
        if level == "sequence":
            ratio = torch.exp(log_ratio.sum(dim=1, keepdim=True))  # [B, 1]
        else:
            ratio = torch.exp(log_ratio)  # [B, T]
        ratio = _constrain(ratio, constraint == "truncate", clip_min, clip_max)
        weights = ratio.expand_as(log_ratio) * valid.to(log_ratio.dtype)  # [B, T]
        if level == "sequence":
            counted = ratio.squeeze(1)[valid.any(dim=1)]  # [B'] sequences with a valid token
        else:
            counted = ratio[valid]  # [N] valid tokens
        diff = (trainer_logps - sampler_logps).abs()[valid]  # [N]
    return weights, _is_metrics(counted, diff)


def _is_metrics(counted: torch.Tensor, diff: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ``sampling/...`` metrics of the constrained weights ``counted`` and the log-prob gaps ``diff``."""
    ratio_min, ratio_mean, ratio_max = _stats(counted)
    _, diff_mean, diff_max = _stats(diff)
    return {
        "sampling/sampling_logp_difference/mean": diff_mean,
        "sampling/sampling_logp_difference/max": diff_max,
        "sampling/importance_sampling_ratio/min": ratio_min,
        "sampling/importance_sampling_ratio/mean": ratio_mean,
        "sampling/importance_sampling_ratio/max": ratio_max,
        # how many values each mean is over, so means of several micro-batches and processes combine exactly
        "sampling/sampling_logp_difference/count": torch.tensor(float(diff.numel())),
        "sampling/importance_sampling_ratio/count": torch.tensor(float(counted.numel())),
    }
