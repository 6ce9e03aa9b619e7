"""LoRA and other PEFT adapters on the policy (the ``peft`` extra: ``pip install posttrain[peft]``),
and QLoRA: the adapter on a base model loaded quantized (the ``qlora`` extra adds bitsandbytes).

With an adapter only its own weights train; the base weights stay frozen. That makes the base
model itself the reference policy of the KL penalty: its log-probs are the policy's with the
adapters switched off, so no second copy of the model is kept (see ``docs/peft.md``).

``peft`` is imported only when an adapter is asked for or a ``PeftModel`` is passed in.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

INSTALL_HINT = "pip install 'posttrain[peft]'  (or: pip install 'peft>=0.18')"
QLORA_INSTALL_HINT = "pip install 'posttrain[qlora]'  (or: pip install bitsandbytes 'peft>=0.18')"


def _import_peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise ImportError(
            f"GRPOTrainer(peft_config=...) needs the peft library, which is not installed: {INSTALL_HINT}"
        ) from exc
    return peft


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (without importing peft when nothing has yet)."""
    peft = sys.modules.get("peft")  # a PeftModel can only exist once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


def check_peft_arguments(model: Any, peft_config: Any, args: Any, quantization_config: Any = None) -> None:
    """Refuse the PEFT combinations that cannot work, before any model is loaded.

    Raises:
        ImportError: ``peft_config`` is given but peft is not installed, or a
            ``BitsAndBytesConfig`` is given but bitsandbytes is not installed.
        TypeError: ``peft_config`` is not a ``peft.PeftConfig``, or ``quantization_config`` is
            not a transformers quantization config.
        ValueError: ``model`` is already a ``PeftModel`` and ``peft_config`` is given too,
            ``sync_ref_model=True`` is combined with an adapter, or ``quantization_config`` is
            given without ``peft_config``.
    """
    check_quantization_arguments(model, quantization_config, peft_config)
    uses_peft = peft_config is not None or is_peft_model(model)
    if not uses_peft:
        return
    if peft_config is not None:
        peft = _import_peft()
        if not isinstance(peft_config, peft.PeftConfig):
            raise TypeError(
                f"peft_config must be a peft.PeftConfig (e.g. peft.LoraConfig(r=16, target_modules=[...])); "
                f"got {type(peft_config).__name__}."
            )
        if is_peft_model(model):
            raise ValueError(
                "model is already a PeftModel and peft_config is given as well; pass the PeftModel with "
                "peft_config=None, or pass the base model with peft_config to add the adapter."
            )
    if getattr(args, "sync_ref_model", False):
        raise ValueError(
            "sync_ref_model=True cannot be used with a PEFT adapter: the KL reference is the base model "
            "(the policy with its adapters disabled), which never changes, so there is no reference to mix "
            "the policy into. Set sync_ref_model=False, or train without peft_config."
        )


def check_quantization_arguments(model: Any, quantization_config: Any, peft_config: Any) -> None:
    """QLoRA: a model loaded quantized (4-bit, 8-bit) trains through an adapter only.

    ``quantization_config`` applies when the trainer loads ``model`` from a name; for a model
    that is already built it is ignored, with a warning (load it quantized yourself instead).

    Raises:
        TypeError: ``quantization_config`` is not a transformers quantization config.
        ImportError: it is a ``BitsAndBytesConfig`` and bitsandbytes is not installed.
        ValueError: ``model`` is a name and ``peft_config`` is ``None``.
    """
    if quantization_config is None:
        return
    from transformers.utils.quantization_config import QuantizationConfigMixin

    if not isinstance(quantization_config, QuantizationConfigMixin):
        raise TypeError(
            "quantization_config must be a transformers quantization config, e.g. "
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4'); "
            f"got {type(quantization_config).__name__}."
        )
    if not isinstance(model, str):
        warnings.warn(
            "quantization_config is ignored: it applies only when GRPOTrainer loads the model from a name. "
            "Load the model quantized yourself (from_pretrained(..., quantization_config=...)) or pass its name.",
            UserWarning,
            stacklevel=3,
        )
        return
    if peft_config is None:
        raise ValueError(
            "quantization_config loads the model's weights quantized, and quantized weights cannot be trained: "
            "pass a peft_config as well (QLoRA), e.g. peft.LoraConfig(r=16, target_modules='all-linear'), or "
            "drop quantization_config to train the full model."
        )
    if (
        quantization_config.quant_method == "bitsandbytes"
        and importlib.util.find_spec("bitsandbytes") is None
    ):
        raise ImportError(
            f"quantization_config=BitsAndBytesConfig(...) needs bitsandbytes: {QLORA_INSTALL_HINT}"
        )


