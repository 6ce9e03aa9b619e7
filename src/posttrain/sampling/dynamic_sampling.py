"""DAPO dynamic sampling: replace groups whose rewards all agree.

A group whose completions all got the same reward has zero advantage everywhere and teaches
nothing, yet it takes a slot of the batch. DAPO (Yu et al. 2025, Sec. 3.2, "Dynamic
Sampling") over-samples and keeps only groups with spread until the batch is full. Here the
generation batch is generated with ``dynamic_sampling_oversample - 1`` times as many further
prompts (in the same generation call); when fewer groups than the batch holds have spread, further
rounds of as many prompts are generated (at most ``dynamic_sampling_max_rounds``). The groups with
spread fill the batch, in sampling order or hardest first (``dynamic_sampling_prefer``); when the
rounds run out, the remaining slots keep their zero-spread groups, so the batch size never changes.

The selection is pure and works on one process's groups; each process refills its own slots,
so groups must not straddle processes (the per-process generation batch must be a multiple of
``num_generations``).
"""

from __future__ import annotations

import torch

from posttrain.core.batch import Rollout, VisionInputs
from posttrain.ops.padding import left_pad
from posttrain.rewards.runner import weighted_sum


def groups_with_spread(rewards: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups have rewards that are not all equal.

    Args:
        rewards: [N, F] per-function rewards (NaN for ``None``), groups consecutive.
        weights: [F] reward weights; the spread is measured on the weighted sum.
        group_size: completions per prompt.

    Returns:
        [N / G] booleans.
    """
    total = weighted_sum(rewards, weights).view(-1, group_size)  # [P, G]
    return (total.max(dim=1).values - total.min(dim=1).values) > 0


def select_groups(
    spread: list[torch.Tensor], slots: int, mean_rewards: list[torch.Tensor] | None = None
) -> list[tuple[int, int]]:
    """Pick ``slots`` groups for the batch.

    In sampling order (``mean_rewards`` None, DAPO's rule): the batch's own groups with spread keep
    their positions and each of its zero-spread groups is replaced in turn by the next group with
    spread, from the first round's over-sampled groups, then from later rounds'. Hardest first
    (``mean_rewards`` given): the groups with spread of every round, lowest mean reward first (ties
    in sampling order). Either way, slots that no group with spread fills keep the batch's own
    zero-spread groups, in order.

    Args:
        spread: per round, [P_r] booleans. Round 0 is the sampled batch: its first ``slots`` groups
            are the batch's own prompts, any further ones its over-sampled groups.
        slots: groups the batch holds.
        mean_rewards: per round, [P_r] mean weighted reward of each group, for hardest first.

    Returns:
        ``(round, group)`` pairs, ``slots`` of them, in batch order.
    """
    own_flat = [(0, g) for g in range(slots) if not spread[0][g]]
    if mean_rewards is not None:
        ranked = sorted(
            (float(mean_rewards[r][g]), r, g)
            for r, ok in enumerate(spread)
            for g in ok.nonzero().flatten().tolist()
        )
        chosen = [(r, g) for _, r, g in ranked[:slots]]
        return chosen + own_flat[: slots - len(chosen)]
    extra = [(0, g) for g in range(slots, len(spread[0])) if spread[0][g]]
    replacements = extra + [
        (r, g) for r in range(1, len(spread)) for g in spread[r].nonzero().flatten().tolist()
    ]
    chosen = []
    for g in range(slots):
        if spread[0][g] or not replacements:
            chosen.append((0, g))
        else:
            chosen.append(replacements.pop(0))
    return chosen


def group_means(rewards: torch.Tensor, weights: torch.Tensor, group_size: int) -> torch.Tensor:
    """Mean weighted reward of each group: [N, F] -> [N / G] (NaN rewards count as ``None`` do)."""
    return weighted_sum(rewards, weights).view(-1, group_size).mean(dim=1)


def take_groups(
    rollouts: list[Rollout], chosen: list[tuple[int, int]], group_size: int, pad_token_id: int
) -> Rollout:
    """Assemble a rollout from the chosen groups of several rollouts, padding anew."""
    rows = [(r, g * group_size + k) for r, g in chosen for k in range(group_size)]

    def prompt(r: int, i: int) -> list[int]:
        ro = rollouts[r]
        return ro.prompt_ids[i][ro.prompt_mask[i].bool()].tolist()

    prompt_ids, prompt_mask = left_pad([prompt(r, i) for r, i in rows], pad_token_id)
    width = max(rollouts[r].completion_ids.shape[1] for r, _ in rows)

    def right(t: torch.Tensor, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]), value=value)

    completion_ids = torch.stack([right(rollouts[r].completion_ids[i], pad_token_id) for r, i in rows])
    completion_mask = torch.stack([right(rollouts[r].completion_mask[i], 0) for r, i in rows])
    sampler = None
    if rollouts[0].sampler_logps is not None:
        sampler = torch.stack([right(rollouts[r].sampler_logps[i], 0.0) for r, i in rows])
    tool_mask = None
    if rollouts[0].tool_mask is not None:
        tool_mask = torch.stack([right(rollouts[r].tool_mask[i], 0) for r, i in rows])
    vision = None
    if any(ro.vision is not None for ro in rollouts):  # each row keeps its own images
        vision = VisionInputs.gather([(rollouts[r].vision, i) for r, i in rows])
    device = rollouts[0].prompt_ids.device
    return Rollout(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_terminated=torch.stack([rollouts[r].is_terminated[i] for r, i in rows]),
        sampler_logps=sampler,
        tool_mask=tool_mask,
        vision=vision,
    )
