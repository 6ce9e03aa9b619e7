"""Dropout on the CPU without torch's per-element random draws.

``F.dropout`` on a CPU tensor draws one Mersenne-Twister number per element on one thread: about
13 ns an element here, 17 ms for an [832, 1536] activation. A LoRA adapter on every linear layer
of a 30-layer model applies dropout to each adapted layer's input, separately for the query, key,
value, gate and up projections, and again when gradient checkpointing recomputes the layer: about
250 million elements a step of 8 x 104 tokens on SmolLM2-135M, 3 to 4 s of a 9 s forward and
backward (``benchmarks/profile_step.py --lora_r 16``, docs/performance.md).

``cpu_dropout`` draws the same thing faster: each element is kept with probability ``1 - p``,
independently, and scaled by ``1 / (1 - p)``. The keep test compares a uniform 32-bit integer
with ``p * 2**32`` (float32's uniform draws resolve 2**-24), the integers coming from NumPy's SFC64
generator (two per 64-bit draw, about 4 ns an element with the mask applied). The generator is
seeded by one draw from torch's default CPU generator, so ``torch.manual_seed`` (``set_seed``)
reproduces the masks, and gradient checkpointing, which restores torch's CPU random state before
it recomputes a layer, recomputes the same mask. The random stream is not ``F.dropout``'s: the
masks differ from torch's for the same seed, their distribution does not.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

#: 2**63 - 1: the seeds drawn from torch's generator for NumPy's.
_SEED_BOUND = 2**63 - 1


def cpu_dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """``F.dropout(x, p, training=True)`` in distribution, for a CPU tensor, with NumPy's random bits.

    Args:
        x: a floating-point CPU tensor.
        p: the probability of zeroing an element, ``0 <= p < 1``.

    Returns:
        A new tensor: each element of ``x`` times ``1 / (1 - p)``, or 0 with probability ``p``.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if p == 0.0:
        return x.clone()
    count = x.numel()
    seed = int(torch.randint(_SEED_BOUND, (1,)))
    bits = np.random.SFC64(seed).random_raw((count + 1) // 2).view(np.int32)[:count]
    draws = torch.from_numpy(bits).view(x.shape)  # uniform over [-2**31, 2**31)
    keep = draws >= round(p * 2**32) - 2**31
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


class CpuDropout(nn.Dropout):
    """``nn.Dropout`` whose CPU training-mode draws go through ``cpu_dropout``.

    Everything else (evaluation mode, ``p == 0``, other devices, in-place) is ``nn.Dropout``'s,
    and it is an ``nn.Dropout``: ``model.eval()`` and ``disable_dropout`` (``p = 0``) act on it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0 or self.inplace or x.device.type != "cpu":
            return F.dropout(x, self.p, self.training, self.inplace)
        return cpu_dropout(x, self.p)


def faster_lora_dropout(model: nn.Module) -> int:
    """Give every peft LoRA layer of ``model`` a ``CpuDropout`` in place of its ``nn.Dropout``.

    The probability is kept; nothing is saved with the adapter (dropout has no state). Returns how
    many modules were replaced.
    """
    replaced = 0
    for module in model.modules():
        dropouts = getattr(module, "lora_dropout", None)
        if not isinstance(dropouts, nn.ModuleDict):
            continue
        for name, dropout in list(dropouts.items()):
            if type(dropout) is nn.Dropout:
                faster = CpuDropout(dropout.p, dropout.inplace)
                faster.train(dropout.training)
                dropouts[name] = faster
                replaced += 1
    return replaced
