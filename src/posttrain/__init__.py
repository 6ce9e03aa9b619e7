"""posttrain: post-training for language models with a TRL-compatible API.

The public names are imported lazily, so ``from posttrain import GRPOConfig`` does not pull
torch or transformers in until one of them is used.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"


class _HubKernelNotice(logging.Filter):
    """Drops the import-time notices about bitsandbytes' optional hub kernel.

    On a CPU with AVX512-BF16, bitsandbytes asks the ``kernels`` package for a hub kernel when
    it is imported, and transformers imports it (through peft) whenever both are installed, so
    two lines reached every posttrain command's output, error paragraphs included: bitsandbytes'
    "Failed to load CPU gemm_4bit_forward from kernels-community ..." and, offline with
    ``kernels`` installed (transformers 5.25 requires it), kernels' "Skipping publisher trust
    check for 'kernels-community/quantization-bitsandbytes' ...". The kernel would be downloaded
    from the hub, and it serves only the repacked 4-bit layout that posttrain switches off for
    training (``posttrain.models.peft.keep_4bit_layers_differentiable``): nothing to act on.
    Notices about any other kernel pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith("Failed to load CPU gemm_4bit_forward"):
            return False
        return not (
            message.startswith("Skipping publisher trust check")
            and "kernels-community/quantization-bitsandbytes" in message
        )


_NOTICE_FILTER = _HubKernelNotice()
for _logger_name in ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub"):
    logging.getLogger(_logger_name).addFilter(_NOTICE_FILTER)

_LAZY = {
    "A2POConfig": "posttrain.a2po.config",
    "A2POTrainer": "posttrain.a2po.trainer",
    "AsyncGRPOConfig": "posttrain.async_grpo.config",
    "AsyncGRPOTrainer": "posttrain.async_grpo.trainer",
    "DistillationConfig": "posttrain.distill.config",
    "DistillationTrainer": "posttrain.distill.trainer",
    "GKDConfig": "posttrain.distill.config",
    "GOLDConfig": "posttrain.distill.gold",
    "GOLDTrainer": "posttrain.distill.gold",
    "GKDTrainer": "posttrain.distill.trainer",
    "IWOPDConfig": "posttrain.distill.config",
    "IWOPDTrainer": "posttrain.distill.trainer",
    "GRPOConfig": "posttrain.grpo.config",
    "GRPOTrainer": "posttrain.grpo.trainer",
    "GMPOConfig": "posttrain.grpo.gmpo",
    "GMPOTrainer": "posttrain.grpo.gmpo",
    "SFTConfig": "posttrain.sft.config",
    "SFTTrainer": "posttrain.sft.trainer",
    "BEMACallback": "posttrain.sft.bema",
    "DPOConfig": "posttrain.dpo.config",
    "DPOTrainer": "posttrain.dpo.trainer",
    "KTOConfig": "posttrain.kto.config",
    "KTOTrainer": "posttrain.kto.trainer",
    "ORPOConfig": "posttrain.orpo.config",
    "ORPOTrainer": "posttrain.orpo.trainer",
    "CPOConfig": "posttrain.cpo.config",
    "CPOTrainer": "posttrain.cpo.trainer",
    "RewardConfig": "posttrain.reward.config",
    "RewardTrainer": "posttrain.reward.trainer",
    "OnlineDPOConfig": "posttrain.online_dpo.config",
    "OnlineDPOTrainer": "posttrain.online_dpo.trainer",
    "SDFTConfig": "posttrain.distill.config",
    "SDFTTrainer": "posttrain.distill.self_distillation",
    "SDPOConfig": "posttrain.distill.config",
    "SDPOTrainer": "posttrain.distill.self_distillation",
    "RLOOConfig": "posttrain.rloo.config",
    "RLOOTrainer": "posttrain.rloo.trainer",
}

__all__ = [*_LAZY, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from posttrain.a2po.config import A2POConfig  # noqa: F401
    from posttrain.a2po.trainer import A2POTrainer  # noqa: F401
    from posttrain.async_grpo.config import AsyncGRPOConfig  # noqa: F401
    from posttrain.async_grpo.trainer import AsyncGRPOTrainer  # noqa: F401
    from posttrain.cpo.config import CPOConfig  # noqa: F401
    from posttrain.cpo.trainer import CPOTrainer  # noqa: F401
    from posttrain.distill.config import (  # noqa: F401
        DistillationConfig,
        GKDConfig,
        IWOPDConfig,
        SDFTConfig,
        SDPOConfig,
    )
    from posttrain.distill.gold import GOLDConfig, GOLDTrainer  # noqa: F401
    from posttrain.distill.self_distillation import SDFTTrainer, SDPOTrainer  # noqa: F401
    from posttrain.distill.trainer import DistillationTrainer, GKDTrainer, IWOPDTrainer  # noqa: F401
    from posttrain.dpo.config import DPOConfig  # noqa: F401
    from posttrain.dpo.trainer import DPOTrainer  # noqa: F401
    from posttrain.grpo.config import GRPOConfig  # noqa: F401
    from posttrain.grpo.gmpo import GMPOConfig, GMPOTrainer  # noqa: F401
    from posttrain.grpo.trainer import GRPOTrainer  # noqa: F401
    from posttrain.kto.config import KTOConfig  # noqa: F401
    from posttrain.kto.trainer import KTOTrainer  # noqa: F401
    from posttrain.online_dpo.config import OnlineDPOConfig  # noqa: F401
    from posttrain.online_dpo.trainer import OnlineDPOTrainer  # noqa: F401
    from posttrain.orpo.config import ORPOConfig  # noqa: F401
    from posttrain.orpo.trainer import ORPOTrainer  # noqa: F401
    from posttrain.reward.config import RewardConfig  # noqa: F401
    from posttrain.reward.trainer import RewardTrainer  # noqa: F401
    from posttrain.rloo.config import RLOOConfig  # noqa: F401
    from posttrain.rloo.trainer import RLOOTrainer  # noqa: F401
    from posttrain.sft.bema import BEMACallback  # noqa: F401
    from posttrain.sft.config import SFTConfig  # noqa: F401
    from posttrain.sft.trainer import SFTTrainer  # noqa: F401


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
