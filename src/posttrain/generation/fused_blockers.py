"""What the fused decode step (``fused_step.FusedDecoder``) covers, and why it does not run a model.

``fused_decoder_blocker`` checks a model before a generation call builds the step: its family,
wrappers and autocast, its attention kind, and that every projection is a plain linear layer
(or a plain LoRA layer over one, for the adapters the step is to apply). ``default_backend``
picks the backend for the model's device; ``lone_lora_adapter`` finds the one adapter of a lone
PEFT run, which the step merges into its copy of the weights, and ``decoder_target`` gives the
model and ``adapter_rows`` the step is built from; ``decoder_blocker`` checks a model as a
generator holds it, PEFT wrapper included (the generator and the reduced copies ask it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from posttrain.generation.introspection import _only_full_attention_layers, core_model
from posttrain.generation.prepacked import is_packable_linear, onednn_linear_available
from posttrain.generation.reduced_kernels import REDUCED_BACKENDS, backend_blocker

#: ``model_type``s whose decoder layers this step reproduces (the families the tests check).
FUSED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def _rms_norm_module(module: object) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and getattr(module, "weight", None) is not None
        and "forward" not in module.__dict__
    )


#: Weight dtypes the plain backend multiplies with (the model's own dtype).
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _is_plain_linear(module: object, device: torch.device) -> bool:
    """A plain ``nn.Linear`` on ``device``, unsharded, with the class's own forward."""
    return (
        type(module) is nn.Linear
        and type(module.weight.detach()) is torch.Tensor
        and module.weight.dtype in PLAIN_DTYPES
        and module.weight.device == device
        and module.weight.dim() == 2
        and not hasattr(module.weight, "ds_id")
        and "forward" not in module.__dict__
    )


