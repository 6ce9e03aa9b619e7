"""The hooks a family that samples may override in ``OnlineTrainer`` (``core/hooks.py`` has the rest)."""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

from posttrain.core.batch import Rollout
from posttrain.core.hooks import FamilyHooks, hook_names
from posttrain.sampling.rollout import ScoredRollout


class OnlineFamilyHooks(FamilyHooks, Protocol):
    """What a family that samples may override in ``OnlineTrainer``, in the order a step runs them."""

    #: Whether the family needs reward functions (distillation: no; SDPO: yes).
    _reward_required: ClassVar[bool]
    #: Whether bf16=True on a bf16 CPU samples from a bf16 copy (a loss that never reads the
    #: sampler's log-probs: RLOO, online DPO, A*-PO; GRPO sets its sampler itself).
    _bf16_sampler_copy: ClassVar[bool]

    @property
    def _judged(self) -> bool:
        """Whether a judge orders the completions instead of rewards (online DPO)."""

    @property
    def _prompt_token_budget(self) -> int | None:
        """The most prompt tokens a sampled prompt keeps, or None for whole prompts (A*-PO)."""

    def _setup_reference(self) -> torch.nn.Module | None:
        """The frozen reference model, or ``None`` (no KL, a PEFT policy, a teacher instead)."""

    def _sample(self, batch: list[dict[str, Any]], mode: str) -> tuple[Rollout, torch.Tensor]:
        """Completions for the rows, scored: the rollout and [n, F] rewards (online DPO: two per
        prompt; A*-PO: one)."""

    def _generate_and_score(
        self, batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> list[ScoredRollout]:
        """The whole sampling stage: sample, score, advantages, split into micro-batches (GKD and
        GOLD choose the student's, the teacher's or the dataset's completions here)."""

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]], mode: str) -> None:
        """Per-row additions to a sampled batch before the split (self-distillation's teacher prompts)."""

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The family's advantages of every process's completions, and metrics about them."""

    def _needs_old_logps(self, mode: str) -> bool:
        """Whether the sampling policy's log-probs must be computed now (the step is off-policy)."""

    def _needs_ref_logps(self) -> bool:
        """Whether the loss needs the reference's log-probs (a KL term)."""

    @property
    def _loss_temperature(self) -> float:
        """What the loss's log-probs divide the logits by (the sampling temperature, or 1)."""

    def _loss_mask(self, rollout: Rollout) -> torch.Tensor:
        """[N, T] the completion tokens that count in the loss."""


#: Every hook a family may override, by name (``BaseTrainer``'s and ``OnlineTrainer``'s).
HOOK_NAMES: frozenset[str] = hook_names(FamilyHooks, OnlineFamilyHooks)
