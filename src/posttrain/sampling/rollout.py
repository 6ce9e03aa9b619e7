"""Typed containers that carry a batch through one step of an online trainer (GRPO, RLOO).

``Rollout`` (generation) -> ``ScoredRollout`` (rewards and advantages) -> split into
``MicroBatch`` es that the loss consumes. Shapes use ``N`` rows (completions), ``P`` prompt
tokens (left padded), ``T`` completion tokens (right padded), ``F`` reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from posttrain.core.batch import Rollout, VisionInputs
from posttrain.ops.reductions import Normalizers

# Per-token tensors of a ScoredRollout, [N, T] (or [N, T, K]) like the completions, sliced and
# trimmed with them.
TOKEN_FIELDS = (
    "old_logps",
    "ref_logps",
    "sampler_logps",
    "sampler_top_logps",
    "sampler_top_ids",
    "sampler_support",
)


@dataclass
class ScoredRollout:
    """A rollout with its rewards, advantages and the per-token tensors the loss needs.

    Attributes:
        rollout: the generated batch (this process's rows).
        rewards: [N, F] per-function rewards, NaN where a function returned ``None``.
        advantages: [N] advantage of each completion.
        old_logps: [N, T] log-probs under the policy that sampled, or ``None`` when the step is
            on-policy (then the detached current log-probs are used).
        ref_logps: [N, T] log-probs under the reference policy (only with a KL penalty).
        sampler_logps: [N, T] the sampler's own log-probs of the tokens (asynchronous GRPO).
        sampler_top_logps, sampler_top_ids: [N, T, K] the sampler's K most likely tokens at each
            position and their log-probs (score centering).
        sampler_support: [N, T, M] the ids of each position's truncated support, ``-1`` padded, when
            the sampler truncates (top-k / top-p / min-p, asynchronous GRPO), or ``None``.
        teacher_prompt_ids, teacher_prompt_mask: [N, P'] the prompts a teacher reads the same
            completions after, left padded (self-distillation's privileged context), or ``None``.
        teacher_index: [N] which of several teachers scores each row (multi-teacher distillation), or ``None``.
        teacher_rows: [N] bool, the rows that have a teacher prompt (SDPO: the others add 0), or ``None``: all.
        teacher_vision: the image inputs of the teacher prompts (rows with images), or ``None``.
        norms: the counts the micro-batch losses are normalised by (``ops.reductions.Normalizers``).
        extra: a family's other values, shared by every micro-batch.
    """

    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    sampler_logps: torch.Tensor | None = None
    sampler_top_logps: torch.Tensor | None = None
    sampler_top_ids: torch.Tensor | None = None
    sampler_support: torch.Tensor | None = None
    teacher_prompt_ids: torch.Tensor | None = None
    teacher_prompt_mask: torch.Tensor | None = None
    teacher_index: torch.Tensor | None = None
    teacher_rows: torch.Tensor | None = None
    teacher_vision: VisionInputs | None = None
    norms: Normalizers = field(default_factory=Normalizers)
    extra: dict[str, Any] = field(default_factory=dict)

    def split(self, num_chunks: int) -> list[ScoredRollout]:
        """Split the rows into ``num_chunks`` equal micro-batches, trimming padding columns."""
        n = self.advantages.shape[0]
        if n % num_chunks != 0:
            raise ValueError(f"{n} rows cannot be split into {num_chunks} equal micro-batches.")
        size = n // num_chunks
        return [self._rows(slice(i * size, (i + 1) * size)) for i in range(num_chunks)]

    def _rows(self, rows: slice) -> ScoredRollout:
        sub = self.rollout.rows(rows)
        keep_t = sub.completion_ids.shape[1]
        per_token = {}
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            per_token[name] = value[rows, :keep_t] if value is not None else None
        teacher_ids = teacher_mask = None
        if self.teacher_prompt_ids is not None:  # the rows, without columns that are padding in all
            mask = self.teacher_prompt_mask[rows]
            start = mask.shape[1] - int(mask.sum(dim=1).max().item())
            teacher_ids, teacher_mask = self.teacher_prompt_ids[rows, start:], mask[:, start:]
        return replace(
            self,
            rollout=sub,
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            teacher_prompt_ids=teacher_ids,
            teacher_prompt_mask=teacher_mask,
            teacher_index=self.teacher_index[rows] if self.teacher_index is not None else None,
            teacher_rows=self.teacher_rows[rows] if self.teacher_rows is not None else None,
            teacher_vision=self.teacher_vision.select(rows) if self.teacher_vision is not None else None,
            extra=dict(self.extra),
            **per_token,
        )
