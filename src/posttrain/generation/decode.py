"""A lean sampling loop for the common GRPO case, in place of ``model.generate``.

A torch.profiler trace of one ``generate`` call (SmolLM2-135M, 8 rows, 64 new tokens, float32,
CPU, 2 threads, about 6.3 s) spends a fifth of its time outside the matrix products:
``torch.multinomial`` over [8, 49152] probabilities (``aten::exponential_``, 9 ms a step, 580 ms),
the ``DynamicCache`` growing every layer by ``torch.cat`` at every step (``aten::cat``, 318 ms), and
the logits processors, stopping criteria and per-step bookkeeping of ``generate`` (about 200 ms).

``lean_generate`` runs the same forward calls as ``generate`` (same inputs: ids, the 2D mask,
position ids from the mask, ``logits_to_keep=1``) with:

- a KV cache preallocated for the whole call (``PreallocatedLayer``): new keys and values are
  written in place, and attention reads a view of the filled prefix;
- the logits processing of ``generate`` for the options it supports, in ``generate``'s order and
  with the same tensor operations (repetition penalty, ``min_new_tokens``, temperature, top-k,
  top-p, min-p), so the processed scores are equal bit for bit;
- sampling by inverting the cumulative distribution (``sample_tokens``): one uniform number per
  row instead of one exponential draw per vocabulary entry.

Greedy rows (top-k 1) give ``generate``'s tokens; sampled rows follow the same distribution from
another stream of random numbers. ``lean_settings`` names what the loop does not implement; the
caller then runs ``generate`` (``TransformersGenerator`` records why in ``path.lean_blocker``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache, GenerationConfig, GenerationMixin
from transformers.cache_utils import DynamicLayer

from posttrain.generation.introspection import (
    _forward_accepts,
    _only_full_attention_layers,
    _supports_dynamic_cache,
    core_model,
)
from posttrain.models.compat import cache_argument
from posttrain.ops import workspace
from posttrain.ops.support import truncate_scores

if TYPE_CHECKING:
    from posttrain.generation.cuda_graph import GraphedDecodeStep
    from posttrain.generation.fused_step import FusedDecoder

# ---- the KV cache --------------------------------------------------------------------------------


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer with room for ``capacity`` positions, filled in place.

    ``keys`` and ``values`` are views ``[N, heads, length, dim]`` of buffers
    ``[N, heads, capacity, dim]`` allocated on the first update, so a decode step copies one
    position instead of concatenating the whole layer.

    Args:
        capacity: the most positions the layer will hold (prompt plus new tokens).
        dtype: the buffers' dtype; None: the first update's. The fused step's float32 backends
            pass float32, so that the values a bf16 autocast prefill wrote (``v_proj``'s bf16
            output) do not send every decode step's attention product to bf16.
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self.buffer_dtype = dtype

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        rows, heads = key_states.shape[:2]
        shape = (rows, heads, self.capacity)
        self._key_buffer = key_states.new_empty(*shape, key_states.shape[-1], dtype=self.buffer_dtype)
        self._value_buffer = value_states.new_empty(*shape, value_states.shape[-1], dtype=self.buffer_dtype)
        self.is_initialized = True
        self._set_length(0)

    def _set_length(self, length: int) -> None:
        self.length = length
        self.keys = self._key_buffer[:, :, :length]
        self.values = self._value_buffer[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions after the filled ones; return the keys and values so far."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions, {end} were asked for")
        self._key_buffer[:, :, self.length : end].copy_(key_states)
        self._value_buffer[:, :, self.length : end].copy_(value_states)
        self._set_length(end)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        if self.is_initialized:
            self._set_length(0)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of positions to remove")
        if self.is_initialized:
            self._set_length(max(self.length + tokens_to_remove, 0))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._reindex(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._reindex(lambda buffer: buffer[indices])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._reindex(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))

    def _reindex(self, select: Any) -> None:
        if self.is_initialized:
            self._key_buffer, self._value_buffer = select(self._key_buffer), select(self._value_buffer)
            self._set_length(self.length)


def preallocated_cache(
    model: torch.nn.Module,
    capacity: int,
    prefix: DynamicCache | None = None,
    dtype: torch.dtype | None = None,
) -> DynamicCache:
    """A ``DynamicCache`` of ``PreallocatedLayer``s, holding a copy of ``prefix`` when given.

    Args:
        model: the model the cache is for (its decoder layers must all be full attention).
        capacity: positions per layer (prompt plus new tokens).
        prefix: a cache of plain ``DynamicLayer``s to start from (``prefill_shared_prefix``).
        dtype: the keys' and values' dtype (None: what the first update writes).
    """
    cache = DynamicCache(config=core_model(model).config.get_text_config(decoder=True))
    cache.layers = [PreallocatedLayer(capacity, dtype) for _ in cache.layers]
    if prefix is not None:
        for mine, given in zip(cache.layers, prefix.layers, strict=True):
            if given.get_seq_length() > 0:
                mine.update(given.keys, given.values)
    return cache


# ---- the settings ------------------------------------------------------------------------------------

#: GenerationConfig fields the loop implements, or that do not change what greedy or multinomial
#: sampling without beams returns. Any other field away from its default sends the call to ``generate``.
HANDLED_FIELDS = frozenset(
    {
        "max_new_tokens",
        "max_length",  # overridden by max_new_tokens, which the loop requires
        "min_new_tokens",
        "min_length",  # overridden by min_new_tokens; checked when that is unset
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "repetition_penalty",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "num_beams",
        "num_return_sequences",
        "length_penalty",  # beam search only
        "early_stopping",  # beam search only
        "num_assistant_tokens",  # assisted decoding only
        "num_assistant_tokens_schedule",
        "assistant_confidence_threshold",
        "compile_config",  # generate compiles static caches only
        "disable_compile",
        "transformers_version",
        "_from_model_config",
    }
)

#: ``generate``'s steps a model may replace; the loop reproduces the library's own.
GENERATION_METHODS = (
    "generate",
    "prepare_inputs_for_generation",
    "_update_model_kwargs_for_generation",
    "_prepare_position_ids_for_generation",
    "_prepare_generation_config",
    "_get_logits_processor",
    "_get_stopping_criteria",
    "_prefill",
    "_sample",
)


@dataclass(frozen=True)
class SamplingSettings:
    """What the loop samples with: the effective ``GenerationConfig`` of a ``generate`` call.

    Attributes:
        max_new_tokens: new tokens at most per row.
        min_new_tokens: EOS is forbidden while fewer new tokens were generated (0: never).
        temperature, top_k, top_p, min_p, repetition_penalty: as in ``GenerationConfig``; None
            or the neutral value (1.0, 0, 1.0) when off.
        eos_token_ids: ids that end a row (none: rows end at ``max_new_tokens``).
        pad_token_id: fills a row after its EOS (``generate``'s default: the first EOS id).
        do_sample: sample (True) or take the argmax of the processed scores (greedy, as
            ``generate`` with ``do_sample=False``: the warpers temperature, top-k, top-p and
            min-p are then off; the repetition penalty and ``min_new_tokens`` still apply).
    """

    max_new_tokens: int
    min_new_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    do_sample: bool = True


def _off(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, (list, tuple, dict, set)) and not value)


def _config_blocker(config: GenerationConfig) -> str | None:
    """Why the loop cannot honour the effective ``config``, or None."""
    checks = (
        (config.use_cache is False, "use_cache=False"),
        (
            config.cache_implementation not in (None, "dynamic"),
            f"cache_implementation={config.cache_implementation!r}",
        ),
        (config.max_new_tokens is None or config.max_new_tokens < 1, "max_new_tokens is not set"),
        (
            config.min_new_tokens is None and (config.min_length or 0) > 0,
            f"min_length={config.min_length}",
        ),
        (
            (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1,
            "beam search or several sequences per row",
        ),
    )
    for blocked, reason in checks:
        if blocked:
            return reason
    defaults = getattr(GenerationConfig, "_get_default_generation_params", dict)()
    for key, value in config.to_dict().items():
        default = defaults.get(key)
        if key not in HANDLED_FIELDS and value != default and not (_off(value) and _off(default)):
            return f"{key}={value!r}"
    return None


def _model_blocker(model: torch.nn.Module) -> str | None:
    """Why the loop cannot run this model the way ``generate`` would, or None."""
    core = core_model(model)
    if getattr(core.config, "is_encoder_decoder", False):
        return "encoder-decoder model"
    if getattr(getattr(model, "active_peft_config", None), "is_prompt_learning", False):
        return "PEFT prompt learning"
    for name in GENERATION_METHODS:
        if getattr(type(core), name, None) is not getattr(GenerationMixin, name, None):
            return f"the model replaces {name}"
    if cache_argument(model) is None:
        return "the model's forward takes no cache argument"
    if not (_forward_accepts(model, "position_ids") and _forward_accepts(model, "attention_mask")):
        return "the model's forward takes no position_ids or attention_mask"
    if _forward_accepts(model, "cache_position"):
        return "the model's forward takes cache_position"
    if not _supports_dynamic_cache(core):
        return "the model does not use a DynamicCache"
    if not _only_full_attention_layers(model):
        return "sliding-window or linear-attention layers"
    if _synced_gpus(core):
        return "sharded model across processes (generate would keep the ranks in step)"
    return None


def _synced_gpus(core: torch.nn.Module) -> bool:
    """``generate``'s default ``synced_gpus``: ZeRO-3 or FSDP with more than one process."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    if torch.distributed.get_world_size() < 2:
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(core))


