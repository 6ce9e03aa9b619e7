"""Sampling from a reduced-precision copy of the policy, with the sampler's own log-probs.

Large systems sample with a bf16 inference engine and train in float32; the gap between the two
(``log p_sampler - log p_trainer``) is corrected by importance sampling
(``vllm_importance_sampling_*``, ``grpo.regularizers.sampler_is_weights``). This module brings
the same trade to CPU generation, where a decode step is memory-bound: it reads every weight for
a few rows, so fewer bytes per weight is the lever.

``GRPOConfig(sampler_precision=...)``:

- ``"float32"`` (default): the policy's own weights (no copy, no sampler log-probs).
- ``"int8"``: the linear layers of the one-token decode step (``fused_step.FusedDecoder``)
  multiply with an int8 copy of the weights, one scale per output channel (symmetric,
  ``max |w| / 127``), through fbgemm's dynamically quantised product
  (``torch.ops.quantized.linear_dynamic``: the activations are quantised too, per call and per
  tensor, in 7 bits on AVX2). The fastest product measured on an AVX2-only host at 8 rows, but
  the activation quantisation moves SmolLM2's log-probs by about 0.2 nats a token
  (docs/performance.md, "Reduced-precision sampler"). Weight-only int8
  (``torch._weight_int8pack_mm``) was slower than float32 there.
- ``"fp16"``: a float16 copy multiplied by fbgemm with float32 activations and accumulation
  (``torch.ops.quantized.linear_dynamic_fp16``): half the bytes, about 1e-3 nats of mismatch.
- ``"bf16"``: a bfloat16 copy (oneDNN-packed where this CPU packs bf16, plain ``F.linear`` in
  bf16 elsewhere, which is correct but slower than float32 on CPUs without bf16 instructions);
  the products in bf16.
- ``"auto"``: ``"bf16"`` on CPUs with native bf16 instructions (AVX512-BF16 or AMX), else
  ``"fp16"`` (int8's mismatch is too large to pick it for the user).

Everything but the linear products (norms, rotary embedding, attention, the KV cache) stays in
float32.

Only the decode steps use the copy: the prompt's forward (compute-bound, many rows per product)
runs the float32 policy. The sampled tokens' log-probs come from the logits the tokens were drawn
from (``log_softmax(logits / temperature)``, before top-k/top-p truncation: the quantity the
trainer recomputes), so the importance-sampling correction sees the true mismatch.

``ReducedCopy`` holds the copy and rebuilds it when the weights change: after each optimizer
step (the trainer calls ``TransformersGenerator.weights_changed``) and whenever a parameter is
replaced or modified in place outside the optimizer (its storage or version counter moved).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from posttrain.generation import reduced_kernels
from posttrain.generation.fused_blockers import decoder_blocker
from posttrain.generation.fused_step import FusedDecoder, decoder_target
from posttrain.generation.reduced_kernels import (  # noqa: F401  (re-exported)
    REDUCED_BACKENDS,
    SAMPLER_PRECISIONS,
    backend_blocker,
    bf16_linear,
    bf16_pack,
    fbgemm_available,
    fp16_linear,
    fp16_pack,
    int8_linear,
    int8_pack,
    linear,
    native_bf16,
    onednn_bf16_packable,
    pack,
    resolve_precision,
)

# ---- the copy, refreshed when the weights change ----------------------------------------------------


def _fingerprint(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each parameter lives and its in-place version: changes when a weight is replaced or written."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


class ReducedCopy:
    """A ``FusedDecoder`` with reduced-precision weights, rebuilt when the policy's weights change.

    The decoder's norms, rotary embedding and input embedding are the model's own (read at every
    step); its linear weights are the reduced copy. ``decoder`` returns the copy, rebuilding it
    first when ``invalidate`` was called (after an optimizer step: fused optimizers write weights
    without moving their version counters) or when a parameter's storage or version moved.

    Args:
        backend: ``"int8"``, ``"fp16"`` or ``"bf16"``.

    Attributes:
        refreshes: how many times the copy was built.
        last_refresh_seconds: the wall time of the latest build.
    """

    def __init__(self, backend: str) -> None:
        if backend not in REDUCED_BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {REDUCED_BACKENDS}.")
        self.backend = backend
        self.refreshes = 0
        self.last_refresh_seconds = 0.0
        self._decoder: FusedDecoder | None = None
        self._key: tuple | None = None
        self._stale = True

    def invalidate(self) -> None:
        """Mark the copy stale: the next ``decoder`` call rebuilds it."""
        self._stale = True

    @property
    def in_memory(self) -> bool:
        """Whether the copy is built and held (``release`` frees it)."""
        return self._decoder is not None

    def release(self) -> None:
        """Free the copy now; the next ``decoder`` call rebuilds it, as after ``invalidate``."""
        self._decoder = None
        self._stale = True

    @torch.no_grad()
    def decoder(
        self,
        model: nn.Module,
        rows: int,
        autocast_dtype: torch.dtype | None = None,
        adapter_rows: Sequence[tuple[str, int]] | None = None,
    ) -> FusedDecoder:
        """The reduced decode step of ``model``'s current weights for ``rows`` rows.

        Args:
            model: the policy (``reduced_sampler_blocker(model, backend, autocast_dtype,
                adapter_rows)`` must be None).
            rows: rows per decode step (oneDNN's packing hint, bf16 only).
            autocast_dtype: the mixed-precision autocast the policy's forward is wrapped in (the
                trainer's ``bf16``/``fp16``), or None.
            adapter_rows: a sweep's shared call, ``[(adapter, rows), ...]`` in row order: the copy
                holds the base weights and each row block adds its adapter's float32 low-rank
                terms (one block: its adapter merged in). None: a lone PEFT policy's active
                adapter is merged into the copy.
        """
        hint = rows if self.backend == "bf16" and onednn_bf16_packable() else 0
        rows = max(rows, 1)
        target, adapter_rows = decoder_target(model, rows, adapter_rows)
        # one block is merged into the copy: its adapter matters, not its rows (oneDNN's hint has them)
        blocks = (
            None
            if not adapter_rows
            else adapter_rows[0][0]
            if len(adapter_rows) == 1
            else tuple(adapter_rows)
        )
        key = (id(model), hint, blocks, _fingerprint(model))
        if self._decoder is None or self._stale or key != self._key:
            self._decoder = None  # free the old copy before building the new one
            start = time.perf_counter()
            self._decoder = FusedDecoder(target, rows, self.backend, autocast_dtype, adapter_rows)
            self.last_refresh_seconds = time.perf_counter() - start
            self.refreshes += 1
            self._key, self._stale = key, False
        return self._decoder


def reduced_sampler_blocker(
    model: nn.Module,
    backend: str,
    autocast_dtype: torch.dtype | None = None,
    adapter_rows: Sequence[tuple[str, int]] | None = None,
) -> str | None:
    """Why a reduced-precision sampler cannot run ``model``'s decode steps, or None.

    Args:
        model: the policy, unwrapped (a PEFT model with one active LoRA adapter: the copy holds
            the base weights with the adapter merged in, ``FusedDecoder``).
        backend: ``"int8"``, ``"fp16"`` or ``"bf16"``.
        autocast_dtype: the mixed-precision autocast the policy's forward is wrapped in (the
            trainer's ``bf16``/``fp16``): accepted, since the copy never calls the forward.
        adapter_rows: a sweep's shared call: the adapter of each block of rows (``decoder``).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None or weight.device.type != "cpu":
        return "the policy is not on the CPU (the reduced-precision sampler is a CPU path)"
    return backend_blocker(backend) or decoder_blocker(model, backend, autocast_dtype, adapter_rows)


def check_sampler_sources(precision: str, tools: Any, rollout_func: Any, environment_factory: Any) -> None:
    """A reduced-precision sampler needs the trainer's own sampling: raise before the model loads.

    Args:
        precision: ``GRPOConfig.sampler_precision``.
        tools, rollout_func, environment_factory: the trainer's arguments of the same names.
    """
    if precision == "float32":
        return
    other = [
        name
        for name, given in (
            ("tools", bool(tools)),
            ("environment_factory", environment_factory is not None),
            ("rollout_func", rollout_func is not None),
        )
        if given
    ]
    if other:
        raise ValueError(
            f"sampler_precision={precision!r} samples with the trainer's own decode loop, but "
            f"{' and '.join(other)} generate the completions another way (their log-probs would not "
            "come from the reduced copy); set sampler_precision='float32'."
        )


def trainer_precision_sampler(generator: Any, model: nn.Module) -> str:
    """The sampler that ``sampler_precision="float32"`` (the default) means for this trainer.

    With ``bf16=True`` the trainer's forward computes in bfloat16 (accelerate's autocast), so the
    decode steps need not multiply in float32: on a CPU with bf16 instructions they run the fused
    step on a bfloat16 copy of the weights (``"bf16"``): the products autocast would run, without
    casting every float32 weight again at every token, and with the sampler's own log-probs
    feeding the importance-sampling correction. Anywhere else (no bf16 instructions, a GPU, a
    model the fused step does not run, float32 training) ``"float32"``: the policy itself.

    Args:
        generator: the trainer's ``TransformersGenerator`` (its ``autocast_dtype`` tells the
            trainer's mixed precision).
        model: the policy, unwrapped.
    """
    autocast = getattr(generator, "autocast_dtype", None)
    if autocast is not torch.bfloat16 or not reduced_kernels.native_bf16():
        return "float32"
    return "bf16" if reduced_sampler_blocker(model, "bf16", autocast) is None else "float32"


def configure_sampler(generator: Any, model: nn.Module, precision: str, own_sampling: bool = True) -> str:
    """Set ``generator`` to sample at ``precision`` from ``model``; return the precision in force.

    An explicit ``"int8"``, ``"fp16"`` or ``"bf16"`` that cannot run ``model`` raises; ``"auto"``
    falls back to float32 with a warning; ``"float32"`` under ``bf16=True`` on a CPU with bf16
    instructions samples from a bf16 copy (``trainer_precision_sampler``). A generator other than
    ``TransformersGenerator`` (a scripted one in tests) is left alone.

    Args:
        generator: the trainer's generation backend.
        model: the policy, unwrapped.
        precision: ``GRPOConfig.sampler_precision``.
        own_sampling: the trainer samples every completion itself (no tools, environments or
            ``rollout_func``, whose turns would reach the copy without its log-probs); only then
            does ``bf16=True`` pick the bf16 copy.
    """
    if not hasattr(generator, "set_sampler_precision"):  # not the trainer's own generator
        return "float32"
    resolved = resolve_precision(precision)
    if resolved == "float32":
        if not own_sampling:
            return "float32"
        resolved = trainer_precision_sampler(generator, model)
        if resolved != "float32":
            generator.set_sampler_precision(resolved, asked=False)
        return resolved
    reason = reduced_sampler_blocker(model, resolved, generator.autocast_dtype)
    if reason is not None and precision != "auto":
        raise ValueError(
            f"sampler_precision={precision!r} cannot sample from this policy: {reason}. The "
            "reduced-precision sampler runs the fused CPU decode step of a float32 Llama, Qwen2, "
            "Qwen3 or Mistral model; set sampler_precision='float32'."
        )
    if reason is not None:
        warnings.warn(
            f"sampler_precision='auto' samples in float32 here: {reason}.", UserWarning, stacklevel=3
        )
        resolved = "float32"
    generator.set_sampler_precision(resolved)
    return resolved
