"""Sharded training (FSDP2, DeepSpeed ZeRO): full parameters for generation, the KL reference, FSDP2 on CPU.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``) and ZeRO-3 each process holds only its
shard of every parameter. A forward pass gathers the parameters it needs and frees them
afterwards; ``generate`` runs one forward per new token, so sampling through the sharded model
would gather every layer once per token. :func:`generation_parameters` gathers the whole model
once around the ``generate`` call instead, and frees it when generation is done.

:func:`create_reference` keeps the frozen KL reference partitioned like the policy under ZeRO-3.
:func:`use_fsdp_on_cpu` lets FSDP2 run on CPU processes (gloo): accelerate selects FSDP only for
accelerator devices and otherwise drops the plugin and trains with DDP (see ``docs/distributed.md``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

from posttrain.models import reference as model_reference
from posttrain.models.compat import checkpointing_enabled


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` sharded with ``fully_shard``, outermost (the root) first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def fsdp2_full_parameters(model: torch.nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Unshard every FSDP2 group of ``model`` for the block's length, then reshard.

    Inside the block every parameter is a plain full tensor, and the forward hooks find the
    groups already unsharded, so the block's forward passes communicate nothing. Resharding
    after each forward is switched off for the block (otherwise the first forward would free
    the layers again) and set back to ``reshard_after_forward`` afterwards; the root keeps
    FSDP2's default for it, no resharding after forward.

    Args:
        model: a model prepared with FSDP2 (a plain model passes through untouched).
        reshard_after_forward: the setting the model was sharded with (accelerate's
            ``fsdp_reshard_after_forward``), restored on the non-root groups on exit.
    """
    modules = fsdp2_modules(model)
    for module in modules:
        module.set_reshard_after_forward(False, recurse=False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for module in modules[1:]:
            module.set_reshard_after_forward(reshard_after_forward, recurse=False)


@contextlib.contextmanager
def zero3_full_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Gather the ZeRO-3 partitioned parameters of ``model`` for the block's length (read only)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        yield


def _zero_stage(accelerator: Any) -> int | None:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return None if plugin is None else int(plugin.zero_stage)


def generation_parameters(
    accelerator: Any, model: torch.nn.Module, ds3_gather_for_generation: bool = True
) -> contextlib.AbstractContextManager:
    """The context to run ``model.generate`` in: full parameters under FSDP2 and ZeRO-3.

    Args:
        accelerator: the trainer's ``Accelerator`` (it tells which backend shards the model).
        model: the unwrapped model that will generate.
        ds3_gather_for_generation: under ZeRO-3, gather the whole model once for the call
            (``True``), or let every forward gather its layers (``False``: slower, but the full
            model never has to fit in one process's memory).

    Returns:
        A context manager; a no-op one for DDP, one process, ZeRO-1/2 and FSDP1.
    """
    if getattr(accelerator, "is_fsdp2", False):
        return fsdp2_full_parameters(model, bool(accelerator.state.fsdp_plugin.reshard_after_forward))
    if _zero_stage(accelerator) == 3 and ds3_gather_for_generation:
        return zero3_full_parameters(model)
    return contextlib.nullcontext()


def _is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded inside ``deepspeed.zero.Init`` (its parameters are ZeRO-3 placeholders)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _frozen(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in eval mode without gradients, as ``models.reference.create_reference`` leaves its copy."""
    model.eval()
    model.requires_grad_(False)
    return model


def _deepspeed_inference_engine(model: torch.nn.Module, accelerator: Any) -> torch.nn.Module:
    """``model`` inside a DeepSpeed engine without optimizer, in eval mode (ZeRO-3 gathers in forward)."""
    import deepspeed

    config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
    for key in ("optimizer", "scheduler"):
        config.pop(key, None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def create_reference(
    policy: torch.nn.Module, accelerator: Any, reload: Callable[[], torch.nn.Module]
) -> torch.nn.Module:
    """The frozen KL reference (a copy of the initial policy), placed like the policy.

    A model loaded by name under ZeRO-3 is partitioned from the start (transformers loads it
    inside ``deepspeed.zero.Init``): a copy of it would hold placeholders, not weights, so the
    reference is loaded again with ``reload`` instead. Under ZeRO-3 the reference goes into a
    DeepSpeed engine without optimizer, which keeps it partitioned like the policy; elsewhere it
    is a full copy on the process's device (FSDP2 does not shard it).

    Args:
        policy: the policy, before ``accelerator.prepare``.
        accelerator: the trainer's ``Accelerator``.
        reload: loads the policy's initial weights again (only called for a partitioned policy).

    Returns:
        The reference, frozen and in eval mode.
    """
    if _is_partitioned(policy):
        reference = _frozen(reload())
    else:
        reference = model_reference.create_reference(policy)
    if _zero_stage(accelerator) == 3:
        return _deepspeed_inference_engine(reference, accelerator)
    return reference.to(accelerator.device)


def _requested_fsdp_plugin(args: Any) -> Any:
    """The FSDP plugin that ``TrainingArguments(fsdp=...)`` or ``accelerate launch`` (FSDP config) asks for."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.environment import parse_flag_from_env

    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if plugin_args is not None:
        return FullyShardedDataParallelPlugin(**plugin_args)
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return FullyShardedDataParallelPlugin()  # reads accelerate launch's FSDP_* variables
    return None


def use_fsdp_on_cpu(trainer: Any) -> bool:
    """Run FSDP2 where accelerate would silently fall back to DDP: processes on CPU (gloo).

    accelerate (1.15) selects FSDP only when the processes drive accelerator devices; on CPU
    it keeps ``MULTI_CPU`` and ignores the FSDP plugin that ``TrainingArguments(fsdp=...)`` or
    an ``accelerate launch`` FSDP config asks for. ``torch``'s ``fully_shard`` itself runs on CPU
    with gloo, so this switches the (shared) accelerate state to FSDP with that plugin before
    ``accelerator.prepare`` shards the model. Call it right after the ``Accelerator`` is created.

    Args:
        trainer: a ``transformers.Trainer`` whose ``accelerator`` was just created.

    Returns:
        Whether the switch was made (``False`` when FSDP is not asked for, or is already on).

    Raises:
        ValueError: FSDP version 1 is asked for (only FSDP2 runs on CPU), or FSDP's own
            activation checkpointing is combined with ``activation_checkpointing=True``.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = _requested_fsdp_plugin(trainer.args)
    if plugin is None:
        return False
    if plugin.fsdp_version != 2:
        raise ValueError(
            "FSDP on CPU processes runs with FSDP2 only; set fsdp_config={'version': 2} (the default) or "
            "fsdp_version: 2 in the accelerate config, or run FSDP1 on GPUs."
        )
    if plugin.activation_checkpointing and checkpointing_enabled(trainer.args):
        raise ValueError(
            "fsdp_config['activation_checkpointing'] and activation_checkpointing=True cannot both be set; "
            "keep one of them."
        )
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    PartialState().distributed_type = DistributedType.FSDP  # two singletons, each with its own copy
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    trainer.is_fsdp_enabled = True
    return True


def end_process_group(before_destroy: Callable[[], None] | None = None) -> bool:
    """Wait for every process, then destroy the default process group; call once at the end of a run.

    A process that exits with its gloo process group alive can abort (SIGABRT, ``terminate
    called without an active exception``) while Python shuts down: gloo's worker threads still
    hold tensors that can no longer be freed. The launcher then sees a failed rank and kills the
    others, possibly in the middle of rank 0's final save. The barrier first lets every rank
    finish its last collective (rank 0's save included), so none is left waiting on a peer that
    is gone. Call it only after a successful run: after a failure the other ranks may never reach
    the barrier.

    Args:
        before_destroy: runs after the barrier, before the group goes (a colocated vLLM engine's
            shutdown, which destroys the process groups it made, and the default one with them).

    Returns:
        Whether there was a process group to end.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        if before_destroy is not None:
            before_destroy()
        return False
    torch.distributed.barrier()
    if before_destroy is not None:
        before_destroy()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return True