def lean_settings(
    model: torch.nn.Module, config: GenerationConfig
) -> tuple[SamplingSettings | None, str | None]:
    """The loop's settings for a ``generate(generation_config=config)`` call on ``model``.

    The model's ``generation_config`` and the library defaults fill what ``config`` leaves
    unset, as ``generate`` does (an unset ``top_k`` samples from the top 50 tokens).

    Args:
        model: the model to sample from (a PEFT wrapper is looked through).
        config: the sampling configuration.

    Returns:
        ``(settings, None)``, or ``(None, reason)`` when ``generate`` must run instead.
    """
    core = core_model(model)
    reason = _model_blocker(model)
    if reason is not None:
        return None, reason
    prepare = getattr(core, "_prepare_generation_config", None)
    if prepare is None:
        return None, "cannot resolve the generation config"
    resolved, _ = prepare(config)
    reason = _config_blocker(resolved)
    if reason is not None:
        return None, reason
    eos = resolved.eos_token_id
    eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    pad = resolved.pad_token_id if resolved.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    sample = bool(resolved.do_sample)
    settings = SamplingSettings(
        max_new_tokens=resolved.max_new_tokens,
        min_new_tokens=resolved.min_new_tokens or 0,
        temperature=resolved.temperature if sample else None,
        top_k=resolved.top_k if sample else None,
        top_p=resolved.top_p if sample else None,
        min_p=resolved.min_p if sample else None,
        repetition_penalty=resolved.repetition_penalty,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        do_sample=sample,
    )
    return settings, None


