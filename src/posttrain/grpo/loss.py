"""The full GRPO loss of one micro-batch: the policy term plus the configured regularisers.

``grpo_loss`` composes the pure pieces of ``objectives`` (the policy term of the chosen
``loss_type``) and ``regularizers`` (KL, entropy, masks and weights). It takes the policy's
forward output and the scored micro-batch, and returns the loss and what the trainer logs;
it knows nothing of models, processes or configs beyond ``LossSettings``.

Order of the per-token pieces (as in the reference):

1. token weights on the policy term: the high-entropy mask (``top_entropy_quantile``, 80/20),
   the off-policy sequence mask (DeepSeek-V3.2 eq. 9) and, when the sampler reported its
   log-probs, the TIS / MIS importance weights ``pi_train / pi_sampler``;
2. the policy term, reduced as its ``loss_type`` says;
3. ``+ beta * KL`` (k3, or bias-corrected by the importance ratio), reduced the same way;
4. ``- coef * mean per-token entropy`` (the bonus is never rescaled by the loss type);
5. ``+ router_aux_loss_coef * aux_loss`` for Mixture-of-Experts models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.grpo import objectives, regularizers
from posttrain.ops.logprobs import PolicyOutput
from posttrain.sampling.rollout import ScoredRollout


@dataclass(frozen=True)
class LossSettings:
    """Everything the loss needs to know besides the tensors.

    Attributes:
        objective: the policy term's settings.
        beta: KL coefficient (0: no reference policy).
        use_bias_correction_kl: multiply the KL by the importance ratio (DeepSeek-V3.2).
        top_entropy_quantile: keep only this top fraction of tokens by entropy in the policy term.
        off_policy_mask_threshold: drop negative-advantage sequences that drifted further than
            this from the sampling policy (``None``: off).
        entropy_regularized: add the entropy bonus (``entropy_coef != 0`` or adaptive).
        adaptive_entropy: apply the coefficient only while entropy is at or below the target.
        entropy_target: Skywork-OR1's target entropy.
        aux_loss_coef: router load-balancing coefficient (0: off).
        is_correction: correct for the sampler with importance weights when it reports log-probs.
        is_mode: TIS / MIS, token or sequence (``vllm_importance_sampling_mode``).
        is_clip_min, is_clip_max: the weights' bounds ``[C_min, C_max]`` (``None``: unbounded).
    """

    objective: objectives.ObjectiveSettings = field(default_factory=objectives.ObjectiveSettings)
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    top_entropy_quantile: float = 1.0
    off_policy_mask_threshold: float | None = None
    entropy_regularized: bool = False
    adaptive_entropy: bool = False
    entropy_target: float = 0.2
    aux_loss_coef: float = 0.0
    is_correction: bool = True
    is_mode: str = "sequence_mask"
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0

    @classmethod
    def from_config(cls, args: Any, aux_loss_coef: float = 0.0) -> LossSettings:
        """Read the settings from a ``GRPOConfig``; an unset ``epsilon_high`` is the loss type's
        ``default_epsilon_high`` (cispo's ``eps_max``, 5.0) or ``epsilon``."""
        if args.epsilon_high is not None:
            eps_high = args.epsilon_high
        else:
            default = objectives.LOSS_TYPES[args.loss_type].default_epsilon_high
            eps_high = default if default is not None else args.epsilon
        # a loss type's own hyper-parameters are GRPOConfig fields of the same name
        renamed = {"epsilon_low": args.epsilon, "epsilon_high": eps_high}
        objective = objectives.ObjectiveSettings(
            **{
                f.name: renamed[f.name] if f.name in renamed else getattr(args, f.name)
                for f in dataclasses.fields(objectives.ObjectiveSettings)
            }
        )
        objectives.resolve_loss(objective)  # a bad loss_type / level combination fails here
        return cls(
            objective=objective,
            beta=args.beta,
            use_bias_correction_kl=args.use_bias_correction_kl,
            top_entropy_quantile=args.top_entropy_quantile,
            off_policy_mask_threshold=args.off_policy_mask_threshold,
            entropy_regularized=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
            adaptive_entropy=args.use_adaptive_entropy,
            entropy_target=args.entropy_target,
            aux_loss_coef=aux_loss_coef,
            is_correction=args.vllm_importance_sampling_correction,
            is_mode=args.vllm_importance_sampling_mode,
            is_clip_min=args.vllm_importance_sampling_clip_min,
            is_clip_max=args.vllm_importance_sampling_clip_max,
        )


@dataclass
class LossResult:
    """The loss and what to log.

    Attributes:
        loss: the scalar to back-propagate (the micro-batch's share of the step's loss).
        per_completion: [B] tensors to gather across processes: the policy statistics of
            ``objectives.policy_loss`` plus ``entropy_sum`` and, with a KL, ``kl_sum`` (sums over
            each completion's counted tokens).
        scalars: detached scalars of this micro-batch: ``policy_loss``, and when active
            ``entropy_bonus`` (measured on the policy term's tokens), ``entropy_coef`` (the
            coefficient applied to this micro-batch: with adaptive entropy, 0 above the target)
            and ``aux_loss``.
        sampling: the ``sampling/*`` metrics of the importance-sampling correction (NaN when
            nothing was measured), when the sampler reported log-probs.
    """

    loss: torch.Tensor
    per_completion: dict[str, torch.Tensor]
    scalars: dict[str, float]
    sampling: dict[str, float] = field(default_factory=dict)


def _token_weights(
    s: LossSettings,
    out: PolicyOutput,
    batch: ScoredRollout,
    old: torch.Tensor,
    mask: torch.Tensor,
    gather_entropies: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Weights on the policy term, the tokens the entropy bonus is measured on, sampling metrics."""
    weights, bonus_mask, sampling = None, mask, {}
    if s.top_entropy_quantile < 1.0:
        # the threshold is taken over the micro-batch's valid tokens of every process
        entropy = out.entropy.detach()
        local = entropy[mask.bool()].float()  # [n]
        population = gather_entropies(local) if gather_entropies is not None else None
        keep = regularizers.high_entropy_mask(entropy, mask, s.top_entropy_quantile, population)
        weights = keep.to(mask.dtype)
        bonus_mask = mask * weights
    sampler = batch.rollout.sampler_logps
    own_correction = objectives.LOSS_TYPES[s.objective.loss_type].sampler_ratio
    if s.off_policy_mask_threshold is not None:
        reference = sampler if sampler is not None else old
        seq = regularizers.off_policy_sequence_mask(
            reference, out.logps.detach(), batch.advantages, mask, s.off_policy_mask_threshold
        )
        seq = seq.to(mask.dtype).unsqueeze(1)  # [B, 1]
        weights = seq if weights is None else weights * seq
    if sampler is not None and s.is_correction:
        # the trainer's log-probs of the sampled tokens: at generation time when known, else now
        w, metrics = regularizers.sampler_is_weights(
            old.detach(), sampler.to(old.device), mask, s.is_mode, s.is_clip_min, s.is_clip_max
        )
        if not own_correction:  # e.g. VESPO's Gamma weight is itself the correction (only the metrics here)
            weights = w if weights is None else weights * w
        sampling = {k: float(v) for k, v in metrics.items()}
    return weights, bonus_mask, sampling


def _kl(
    s: LossSettings, logps: torch.Tensor, old: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token KL to the reference: [B, T]."""
    if not s.use_bias_correction_kl:
        return regularizers.kl_k3(logps, ref)
    ratio = None
    if s.objective.importance_sampling_level == "sequence":
        ratio = torch.exp(objectives.masked_mean(logps - old, mask)).unsqueeze(1)  # [B, 1], differentiable
    return regularizers.bias_corrected_kl(logps, old, ref, ratio=ratio)


def grpo_loss(
    out: PolicyOutput,
    batch: ScoredRollout,
    mask: torch.Tensor,
    s: LossSettings,
    entropy_coef: float,
    gather_entropies: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> LossResult:
    """The loss of one micro-batch.

    Args:
        out: the policy's forward output on the micro-batch (log-probs with gradient, entropy).
        batch: the scored micro-batch (advantages, old / reference log-probs, normalisers).
        mask: [B, T] completion tokens that count in the loss.
        s: the settings.
        entropy_coef: the entropy coefficient in force (it moves when adaptive).
        gather_entropies: maps this process's valid token entropies ``[n]`` to those of every
            process, for the ``top_entropy_quantile`` threshold; ``None``: this process's only.

    Returns:
        A ``LossResult``.
    """
    logps = out.logps
    mask = mask.to(logps.dtype)
    old = batch.old_logps if batch.old_logps is not None else logps.detach()
    adv = batch.advantages.to(logps.device)
    weights, bonus_mask, sampling = _token_weights(s, out, batch, old, mask, gather_entropies)
    behaviour = old  # what the policy term's ratio is taken against
    sampler = batch.rollout.sampler_logps
    if objectives.LOSS_TYPES[s.objective.loss_type].sampler_ratio and sampler is not None and s.is_correction:
        behaviour = sampler.to(device=logps.device, dtype=logps.dtype)  # e.g. VESPO: W = pi_theta / mu
    policy, stats = objectives.policy_loss(logps, behaviour, adv, mask, s.objective, batch.norms, weights)
    loss, per_completion = policy, dict(stats)
    scalars = {"policy_loss": policy.item()}
    per_completion["entropy_sum"] = (out.entropy.detach() * mask).sum(dim=1)
    if s.beta != 0.0:
        kl = _kl(s, logps, old, batch.ref_logps, mask)
        reduction = objectives.LOSS_TYPES[s.objective.loss_type].reduction
        loss = loss + s.beta * objectives.reduce_loss(kl, mask, reduction, batch.norms)
        per_completion["kl_sum"] = (kl.detach() * mask).sum(dim=1)
    if s.entropy_regularized:
        bonus = regularizers.entropy_bonus(out.entropy, bonus_mask)
        coef = entropy_coef
        if s.adaptive_entropy:
            coef = regularizers.applied_entropy_coef(entropy_coef, bonus.item(), s.entropy_target)
        loss = loss - coef * bonus / batch.norms.accumulation
        scalars.update(entropy_bonus=bonus.item(), entropy_coef=coef)
    if s.aux_loss_coef and out.aux_loss is not None:
        loss = loss + s.aux_loss_coef * out.aux_loss / batch.norms.accumulation
        scalars["aux_loss"] = out.aux_loss.item()
    return LossResult(loss=loss, per_completion=per_completion, scalars=scalars, sampling=sampling)
