"""The reduced-precision products of the sampler, and what this CPU and torch build offer for them.

A leaf of ``generation/`` (it imports only ``prepacked``, and ``ops.precision``'s host check): the fused decode step multiplies with
these, and ``reduced_precision`` (the copy of the policy the sampler reads) builds on both.
``reduced_precision``'s docstring says what each precision costs and why.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn import functional as F

from posttrain.generation.prepacked import onednn_linear_available
from posttrain.ops.precision import native_bf16  # noqa: F401  (re-exported; the LM head asks it too)

#: Values of ``GRPOConfig.sampler_precision``.
SAMPLER_PRECISIONS = ("float32", "int8", "fp16", "bf16", "auto")

#: The reduced backends of ``fused_step.FusedDecoder``.
REDUCED_BACKENDS = ("int8", "fp16", "bf16")


# ---- what this CPU and torch build offer ------------------------------------------------------


@functools.cache
def fbgemm_available(backend: str) -> bool:
    """Whether fbgemm's ``"int8"`` or ``"fp16"`` linear product runs in this torch build."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    pack, linear = (int8_pack, int8_linear) if backend == "int8" else (fp16_pack, fp16_linear)
    try:
        out = linear(torch.ones(2, 8), pack(torch.ones(4, 8)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, torch.full((2, 4), 8.0), rtol=0.05))


@functools.cache
def onednn_bf16_packable() -> bool:
    """Whether oneDNN packs bfloat16 linear weights on this CPU (it needs AVX512 or AVX-NE-CONVERT)."""
    if not onednn_linear_available():
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 8, dtype=torch.bfloat16), 2)
        torch.ops.mkldnn._linear_pointwise(
            torch.ones(2, 8, dtype=torch.bfloat16), packed, None, "none", [], ""
        )
    except RuntimeError:
        return False
    return True


def resolve_precision(requested: str) -> str:
    """The precision ``requested`` means on this host: ``"auto"`` becomes ``"bf16"`` or ``"int8"``.

    Args:
        requested: a value of ``SAMPLER_PRECISIONS``.
    """
    if requested not in SAMPLER_PRECISIONS:
        raise ValueError(f"sampler_precision={requested!r} is not one of {SAMPLER_PRECISIONS}.")
    if requested != "auto":
        return requested
    return "bf16" if native_bf16() else "fp16"


# ---- the products --------------------------------------------------------------------------------


def int8_pack(weight: torch.Tensor) -> torch.Tensor:
    """fbgemm's packed int8 copy of a float32 ``[out, in]`` weight, one symmetric scale per row."""
    weight = weight.detach().float().contiguous()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    with warnings.catch_warnings():  # torch 2.13 marks quantised tensor creation deprecated
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*", category=UserWarning)
        quantised = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(quantised, None)


def int8_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with ``int8_pack(w)``: float32 in and out, the activations quantised per call.

    ``reduce_range=True`` keeps the quantised activations in 7 bits, so fbgemm's AVX2 kernel
    (pairs of u8 x s8 products summed in int16) cannot saturate.
    """
    return torch.ops.quantized.linear_dynamic(x, packed, True)


def fp16_pack(weight: torch.Tensor) -> torch.Tensor:
    """fbgemm's packed float16 copy of a float32 ``[out, in]`` weight."""
    return torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)


def fp16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with ``fp16_pack(w)``: float32 activations and accumulation, float16 weights."""
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


def bf16_pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """A bfloat16 copy of ``weight``, oneDNN-packed for ``rows`` rows where this CPU packs bf16."""
    weight = weight.detach().to(torch.bfloat16).contiguous()
    if onednn_bf16_packable():
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return weight


def bf16_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` with ``bf16_pack(w)``: the product in bfloat16, the result in float32."""
    return bf16_product(x.to(torch.bfloat16), weight).float()


def bf16_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` of a bfloat16 ``x`` with ``bf16_pack(w)``, in bfloat16 (as autocast's product)."""
    if onednn_bf16_packable():
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


def backend_blocker(backend: str) -> str | None:
    """Why this torch build cannot run the reduced ``backend``, or None."""
    if backend in ("int8", "fp16") and not fbgemm_available(backend):
        return f"no fbgemm {backend} linear product in this torch build"
    return None


def pack(backend: str, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """The reduced ``backend``'s copy of a float32 ``[out, in]`` weight."""
    if backend == "int8":
        return int8_pack(weight)
    if backend == "fp16":
        return fp16_pack(weight)
    return bf16_pack(weight, rows)


def linear(backend: str, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in float32 from the reduced ``backend``'s copy ``packed`` of ``w``."""
    if backend == "int8":
        return int8_linear(x, packed)
    if backend == "fp16":
        return fp16_linear(x, packed)
    return bf16_linear(x, packed)
