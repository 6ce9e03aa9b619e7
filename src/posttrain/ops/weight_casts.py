"""Each linear weight cast to bf16 once per training micro-step, where CPU autocast casts it per use.

Under ``bf16=True`` on the CPU the model's forward runs in autocast, which casts a float32 weight
to bfloat16 at every ``F.linear`` that reads it. Its cast cache lives only as long as one
autocast region, so a micro-step casts each weight again and again: GRPO's completion pass after
the shared prompt's pass, gradient checkpointing's recomputation of a layer in backward, the
reference forward of a PEFT model. On the anchor config (SmolLM2-135M, bf16 on an Intel Xeon
with AMX) a ``torch.profiler`` trace of a step counted six casts of every decoder weight, most of
the step's ``aten::copy_`` time, which was as large as the training products' own.

``WeightCasts`` keeps one cast per weight for a whole training micro-step:

- forward pre-hooks on the model's ``nn.Linear`` modules (not the output head, whose chunked
  products cast their own weight, ``ops/chunked.py``) put the cached cast in the module's
  instance dictionary under ``weight`` (and ``bias``) for that call. ``nn.Linear.forward`` reads
  ``self.weight`` there before the registered parameter; the forward hook removes it again.
- each use under gradients goes through ``_SharedCast``, whose backward turns the bf16 gradient
  into float32 as autocast's own cast does, and accumulates it into the parameter's ``grad``. So
  the forward values and every gradient are bit-identical to autocast's (``tests/test_weight_casts.py``):
  accelerate wraps each forward call in its own autocast region, so autocast's cast too has one
  backward node per forward. (Within one region autocast would share one node between two uses
  and sum their bf16 gradients in bf16; here each use's gradient is widened before the sum.)
- a cast is reused while its parameter's version counter is unchanged: an in-place update (the
  optimizer's) makes the next use cast again.

The trainer attaches the hooks at the start of each training micro-step and releases them, with
the casts, at its end (``BaseTrainer.training_step``), so a generation's prompt forward under
autocast casts the weights once for the loss forward and backward that follow. The fused decode
step reads the parameters themselves (no module is inside a forward then); the bf16 sampler copy
it multiplies with is built from the same casts (``shared_cast``), so a weight is cast once per
micro-step for the generation and the loss together. It applies on a single
CPU process under bf16 autocast (``applies``); ``POSTTRAIN_REUSE_WEIGHT_CASTS=0`` turns it off. Figures:
docs/performance.md, "One bf16 cast per weight".
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from posttrain.ops import switches

ENV = "POSTTRAIN_REUSE_WEIGHT_CASTS"
_SHADOWED = ("weight", "bias")
_ATTACHED = threading.local()  # .instances: the WeightCasts attached in this thread, innermost last


class _SharedCast(torch.autograd.Function):
    """The cached cast as the output of the float32 parameter: gradients flow back as autocast's cast."""

    @staticmethod
    def forward(ctx: Any, parameter: torch.Tensor, cast: torch.Tensor) -> torch.Tensor:  # noqa: ARG004
        ctx.dtype = parameter.dtype
        return cast.detach()  # a new tensor on the same storage: each use gets its own node

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype), None


def enabled() -> bool:
    """Whether ``POSTTRAIN_REUSE_WEIGHT_CASTS`` allows it (unset or 1; 0 turns it off).

    Raises:
        ValueError: the variable holds something else.
    """
    return switches.switched_on(ENV, "set it to 0 to let autocast cast every use, or unset it.")


def applies(args: Any) -> bool:
    """Whether a trainer with these ``TrainingArguments`` reuses its casts: bf16 on one CPU process.

    Raises:
        ValueError: ``POSTTRAIN_REUSE_WEIGHT_CASTS`` holds something else than 0 or 1 (read first,
            whatever the precision, so a typo fails when the trainer is built).
    """
    return (
        enabled()
        and bool(getattr(args, "bf16", False))
        and args.device.type == "cpu"
        and args.world_size == 1
    )


class WeightCasts:
    """The bf16 casts of one model's linear weights, shared by every use within a micro-step."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self.casts = 0  # casts made since the last ``release`` (tests count them)
        self._cache: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self._handles: list[Any] = []
        self._shadowing: set[nn.Module] = set()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def attach(self, model: nn.Module) -> None:
        """Hook ``model``'s ``nn.Linear`` modules, its output head excepted (a no-op when attached)."""
        if self._handles:
            return
        if self not in _attached():
            _attached().append(self)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for module in model.modules():
            if type(module) is nn.Linear and module is not head:
                self._handles.append(module.register_forward_pre_hook(self._before))
                self._handles.append(module.register_forward_hook(self._after))

    def release(self) -> None:
        """Remove the hooks, any cast still in a module's dictionary, and the cached casts."""
        for handle in self._handles:
            handle.remove()
        for module in self._shadowing:
            for name in _SHADOWED:
                module.__dict__.pop(name, None)
        self._handles, self._shadowing, self._cache, self.casts = [], set(), {}, 0
        instances = _attached()
        if self in instances:
            instances.remove(self)

    def cast_of(self, parameter: torch.Tensor) -> torch.Tensor:
        """The cached cast of ``parameter`` (made now when missing or stale), without a gradient."""
        with torch.no_grad():
            return self._entry(parameter)[2]

    def _entry(self, parameter: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
        entry = self._cache.get(id(parameter))
        if entry is None or entry[0] is not parameter or entry[1] != parameter._version:
            with torch.no_grad():
                entry = (parameter, parameter._version, parameter.detach().to(self.dtype))
            self._cache[id(parameter)] = entry
            self.casts += 1
        return entry

    def _cast(self, parameter: torch.Tensor) -> torch.Tensor:
        cast = self._entry(parameter)[2]
        if parameter.requires_grad and torch.is_grad_enabled():
            return _SharedCast.apply(parameter, cast)
        return cast

    def _before(self, module: nn.Module, args: Any) -> None:  # noqa: ARG002
        device = module._parameters["weight"].device.type
        if not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != self.dtype:
            return
        for name in _SHADOWED:
            parameter = module._parameters.get(name)
            if parameter is not None and parameter.dtype == torch.float32:
                module.__dict__[name] = self._cast(parameter)
                self._shadowing.add(module)

    def _after(self, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG002
        if module in self._shadowing:
            for name in _SHADOWED:
                module.__dict__.pop(name, None)
            self._shadowing.discard(module)


def _attached() -> list[WeightCasts]:
    if not hasattr(_ATTACHED, "instances"):
        _ATTACHED.instances = []
    return _ATTACHED.instances


def shared_cast(parameter: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor | None:
    """``parameter`` in ``dtype`` from the micro-step's shared casts, or None outside one.

    Inside a training micro-step whose ``WeightCasts`` is attached (in this thread) and casts to
    ``dtype``, a float32 parameter gets that cache's cast, made now if no forward made it yet:
    the values ``parameter.to(dtype)`` would give, and the one copy the micro-step's forwards and
    backward use too. Used by the bf16 sampler copy (``generation/fused_step.py``) when it is
    rebuilt inside a micro-step. Without gradients.
    """
    instances = _attached()
    if not instances or instances[-1].dtype != dtype or parameter.dtype != torch.float32:
        return None
    return instances[-1].cast_of(parameter)
