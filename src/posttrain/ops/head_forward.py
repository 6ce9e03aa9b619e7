"""Which models the chunked LM head serves, and their final hidden states from one forward.

``ops/chunked.py`` computes completion log-probs and entropy from the decoder's final hidden
states instead of the model's ``[B, T, V]`` logits. This module decides where that is exact
(``supports_chunked``), obtains the hidden states through whatever wraps the model
(``run_with_hidden``: the model is called as usual with ``logits_to_keep=1`` and a forward hook on
the decoder catches ``last_hidden_state``), checks once per model that its logits are
``lm_head(hidden)`` (``logits_match_head``), and tells the head's product dtype under bf16
autocast (``head_product_dtype``). See ``ops/chunked.py``'s docstring for the whole design.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttrain.ops import precision

# config fields of transformers models whose logits are not plainly lm_head(hidden)
_LOGIT_TRANSFORMS: dict[str, Callable[[Any], bool]] = {
    "final_logit_softcapping": lambda v: v is not None and v != 0,  # Gemma 2/3: cap * tanh(z / cap)
    "logit_scale": lambda v: v is not None and v != 1,  # Cohere: z * logit_scale
    "logits_scaling": lambda v: v is not None and v != 1,  # Granite: z / logits_scaling
}


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers (the one with the LM head)."""
    while True:
        if hasattr(model, "get_base_model"):  # PeftModel
            model = model.get_base_model()
        elif not hasattr(model, "get_output_embeddings") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module  # DistributedDataParallel, DeepSpeedEngine, FSDP (v1)
        else:
            return model


def vocab_size(model: nn.Module) -> int:
    """The number of logits the model's LM head produces (wrappers looked through)."""
    return int(causal_lm(model).get_output_embeddings().weight.shape[0])


