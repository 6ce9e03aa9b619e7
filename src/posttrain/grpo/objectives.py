"""GRPO policy objectives: pure tensor math.

Every ``loss_type`` is one row of the table ``LOSS_TYPES``: a ``LossSpec`` composed of

* the **importance level** it accepts (``ObjectiveSettings.importance_sampling_level``):
  ``"token"`` keeps one ratio per token; ``"sequence"`` (GSPO) gives every token of a
  completion the length-normalised sequence ratio, see ``sequence_old_logps``;
* a **term**: the per-token loss ``[B, T]`` from log-probs, old log-probs and advantages
  (``clipped_surrogate``, ``cispo_surrogate``, ``sapo_surrogate``, ``vespo_surrogate``,
  ``gmpo_surrogate``) and the ``ObjectiveSettings`` fields it reads;
* a **reduction** (``REDUCTIONS``): how the masked per-token losses of a micro-batch become
  its share of the optimizer step's scalar loss;
* the **clip region** the statistics count (``CLIP_REGIONS``) and any extra statistics.

``policy_loss`` is the one entry point; it composes the pieces of the row. The importance
weights and the terms are in ``grpo/policy_terms.py`` and imported here.

==========  ======================  ============  ================  ==========  =============
loss_type   term                    reduction     levels            clip stats  extra stats
==========  ======================  ============  ================  ==========  =============
grpo        clipped_surrogate       sequence      token, sequence   ratio       -
dapo        clipped_surrogate       token         token, sequence   ratio       -
bnpo        clipped_surrogate       token_local   token, sequence   ratio       -
dr_grpo     clipped_surrogate       fixed_length  token, sequence   ratio       -
luspo       clipped_surrogate       sequence_sum  sequence          ratio       -
cispo       cispo_surrogate         token         token, sequence   none        cispo_clip
sapo        sapo_surrogate          sequence      token, sequence   none        -
vespo       vespo_surrogate         token         token             none        vespo_phi
gmpo        gmpo_surrogate          sequence      token             log         -
==========  ======================  ============  ================  ==========  =============

Statistics: ``policy_loss`` returns per-completion tensors ``[B]`` (without gradient), for
every loss type ``low``, ``high``, ``region`` (fraction of the completion's tokens whose
ratio lies below the lower bound with ``A < 0``, above the upper bound with ``A > 0``,
either; with ``importance_sampling_level="sequence"`` every token carries the sequence ratio,
so the fraction is 0 or 1) and ``tokens`` (its loss-counted tokens, the weight for batch
means). Clip stats ``ratio``: bounds ``[1 - epsilon_low, 1 + epsilon_high]``; ``log``: bounds
``[exp(-epsilon_low), exp(epsilon_high)]``; ``none``: the loss has no hard clip and the three
fractions are 0. ``cispo`` adds ``cispo_clip`` (fraction of tokens whose weight was truncated
at ``eps_max`` while ``A > 0``) and ``vespo`` adds ``vespo_phi`` (the sequence's Gamma weight).

Shapes: ``B`` completions in the micro-batch, ``T`` completion tokens. ``mask`` is 1 on the
completion tokens that count in the loss; log-probs at other positions are ignored (they are
zeroed before any term sees them, so padding garbage, even ``inf``, cannot leak).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from posttrain.grpo.policy_terms import (  # noqa: F401  (re-exported)
    cispo_surrogate,
    clipped_surrogate,
    gmpo_surrogate,
    importance_old_logps,
    importance_ratio,
    sapo_gate,
    sapo_surrogate,
    sequence_old_logps,
    vespo_gamma_weight,
    vespo_surrogate,
)
from posttrain.ops.reductions import (  # noqa: F401  (the reductions of the table below)
    REDUCTIONS,
    TOKEN_SUMMED_REDUCTIONS,
    Normalizers,
    masked_mean,
    reduce_loss,
)

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ObjectiveSettings:
    """The hyper-parameters of the policy objective (the GRPOConfig fields it reads).

    Attributes:
        loss_type: a key of ``LOSS_TYPES``.
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO).
        epsilon_low: lower clip range (``epsilon``); for ``gmpo`` a log-space range.
        epsilon_high: upper clip range; for ``gmpo`` a log-space range; for ``cispo`` it is
            ScaleRL's ``eps_max``, the cap of the importance weight itself (the trainer
            passes 5.0 when the config's ``epsilon_high`` is None).
        delta: INTELLECT-2's cap of the unclipped ratio (two-sided clipping); None disables.
        sapo_temperature_pos, sapo_temperature_neg: SAPO's gate temperatures for ``A > 0``
            and ``A <= 0``.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO's Gamma-kernel
            exponent ``k`` and decay ``lambda`` for ``A > 0`` and ``A <= 0``.
    """

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0


# ---- statistics --------------------------------------------------------------------------


def clip_fractions_between(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lower: float, upper: float
) -> Stats:
    """Which tokens lie outside the trust region ``[lower, upper]`` where it binds, per completion.

    A token counts as clipped low when ``r < lower`` and ``A < 0``, high when ``r > upper`` and
    ``A > 0`` (only then does a one-sided clip stop its gradient).

    Returns:
        ``low``, ``high``, ``region``: [B] fractions of each completion's tokens, and
        ``tokens``: [B] token counts (to weight the fractions into batch means).
    """
    mask = mask.to(ratio.dtype)
    adv = advantages.unsqueeze(1)  # [B, 1]
    low = ((ratio < lower) & (adv < 0)).to(ratio.dtype) * mask  # [B, T]
    high = ((ratio > upper) & (adv > 0)).to(ratio.dtype) * mask  # [B, T]
    tokens = mask.sum(dim=1)  # [B]
    denom = tokens.clamp(min=1.0)
    return {
        "low": low.sum(dim=1) / denom,
        "high": high.sum(dim=1) / denom,
        "region": (low + high).sum(dim=1) / denom,
        "tokens": tokens,
    }


def clip_fractions(
    ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, eps_low: float, eps_high: float
) -> Stats:
    """``clip_fractions_between`` for PPO's region ``[1 - eps_low, 1 + eps_high]``."""
    return clip_fractions_between(ratio, advantages, mask, 1 - eps_low, 1 + eps_high)