# ---- logits processing and sampling -----------------------------------------------------------------


class ScoreProcessor:
    """``generate``'s logits processing for ``SamplingSettings``, with the same tensor operations.

    Order: repetition penalty, minimum new tokens, then the sampling warpers temperature, top-k,
    top-p and min-p. The repetition penalty keeps a [N, V] mask of the tokens seen so far (the
    prompt after its left padding, then each sampled token) instead of gathering over the
    growing sequence; the penalised values are the same.

    Args:
        settings: the sampling settings.
        prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
        vocab_size: V, the width of the logits.
    """

    def __init__(
        self,
        settings: SamplingSettings,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        vocab_size: int,
    ) -> None:
        self.settings = settings
        device = prompt_ids.device
        vocab = torch.arange(vocab_size, device=device)
        self.eos_mask = torch.isin(
            vocab, torch.tensor(settings.eos_token_ids, device=device, dtype=torch.long)
        )
        self.seen: torch.Tensor | None = None
        penalty = settings.repetition_penalty
        if penalty is not None and penalty != 1.0:
            # As generate: positions before the first unmasked one are ignored; ids beyond the
            # vocabulary land in an extra column.
            first = (prompt_mask != 0).int().argmax(dim=1, keepdim=True)
            ignored = torch.arange(prompt_ids.shape[1], device=device) < first
            ids = prompt_ids.masked_fill(ignored, vocab_size).clamp(max=vocab_size)
            self.seen = torch.zeros(prompt_ids.shape[0], vocab_size + 1, dtype=torch.bool, device=device)
            self.seen.scatter_(1, ids, True)

    def observe(self, tokens: torch.Tensor) -> None:
        """Record the tokens [N] just sampled (for the repetition penalty)."""
        if self.seen is not None:
            self.seen.scatter_(1, tokens.clamp(max=self.seen.shape[1] - 1)[:, None], True)

    def __call__(self, logits: torch.Tensor, step: int) -> torch.Tensor:
        """Processed scores [N, V] from float32 logits [N, V] at step ``step`` (tokens generated so far)."""
        s, scores = self.settings, logits
        if self.seen is not None:
            penalty = s.repetition_penalty
            penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
            scores = torch.where(self.seen[:, : scores.shape[-1]], penalised, scores)
        if step < s.min_new_tokens and s.eos_token_ids:
            scores = torch.where(self.eos_mask, -math.inf, scores)
        if s.temperature is not None and s.temperature != 1.0:
            scores = scores / s.temperature
        return truncate_scores(scores, s.top_k, s.top_p, s.min_p)  # top-k, top-p, min-p (ops/support.py)


