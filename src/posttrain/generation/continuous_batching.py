"""Generation with transformers' continuous batching (``model.generate_batch``).

The continuous-batching engine (transformers >= 5.8) keeps a paged KV cache and schedules
requests token by token: a finished completion leaves the batch at once, and prompts that
share pages are cached once. It runs the training model in-process, so no weights are synced.

Departures from ``generate`` that matter for GRPO:

- Its logits processing covers temperature, top-k, top-p (and min-p, applied per token); it
  drops repetition penalty and minimum lengths. ``ContinuousBatchingGenerator`` refuses a
  sampling configuration that uses them (``unsupported_sampling_options``) instead of
  sampling from another distribution than the one configured.
- Sampled tokens come from its own seeded generator: the seed is drawn from torch's global
  generator (so the run's seed fixes it) and the engine's reseeding is undone afterwards.
  Samples match ``generate`` for greedy decoding, not draw for draw when sampling.
- On the CPU, transformers sizes the cache from free system memory (90 % of it), which takes
  long to allocate; unless the caller sets ``num_blocks``, the cache is sized for the batch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import transformers
from transformers import GenerationConfig

from posttrain.generation.base import Samples

#: TRL's default share of free accelerator memory for the cache (transformers uses 0.9),
#: leaving room for the backward pass.
DEFAULT_MAX_MEMORY_PERCENT = 0.5

#: The page size transformers uses when the caller sets none (``ContinuousBatchingConfig.page_size``).
DEFAULT_PAGE_SIZE = 256

#: Upper bound of the tokens of one engine step on the CPU: the attention mask of a step is
#: [tokens, cached tokens + tokens] float32, so it stays bounded for large batches.
MAX_BATCH_TOKENS_CPU = 1024


def cb_config_class() -> type:
    """transformers' ``ContinuousBatchingConfig``.

    Raises:
        ImportError: the installed transformers has no continuous-batching engine (< 5.8).
    """
    cls = getattr(transformers, "ContinuousBatchingConfig", None)
    if cls is None:
        raise ImportError(
            "use_transformers_continuous_batching needs transformers >= 5.8 (installed: "
            f"{transformers.__version__}). Upgrade transformers or set use_transformers_continuous_batching=False."
        )
    return cls


def unsupported_sampling_options(config: GenerationConfig) -> list[str]:
    """The sampling options set in ``config`` that continuous batching would ignore.

    Args:
        config: the sampling configuration.

    Returns:
        ``"name=value"`` for each option the engine drops or cannot do; empty when it can serve.
    """
    checks = {
        "repetition_penalty": config.repetition_penalty not in (None, 1.0),
        "min_new_tokens": bool(config.min_new_tokens),
        "min_length": bool(config.min_length),
        "num_beams": (config.num_beams or 1) > 1,
        "num_return_sequences": (config.num_return_sequences or 1) > 1,
        "no_repeat_ngram_size": bool(config.no_repeat_ngram_size),
        "bad_words_ids": config.bad_words_ids is not None,
    }
    return [f"{name}={getattr(config, name)!r}" for name, used in checks.items() if used]


def batch_sized_cb_config(
    user: Mapping[str, Any] | None, prompt_lengths: list[int], max_new_tokens: int, device: torch.device
) -> dict[str, Any]:
    """``ContinuousBatchingConfig`` keyword arguments: the user's, over defaults fitted to this batch.

    Args:
        user: the ``transformers_continuous_batching_config`` values (they win).
        prompt_lengths: the unpadded length of each prompt.
        max_new_tokens: the completion length limit.
        device: the model's device; on the CPU the cache is sized for the batch.

    Returns:
        Keyword arguments for ``ContinuousBatchingConfig``.
    """
    values: dict[str, Any] = {"max_memory_percent": DEFAULT_MAX_MEMORY_PERCENT}
    if device.type == "cpu":
        page = int((user or {}).get("page_size", DEFAULT_PAGE_SIZE))
        pages = sum(math.ceil((n + max_new_tokens) / page) for n in prompt_lengths)
        values["num_blocks"] = pages + 1
        # Enough for the longest prompt and a decode step of every row; about one step's prefill otherwise.
        tokens = min(sum(prompt_lengths), MAX_BATCH_TOKENS_CPU)
        values["max_batch_tokens"] = max(tokens, max(prompt_lengths), len(prompt_lengths))
    values.update(dict(user or {}))
    return values


class ContinuousBatchingGenerator:
    """Samples with ``model.generate_batch`` on the training model (eval mode, no gradients).

    Args:
        get_model: returns the unwrapped model to sample from.
        config: the sampling configuration (``pad_token_id`` pads the completions).
        cb_config: keyword arguments for ``ContinuousBatchingConfig``
            (``transformers_continuous_batching_config``).
        full_parameters: maps the model to the context generation runs in (FSDP2 / ZeRO-3
            gathering, as for ``TransformersGenerator``). No context when ``None``.

    Raises:
        ValueError: ``config`` uses options the engine would ignore.
        TypeError: ``cb_config`` has a key ``ContinuousBatchingConfig`` does not take.
        ImportError: transformers is older than 5.8.
    """

    def __init__(
        self,
        get_model: Callable[[], torch.nn.Module],
        config: GenerationConfig,
        cb_config: Mapping[str, Any] | None = None,
        full_parameters: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        unsupported = unsupported_sampling_options(config)
        if unsupported:
            raise ValueError(
                f"transformers continuous batching cannot sample with {', '.join(unsupported)}: it would ignore "
                "them. Remove them (generation_kwargs, repetition_penalty) or set "
                "use_transformers_continuous_batching=False."
            )
        self.get_model = get_model
        self.config = config
        self.cb_config = dict(cb_config or {})
        self.full_parameters = full_parameters or (lambda model: contextlib.nullcontext())
        cb_config_class()(**self.cb_config)  # unknown keys fail here, before any generation

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """One completion per prompt row: ``[N, P] -> Samples([N, T])``, right-padded with the pad id."""
        prompts = [row[mask.bool()].tolist() for row, mask in zip(prompt_ids, prompt_mask, strict=True)]
        model = self.get_model()
        was_training = model.training
        model.eval()
        try:
            with self.full_parameters(model):
                completions = self._run(model, prompts)
        finally:
            model.train(was_training)
        return Samples.from_lists(completions, self.config.pad_token_id, prompt_ids.device)

    def _run(self, model: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
        """``generate_batch`` on the prompts, under a seed drawn from the global generator."""
        values = batch_sized_cb_config(
            self.cb_config, [len(p) for p in prompts], self.config.max_new_tokens, model.device
        )
        values.setdefault("seed", int(torch.randint(0, 2**31 - 1, ()).item()))
        devices = [] if model.device.type == "cpu" else [model.device]
        with torch.random.fork_rng(devices=devices, device_type=model.device.type), torch.no_grad():
            outputs = model.generate_batch(
                inputs=prompts,
                generation_config=self.config,
                continuous_batching_config=cb_config_class()(**values),
                progress_bar=False,
            )
        return _completions_in_order(list(outputs.values()), prompts)


def _completions_in_order(outputs: list[Any], prompts: list[list[int]]) -> list[list[int]]:
    """The generated tokens in prompt order, after checking that every request succeeded.

    ``generate_batch`` returns its results in the order of its inputs; each one's prompt is
    checked against its row so that a reordering can never pair a completion with another
    prompt.
    """
    failed = [o.request_id for o in outputs if o.error is not None]
    if failed or len(outputs) != len(prompts):
        raise RuntimeError(
            f"transformers continuous batching returned {len(outputs)} results for {len(prompts)} prompts "
            f"(failed requests: {failed}); see the transformers log above for the cause."
        )
    for i, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        if list(out.prompt_ids) != prompt:
            raise RuntimeError(f"continuous batching returned the results out of order (row {i}).")
    return [list(o.generated_tokens) for o in outputs]
