"""oneDNN-prepacked weights for the CPU's float32 linear layers, for the duration of a generation.

A decode step multiplies a few rows by every weight; the blocked layout oneDNN packs them into is
read faster than ``F.linear`` reads the plain one. ``onednn_prepacked_linears`` swaps each
packable layer's forward for the prepacked product and restores it after; the fused decode step
(``generation/fused_step.py``) and the reduced-precision sampler use the same checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

#: Below this many new tokens, packing the weights (about 0.25 s for a 135M model) costs more than
#: the decode steps save (20-50 ms each on 2 CPU cores): ``generate`` runs with ``F.linear``.
PREPACK_MIN_NEW_TOKENS = 32


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's prepacked linear product (CPU builds with MKLDNN)."""
    ops = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def packable_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The layers ``onednn_prepacked_linears`` swaps: plain float32 ``nn.Linear`` on the CPU.

    Subclasses (quantised layers), sharded weights (DTensor, DeepSpeed ZeRO-3 partitions) and layers whose forward is
    already replaced (offloading hooks, a swap in progress) are left alone.
    """
    if not onednn_linear_available():
        return []
    return [m for m in model.modules() if is_packable_linear(m)]


def is_packable_linear(module: object) -> bool:
    """A plain float32 ``nn.Linear`` on the CPU, unsharded, with the class's own forward."""
    return (
        type(module) is torch.nn.Linear
        and type(module.weight.detach()) is torch.Tensor
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and module.weight.dim() == 2  # a DeepSpeed ZeRO-3 partitioned weight is an empty 1-D placeholder
        and not hasattr(module.weight, "ds_id")
        and "forward" not in module.__dict__
    )


@contextlib.contextmanager
def onednn_prepacked_linears(model: torch.nn.Module, rows: int) -> Iterator[int]:
    """Within the block, every packable linear layer multiplies with a oneDNN-prepacked weight copy.

    Small-batch float32 products (a decode step multiplies ``rows`` vectors by each weight)
    reach more of the memory bandwidth with oneDNN's blocked weight layout than with
    ``F.linear``. Weights change at every optimizer step, so they are packed on entry (one
    copy of the weights, freed on exit) and the layers are restored on exit, also on error.
    The products differ from ``F.linear`` by float32 rounding only (accumulation order).

    Args:
        model: the model about to generate (gradients off).
        rows: the number of rows per decode step, the packing's batch-size hint.

    Yields:
        The number of layers swapped (0 where oneDNN is unavailable).
    """
    swapped = packable_linears(model)
    for module in swapped:
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
        module.forward = _prepacked_forward(module, packed)
    try:
        yield len(swapped)
    finally:
        for module in swapped:
            del module.forward  # the class's forward again


def _prepacked_forward(
    module: torch.nn.Linear, packed: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The packed product for float32 inputs; the layer's own forward otherwise.

    Under CPU autocast (``bf16=True``: accelerate wraps the model's forward in it) inputs arrive
    in bfloat16 and ``F.linear`` must run, so the cast autocast applies stays the same.
    """

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type):
            return torch.nn.Linear.forward(module, x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")

    return forward