def sample_tokens(scores: torch.Tensor) -> torch.Tensor:
    """One token per row from ``softmax(scores)``, by inverting the cumulative distribution.

    The unnormalised probabilities ``exp(scores - max)`` are summed in float64; a uniform number
    ``u`` in ``[0, total)`` per row picks the first token whose cumulative sum exceeds ``u``. A
    token of probability zero adds nothing to the sum, so it is never the first to exceed ``u``.
    Draws come from torch's global generator (``torch.manual_seed`` makes them reproducible).
    The probabilities and their sums go to buffers kept between calls (``ops/workspace.py``)
    instead of fresh [N, V] tensors at every token (SmolLM2's anchor, in the trainer: 670 against
    577 us a call).

    Args:
        scores: [N, V] processed scores (-inf for excluded tokens).

    Returns:
        [N] token ids.
    """
    shape, device = tuple(scores.shape), scores.device
    weights = workspace.scratch("sample_weights", shape, scores.dtype, device)
    torch.sub(scores, scores.amax(dim=-1, keepdim=True), out=weights).exp_()
    cdf = torch.cumsum(
        weights,
        dim=-1,
        dtype=torch.float64,
        out=workspace.scratch("sample_cdf", shape, torch.float64, device),
    )
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=scores.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rand * total may round up
    return torch.searchsorted(cdf, u, right=True).squeeze(-1)


# ---- the loop --------------------------------------------------------------------------------------


@torch.no_grad()
def lean_generate(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings,
    prefix_cache: DynamicCache | None = None,
    fused: FusedDecoder | GraphedDecodeStep | None = None,
) -> torch.Tensor:
    """Sample completions like ``model.generate``: ``[N, P] -> [N, P + T]``.

    ``lean_generate_with_logps`` is the same loop that also returns the log-probs of the
    sampled tokens.

    Args:
        model: the model (eval mode); ``lean_settings`` must have accepted it.
        prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
        settings: from ``lean_settings``.
        prefix_cache: every row's prompt minus its last token (``prefill_shared_prefix``); the
            prompt is then run from its last token.
        fused: a ``fused_step.FusedDecoder`` of ``model`` (or a ``cuda_graph.GraphedDecodeStep``
            of one), which then runs every one-token step (all steps after the prompt's, and the
            prompt's too when ``prefix_cache`` holds all but its last token); the model's own
            forward runs them when None.

    Returns:
        [N, P + T] the prompts and their completions, T <= ``max_new_tokens``: the loop stops
        when every row has produced an EOS id, and rows are padded with ``pad_token_id`` after it.
    """
    return _lean_loop(model, prompt_ids, prompt_mask, settings, prefix_cache, fused, False)[0]


