"""Group-relative advantages: pure tensor math.

Every function here takes tensors and returns ``(tensor, metrics)`` or a tensor; no model,
trainer or config object enters. Shapes: ``N`` completions (a multiple of the group size
``G``), ``F`` reward functions.

Conventions (shared with the reference implementation so numbers are comparable):

* the standard deviation is the unbiased one (Bessel's correction, ``torch.std``);
* the scaled advantage divides by ``std + EPS`` with ``EPS = 1e-4``, so a group whose rewards
  all agree gets advantage 0 rather than a division by zero.
"""

from __future__ import annotations

import torch

from posttrain.rewards.runner import weighted_sum  # noqa: F401  (the advantages start from it)

EPS = 1e-4

SCALE_MODES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """View ``x`` [N, ...] as [N / G, G, ...], checking that groups are whole."""
    if x.shape[0] % group_size != 0:
        raise ValueError(
            f"{x.shape[0]} completions do not form whole groups of num_generations={group_size}; "
            "every prompt's completions must sit in the same batch."
        )
    return x.view(x.shape[0] // group_size, group_size, *x.shape[1:])


def group_std(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """Unbiased standard deviation of each sample's group, repeated per sample: [N] -> [N].

    A group of one completion has no spread: its std is 0 (not NaN), so its advantage is 0.
    """
    if group_size == 1:
        return torch.zeros_like(values)
    return _grouped(values, group_size).std(dim=1).repeat_interleave(group_size)


def group_relative(
    rewards: torch.Tensor, group_size: int, scale: str = "group"
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO advantages of summed rewards (DeepSeekMath, eq. for outcome supervision).

    ``A_i = (r_i - mean(r_group(i))) / (s + EPS)`` where ``s`` is the std of the sample's group
    (``scale="group"``), of the whole batch (``"batch"``, as in Lite PPO), or 1 with no
    ``EPS`` (``"none"``, as recommended by Dr. GRPO).

    Args:
        rewards: [N] rewards, grouped consecutively by prompt.
        group_size: completions per prompt (``num_generations``).
        scale: one of ``SCALE_MODES``.

    Returns:
        [N] advantages, and ``{"frac_reward_zero_std": ...}``: the fraction of samples whose
        group rewards all agree (no learning signal).
    """
    if scale not in SCALE_MODES:
        raise ValueError(f"scale_rewards={scale!r} is not one of {SCALE_MODES}.")
    grouped = _grouped(rewards, group_size)  # [P, G]
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()  # [N]
    std_in_group = group_std(rewards, group_size)  # [N]
    if scale == "group":
        advantages = centred / (std_in_group + EPS)
    elif scale == "batch":
        advantages = centred / (rewards.std() + EPS)
    else:
        advantages = centred
    zero_std = torch.isclose(std_in_group, torch.zeros_like(std_in_group))
    return advantages, {"frac_reward_zero_std": zero_std.float().mean().item()}


def decoupled_group_normalized(
    rewards: torch.Tensor, weights: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """GDPO advantages: normalise each reward within its group, sum, then normalise the batch.

    ``A'_i = sum_f w_f * (R[i,f] - mean_g R[.,f]) / (std_g R[.,f] + EPS)``, then
    ``A_i = (A'_i - mean(A')) / (std(A') + EPS)`` over the batch (GDPO, Sec. 3). Entries a
    function did not score (NaN) contribute 0 and are left out of that function's group
    statistics.

    Args:
        rewards: [N, F] rewards, NaN where a function returned ``None``.
        weights: [F] weight of each function.
        group_size: completions per prompt.

    Returns:
        [N] advantages and ``{"frac_reward_zero_std": ...}`` measured on the weighted sum.
    """
    grouped = _grouped(rewards, group_size)  # [P, G, F]
    present = ~torch.isnan(grouped)
    count = present.sum(dim=1, keepdim=True).clamp(min=1)  # [P, 1, F]
    filled = torch.where(present, grouped, torch.zeros_like(grouped))
    mean = filled.sum(dim=1, keepdim=True) / count  # [P, 1, F]
    sq = torch.where(present, (grouped - mean) ** 2, torch.zeros_like(grouped))
    std = (sq.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # [P, 1, F]
    per_function = torch.where(present, (grouped - mean) / (std + EPS), torch.zeros_like(grouped))
    summed = (per_function * weights).sum(dim=-1).flatten()  # [N]
    advantages = (summed - summed.mean()) / (summed.std() + EPS)
    _, metrics = group_relative(weighted_sum(rewards, weights), group_size, "none")
    return advantages, metrics


def compute(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    scale: str = "group",
    aggregation: str = "sum_then_normalize",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Advantages of a batch from per-function rewards.

    Args:
        rewards: [N, F] rewards, NaN where a function returned ``None``.
        weights: [F] reward weights.
        group_size: completions per prompt (``num_generations``).
        scale: ``scale_rewards`` ("group", "batch", "none"), used by ``sum_then_normalize``.
        aggregation: ``multi_objective_aggregation``.

    Returns:
        [N] advantages and metrics (``frac_reward_zero_std``).
    """
    if aggregation == "sum_then_normalize":
        return group_relative(weighted_sum(rewards, weights), group_size, scale)
    if aggregation == "normalize_then_sum":
        return decoupled_group_normalized(rewards, weights, group_size)
    raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {AGGREGATIONS}.")
