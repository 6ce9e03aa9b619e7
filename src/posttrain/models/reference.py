"""The reference policy of the KL penalty, and model-level options of the policy."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch


def create_reference(policy: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of ``policy`` at its current weights (the KL anchor), in eval mode."""
    ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    disable = getattr(ref, "activation_checkpointing_disable", None) or getattr(
        ref, "gradient_checkpointing_disable", None
    )
    if disable is not None:
        disable()
    return ref


def cast_lm_head_to_fp32(model: Any) -> None:
    """Compute the LM head in float32 (ScaleRL), whatever the model's dtype.

    Raises:
        ValueError: the input embeddings are tied to the LM head (casting one would cast both).
    """
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "cast_lm_head_to_fp32=True needs an LM head that is not tied to the input embeddings, but this "
            "model has tie_word_embeddings=True. Set cast_lm_head_to_fp32=False for this model."
        )
    head = model.get_output_embeddings()
    head.float()

    def to_fp32(module: torch.nn.Module, args: tuple) -> tuple:
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    head.register_forward_pre_hook(to_fp32)


def is_moe(model: Any) -> bool:
    """Whether the model has a router auxiliary loss (a Mixture-of-Experts config)."""
    config = model.config
    return (
        hasattr(config, "router_aux_loss_coef")
        and (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)) is not None
    )


def set_router_aux_loss_coef(model: Any, coef: float | None) -> float:
    """Resolve the router auxiliary-loss coefficient; 0 turns it off.

    Args:
        model: the policy.
        coef: ``router_aux_loss_coef`` from the config; ``None`` keeps the model's own value.

    Returns:
        The coefficient in force (0.0 for a dense model with ``coef=None``).

    Raises:
        ValueError: ``coef`` is set for a model that is not a Mixture-of-Experts.
    """
    if not is_moe(model):
        if coef is not None:
            raise ValueError(
                f"router_aux_loss_coef={coef} is set, but {type(model).__name__} is not a Mixture-of-Experts "
                "model (its config has no router). Leave router_aux_loss_coef=None for dense models."
            )
        return 0.0
    if coef is None:
        coef = float(model.config.router_aux_loss_coef)
    model.config.router_aux_loss_coef = coef
    model.config.output_router_logits = coef > 0
    return coef


def mix_into_reference(
    ref_params: Iterable[torch.Tensor], policy_params: Iterable[torch.Tensor], alpha: float
) -> None:
    """TR-DPO's soft update of the reference policy, in place (Gorbatovski et al., Sec. 3).

    ``pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref_prev``, parameter by parameter
    (``alpha = 1`` is the hard update). The policy tensors are cast to each reference tensor's
    dtype and device; no gradient is recorded.

    Args:
        ref_params: the reference tensors, updated in place.
        policy_params: the policy tensors, in the same order and shapes.
        alpha: ``ref_model_mixup_alpha`` in [0, 1].
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"ref_model_mixup_alpha={alpha} must lie in [0, 1].")
    with torch.no_grad():
        for ref, pol in zip(ref_params, policy_params, strict=True):
            ref.lerp_(pol.to(dtype=ref.dtype, device=ref.device), alpha)


def should_sync_reference(global_step: int, sync_steps: int) -> bool:
    """Whether the reference is synchronised after optimizer step ``global_step`` (TR-DPO ``tau``).

    True every ``sync_steps`` completed optimizer steps: ``global_step > 0`` and
    ``global_step % sync_steps == 0``.
    """
    if sync_steps < 1:
        raise ValueError(f"ref_model_sync_steps={sync_steps} must be a positive integer.")
    return global_step > 0 and global_step % sync_steps == 0