@torch.no_grad()
def lean_generate_with_logps(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings,
    prefix_cache: DynamicCache | None = None,
    fused: FusedDecoder | GraphedDecodeStep | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lean_generate`` plus the sampler's log-prob of each sampled token.

    The log-prob is ``log_softmax(logits / temperature)`` at the sampled token, from the very
    logits the token was drawn from (the fused step's when ``fused`` runs the step), before the
    repetition penalty and the top-k / top-p / min-p truncation: the quantity the trainer
    recomputes for the same token, so the two differ only by the sampler's arithmetic.

    Args: as ``lean_generate``.

    Returns:
        ``(sequences [N, P + T], logps [N, T])``; the log-probs are 0 after a row's EOS.
    """
    out, logps = _lean_loop(model, prompt_ids, prompt_mask, settings, prefix_cache, fused, True)
    assert logps is not None
    return out, logps


def _prompt_inputs(
    model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: DynamicCache
) -> dict[str, Any]:
    """The first forward's keywords: the prompt tokens not in the cache, the last position's logits only."""
    inputs: dict[str, Any] = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        cache_argument(model): cache,
        "use_cache": True,
        "return_dict": True,
    }
    if _forward_accepts(model, "logits_to_keep"):
        inputs["logits_to_keep"] = 1
    if _forward_accepts(model, "output_router_logits"):
        inputs["output_router_logits"] = False  # MoE: no load-balancing loss while sampling
    return inputs


def _sampled_logps(logits: torch.Tensor, tokens: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at each row's sampled token: [N]."""
    scaled = logits if temperature is None else logits / temperature
    return scaled.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(scaled, dim=-1)


def _lean_loop(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    settings: SamplingSettings,
    prefix_cache: DynamicCache | None,
    fused: FusedDecoder | GraphedDecodeStep | None,
    record_logps: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The loop of ``lean_generate``; with ``record_logps``, the sampled tokens' log-probs too."""
    rows, width = prompt_ids.shape
    steps = settings.max_new_tokens
    cache = preallocated_cache(model, width + steps, prefix_cache, getattr(fused, "cache_dtype", None))
    mask = prompt_mask.new_ones(rows, width + steps)
    mask[:, :width] = prompt_mask
    positions = (prompt_mask.long().cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
    out = prompt_ids.new_full((rows, width + steps), settings.pad_token_id or 0)
    out[:, :width] = prompt_ids
    start = 0 if prefix_cache is None else cache.get_seq_length()
    inputs = _prompt_inputs(model, prompt_ids[:, start:], positions[:, start:], cache)
    eos = torch.tensor(settings.eos_token_ids, dtype=prompt_ids.dtype, device=prompt_ids.device)
    unfinished = torch.ones(rows, dtype=torch.bool, device=prompt_ids.device)
    processor: ScoreProcessor | None = None
    last_position = positions[:, -1:]
    logps = prompt_ids.new_zeros((rows, steps), dtype=torch.float32) if record_logps else None
    temperature = settings.temperature if settings.temperature not in (None, 1.0) else None
    for step in range(steps):
        if fused is not None and inputs["input_ids"].shape[1] == 1:
            logits = fused.step(
                inputs["input_ids"][:, 0], inputs["position_ids"][:, 0], mask[:, : width + step], cache.layers
            )
        else:
            logits = model(attention_mask=mask[:, : width + step], **inputs).logits[:, -1].float()
        if processor is None:
            processor = ScoreProcessor(settings, prompt_ids, prompt_mask, logits.shape[-1])
        scores = processor(logits, step)
        tokens = sample_tokens(scores) if settings.do_sample else scores.argmax(dim=-1)
        if logps is not None:  # rows that ended before: padding
            logps[:, step] = _sampled_logps(logits, tokens, temperature).masked_fill(~unfinished, 0.0)
        if len(eos):
            tokens = tokens.masked_fill(~unfinished, settings.pad_token_id)
            unfinished &= ~torch.isin(tokens, eos)
        out[:, width + step] = tokens
        processor.observe(tokens)
        if not unfinished.any():
            return out[:, : width + step + 1], None if logps is None else logps[:, : step + 1]
        inputs["input_ids"] = tokens[:, None]
        inputs["position_ids"] = last_position + step + 1
    return out, logps
