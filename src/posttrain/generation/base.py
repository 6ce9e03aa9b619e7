"""The generation protocol shared by every backend.

A backend turns a batch of tokenised prompts into sampled completions. Everything after that
(EOS masking, the ``Rollout`` container) is shared and lives here, so backends stay small and
tests can plug in a scripted generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from posttrain.grpo.rollout import Rollout


@dataclass
class Samples:
    """Raw backend output.

    Attributes:
        completion_ids: [N, T] sampled tokens; anything after the first EOS is ignored.
        logps: [N, T] the sampler's log-probs of those tokens, if it reports them.
    """

    completion_ids: torch.Tensor
    logps: torch.Tensor | None = None


@runtime_checkable
class Generator(Protocol):
    """Samples one completion per row of a left-padded prompt batch."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P]. Returns one completion per row."""
        ...


def mask_after_eos(
    completion_ids: torch.Tensor, eos_token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token after the first EOS.

    Args:
        completion_ids: [N, T] sampled tokens.
        eos_token_ids: ids that end a completion.

    Returns:
        ``mask`` [N, T] (1 up to and including the first EOS) and ``is_terminated`` [N].
    """
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))  # [N, T]
    is_terminated = is_eos.any(dim=1)
    T = completion_ids.shape[1]
    first_eos = torch.where(
        is_terminated, is_eos.int().argmax(dim=1), torch.full_like(is_terminated, T, dtype=torch.long)
    )
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(1)).long()
    return mask, is_terminated


def build_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: Samples,
    eos_token_ids: list[int],
    pad_token_id: int,
) -> Rollout:
    """Assemble a ``Rollout``: mask after EOS, replace masked tokens by padding."""
    completion_ids, logps = samples.completion_ids, samples.logps
    if completion_ids.shape[1] == 0:  # nothing sampled: one padding column that counts for nothing
        n = completion_ids.shape[0]
        completion_ids = torch.full((n, 1), pad_token_id, dtype=torch.long, device=prompt_ids.device)
        mask = torch.zeros_like(completion_ids)
        terminated = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
        logps = torch.zeros((n, 1), device=prompt_ids.device) if logps is not None else None
    else:
        mask, terminated = mask_after_eos(completion_ids, eos_token_ids)
    completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad_token_id))
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        is_terminated=terminated,
        sampler_logps=logps,
    )