def _ratio_region(s: ObjectiveSettings) -> tuple[float, float]:
    return 1 - s.epsilon_low, 1 + s.epsilon_high


def _log_region(s: ObjectiveSettings) -> tuple[float, float]:
    return math.exp(-s.epsilon_low), math.exp(s.epsilon_high)


def _no_region(s: ObjectiveSettings) -> tuple[float, float]:
    return 0.0, math.inf


CLIP_REGIONS: dict[str, Callable[[ObjectiveSettings], tuple[float, float]]] = {
    "ratio": _ratio_region,
    "log": _log_region,
    "none": _no_region,
}


def cispo_stats(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, s: ObjectiveSettings
) -> Stats:
    """``cispo_clip``: [B] fraction of tokens with ``r > eps_max`` and ``A > 0`` (TRL's metric)."""
    truncated = (log_ratio.exp() > s.epsilon_high) & (advantages.unsqueeze(1) > 0)  # [B, T]
    return {"cispo_clip": masked_mean(truncated.to(mask.dtype), mask)}


def vespo_stats(
    log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, s: ObjectiveSettings
) -> Stats:
    """``vespo_phi``: [B] each sequence's Gamma weight ``phi(W)``."""
    log_w = (log_ratio * mask).sum(dim=1)  # [B]
    phi = vespo_gamma_weight(
        log_w, advantages, s.vespo_k_pos, s.vespo_lambda_pos, s.vespo_k_neg, s.vespo_lambda_neg
    )
    return {"vespo_phi": phi}


