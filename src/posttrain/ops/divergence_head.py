"""The head side of the divergence engine (``ops/divergence.py``): each model's LM head inputs,
its vocabulary products in their dtype, and the student's gradient products.

Under ``bf16=True`` on hardware with native bf16 products (``chunked.head_product_dtype``), a
side's ``[c, H] x [H, V]`` product and the student's two gradient products run in bf16 with
float32 outputs and sums, as the chunked log-prob head does (``ops/chunked.py``). The large
temporaries (logits, the bf16 weight copies, a product's raw output) live in scratch buffers
(``ops/workspace.py``) so that chunk after chunk, call after call, they reuse the same pages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops import chunked, workspace


def scratch_like(like: torch.Tensor, name: str) -> torch.Tensor:
    """A scratch tensor (``ops/workspace.py``) of ``like``'s shape and dtype, dead when the chunk is done."""
    return workspace.scratch(name, tuple(like.shape), like.dtype, like.device)


@dataclass
class HeadInputs:
    """One model's side of a divergence: what its LM head turns into next-token logits.

    Attributes:
        hidden: [N, H] final hidden states in the head's dtype, or [N, V] logits when ``weight`` is
            ``None`` (a model whose logits are not plainly ``lm_head(hidden)``).
        weight: [V, H] the LM head's weight, or ``None``.
        bias: [V] the LM head's bias, or ``None``.
        product_dtype: the dtype the vocabulary products run in (``chunked.head_product_dtype``:
            bf16 when the model's forward ran under bf16 autocast where bf16 products are native),
            or ``None``: the head's own. Softmax statistics are float32 either way.
    """

    hidden: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    product_dtype: torch.dtype | None = None

    @property
    def vocab_size(self) -> int:
        """V: the number of logits per position."""
        return self.weight.shape[0] if self.weight is not None else self.hidden.shape[-1]

    def rows(self, keep: torch.Tensor) -> HeadInputs:
        """The positions where ``keep`` ([...] bool, the hidden states' leading shape) is true."""
        return HeadInputs(self.hidden[keep], self.weight, self.bias, self.product_dtype)


def side_logits(x: torch.Tensor, head: tuple[Any, Any], temperature: float, name: str) -> torch.Tensor:
    """One side's [c, V] logits over the temperature, float32 or wider, in the scratch buffer ``name``.

    ``head`` is ``(weight, bias)`` already in the products' dtype (``in_products``), or
    ``(None, None)`` when ``x`` holds the logits themselves.
    """
    weight, bias = head
    if weight is None:
        z = x.to(torch.promote_types(x.dtype, torch.float32))
        return torch.div(z, temperature, out=scratch_like(z, name))
    return chunked._scaled_logits(x.to(weight.dtype), weight, bias, temperature, reuse=True, name=name)


def in_products(
    weight: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype | None, name: str
) -> tuple[Any, Any]:
    """A head's weight and bias in its products' dtype: the weight cast into the scratch buffer ``name``."""
    if weight is None or dtype is None or weight.dtype == dtype:
        return weight, bias
    return chunked._product_weight(weight, dtype, name), bias.to(dtype) if bias is not None else None


def head_products(
    g: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    w_rows: torch.Tensor | None,
    gx_rows: torch.Tensor | None,
    gw: torch.Tensor | None,
) -> None:
    """One chunk's gradient products: ``gx_rows = g @ W`` and ``gw += g^T (w_rows * x)``, in ``weight``'s dtype.

    ``g`` [c, V] (float32 or wider) goes to the products' dtype first (a bf16 copy in the
    ``"head_product"`` scratch buffer); the weight's product lands in ``"head_weight_grad"`` before
    its float32 sum.
    """
    if weight.dtype != g.dtype:
        g = workspace.scratch("head_product", tuple(g.shape), weight.dtype, g.device).copy_(g)
    if gx_rows is not None:
        gx_rows.copy_(g @ weight)
    if gw is None:
        return
    x = (x.to(w_rows.dtype) * w_rows.unsqueeze(-1)).to(g.dtype) if w_rows is not None else x.to(g.dtype)
    chunked.add_weight_product(gw, g.t(), x)
