"""What this machine multiplies fast: the one host check the products' dtype depends on.

``native_bf16`` tells whether the CPU has bf16 instructions (AVX512-BF16 or AMX). Without them a
bf16 product is emulated, several times slower than float32 (BENCHMARKS.md, "bf16 on the CPU"),
so the places that would move a product to bf16 for speed (the bf16 sampler copy, the LM head's
chunked products under ``bf16=True``) ask here first.
"""

from __future__ import annotations

import torch


def native_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX), per PyTorch's CPU checks."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not capability.startswith("AVX512"):
        return False
    checks = (
        getattr(torch.cpu, "_is_avx512_bf16_supported", None),
        getattr(torch.cpu, "_is_amx_tile_supported", None),
    )
    return any(callable(check) and check() for check in checks)


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 products on ``device`` are native: any CUDA device, a CPU with bf16 instructions."""
    return device.type == "cuda" or (device.type == "cpu" and native_bf16())
