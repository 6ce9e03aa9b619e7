"""Generation with transformers' ``generate``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import GenerationConfig

from posttrain.generation.base import Samples


def sampling_config(
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    min_p: float | None,
    repetition_penalty: float,
    cache_implementation: str | None,
    pad_token_id: int,
    eos_token_ids: list[int],
    generation_kwargs: Mapping[str, Any] | None = None,
) -> GenerationConfig:
    """The ``GenerationConfig`` for GRPO sampling; ``generation_kwargs`` override the rest."""
    values: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": True,
        # The Trainer sets model.config.use_cache from TrainingArguments.use_cache (False) for
        # training; sampling always wants the KV cache.
        "use_cache": True,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k if top_k > 0 else None,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "cache_implementation": cache_implementation,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_ids,
    }
    values.update(dict(generation_kwargs or {}))
    return GenerationConfig(**values)


class TransformersGenerator:
    """Samples with ``model.generate`` on the training model (in eval mode, without gradients).

    Args:
        get_model: returns the unwrapped model to sample from (it changes under DDP wrapping).
        config: the sampling configuration.
    """

    def __init__(self, get_model: Callable[[], torch.nn.Module], config: GenerationConfig) -> None:
        self.get_model = get_model
        self.config = config

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """One sampled completion per prompt row: ``[N, P] -> Samples([N, T])``."""
        model = self.get_model()
        was_training = model.training
        model.eval()
        try:
            out = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=self.config
            )
        finally:
            model.train(was_training)
        return Samples(completion_ids=out[:, prompt_ids.shape[1] :])