def _is_sharded(model: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the head's weight is partitioned (FSDP, DeepSpeed ZeRO-3): not whole outside forward."""
    wrappers = []
    while isinstance(getattr(model, "module", None), nn.Module):
        wrappers.append(type(model).__name__)
        model = model.module
    dtensor = type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor"
    return (
        dtensor or hasattr(weight, "ds_id") or weight.numel() == 0 or "FullyShardedDataParallel" in wrappers
    )


def _plain_linear_head(head: Any) -> bool:
    """An ``nn.Linear`` itself (not LoRA, quantized or offloaded), with at most input pre-hooks."""
    return (
        type(head) is nn.Linear
        and not hasattr(head, "_hf_hook")  # accelerate offloading / device maps replace forward
        and not head._forward_hooks
        and not head._forward_pre_hooks_with_kwargs
    )


def supports_chunked(model: nn.Module) -> bool:
    """Whether the chunked path computes exactly what ``model(...).logits`` would.

    True for a transformers causal LM (plain, inside DDP, or a ``PeftModel`` whose adapters do not
    touch the LM head) whose logits are ``lm_head(decoder(x).last_hidden_state)``: the head is a
    plain ``nn.Linear``, tied to the input embeddings or not, possibly cast to float32 by
    ``cast_lm_head_to_fp32`` (its input pre-hooks are applied to the hidden states). Mixture-of-
    Experts models qualify: their router loss comes from the same forward call.

    False (the naive full-logits path is used) for: logits transformed after the head (Gemma's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``); an LM head
    that is wrapped (LoRA on ``lm_head``, ``modules_to_save``, quantized, offloaded) or has output
    hooks; a sharded head weight (FSDP, DeepSpeed ZeRO-3); a model without ``get_decoder``. A
    model that transforms its logits some other way is caught at its first call (module docstring).
    """
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_output_embeddings") or not hasattr(lm, "get_decoder"):
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(test(getattr(text_config, name, None)) for name, test in _LOGIT_TRANSFORMS.items()):
        return False
    head = lm.get_output_embeddings()
    return _plain_linear_head(head) and not _is_sharded(model, head.weight)


def head_input(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as the LM head sees it: its input pre-hooks applied (the float32 cast), in its dtype."""
    head = causal_lm(model).get_output_embeddings()
    for hook in head._forward_pre_hooks.values():
        result = hook(head, (hidden,))
        if result is not None:
            hidden = result[0] if isinstance(result, tuple) else result
    return hidden.to(head.weight.dtype)


def head_product_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``token_stats`` should run ``model``'s vocabulary products in: bf16 or ``None``.

    bf16 when the model's latest ``run_with_hidden`` forward ran under bf16 autocast (``bf16=True``:
    accelerate wraps the forward, not the loss that calls the head afterwards) and bf16 products
    are native on the head's device (a GPU; a CPU with AVX512-BF16 or AMX). The head then
    multiplies in the precision the rest of the model did, as autocast would have run
    ``lm_head``, but with float32 logits and statistics. ``None`` elsewhere: no autocast, float16
    autocast (its gradients need the loss scaler's range), or a CPU that would emulate bf16.
    """
    lm = causal_lm(model)
    if _AUTOCAST_SEEN.get(lm) is not torch.bfloat16:
        return None
    weight = lm.get_output_embeddings().weight
    if weight.dtype != torch.float32 or not precision.fast_bf16(weight.device):
        return None
    return torch.bfloat16


def run_with_hidden(model: nn.Module, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """Call ``model(**inputs, logits_to_keep=1)`` and catch the decoder's final hidden states.

    Once ``logits_match_head`` has verified an unwrapped model (not inside DDP or another
    ``.module`` wrapper), its plain ``nn.Linear`` head is not run:
    during the call its ``forward`` returns ``[B, 1, 0]`` logits (no vocabulary product and, under
    autocast, no bf16 copy of the [V, H] weight, which cost 60 to 90 ms of page faults a forward
    on SmolLM2's head). ``out.logits`` is then empty; callers use the hidden states.

    Returns:
        The model's output (its ``logits`` cover the last position only, with no vocabulary
        entries once verified) and the hidden states [B, L, H] of every position.
    """
    captured: list[torch.Tensor] = []
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    # not under DDP & co. (``.module``): their unused-parameter search must see the head used
    skip_head = _VERIFIED.get(lm) is True and _plain_linear_head(head) and not hasattr(model, "module")

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if hidden is not None else output[0]
        captured.append(hidden)
        # the head's product runs under the same autocast (accelerate wraps the whole forward
        # and casts the logits back to float32, so their dtype does not tell)
        device = hidden.device.type
        _AUTOCAST_SEEN[lm] = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    handle = causal_lm(model).get_decoder().register_forward_hook(keep)
    if skip_head:
        head.forward = _no_vocabulary  # an instance attribute over nn.Linear.forward, deleted below
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
        if skip_head:
            del head.forward
    if not captured:
        raise RuntimeError(f"{type(causal_lm(model)).__name__}.get_decoder() was not called in forward.")
    return out, captured[-1]


def _no_vocabulary(hidden: torch.Tensor) -> torch.Tensor:
    """A verified model's LM head during ``run_with_hidden``: [..., H] -> [..., 0] logits."""
    return hidden.new_zeros(*hidden.shape[:-1], 0)


_VERIFIED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
#: the autocast dtype the model's latest ``run_with_hidden`` forward ran under (None: none)
_AUTOCAST_SEEN: weakref.WeakKeyDictionary[nn.Module, torch.dtype | None] = weakref.WeakKeyDictionary()


def logits_match_head(model: nn.Module, out: Any, hidden: torch.Tensor) -> bool:
    """Once per model: whether its own last-position logits equal ``lm_head(hidden)`` there.

    Args:
        model: the model called by ``run_with_hidden``.
        out: its output; ``out.logits`` is [B, 1, V].
        hidden: [B, L, H] the captured hidden states.

    Returns:
        The verdict, remembered for the model; a ``False`` also warns once.
    """
    lm = causal_lm(model)
    if lm in _VERIFIED:
        return _VERIFIED[lm]
    head = lm.get_output_embeddings()
    with torch.no_grad():
        ours = nn.functional.linear(
            head_input(model, hidden[:, -1]), head.weight, head.bias
        ).float()  # [B, V]
        theirs = out.logits[:, -1].float()  # [B, V]
        # bf16 logits (autocast) come from a bf16 product, ours from a float32 one (or another
        # bf16 kernel): judge them at the precision they were computed in, not the weights'
        dtypes = [head.weight.dtype, out.logits.dtype, _AUTOCAST_SEEN.get(lm) or head.weight.dtype]
        precision = max(torch.finfo(d).eps for d in dtypes)
        tol = 8 * precision
        ok = bool(torch.allclose(ours, theirs, rtol=tol, atol=tol * float(theirs.abs().max())))
    _VERIFIED[lm] = ok
    if not ok:
        warnings.warn(
            f"{type(lm).__name__} computes its logits differently from lm_head(hidden_states); its completion "
            "log-probs are taken from full logits instead of the chunked path (more memory).",
            stacklevel=3,
        )
    return ok
