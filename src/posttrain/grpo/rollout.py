"""Typed containers that carry a batch through one GRPO step.

``Rollout`` (generation) -> ``ScoredRollout`` (rewards and advantages) -> split into
``MicroBatch`` es that the loss consumes. Shapes use ``N`` rows (completions), ``P`` prompt
tokens (left padded), ``T`` completion tokens (right padded), ``F`` reward functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
        tool_mask: [N, T] in agent rollouts, 1 on the tokens the model sampled and 0 on those the
            tool loop inserted (tool results, template text); ``None`` when every completion
            token was sampled.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_terminated: torch.Tensor
    sampler_logps: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens (EOS included), inserted tool tokens included."""
        return self.completion_mask.sum(dim=1)

    @property
    def model_token_mask(self) -> torch.Tensor:
        """[N, T] 1 on the completion tokens the model sampled (tool results excluded)."""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask * self.tool_mask

    @property
    def generated_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens the model sampled (what ``completions/*`` count)."""
        return self.model_token_mask.sum(dim=1)

    def rows(self, rows: slice) -> Rollout:
        """The given rows, without the prompt columns that are padding in all of them and the
        completion columns past their longest completion."""
        keep_p = int(self.prompt_mask[rows].sum(dim=1).max().item())
        keep_t = max(int(self.completion_mask[rows].sum(dim=1).max().item()), 1)
        start_p = self.prompt_ids.shape[1] - keep_p
        return Rollout(
            prompt_ids=self.prompt_ids[rows, start_p:],
            prompt_mask=self.prompt_mask[rows, start_p:],
            completion_ids=self.completion_ids[rows, :keep_t],
            completion_mask=self.completion_mask[rows, :keep_t],
            is_terminated=self.is_terminated[rows],
            sampler_logps=self.sampler_logps[rows, :keep_t] if self.sampler_logps is not None else None,
            tool_mask=self.tool_mask[rows, :keep_t] if self.tool_mask is not None else None,
        )


# Per-token tensors of a ScoredRollout, [N, T] like the completions, sliced and trimmed with them.
TOKEN_FIELDS = ("old_logps", "ref_logps")


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
        norms: the counts the micro-batch losses are normalised by (``objectives.Normalizers``).
    """

    rollout: Rollout
    rewards: torch.Tensor
    advantages: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
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
        return replace(
            self,
            rollout=sub,
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            extra=dict(self.extra),
            **per_token,
        )