def is_quantized(model: Any) -> bool:
    """Whether ``model`` was loaded with a transformers quantization config (4-bit, 8-bit, ...)."""
    return getattr(model, "hf_quantizer", None) is not None


def wrap_policy(
    policy: Any, peft_config: Any, gradient_checkpointing: bool, adapter_name: str = "default"
) -> Any:
    """The policy ready for adapter training.

    A quantized model is first prepared for k-bit training (``peft.prepare_model_for_kbit_training``:
    base weights frozen, the remaining half-precision ones such as norms cast to float32), and its
    4-bit layers kept differentiable on every CPU (:func:`keep_4bit_layers_differentiable`).

    Args:
        policy: a causal LM (possibly loaded quantized), or already a ``PeftModel``.
        peft_config: the adapter to add (``None`` for a ``PeftModel`` taken as is).
        gradient_checkpointing: whether activations will be recomputed in the backward pass;
            the frozen embeddings' outputs must then require a gradient, or none reaches the
            adapters through the checkpointed layers.
        adapter_name: the name of the adapter ``peft_config`` adds (a sweep names it after its run).

    Returns:
        A ``PeftModel`` whose only trainable parameters are the adapter's.

    Raises:
        ValueError: a ``PeftModel`` with no trainable parameter (loaded without ``is_trainable=True``).
    """
    keep_4bit_layers_differentiable(policy)
    if peft_config is not None:
        if is_quantized(policy):
            policy = _import_peft().prepare_model_for_kbit_training(policy, use_gradient_checkpointing=False)
        with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            policy = _import_peft().get_peft_model(policy, peft_config, adapter_name=adapter_name)
    if not any(p.requires_grad for p in policy.parameters()):
        raise ValueError(
            "The PeftModel passed as model has no trainable parameters: its adapter was loaded frozen. "
            "Load it with PeftModel.from_pretrained(base, path, is_trainable=True)."
        )
    if gradient_checkpointing:
        policy.enable_input_require_grads()
    return policy


def keep_4bit_layers_differentiable(model: torch.nn.Module) -> int:
    """Keep every bitsandbytes 4-bit layer on its dequantize-and-matmul path, which has a backward.

    On a CPU with AVX512-BF16, bitsandbytes (0.49 to at least 0.50.2) repacks a ``Linear4bit``'s
    weight into a fused-kernel layout the first time the layer runs in eval mode without a
    gradient (a generation, the adapters-disabled reference) and keeps that layout for every
    later call, training's included. That kernel has no backward: the gradient stops at the first
    4-bit layer it meets, so the adapters below it never train (layer 0's ``lora_A`` got no
    gradient at all in ``tests/test_qlora.py``), and it computes in bfloat16 whatever
    ``bnb_4bit_compute_dtype`` says. It also fails outright on a layer whose input size is not a
    multiple of the quantization block (``shape '[32, 0]' is invalid``). So posttrain turns the
    repacking off (bitsandbytes' own per-layer switch) and undoes it where it already happened.

    Returns:
        How many 4-bit layers were switched (0 without bitsandbytes or on a model without them).
    """
    switched = 0
    for module in model.modules():
        if not hasattr(module, "support_avx512bf16_for_cpu"):
            continue
        module.support_avx512bf16_for_cpu = False
        weight = module.weight
        if getattr(getattr(weight, "quant_state", None), "packing_format_for_cpu", False):
            from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

            weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                weight.data, weight.quant_state
            )
            module.quant_state = weight.quant_state
        switched += 1
    return switched


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The base model of a ``PeftModel``, in eval mode like a frozen reference, for the block's length."""
    was_training = model.training
    model.eval()
    try:
        with model.disable_adapter():
            yield model
    finally:
        model.train(was_training)