def default_backend(model: nn.Module) -> str | None:
    """``"onednn"`` for float32 CPU weights where oneDNN is there, ``"plain"`` on a GPU, else None."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None:
        return None
    if weight.device.type == "cpu":
        return "onednn" if onednn_linear_available() else None
    return "plain"


def rope_is_static(model: nn.Module) -> bool:
    """Whether the rotary angles of a position depend on the position alone (not on the length).

    ``"dynamic"`` and ``"longrope"`` scaling change with the sequence length; a cos/sin table made
    once (``static_step``) would then differ from the model's per-step values.
    """
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return getattr(rotary, "rope_type", "default") not in {"dynamic", "longrope"}


def fused_decoder_blocker(
    model: nn.Module,
    backend: str | None = None,
    autocast_dtype: torch.dtype | None = None,
    lora_adapters: Sequence[str] | None = None,
) -> str | None:
    """Why ``FusedDecoder`` cannot run ``model``'s decode steps, or None when it can.

    Args:
        model: the model about to generate (a ``PreTrainedModel``; wrappers are not looked through,
            so a PEFT model falls back).
        backend: ``"onednn"``, ``"plain"``, or a reduced copy (``reduced_kernels.REDUCED_BACKENDS``);
            None picks ``default_backend``.
        autocast_dtype: the dtype of the mixed-precision autocast the model's forward is wrapped
            in (accelerate's ``bf16``/``fp16``); the wrapper is then accepted by the plain backend
            (whose steps run under the same autocast) and by the reduced copies (which never call
            the forward: their products are in their own precision).
        lora_adapters: the model (the transformers model under a ``PeftModel``) carries LoRA
            layers and these adapters are to be applied (``FusedDecoder(adapter_rows=...)``): a
            plain LoRA layer (no DoRA, not merged, float32 or plain weights) then counts as its
            base linear layer plus low-rank terms (one adapter on a copying backend: merged into
            the copy; several: float32 terms beside the copied base products). None: any LoRA
            layer rules the step out.
    """
    backend = backend or default_backend(model)
    reason = _backend_blocker(backend) or _wrapping_blocker(model, backend, autocast_dtype)
    if reason is not None:
        return reason
    backbone = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or head is None or getattr(head, "bias", None) is not None:
        return "the LM head is not a plain linear layer"
    device = head.weight.device
    cpu_float32 = backend != "plain"  # onednn and the reduced copies start from float32 CPU weights
    if cpu_float32:
        linear_ok, what = is_packable_linear, "float32 linear layer on the CPU"
    else:
        linear_ok, what = (lambda m: _is_plain_linear(m, device)), "linear layer"
    if not linear_ok(head):
        return f"the LM head is not a plain {what}"
    if lora_adapters is not None:
        linear_ok = _lora_or(linear_ok, lora_adapters)
    embed = getattr(backbone, "embed_tokens", None)
    if type(embed) is not nn.Embedding or embed.weight.device != device:
        return "the input embedding is not a plain embedding beside the LM head"
    if cpu_float32 and embed.weight.dtype != torch.float32:
        return "the input embedding is not a plain float32 embedding on the CPU"
    if not _rms_norm_module(getattr(backbone, "norm", None)) or getattr(backbone, "rotary_emb", None) is None:
        return "no final RMSNorm or rotary embedding"
    return next(
        (r for layer in backbone.layers if (r := _layer_blocker(layer, linear_ok, what)) is not None), None
    )


def is_lora_layer(module: object) -> bool:
    """Whether ``module`` is a peft LoRA layer (a base layer with ``lora_A``/``lora_B`` beside it)."""
    return hasattr(module, "lora_A") and hasattr(module, "lora_B") and hasattr(module, "base_layer")


def _base_layer(module: nn.Module) -> nn.Module:
    return module.base_layer if is_lora_layer(module) else module


def _plain_lora(module: nn.Module, adapters: Sequence[str]) -> bool:
    """A LoRA layer the step can apply as base product + ``scaling * B(A x)`` for ``adapters``."""
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return False
    for name in adapters:
        if name not in module.lora_A:
            continue  # this adapter does not wrap the layer: the base product alone
        if getattr(module, "use_dora", {}).get(name, False) or getattr(module, "lora_bias", {}).get(
            name, False
        ):
            return False
        if type(module.lora_A[name]) is not nn.Linear or type(module.lora_B[name]) is not nn.Linear:
            return False
    return True


def lone_lora_adapter(model: nn.Module) -> str | None:
    """The one active adapter of a PEFT-wrapped model (None: not wrapped, or several active).

    A lone PEFT run samples through its adapter alone: the fused step then takes the model as
    ``adapter_rows=[(adapter, rows)]`` (``fused_decoder_blocker`` still checks every layer).
    """
    if core_model(model) is model:
        return None
    active = getattr(model, "active_adapters", None)
    if callable(active):  # transformers' integration: a method; peft's PeftModel: a property
        active = active()
    if isinstance(active, str):
        active = [active]
    return active[0] if isinstance(active, (list, tuple)) and len(active) == 1 else None


def decoder_target(
    model: nn.Module, rows: int, adapter_rows: Sequence[tuple[str, int]] | None = None
) -> tuple[nn.Module, list[tuple[str, int]] | None]:
    """The model a fused step runs for ``model``, and its ``adapter_rows``.

    Given ``adapter_rows`` (a sweep's shared call: ``[(adapter, rows), ...]`` in row order): the
    transformers model under the PEFT wrapper, with those blocks. A lone PEFT run
    (``lone_lora_adapter``): that model, with its adapter for all ``rows``. Anything else:
    ``model`` itself, no adapters.
    """
    if adapter_rows is not None:
        return core_model(model), list(adapter_rows)
    lone = lone_lora_adapter(model)
    return (model, None) if lone is None else (core_model(model), [(lone, rows)])


def _lora_or(linear_ok: Callable[[nn.Module], bool], adapters: Sequence[str]) -> Callable[[nn.Module], bool]:
    """``linear_ok``, also true of a plain LoRA layer (for ``adapters``) whose base layer passes it."""
    return lambda m: linear_ok(_base_layer(m)) and (not is_lora_layer(m) or _plain_lora(m, adapters))


def _backend_blocker(backend: str | None) -> str | None:
    """Why this torch build cannot run ``backend``'s products, or None."""
    if backend is None or (backend == "onednn" and not onednn_linear_available()):
        return "no oneDNN linear product in this torch build"
    if backend in REDUCED_BACKENDS:
        return backend_blocker(backend)
    return None


def _wrapping_blocker(model: nn.Module, backend: str, autocast_dtype: torch.dtype | None) -> str | None:
    """Why the model as a whole (its family, wrappers, autocast, attention kind) rules the step out."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if core_model(model) is not model:
        return "a wrapped model (PEFT)"
    if _forward_replaced(model, backend, autocast_dtype):
        return "the model's forward is wrapped (mixed-precision autocast, hooks)"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast"
    if not _only_full_attention_layers(model):
        return "sliding-window attention"
    return None


def decoder_blocker(
    model: nn.Module,
    backend: str | None,
    autocast_dtype: torch.dtype | None = None,
    adapter_rows: Sequence[tuple[str, int]] | None = None,
) -> str | None:
    """Why the fused step cannot run the decode steps of ``model`` as a generator holds it, or None.

    ``model`` may be a PEFT wrapper: the step is built from ``decoder_target`` (the model under
    it, with its adapters' rows), and the wrapper's own forward, which runs the prompts' prefill,
    must not be one the step cannot follow (``peft_wrapper_blocker``).

    Args:
        model: the model the generator samples from.
        backend: as ``fused_decoder_blocker``'s (None: ``default_backend`` of the target).
        autocast_dtype: as ``fused_decoder_blocker``'s.
        adapter_rows: a sweep's shared call: the adapter of each block of rows.
    """
    target, rows = decoder_target(model, 0, adapter_rows)
    adapters = None if rows is None else [name for name, _ in rows]
    return peft_wrapper_blocker(model, backend, autocast_dtype) or fused_decoder_blocker(
        target, backend, autocast_dtype, adapters
    )


def peft_wrapper_blocker(
    model: nn.Module, backend: str | None, autocast_dtype: torch.dtype | None
) -> str | None:
    """Why the PEFT wrapper around a model rules the fused step out, or None (no wrapper, or a plain one).

    The step runs the transformers model under the wrapper (``decoder_target``), but a call's
    prefill runs the wrapper's forward: one that accelerate wrapped in a mixed-precision autocast
    leaves a bf16 or fp16 cache, which the float32 step cannot read unless it runs under the
    same autocast (``autocast_dtype``, as ``fused_decoder_blocker`` accepts it).
    """
    if core_model(model) is model or not _forward_replaced(model, backend, autocast_dtype):
        return None
    return "the PEFT model's forward is wrapped (mixed-precision autocast, hooks)"


def _forward_replaced(model: nn.Module, backend: str | None, autocast_dtype: torch.dtype | None) -> bool:
    """Whether ``model``'s forward is an instance attribute the step does not know how to follow."""
    known_wrapper = autocast_dtype is not None and (backend == "plain" or backend in REDUCED_BACKENDS)
    return "forward" in model.__dict__ and not known_wrapper


def _layer_blocker(layer: nn.Module, linear_ok: Callable[[nn.Module], bool], what: str) -> str | None:
    """Why one decoder layer is not the plain attention + gated MLP the fused step computes, or None."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    projections = [getattr(attn, f"{n}_proj", None) for n in "qkvo"]
    projections += [getattr(mlp, f"{n}_proj", None) for n in ("gate", "up", "down")]
    if not all(linear_ok(p) for p in projections):
        return f"a projection is not a plain {what} (LoRA, quantised, offloaded)"
    if any(p.bias is not None for p in projections[4:]) or projections[3].bias is not None:
        return "biases on the output or MLP projections"
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if not all(_rms_norm_module(n) for n in norms):
        return "a norm is not an RMSNorm"
    if "forward" in layer.__dict__ or "forward" in attn.__dict__ or "forward" in mlp.__dict__:
        return "a layer's forward is replaced (hooks or offloading)"
    if getattr(attn, "scaling", None) is None or getattr(mlp, "act_fn", None) is None:
        return "an attention layer without scaling or an MLP without act_fn"
    return None
