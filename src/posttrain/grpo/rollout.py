"""Typed containers that carry a batch through one GRPO step.

``Rollout`` (generation) -> ``ScoredRollout`` (rewards and advantages) -> split into
``MicroBatch`` es that the loss consumes. Shapes use ``N`` rows (completions), ``P`` prompt
tokens (left padded), ``T`` completion tokens (right padded), ``F`` reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from posttrain.grpo.objectives import Normalizers


@dataclass
class Rollout:
    """What the generator produced for a batch of prompts.

    Attributes:
        prompt_ids: [N, P] prompt tokens, left padded.
        prompt_mask: [N, P] 1 on real prompt tokens.
        completion_ids: [N, T] sampled tokens, right padded.
        completion_mask: [N, T] 1 up to and including the first EOS, 0 after it.
        is_terminated: [N] whether the completion ended with EOS (False: cut at the length limit).
        sampler_logps: [N, T] log-probabilities the sampler assigned, when it reports them.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_terminated: torch.Tensor
    sampler_logps: torch.Tensor | None = None

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens (EOS included)."""
        return self.completion_mask.sum(dim=1)


@dataclass
class ScoredRollout:
    """A rollout with its rewards, advantages and, when off-policy, old log-probs.

    Attributes:
        rollout: the generated batch (this process's rows).
        rewards: [N, F] per-function rewards, NaN where a function returned ``None``.
        advantages: [N] advantage of each completion.
        old_logps: [N, T] log-probs under the policy that sampled, or ``None`` when the step is
            on-policy (then the detached current log-probs are used).
        norms: the counts the micro-batch losses are normalised by (``objectives.Normalizers``).
    """

    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
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
        r = self.rollout
        sub = Rollout(
            **{
                f.name: (getattr(r, f.name)[rows] if getattr(r, f.name) is not None else None)
                for f in fields(Rollout)
            }
        )
        old = self.old_logps[rows] if self.old_logps is not None else None
        sub, old = _trim(sub, old)
        return replace(
            self, rollout=sub, rewards=self.rewards[rows], advantages=self.advantages[rows], old_logps=old
        )


def _trim(r: Rollout, old: torch.Tensor | None) -> tuple[Rollout, torch.Tensor | None]:
    """Drop prompt columns that are padding in every row, and completion columns past the longest."""
    keep_p = int(r.prompt_mask.sum(dim=1).max().item())
    keep_t = max(int(r.completion_mask.sum(dim=1).max().item()), 1)
    P = r.prompt_ids.shape[1]
    trimmed = replace(
        r,
        prompt_ids=r.prompt_ids[:, P - keep_p :],
        prompt_mask=r.prompt_mask[:, P - keep_p :],
        completion_ids=r.completion_ids[:, :keep_t],
        completion_mask=r.completion_mask[:, :keep_t],
        sampler_logps=r.sampler_logps[:, :keep_t] if r.sampler_logps is not None else None,
    )
    return trimmed, (old[:, :keep_t] if old is not None else None)
