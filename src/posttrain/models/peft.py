"""LoRA and other PEFT adapters on the policy (the ``peft`` extra: ``pip install posttrain[peft]``).

With an adapter only its own weights train; the base weights stay frozen. That makes the base
model itself the reference policy of the KL penalty: its log-probs are the policy's with the
adapters switched off, so no second copy of the model is kept (see ``docs/peft.md``).

``peft`` is imported only when an adapter is asked for or a ``PeftModel`` is passed in.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

INSTALL_HINT = "pip install 'posttrain[peft]'  (or: pip install 'peft>=0.15')"


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


def check_peft_arguments(model: Any, peft_config: Any, args: Any) -> None:
    """Refuse the PEFT combinations that cannot work, before any model is loaded.

    Raises:
        ImportError: ``peft_config`` is given but peft is not installed.
        TypeError: ``peft_config`` is not a ``peft.PeftConfig``.
        ValueError: ``model`` is already a ``PeftModel`` and ``peft_config`` is given too, or
            ``sync_ref_model=True`` is combined with an adapter.
    """
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
    if args.sync_ref_model:
        raise ValueError(
            "sync_ref_model=True cannot be used with a PEFT adapter: the KL reference is the base model "
            "(the policy with its adapters disabled), which never changes, so there is no reference to mix "
            "the policy into. Set sync_ref_model=False, or train without peft_config."
        )


def wrap_policy(policy: Any, peft_config: Any, gradient_checkpointing: bool) -> Any:
    """The policy ready for adapter training.

    Args:
        policy: a causal LM, or already a ``PeftModel``.
        peft_config: the adapter to add (``None`` for a ``PeftModel`` taken as is).
        gradient_checkpointing: whether activations will be recomputed in the backward pass;
            the frozen embeddings' outputs must then require a gradient, or none reaches the
            adapters through the checkpointed layers.

    Returns:
        A ``PeftModel`` whose only trainable parameters are the adapter's.

    Raises:
        ValueError: a ``PeftModel`` with no trainable parameter (loaded without ``is_trainable=True``).
    """
    if peft_config is not None:
        with warnings.catch_warnings():  # peft reads a transformers attribute deprecated in v5
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            policy = _import_peft().get_peft_model(policy, peft_config)
    if not any(p.requires_grad for p in policy.parameters()):
        raise ValueError(
            "The PeftModel passed as model has no trainable parameters: its adapter was loaded frozen. "
            "Load it with PeftModel.from_pretrained(base, path, is_trainable=True)."
        )
    if gradient_checkpointing:
        policy.enable_input_require_grads()
    return policy


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
