"""The metrics of a sampled batch, reduced across processes: completion lengths, rewards, and
the importance-sampling correction's ``sampling/*`` values.

Every online trainer logs these under the reference's names. Each function gathers what it
needs from every process (all processes must call it together) and returns plain floats.
"""

from __future__ import annotations

import math

import torch
from accelerate.utils import gather

from posttrain.core.batch import Rollout
from posttrain.rewards.runner import weighted_sum


def _stats(pattern: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {pattern.format(k): 0.0 for k in ("mean", "min", "max")}
    return {
        pattern.format("mean"): values.mean().item(),
        pattern.format("min"): values.min().item(),
        pattern.format("max"): values.max().item(),
    }


def _nanstd(values: torch.Tensor) -> float:
    present = values[~torch.isnan(values)]
    return present.std().item() if present.numel() > 1 else 0.0


def batch_tokens(rollout: Rollout, device: torch.device) -> int:
    """Prompt and sampled completion tokens of the batch over all processes (``num_tokens``)."""
    local = (rollout.prompt_mask.sum() + rollout.model_token_mask.sum()).reshape(1).to(device)
    return int(gather(local).sum().item())


def rollout_metrics(
    rollout: Rollout,
    rewards: torch.Tensor,
    names: list[str],
    weights: torch.Tensor,
    faults: dict[str, int] | None,
    device: torch.device,
) -> dict[str, float]:
    """``completions/*`` (lengths of the tokens the model sampled, clipped ratio), ``rewards/<name>/*``
    and ``reward``/``reward_std`` of the weighted sum.

    Args:
        rollout: this process's rows.
        rewards: [N, F] rewards of every process (already gathered).
        names: one name per reward column.
        weights: [F] reward weights.
        faults: per reward name, this process's faulted calls; ``None``: faults are not counted.
        device: the process's device (for the gathers).
    """
    lengths = gather(rollout.generated_lengths.to(device)).float().cpu()  # tool results not counted
    terminated = gather(rollout.is_terminated.to(device)).cpu()
    m = _stats("completions/{}_length", lengths)
    m.update(_stats("completions/{}_terminated_length", lengths[terminated]))
    m["completions/clipped_ratio"] = 1.0 - terminated.float().mean().item()
    for j, name in enumerate(names):
        col = rewards[:, j]
        m[f"rewards/{name}/mean"] = torch.nanmean(col).item()
        m[f"rewards/{name}/std"] = _nanstd(col)
    if faults is not None:
        local = torch.tensor([float(faults.get(name, 0)) for name in names], device=device)
        for name, count in zip(names, gather(local.unsqueeze(0)).sum(dim=0).tolist(), strict=True):
            m[f"rewards/{name}/faults"] = count
    if not names:  # a judge orders the completions (online DPO): there is no reward
        return m
    total = weighted_sum(rewards, weights)
    m["reward"] = total.mean().item()
    m["reward_std"] = total.std().item() if total.numel() > 1 else 0.0
    return m


def reduce_sampling_metrics(sampling: dict[str, float], device: torch.device) -> dict[str, float]:
    """The importance-sampling metrics of every process (``_combine``), their ``.../count`` kept for
    ``combine_step_metrics``."""
    keys = sorted(sampling)
    local = torch.tensor([[sampling[k] for k in keys]], device=device)
    everyone = gather(local).cpu().tolist()  # [processes, K]
    return _combine([dict(zip(keys, row, strict=True)) for row in everyone])


def combine_step_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """One optimizer step's importance-sampling metrics from its micro-batches' (each already
    reduced over processes), as if the step's completions had been measured at once; the
    ``.../count`` entries are dropped."""
    return {k: v for k, v in _combine(parts).items() if not k.endswith("/count")}


def _combine(parts: list[dict[str, float]]) -> dict[str, float]:
    """Min of ``*/min``, max of ``*/max``, the ``*/count``-weighted mean of ``*/mean`` (plain mean
    without a count), the sum of ``*/count``; NaN (nothing measured there) ignored."""
    keys = dict.fromkeys(k for part in parts for k in part)
    m: dict[str, float] = {}
    for key in keys:
        stem = key.rsplit("/", 1)[0]
        pairs = [(part[key], part.get(f"{stem}/count", 1.0)) for part in parts if key in part]
        pairs = [(v, c) for v, c in pairs if not math.isnan(v) and c > 0]
        if not pairs:
            continue
        if key.endswith("/min"):
            m[key] = min(v for v, _ in pairs)
        elif key.endswith("/max"):
            m[key] = max(v for v, _ in pairs)
        elif key.endswith("/count"):
            m[key] = sum(v for v, _ in pairs)
        else:
            m[key] = sum(v * c for v, c in pairs) / sum(c for _, c in pairs)
    return m