# ---- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSpec:
    """How one ``loss_type`` is computed: a composition of the pieces above.

    Attributes:
        term: per-token loss ``(logps, old_logps, advantages, *hyper[, mask=]) -> [B, T]``.
        reduction: a key of ``REDUCTIONS``.
        hyper: the ``ObjectiveSettings`` fields passed to ``term`` after the tensors, in order.
        masked_term: whether ``term`` couples the tokens of a sequence and takes ``mask=``.
        levels: the ``importance_sampling_level`` values the loss accepts.
        clip_region: a key of ``CLIP_REGIONS``: the bounds ``low``/``high``/``region`` count
            (``"none"``: the loss has no hard clip; the trainer need not log them).
        extra_stats: ``(log_ratio, advantages, mask, settings) -> {name: [B]}`` or None.
        extra_metrics: the metrics logged from ``extra_stats``, one ``ExtraMetric`` each.
        default_epsilon_high: the upper bound when ``GRPOConfig.epsilon_high`` is None (None:
            ``epsilon``, as for the clipped losses).
        sampler_ratio: the term's own weight is taken against the sampler's log-probs (it is
            itself the sampler correction), so the importance-sampling weights are not applied on
            top; their metrics are still logged.
    """

    term: Callable[..., torch.Tensor]
    reduction: str
    hyper: tuple[str, ...] = ()
    masked_term: bool = False
    levels: tuple[str, ...] = ("token", "sequence")
    clip_region: str = "ratio"
    extra_stats: Callable[..., Stats] | None = None
    extra_metrics: tuple[ExtraMetric, ...] = ()
    default_epsilon_high: float | None = None
    sampler_ratio: bool = False


@dataclass(frozen=True)
class ExtraMetric:
    """One logged metric of a loss type's ``extra_stats``.

    Attributes:
        stat: the key of ``extra_stats``' output ([B] per completion).
        name: the metric's logged name.
        per_token: weighted by each completion's counted tokens (like the clip ratios; a mean
            over completions at ``importance_sampling_level="sequence"``); False: a plain mean
            over completions.
    """

    stat: str
    name: str
    per_token: bool = True


_CLIP = ("epsilon_low", "epsilon_high", "delta")
_VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")

LOSS_TYPES: dict[str, LossSpec] = {
    # GRPO (DeepSeekMath eq. 3): mean over each sequence's tokens, then over sequences.
    "grpo": LossSpec(clipped_surrogate, "sequence", _CLIP),
    # DAPO (eq. 8): token-level average over every active token of the accumulated global batch.
    "dapo": LossSpec(clipped_surrogate, "token", _CLIP),
    # BNPO: token average over the local micro-batch.
    "bnpo": LossSpec(clipped_surrogate, "token_local", _CLIP),
    # Dr. GRPO (arXiv 2503.20783, Sec. 3.2): sum divided by batch size x max_completion_length.
    "dr_grpo": LossSpec(clipped_surrogate, "fixed_length", _CLIP),
    # LUSPO (arXiv 2602.05261): GSPO with each sequence's loss scaled by its length.
    "luspo": LossSpec(clipped_surrogate, "sequence_sum", _CLIP, levels=("sequence",)),
    # CISPO (MiniMax-M1 / ScaleRL): detached truncated weight x A x logp, DAPO's normaliser.
    "cispo": LossSpec(
        cispo_surrogate,
        "token",
        ("epsilon_high",),
        clip_region="none",
        extra_stats=cispo_stats,
        extra_metrics=(ExtraMetric("cispo_clip", "cispo_clip_ratio"),),
        default_epsilon_high=5.0,  # ScaleRL's eps_max
    ),
    # SAPO (Qwen): sigmoid soft gate instead of the clip, per-sequence token mean.
    "sapo": LossSpec(
        sapo_surrogate, "sequence", ("sapo_temperature_pos", "sapo_temperature_neg"), clip_region="none"
    ),
    # VESPO: detached Gamma weight of the unnormalised sequence ratio; it is sequence-level by
    # construction, so it takes token-level inputs only.
    "vespo": LossSpec(
        vespo_surrogate,
        "token",
        _VESPO,
        masked_term=True,
        levels=("token",),
        clip_region="none",
        extra_stats=vespo_stats,
        extra_metrics=(ExtraMetric("vespo_phi", "vespo/phi_seq_mean", per_token=False),),
        sampler_ratio=True,  # W = pi_theta / mu, mu the sampler
    ),
    # GMPO: geometric mean of per-token log-space-clipped ratios, mean over sequences.
    "gmpo": LossSpec(
        gmpo_surrogate,
        "sequence",
        ("epsilon_low", "epsilon_high"),
        masked_term=True,
        levels=("token",),
        clip_region="log",
    ),
}


