"""The GRPO loss metrics of a micro-batch, reduced across processes: ``entropy``, ``kl``, the
clip ratios of the loss type, and the loss's own scalars."""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather

from posttrain.grpo import objectives
from posttrain.observe.metrics import clip_ratios


def loss_metrics(
    per_completion: dict[str, torch.Tensor],
    scalars: dict[str, float],
    args: Any,
    entropy_regularized: bool,
    entropy_coef: float,
    device: torch.device,
) -> dict[str, float]:
    """Gather a micro-batch's per-completion statistics (``loss.LossResult``) into metrics.

    Token-level statistics are weighted by each completion's counted tokens; at
    ``importance_sampling_level="sequence"`` each completion is clipped as a whole, so its clip
    fractions are averaged over completions.
    """
    g = {k: gather(v.detach().float().to(device)).cpu() for k, v in per_completion.items()}
    tokens = g["tokens"].clamp(min=0)
    total = max(tokens.sum().item(), 1.0)
    sequence_level = args.importance_sampling_level == "sequence"
    weight = torch.ones_like(tokens) / len(tokens) if sequence_level else tokens / total
    m = {"entropy": g["entropy_sum"].sum().item() / total}
    spec = objectives.LOSS_TYPES[args.loss_type]
    if spec.clip_region != "none":
        m.update(clip_ratios(g["low"], g["high"], g["region"], weight))
    for extra in spec.extra_metrics:
        values = g[extra.stat]
        m[extra.name] = (values * weight).sum().item() if extra.per_token else values.mean().item()
    if "kl_sum" in g:
        m["kl"] = g["kl_sum"].sum().item() / total
    local = torch.tensor([scalars[k] for k in sorted(scalars)], device=device)
    means = gather(local.unsqueeze(0)).mean(dim=0).tolist()
    reported = {"aux_loss"}
    if entropy_regularized:
        reported.add("policy_loss")  # the spec logs it only next to an entropy term
        m["entropy_coef"] = entropy_coef  # the current coefficient (adaptive: before gating)
    for key, value in zip(sorted(scalars), means, strict=True):
        if key in reported:
            m[key] = value
    return m
