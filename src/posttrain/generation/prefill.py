"""Prefilling the prompts' KV cache once for the rows that share it, before ``generate`` continues.

Shared-prefix prefill: ``group_prompts`` finds the distinct prompts of a batch (GRPO repeats each
``num_generations`` times), ``prefill_shared_prefix`` runs each once (minus its last token) and
copies its cache to its rows. Common-prefix prefill: for a batch of distinct prompts that open
alike (a system message, worked examples), ``prefill_common_prefix`` runs the common opening once.
``shared_prefix_blocker`` and ``prefix_cache_blocker`` name the cases where the plain call is used
instead. ``generation/transformers_backend.py`` explains why the completions do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from posttrain.generation.introspection import (
    _forward_accepts,
    _only_full_attention_layers,
    _supports_dynamic_cache,
    core_model,
)
from posttrain.models.compat import cache_argument

# ---- shared-prefix prefill ---------------------------------------------------------------------


@dataclass(frozen=True)
class PromptGroups:
    """The distinct rows of a left-padded prompt batch.

    Attributes:
        unique_ids: [U, P] one row per distinct prompt (same width and padding as the batch).
        unique_mask: [U, P] their attention mask.
        inverse: [N] for each batch row, the index of its distinct prompt in ``unique_ids``.
        unique_keys: [U] each distinct row's key when the rows carried one (``group_prompts``'s
            ``row_keys``: a sweep's adapter per row), else None.
    """

    unique_ids: torch.Tensor
    unique_mask: torch.Tensor
    inverse: torch.Tensor
    unique_keys: torch.Tensor | None = None

    @property
    def num_unique(self) -> int:
        """U, the number of distinct prompts."""
        return self.unique_ids.shape[0]


def group_prompts(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_keys: torch.Tensor | None = None
) -> PromptGroups:
    """Find the distinct prompts of a batch; rows are equal when their mask and unmasked ids are.

    Args:
        prompt_ids: [N, P] left-padded prompt tokens (row order does not matter).
        prompt_mask: [N, P] 1 for prompt tokens, 0 for padding.
        row_keys: [N] integers that must match too (a sweep's shared call: each row's adapter,
            whose weights make its own keys and values), or None.
    """
    width = prompt_ids.shape[1]
    visible = prompt_ids.masked_fill(prompt_mask == 0, 0)  # what sits under padding does not count
    parts = [visible, prompt_mask.to(prompt_ids.dtype)]
    if row_keys is not None:
        parts.append(row_keys.to(prompt_ids.dtype)[:, None])
    keys = torch.cat(parts, dim=1)  # [N, 2P (+1)]
    unique, inverse = torch.unique(keys, dim=0, return_inverse=True)  # [U, 2P (+1)], [N]
    unique_keys = None if row_keys is None else unique[:, 2 * width]
    return PromptGroups(
        unique[:, :width], unique[:, width : 2 * width].to(prompt_mask.dtype), inverse, unique_keys
    )


def shared_prefix_blocker(
    model: torch.nn.Module, config: GenerationConfig, groups: PromptGroups
) -> str | None:
    """Why the shared-prefix prefill cannot serve this batch, or None when it can.

    Args:
        model: the model ``generate`` runs on (a PEFT wrapper is looked through).
        config: the sampling configuration.
        groups: the batch's distinct prompts.

    Returns:
        A short reason for taking the plain ``generate`` path, or None.
    """
    if groups.unique_ids.shape[1] < 2:
        return "one-token prompts leave nothing to prefill ahead"
    if groups.num_unique == groups.inverse.shape[0]:
        return EVERY_PROMPT_DISTINCT
    return prefix_cache_blocker(model, config)


def prefix_cache_blocker(model: torch.nn.Module, config: GenerationConfig) -> str | None:
    """Why a prefilled prompt cache cannot be handed to this model's sampling, or None when it can.

    The checks of ``shared_prefix_blocker`` that do not depend on the batch's prompts.
    """
    core = core_model(model)
    model_default = getattr(getattr(core, "generation_config", None), "cache_implementation", None)
    checks = (
        (config.use_cache is False, "use_cache=False"),
        (
            config.cache_implementation not in (None, "dynamic"),
            f"cache_implementation={config.cache_implementation!r}",
        ),
        (
            model_default is not None,
            f"the model's generation_config sets cache_implementation={model_default!r}",
        ),
        (
            (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1,
            "beam search or several sequences per row",
        ),
        (getattr(core.config, "is_encoder_decoder", False), "encoder-decoder model"),
        (not _supports_dynamic_cache(core), "the model does not use a DynamicCache"),
        (cache_argument(model) is None, "the model's forward takes no cache argument"),
    )
    for blocked, reason in checks:
        if blocked:
            return reason
    if not _only_full_attention_layers(model):
        return "sliding-window or linear-attention layers"
    return None


def prefill_shared_prefix(model: torch.nn.Module, groups: PromptGroups) -> DynamicCache:
    """KV cache of every prompt row but its last token, computed once per distinct prompt.

    The unique prompts keep the batch's width and left padding, and get the position ids
    ``generate`` derives from the attention mask, so each cached row equals the plain
    prefill's. The cache is then copied to the N batch rows.

    Args:
        model: the model to prefill with (eval mode, gradients off).
        groups: the batch's distinct prompts.

    Returns:
        A ``DynamicCache`` of N rows and P - 1 positions.
    """
    ids, mask = groups.unique_ids[:, :-1], groups.unique_mask[:, :-1]  # [U, P-1]
    cache = DynamicCache(config=core_model(model).config.get_text_config(decoder=True))
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
    inputs[cache_argument(model)] = cache
    if _forward_accepts(model, "position_ids"):
        inputs["position_ids"] = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    if _forward_accepts(model, "logits_to_keep"):
        inputs["logits_to_keep"] = 1  # the logits are not used: keep the smallest slice
    model(**inputs)
    cache.batch_select_indices(groups.inverse)  # [U, ...] -> [N, ...]
    return cache


# ---- common-prefix prefill (distinct prompts) ------------------------------------------------------

EVERY_PROMPT_DISTINCT = "every prompt is distinct"

#: The fewest leading tokens, common to every prompt of a batch of distinct prompts, worth running
#: once for the whole batch (a system message, worked examples); fewer are run with each row.
COMMON_PREFIX_MIN_TOKENS = 16


def common_prefix_length(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> int:
    """How many leading tokens every prompt of a left-padded batch shares.

    Counted from each row's first token, and at most the shortest prompt's length minus one, so
    that every row keeps at least its last token to run (its logits give the first sampled
    token). 0 when the mask is not a left padding (ones after zeros in every row).

    Args:
        prompt_ids: [N, P] left-padded prompt tokens.
        prompt_mask: [N, P] 1 for prompt tokens, 0 for padding.
    """
    rows, width = prompt_ids.shape
    lengths = prompt_mask.long().sum(-1)
    starts = width - lengths
    columns = torch.arange(width, device=prompt_ids.device)
    if not torch.equal((columns[None, :] >= starts[:, None]).to(prompt_mask.dtype), prompt_mask):
        return 0
    shortest = int(lengths.min())
    if rows < 2 or shortest < 2:
        return 0
    heads = prompt_ids.gather(1, starts[:, None] + columns[None, : shortest - 1])  # [N, shortest - 1]
    same = (heads == heads[:1]).all(dim=0)
    return int(same.long().cumprod(0).sum())


def prefix_first(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch with its common prefix moved to the front: ``[pad][prefix][rest]`` becomes
    ``[prefix][pad][rest]``, so that every row holds the prefix at the same positions.

    The model reads positions from the attention mask (its cumulative sum), so each token keeps
    its position and attends to the same tokens as before; only the padding moved.
    """
    width = prompt_ids.shape[1]
    starts = (width - prompt_mask.long().sum(-1))[:, None]
    columns = torch.arange(width, device=prompt_ids.device)[None, :]
    source = torch.where(
        columns < length, starts + columns, torch.where(columns < starts + length, columns - length, columns)
    )
    return prompt_ids.gather(1, source), prompt_mask.gather(1, source)


def prefill_common_prefix(model: torch.nn.Module, prefix: torch.Tensor, rows: int) -> DynamicCache:
    """KV cache of ``prefix`` ([L] tokens) computed once and copied to ``rows`` rows.

    Args:
        model: the model to prefill with (eval mode, gradients off).
        prefix: the tokens every prompt starts with.
        rows: the batch's rows.

    Returns:
        A ``DynamicCache`` of ``rows`` rows and L positions (0 to L - 1).
    """
    ids = prefix[None, :]
    cache = DynamicCache(config=core_model(model).config.get_text_config(decoder=True))
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": True}
    inputs[cache_argument(model)] = cache
    if _forward_accepts(model, "position_ids"):
        inputs["position_ids"] = torch.arange(ids.shape[1], device=ids.device)[None, :]
    if _forward_accepts(model, "logits_to_keep"):
        inputs["logits_to_keep"] = 1
    model(**inputs)
    cache.batch_select_indices(torch.zeros(rows, dtype=torch.long, device=ids.device))
    return cache