def resolve_loss(settings: ObjectiveSettings) -> LossSpec:
    """The ``LOSS_TYPES`` row of ``settings``, after checking its importance level.

    Raises:
        NotImplementedError: ``settings.loss_type`` is not in ``LOSS_TYPES``.
        ValueError: the loss does not accept ``settings.importance_sampling_level``.
    """
    spec = LOSS_TYPES.get(settings.loss_type)
    if spec is None:
        raise NotImplementedError(
            f"loss_type={settings.loss_type!r} is not implemented; use one of {sorted(LOSS_TYPES)}."
        )
    level = settings.importance_sampling_level
    if level not in ("token", "sequence"):
        raise ValueError(f"importance_sampling_level={level!r} is invalid; use 'token' or 'sequence'.")
    if level not in spec.levels:
        raise ValueError(
            f"loss_type={settings.loss_type!r} needs importance_sampling_level in {list(spec.levels)}, "
            f"got {level!r}; set importance_sampling_level={spec.levels[0]!r}."
        )
    return spec


def policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: ObjectiveSettings,
    norms: Normalizers,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """The policy loss of one micro-batch and its per-completion statistics.

    Composes the ``LOSS_TYPES`` row of ``settings.loss_type``: the importance level's "old"
    log-probs, the term, the reduction and the statistics (see the module docstring).

    Args:
        logps: [B, T] log-probs of the sampled tokens under the current policy (with gradient).
        old_logps: [B, T] log-probs under the sampling policy (no gradient; ``logps.detach()``
            on-policy).
        advantages: [B] advantages.
        mask: [B, T] completion tokens that count.
        settings: the objective's hyper-parameters.
        norms: the step's counts, see ``reduce_loss``.
        token_weights: [B, T] factors (no gradient) multiplying each token's policy loss while
            the reduction still counts every token of ``mask``: the high-entropy token mask
            (80/20), the off-policy sequence mask (DeepSeek-V3.2) and sampler importance weights.

    Returns:
        The scalar loss and a dict of [B] tensors without gradient: ``low``, ``high``,
        ``region``, ``tokens``, plus ``cispo_clip`` (cispo) or ``vespo_phi`` (vespo).

    Raises:
        NotImplementedError: unknown ``loss_type``.
        ValueError: the loss does not accept ``importance_sampling_level``.
    """
    spec = resolve_loss(settings)
    mask = mask.to(logps.dtype)
    keep = mask > 0
    logps = logps.masked_fill(~keep, 0.0)  # [B, T] padding cannot leak, even inf
    old_logps = old_logps.detach().masked_fill(~keep, 0.0)  # [B, T]
    old = importance_old_logps(logps, old_logps, mask, settings.importance_sampling_level)  # [B, T]
    hyper = [getattr(settings, name) for name in spec.hyper]
    extra = {"mask": mask} if spec.masked_term else {}
    per_token = spec.term(logps, old, advantages, *hyper, **extra)  # [B, T]
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    loss = reduce_loss(per_token, mask, spec.reduction, norms)
    with torch.no_grad():
        log_ratio = logps.detach() - old  # [B, T]
        lower, upper = CLIP_REGIONS[spec.clip_region](settings)
        stats = clip_fractions_between(log_ratio.exp(), advantages, mask, lower, upper)
        if spec.extra_stats is not None:
            stats.update(spec.extra_stats(log_ratio, advantages, mask, settings))
    return loss, stats
