"""Generation with transformers' ``generate``: the shared prompt prefilled once, prepacked weights.

GRPO samples ``num_generations`` completions of every prompt, so a batch of N prompt rows holds
far fewer distinct prompts. ``TransformersGenerator`` runs the prompt tokens of each distinct
prompt once (a forward pass over the unique rows, minus their last token), copies the resulting
KV cache to the N rows, and lets ``generate`` continue from that cache: it then computes only
the last prompt token (whose logits give the first sampled token) and the decode steps.

Only the prefill changes, so the completions are those of the plain call up to floating-point
rounding of the prompt's keys and values (a different batch shape): greedy and seeded sampling
give the same tokens except at exact near-ties. ``shared_prefix_blocker`` names the cases where
the plain call is used instead.

On the CPU, the float32 linear layers also multiply with oneDNN-prepacked weight copies for the
duration of the call (``onednn_prepacked_linears``): a decode step multiplies a few rows by every
weight, and the blocked layout reads them faster than ``F.linear`` does. Figures and exactness:
``benchmarks/decode_paths.py`` and ``docs/performance-generation-draft.md``.

The prefill is in ``generation/prefill.py`` and the prepacked weights in
``generation/prepacked.py``; their public names are imported here.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from posttrain.generation.base import Samples
from posttrain.generation.cuda_graph import GraphedDecodeStep, cuda_graph_blocker
from posttrain.generation.decode import lean_generate, lean_generate_with_logps, lean_settings
from posttrain.generation.fused_blockers import decoder_blocker
from posttrain.generation.fused_step import (
    FusedDecoder,
    decoder_target,
    default_backend,
)
from posttrain.generation.introspection import (  # noqa: F401  (re-exported)
    _forward_accepts,
    _only_full_attention_layers,
    _supports_dynamic_cache,
    core_model,
)
from posttrain.generation.prefill import (  # noqa: F401  (re-exported)
    COMMON_PREFIX_MIN_TOKENS,
    EVERY_PROMPT_DISTINCT,
    PromptGroups,
    common_prefix_length,
    group_prompts,
    prefill_common_prefix,
    prefill_shared_prefix,
    prefix_cache_blocker,
    prefix_first,
    shared_prefix_blocker,
)
from posttrain.generation.prepacked import (  # noqa: F401  (re-exported)
    PREPACK_MIN_NEW_TOKENS,
    is_packable_linear,
    onednn_linear_available,
    onednn_prepacked_linears,
    packable_linears,
)
from posttrain.generation.reduced_precision import ReducedCopy, reduced_sampler_blocker, resolve_precision
from posttrain.models.compat import cache_argument


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
        "top_k": top_k,  # 0 disables top-k filtering (None would let generate fill in its default, 50)
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
        "cache_implementation": cache_implementation,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_ids,
    }
    values.update(dict(generation_kwargs or {}))
    return GenerationConfig(**values)


# ---- the path a call took ----------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationPath:
    """Which path one generation call took, and why each faster one did not apply.

    ``TransformersGenerator.path`` holds the latest call's record; the trainer logs each new
    record once (``sampling.pipeline``), so a run says how it samples without a profiler.

    Attributes:
        taken: ``"plain"`` (``generate``), ``"shared_prefix"`` or ``"common_prefix"``
            (``generate`` after prefilling the prompts' shared rows or common opening once), or
            ``"lean"``, ``"lean+shared_prefix"``, ``"lean+common_prefix"`` (``decode.lean_generate``).
        prefix_blocker: why no prefix was prefilled once (None: one was).
        lean_blocker: why ``generate`` ran instead of the lean loop (None: the lean loop ran).
        fused_blocker: why the lean loop ran the model's forward instead of the fused decode step.
        cuda_graph_blocker: why the decode step was not replayed as a CUDA graph.
        reduced_blocker: why the call sampled from the policy although a reduced-precision
            sampler is set (None: it sampled from the copy, or no copy is set).
    """

    taken: str = "plain"
    prefix_blocker: str | None = None
    lean_blocker: str | None = None
    fused_blocker: str | None = "the lean loop did not run"
    cuda_graph_blocker: str | None = "no fused decode step"
    reduced_blocker: str | None = None

    def describe(self) -> str:
        """One line: the path taken, then what kept each faster path off."""
        reasons = (
            ("prefix prefill", self.prefix_blocker),
            ("lean loop", self.lean_blocker),
            ("fused step", self.fused_blocker),
            ("CUDA graph", self.cuda_graph_blocker),
            ("reduced-precision copy", self.reduced_blocker),
        )
        return "; ".join([self.taken] + [f"no {what}: {why}" for what, why in reasons if why is not None])


# ---- the backend -------------------------------------------------------------------------------


class TransformersGenerator:
    """Samples with ``model.generate`` on the training model (in eval mode, without gradients).

    The speed paths below (shared prefill, the lean loop, the fused step) stand in for
    ``generate``; when ``generate`` has been replaced on the model instance (a wrapper, a test
    double), that replacement is called instead, with the prompts and the generation config.

    Args:
        get_model: returns the unwrapped model to sample from (it changes under DDP wrapping).
        config: the sampling configuration.
        share_prefix: prefill each distinct prompt once (see the module docstring); batches
            where ``shared_prefix_blocker`` gives a reason take the plain path.
        full_parameters: maps the model to the context its prefill and ``generate`` run in; under
            FSDP2 or ZeRO-3 it gathers the sharded parameters once for the whole call
            (``models.distributed.generation_parameters``). No context when ``None``.
        prepack_weights: on the CPU, multiply float32 linear layers with oneDNN-prepacked
            weights while generating (``onednn_prepacked_linears``), for calls of at least
            ``PREPACK_MIN_NEW_TOKENS`` new tokens.
        lean: sample with ``decode.lean_generate`` instead of ``generate`` when
            ``decode.lean_settings`` accepts the model and configuration.
        fused_step: in the lean loop, run the one-token decode steps with
            ``fused_step.FusedDecoder`` (no module tree) when ``fused_step.fused_decoder_blocker``
            finds nothing against the model: on the CPU with fused, prepacked products (where
            ``prepack_weights`` applies; the packed weights of ``onednn_prepacked_linears`` are
            then not built), on a GPU with the model's own weights.
        cuda_graph: on a GPU, capture the fused step as a CUDA graph once per call and replay it
            for every token (``cuda_graph.GraphedDecodeStep``), unless
            ``cuda_graph.cuda_graph_blocker`` gives a reason.
        autocast_dtype: the dtype of the mixed-precision autocast the model's forward is wrapped
            in (the trainer's ``bf16``/``fp16``); the fused step on a GPU then runs under the same
            autocast. None: no wrapper (the fused step refuses a wrapped forward).
        sampler_precision: ``"float32"`` samples from the model itself; ``"int8"``, ``"bf16"`` or
            ``"auto"`` run the lean loop's decode steps on a reduced-precision copy of the
            weights (``reduced_precision.ReducedCopy``, rebuilt after ``weights_changed``) and
            return the sampled tokens' log-probs in ``Samples.logps``. A call the reduced
            sampler cannot serve (``path.reduced_blocker``) samples in float32, without log-probs,
            and warns once.

    Attributes:
        path: the latest call's ``GenerationPath`` (which path it took, and why not the faster ones).
    """

    def __init__(
        self,
        get_model: Callable[[], torch.nn.Module],
        config: GenerationConfig,
        share_prefix: bool = True,
        full_parameters: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None,
        prepack_weights: bool = True,
        lean: bool = True,
        fused_step: bool = True,
        cuda_graph: bool = True,
        autocast_dtype: torch.dtype | None = None,
        sampler_precision: str = "float32",
    ) -> None:
        self.get_model = get_model
        self.config = config
        self.share_prefix = share_prefix
        self.full_parameters = full_parameters or (lambda model: contextlib.nullcontext())
        self.prepack_weights = prepack_weights
        self.lean = lean
        self.fused_step = fused_step
        self.cuda_graph = cuda_graph
        self.autocast_dtype = autocast_dtype
        self.reduced: ReducedCopy | None = None  # the reduced-precision copy (None: float32)
        #: ``[(adapter, rows), ...]`` while a sweep's shared call samples each block of rows with its
        #: own LoRA adapter (``sweep/generation.py``): the prompts' forward runs peft's mixed-adapter
        #: batches (each distinct prompt and adapter once), the fused step adds the low-rank terms.
        self.adapter_rows: list[tuple[str, int]] | None = None
        self.set_sampler_precision(sampler_precision)
        self.path = GenerationPath()

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        max_new_tokens: int | None = None,
        model_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> Samples:
        """One sampled completion per prompt row: ``[N, P] -> Samples([N, T])``.

        Args:
            prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
            max_new_tokens: a tighter budget for this call (the tool loop's remaining tokens).
            model_inputs: a vision-language model's image inputs of the rows (pixel values, grid
                sizes, ...): passed to ``generate``, which then runs plain (the lean loop and the
                shared prefill read tokens only).
        """
        config = self.config
        if max_new_tokens is not None and max_new_tokens < (config.max_new_tokens or max_new_tokens + 1):
            config = copy.deepcopy(config)
            config.max_new_tokens = max_new_tokens
            if config.min_new_tokens is not None:
                config.min_new_tokens = min(config.min_new_tokens, max_new_tokens)
        model = self.get_model()
        self.path = GenerationPath()
        was_training = model.training
        model.eval()
        try:
            with self.full_parameters(model):
                if model_inputs:
                    out = self._generate_with_inputs(model, prompt_ids, prompt_mask, config, model_inputs)
                    logps = None
                else:
                    out, logps = self._generate(model, prompt_ids, prompt_mask, config)
        finally:
            model.train(was_training)
        return Samples(completion_ids=out[:, prompt_ids.shape[1] :], logps=logps)

    def set_sampler_precision(self, precision: str, asked: bool = True) -> None:
        """Sample from the policy (``"float32"``) or a reduced-precision copy of it from the next call.

        Args:
            precision: a value of ``reduced_precision.SAMPLER_PRECISIONS`` (``"auto"`` is resolved
                for this CPU).
            asked: the user asked for this precision (``sampler_precision``); False when the trainer
                chose it (bf16 training samples from a bf16 copy): a call the copy cannot serve
                then samples from the policy without a warning, as it would without the copy.
        """
        precision = resolve_precision(precision)
        self.sampler_precision = precision
        self.reduced = ReducedCopy(precision) if precision != "float32" else None
        self._warned_reduced = not asked

    def weights_changed(self) -> None:
        """The policy's weights changed (an optimizer step): rebuild the reduced copy before sampling."""
        if self.reduced is not None:
            self.reduced.invalidate()

    def release_reduced_copy(self) -> None:
        """Free the reduced-precision copy until the next call, which rebuilds it.

        The trainer calls this once a training batch is sampled: the optimizer step that follows
        makes the copy stale, so keeping it would only hold its bytes (a bf16 copy of SmolLM2:
        about 270 MB) through the loss's forward and backward, the step's peak.
        """
        if self.reduced is not None:
            self.reduced.release()

    def _generate_with_inputs(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig,
        model_inputs: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """``model.generate`` with a vision-language model's image inputs beside the tokens."""
        reason = "the batch has image inputs"
        self._note(taken="plain", prefix_blocker=reason, lean_blocker=reason)
        self._reduced_skipped(reason)
        return model.generate(
            input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **model_inputs
        )

    def _note(self, **fields: Any) -> None:
        """Record what this call did (fields of ``GenerationPath``) in ``self.path``."""
        self.path = dataclasses.replace(self.path, **fields)

    def _packing_pays(self, config: GenerationConfig) -> bool:
        return self.prepack_weights and (config.max_new_tokens or 0) >= PREPACK_MIN_NEW_TOKENS

    def _packed(
        self, model: torch.nn.Module, rows: int, config: GenerationConfig
    ) -> contextlib.AbstractContextManager:
        """The prepacked-weights context; none when ``prepack_weights`` is off or too few steps repay it."""
        if self._packing_pays(config):
            return onednn_prepacked_linears(model, rows)
        return contextlib.nullcontext()

    def _fused_decoder(
        self, model: torch.nn.Module, rows: int, config: GenerationConfig
    ) -> FusedDecoder | GraphedDecodeStep | None:
        """The lean loop's one-token step: fused (graphed on a GPU), or None for the model's forward.

        The reasons for what did not apply go to ``path.fused_blocker`` and ``path.cuda_graph_blocker``.
        """
        if self.reduced is not None:
            backend, autocast = self.reduced.backend, self.autocast_dtype
            reduced_blocker = reduced_sampler_blocker(model, backend, autocast, self.adapter_rows)
            self._note(reduced_blocker=reduced_blocker)
            if reduced_blocker is None:  # the copy is built once per weights, for any length
                self._note(
                    fused_blocker=None, cuda_graph_blocker="the reduced-precision sampler runs on the CPU"
                )
                return self.reduced.decoder(model, rows, autocast, self.adapter_rows)
        # a sweep's shared call: each row block's adapter; a lone PEFT run: its adapter for every row
        target, adapter_rows = decoder_target(model, rows, self.adapter_rows)
        backend = default_backend(target)
        if not self.fused_step:
            fused_blocker = "fused_step=False"
        elif backend == "onednn" and not self._packing_pays(config):
            fused_blocker = "prepack_weights=False or too few new tokens to repay packing"
        else:
            fused_blocker = decoder_blocker(model, backend, self.autocast_dtype, self.adapter_rows)
        self._note(fused_blocker=fused_blocker)
        if fused_blocker is not None:
            return None
        fused = FusedDecoder(target, rows, backend, self.autocast_dtype, adapter_rows)
        device = target.get_output_embeddings().weight.device
        if fused.segments:
            self._note(cuda_graph_blocker="LoRA terms per row block")
            return fused
        graph_blocker = cuda_graph_blocker(fused, device) if self.cuda_graph else "cuda_graph=False"
        self._note(cuda_graph_blocker=graph_blocker)
        return GraphedDecodeStep(fused) if graph_blocker is None else fused

    def _generate(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model.generate`` or the lean loop on the batch, from a shared-prefix cache when that applies.

        The shared prefill runs before the weights are packed: prepacking pays for decode steps
        (a few rows per product) and costs about 10 % on a prefill's many-row products.

        Returns:
            The sequences [N, P + T] and, from the reduced-precision sampler, the log-probs [N, T]
            of the sampled tokens (None otherwise).
        """
        kwargs: dict[str, Any] = {}
        self._note(taken="plain", prefix_blocker="share_prefix=False")
        row_adapters = self._row_adapters(model, self._adapter_per_row())
        if "generate" in vars(model):  # a wrapper or a test double set on the instance: honour it
            reason = "model.generate is replaced on the instance"
            self._note(prefix_blocker=reason, lean_blocker=reason)
            self._reduced_skipped(reason)
            with row_adapters:
                out = model.generate(
                    input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config
                )
            return out, None
        settings, lean_blocker = lean_settings(model, config) if self.lean else (None, "lean=False")
        self._note(lean_blocker=lean_blocker)
        original_prompt = prompt_ids
        if self.share_prefix:
            prompt_ids, prompt_mask, config, kwargs = self._prefill_prefix(
                model, prompt_ids, prompt_mask, config, lean=settings is not None
            )
        if settings is not None:
            prefix = next(iter(kwargs.values()), None)
            with row_adapters:
                out, logps = self._lean(model, prompt_ids, prompt_mask, config, settings, prefix)
            out[:, : original_prompt.shape[1]] = original_prompt  # the caller's layout of the prompts
            return out, logps
        self._reduced_skipped(f"no lean sampling loop ({lean_blocker})")
        with self._packed(model, prompt_ids.shape[0], config), row_adapters:
            out = model.generate(
                input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config, **kwargs
            )
            return out, None

    def _adapter_per_row(self) -> list[str] | None:
        """The LoRA adapter of every row of a sweep's shared call (``adapter_rows``), else None."""
        if self.adapter_rows is None:
            return None
        return [name for name, count in self.adapter_rows for _ in range(count)]

    @staticmethod
    def _row_adapters(model: torch.nn.Module, names: list[str] | None) -> contextlib.AbstractContextManager:
        """peft's mixed-adapter batches for the forwards in the context: row i through adapter
        ``names[i]`` (a sweep's shared call); no context when ``names`` is None."""
        if names is None:
            return contextlib.nullcontext()
        return model._enable_peft_forward_hooks(adapter_names=names)

    def _prefill_prefix(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig,
        lean: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, GenerationConfig, dict[str, Any]]:
        """The prompts' shared prefix (or, for distinct prompts that open alike, their common
        opening) run once: the prompts, config and ``generate`` keyword (the cache) to sample with."""
        kwargs: dict[str, Any] = {}
        names = self._adapter_per_row()
        adapters = None if names is None else sorted(set(names))
        row_keys = None  # a sweep's shared call: rows are alike when their prompt and adapter are
        if adapters is not None:
            row_keys = torch.tensor([adapters.index(name) for name in names], device=prompt_ids.device)
        groups = group_prompts(prompt_ids, prompt_mask, row_keys)
        blocker = shared_prefix_blocker(model, config, groups)
        self._note(prefix_blocker=blocker)
        if blocker is None:
            self._note(taken="shared_prefix")
            unique = None if adapters is None else [adapters[int(key)] for key in groups.unique_keys]
            with self._row_adapters(model, unique):
                kwargs[cache_argument(model)] = prefill_shared_prefix(model, groups)
            config = _without_cache_implementation(config)
        elif blocker == EVERY_PROMPT_DISTINCT and lean and (adapters is None or len(adapters) == 1):
            # distinct prompts that open alike (a system message, worked examples): that opening
            # runs once, each row's rest with the batch (not across adapters: each has its own
            # keys and values of the opening)
            length = common_prefix_length(prompt_ids, prompt_mask)
            blocked = prefix_cache_blocker(model, config)
            if length >= COMMON_PREFIX_MIN_TOKENS and blocked is None:
                prompt_ids, prompt_mask = prefix_first(prompt_ids, prompt_mask, length)
                with self._row_adapters(model, adapters):
                    kwargs[cache_argument(model)] = prefill_common_prefix(
                        model, prompt_ids[0, :length], prompt_ids.shape[0]
                    )
                self._note(prefix_blocker=None, taken="common_prefix")
        return prompt_ids, prompt_mask, config, kwargs

    def _lean(
        self,
        model: torch.nn.Module,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        config: GenerationConfig,
        settings: Any,
        prefix: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The lean sampling loop, fused (or on prepacked weights) where that applies; the reduced
        copy's log-probs of the sampled tokens when it sampled."""
        fused = self._fused_decoder(model, prompt_ids.shape[0], config)
        packed = (
            contextlib.nullcontext()
            if fused is not None
            else self._packed(model, prompt_ids.shape[0], config)
        )
        with packed:
            self._note(taken=f"lean+{self.path.taken}" if prefix is not None else "lean")
            if self.reduced is not None and self.path.reduced_blocker is None:
                return lean_generate_with_logps(
                    model, prompt_ids, prompt_mask, settings, prefix_cache=prefix, fused=fused
                )
            self._reduced_skipped(self.path.reduced_blocker)
            return lean_generate(
                model, prompt_ids, prompt_mask, settings, prefix_cache=prefix, fused=fused
            ), None

    def _reduced_skipped(self, reason: str | None) -> None:
        """Record (and warn once) that this call sampled from the float32 policy despite ``sampler_precision``."""
        if self.reduced is None:
            return
        self._note(reduced_blocker=reason)
        if not self._warned_reduced:
            self._warned_reduced = True
            warnings.warn(
                f"sampler_precision={self.sampler_precision!r} did not apply to this generation call "
                f"({reason}): it samples from the float32 policy without sampler log-probs, so the "
                "importance-sampling correction is off for these completions. Set "
                "sampler_precision='float32' to silence this.",
                UserWarning,
                stacklevel=4,
            )


def _without_cache_implementation(config: GenerationConfig) -> GenerationConfig:
    """``config`` with ``cache_implementation`` unset: ``generate`` refuses it beside a given cache."""
    if config.cache_implementation is None:
        return config
    config = copy.deepcopy(config)
    config.cache_implementation = None
    return config
