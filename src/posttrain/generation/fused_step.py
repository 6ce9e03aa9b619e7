"""A decode step for Llama-family models that runs the layers' arithmetic without the module tree.

A ``torch.profiler`` trace of the lean loop's decode steps (SmolLM2-135M, 8 rows, float32, 2 CPU
threads, about 89 ms a step) puts the oneDNN products at 54 ms. Most of the rest is per-layer
overhead that does no arithmetic: seven separate products per layer, the attention mask built
again for every forward, about 40 small tensor operations and the Python calls of the module tree
per layer, and ``scaled_dot_product_attention``'s dispatch for a single query position.

``FusedDecoder`` packs each layer's weights for the call: the query, key and value projections
as one product, the gate and up projections as one, the output and down projections and the LM
head as they are (oneDNN's blocked layout, like ``onednn_prepacked_linears``). Its ``step`` then
computes one new position for every row with the same arithmetic as the model's own forward:

- RMSNorm as ``transformers`` writes it (float32 variance, ``rsqrt``, weight after);
- rotary embeddings from the model's own ``rotary_emb`` (so every RoPE scaling it supports);
- Qwen3's per-head query and key norms; Qwen2's projection biases;
- attention of the grouped query heads against the cached keys and values with the row's
  padding masked, in float32;
- the MLP with the configured activation.

It reads and writes the same ``PreallocatedLayer`` KV cache the prompt's forward filled. The
logits equal the model's forward to float32 rounding (``tests/test_fused_step.py``); greedy
decoding gives the same tokens. ``fused_decoder_blocker`` names what it does not cover (other
architectures, LoRA or quantised layers, sliding windows, CPU autocast); the lean loop then
calls the model as usual.

Backends:

- ``"onednn"`` (float32 weights on the CPU): the packed products above.
- ``"int8"``, ``"fp16"`` and ``"bf16"`` (float32 models on the CPU): the same packed products from a
  reduced-precision copy of the weights (``reduced_precision``: the sampler of
  ``GRPOConfig.sampler_precision``); the rest of the step stays in float32.
- ``"plain"`` (any device; the default on a GPU): the same arithmetic with ``F.linear`` on the
  model's own weights, no copies; in the model's dtype, or under autocast (``autocast_dtype``,
  for a forward that accelerate wrapped in mixed precision). On a GPU a step is launch-bound
  (hundreds of small kernels); ``static_step`` computes the same step with fixed shapes (the
  whole cache's capacity, masked) so that ``cuda_graph.GraphedDecodeStep`` can capture it once
  and replay it for every token.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from posttrain.generation import reduced_kernels
from posttrain.generation.fused_blockers import (  # noqa: F401  (re-exported)
    FUSED_MODEL_TYPES,
    _base_layer,
    decoder_target,
    default_backend,
    fused_decoder_blocker,
    is_lora_layer,
    rope_is_static,
)
from posttrain.generation.reduced_kernels import REDUCED_BACKENDS
from posttrain.ops import weight_casts


@dataclass
class _Layer:
    norm_in: nn.Module
    qkv: tuple[torch.Tensor, ...]  # onednn: (packed [q; k; v],); plain: (q, k, v) weights
    qkv_bias: tuple[torch.Tensor | None, ...]  # onednn: (packed bias or None,); plain: per projection
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o: torch.Tensor
    norm_post: nn.Module
    gate_up: tuple[torch.Tensor, ...]  # onednn: (packed [gate; up],); plain: (gate, up) weights
    down: torch.Tensor
    act: nn.Module
    scaling: float
    #: LoRA terms per product ("qkv", "o", "gate_up", "down"; the packed products' parts together)
    lora: dict[str, _LoraTerms] = field(default_factory=dict)


@dataclass
class _LoraTerms:
    """Every row block's low-rank term of one product, or of a packed group of products
    (``[q; k; v]``, ``[gate; up]``: their ``A`` matrices stacked, their ``B`` matrices side by side
    on the diagonal, so one pair of products serves the group).

    When every block has as many rows and the same total rank (a sweep's runs share their LoRA
    settings, and each asks for a group of completions), the blocks' products run as two batched
    products for all of them (``torch.bmm`` over the blocks); otherwise one pair per block. The
    first build of this step ran one pair per adapter and projection: 109,000 small products in a
    64-token call of 4 adapters, where the base weights needed 7,700, and most of the step's time.

    Attributes:
        blocks: ``(rows, A [T, I], B [O, T])`` for each row block whose adapter wraps the product.
        a_t, b_t: ``[S, I, T]`` and ``[S, T, O]``: every block's ``A.T`` and ``B.T`` stacked, when
            the blocks are uniform (else None).
    """

    blocks: list[tuple[slice, torch.Tensor, torch.Tensor]]
    a_t: torch.Tensor | None = None
    b_t: torch.Tensor | None = None

    @classmethod
    def build(cls, blocks: list[tuple[slice, torch.Tensor, torch.Tensor]], rows: int) -> _LoraTerms:
        """The terms of ``blocks``; batched when they tile all ``rows`` with equal blocks."""
        counts = {block.stop - block.start for block, _, _ in blocks}
        ranks = {a.shape[0] for _, a, _ in blocks}
        tiled = sum(block.stop - block.start for block, _, _ in blocks) == rows and all(
            block.start == index * (rows // len(blocks)) for index, (block, _, _) in enumerate(blocks)
        )
        if len(blocks) > 1 and len(counts) == 1 and len(ranks) == 1 and tiled:
            a_t = torch.stack([a.t() for _, a, _ in blocks]).contiguous()
            b_t = torch.stack([b.t() for _, _, b in blocks]).contiguous()
            return cls(blocks, a_t, b_t)
        return cls(blocks)

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add each row's low-rank term of ``x`` [N, I] to the product ``out`` [N, O], in place."""
        if self.a_t is not None:
            out += self.term(x)
            return
        for rows, a, b in self.blocks:
            out[rows] += (x[rows].to(a.dtype) @ a.t()) @ b.t()

    def term(self, x: torch.Tensor) -> torch.Tensor:
        """The low-rank terms [N, O] of ``x`` [N, I], each row through its own adapter (0: none)."""
        if self.a_t is not None:
            blocks, inner = self.a_t.shape[0], x.shape[-1]
            low = torch.bmm(x.to(self.a_t.dtype).reshape(blocks, -1, inner), self.a_t)
            return torch.bmm(low, self.b_t).reshape(x.shape[0], -1)
        out = x.new_zeros(x.shape[0], self.blocks[0][2].shape[0], dtype=self.blocks[0][2].dtype)
        self.add_to(out, x)
        return out


def _rms_norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``transformers``' RMSNorm, operation for operation (float32 statistics, weight after)."""
    dtype = x.dtype
    x = x.float()  # the same tensor when it already is float32
    variance = x.pow(2).mean(-1, keepdim=True)
    return module.weight * (x * torch.rsqrt(variance + module.variance_epsilon)).to(dtype)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _normed(x: torch.Tensor, module: nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """``_rms_norm`` of a float32 ``x``, into ``out`` (of the product's input dtype) when given:
    the same values.

    In place where ``_rms_norm`` makes a new tensor per operation, and cast as the last
    multiplication stores its float32 result (one rounding, as ``.to(dtype)`` after it): five
    operations where the decode step made eleven, 30 times a token on SmolLM2.
    """
    variance = x.pow(2).mean(-1, keepdim=True)
    normed = x * variance.add_(module.variance_epsilon).rsqrt_()
    if out is None:
        return normed.mul_(module.weight)
    return torch.mul(normed, module.weight, out=out)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: ``_rotate``'s factor of the rolled halves."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding: ``x * cos + cat(-x2, x1) * sin`` with ``signed_sin = _signed_sin(sin)``.

    ``cat(x2, x1)`` is ``x`` rolled by half its width, and ``-x2 * s == x2 * -s`` exactly: the same
    values as the model's ``rotate_half`` in four operations instead of seven.
    """
    rotated = x.roll(x.shape[-1] // 2, -1) * signed_sin  # promoted as the model's (bf16 x, float32 sin)
    return rotated.add_(x * cos)


class FusedDecoder:
    """One model's decode steps without the module tree (see the module docstring).

    Build it inside ``torch.no_grad()`` for one generation call. The oneDNN backend holds a
    packed copy of the weights (about the size of the model's linear layers), freed with the
    object; the plain backend uses the model's weights as they are.

    Args:
        model: a model ``fused_decoder_blocker`` accepts.
        rows: rows per decode step (the packing's batch-size hint).
        backend: ``"onednn"``, ``"plain"``, or a reduced copy (``"int8"``, ``"fp16"``, ``"bf16"``:
            see ``reduced_precision``); None picks ``default_backend``.
        autocast_dtype: the model's forward is wrapped in a mixed-precision autocast to this
            dtype: the plain backend runs every step under the same autocast; the reduced copies
            accept the wrapper and compute in their own precision.
        adapter_rows: the model (the transformers model under a ``PeftModel``) has LoRA layers:
            ``[(adapter, rows), ...]`` in row order, the adapter each block of rows samples with
            (a sweep's shared call). Every product then multiplies the base weights once for all
            rows and adds, per block, its adapter's ``scaling * B(A x)``. One adapter for every
            row (a lone PEFT run) on a backend that copies the weights (oneDNN, the reduced
            copies) is merged into the copy instead, ``W + scaling * B A`` computed in float32:
            its decode steps then cost what the base model's do, and the model is not touched.
    """

    def __init__(
        self,
        model: nn.Module,
        rows: int,
        backend: str | None = None,
        autocast_dtype: torch.dtype | None = None,
        adapter_rows: Sequence[tuple[str, int]] | None = None,
    ) -> None:
        backend = backend or default_backend(model)
        names = None if adapter_rows is None else [name for name, _ in adapter_rows]
        reason = fused_decoder_blocker(model, backend, autocast_dtype, names)
        if reason is not None:
            raise ValueError(f"FusedDecoder cannot run this model: {reason}")
        self.backend = backend
        self.autocast_dtype = autocast_dtype
        #: the bf16 copy of a policy trained under bf16 autocast computes the MLP's middle as the
        #: trainer's forward does: the activation and product of the bf16 gate and up in bf16
        self.bf16_middle = backend == "bf16" and autocast_dtype == torch.bfloat16
        #: the KV cache's dtype the step wants: its copying backends compute in float32, and a bf16
        #: autocast prefill would leave bf16 values (4x slower products of 8 rows; ``decode.py``)
        self.cache_dtype = None if backend == "plain" else torch.float32
        self.rope_is_static = rope_is_static(model)
        #: the bf16 copy's norm outputs, one buffer per shape (``_norm``)
        self._scratch: dict[torch.Size, torch.Tensor] = {}
        self.segments: list[tuple[str, slice]] = []
        start = 0
        for name, count in adapter_rows or ():
            self.segments.append((name, slice(start, start + count)))
            start += count
        #: the adapter merged into the copied weights (one block of rows, a copying backend)
        self.merged = self.segments[0][0] if len(self.segments) == 1 and backend != "plain" else None
        if self.merged is not None:
            self.segments = []
        backbone = model.model
        self.embed = backbone.embed_tokens.weight.detach()
        self.rotary = backbone.rotary_emb
        self.final_norm = backbone.norm
        self.head = self._weight(model.get_output_embeddings().weight, rows)
        self.layers = [self._layer(layer, rows) for layer in backbone.layers]
        first = backbone.layers[0].self_attn
        self.head_dim = first.head_dim
        self.q_width = _base_layer(first.q_proj).out_features
        self.kv_width = _base_layer(first.k_proj).out_features
        self.intermediate = _base_layer(backbone.layers[0].mlp.gate_proj).out_features

    def _layer(self, layer: nn.Module, rows: int) -> _Layer:
        """One decoder layer's weights for this backend: packed ``[q; k; v]`` and ``[gate; up]``
        products for the CPU copies, the model's own tensors for the plain backend."""
        attn, mlp = layer.self_attn, layer.mlp
        wrapped = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
        wrapped.update(gate=mlp.gate_proj, up=mlp.up_proj, down=mlp.down_proj)
        packed_groups = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
        lora = {
            group: terms
            for group, keys in packed_groups.items()
            if (terms := self._lora_terms([wrapped[key] for key in keys])) is not None
        }
        base = {key: _base_layer(module) for key, module in wrapped.items()}
        weights = {key: self._merged_weight(module) for key, module in wrapped.items()}
        q, k, v = base["q"], base["k"], base["v"]
        biases = [None if p.bias is None else p.bias.detach() for p in (q, k, v)]
        if self.backend != "plain":  # packed copies: [q; k; v] and [gate; up] as one product each
            qkv = (self._stacked_weight([weights["q"], weights["k"], weights["v"]], rows),)
            qkv_bias: tuple[torch.Tensor | None, ...] = (None,)
            if any(b is not None for b in biases):
                qkv_bias = (
                    torch.cat(
                        [
                            b if b is not None else p.weight.new_zeros(p.out_features)
                            for b, p in zip(biases, (q, k, v), strict=True)
                        ]
                    ),
                )
            gate_up = (self._stacked_weight([weights["gate"], weights["up"]], rows),)
        else:
            qkv = (q.weight.detach(), k.weight.detach(), v.weight.detach())
            qkv_bias = tuple(biases)
            gate_up = (base["gate"].weight.detach(), base["up"].weight.detach())
        return _Layer(
            norm_in=layer.input_layernorm,
            qkv=qkv,
            qkv_bias=qkv_bias,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
            o=self._weight(weights["o"], rows),
            norm_post=layer.post_attention_layernorm,
            gate_up=gate_up,
            down=self._weight(weights["down"], rows),
            act=mlp.act_fn,
            scaling=float(attn.scaling),
            lora=lora,
        )

    def _merged_weight(self, module: nn.Module) -> torch.Tensor:
        """The product's weight: the base layer's, plus ``scaling * B A`` of the merged adapter.

        The bf16 copy of a weight without a merged adapter is the training micro-step's own cast
        where one is in progress (``weight_casts.shared_cast``): the same values, cast once.
        """
        parameter = _base_layer(module).weight
        weight = parameter.detach()
        if self.merged is None or not is_lora_layer(module) or self.merged not in module.lora_A:
            shared = weight_casts.shared_cast(parameter) if self.backend == "bf16" else None
            return weight if shared is None else shared
        a = module.lora_A[self.merged].weight.detach().float()
        b = module.lora_B[self.merged].weight.detach().float()
        return (weight.float() + (b @ a) * module.scaling[self.merged]).to(weight.dtype)

    def _lora_terms(self, modules: list[nn.Module]) -> _LoraTerms | None:
        """The row blocks' low-rank terms of the product of ``modules`` (their outputs side by side),
        or None when no block's adapter wraps any of them."""
        if not self.segments:
            return None
        widths = [_base_layer(module).out_features for module in modules]
        blocks = []
        for name, rows in self.segments:
            stacked, placed = [], []  # A matrices; (output offset, scaled B)
            for module, offset in zip(modules, itertools.accumulate([0, *widths[:-1]]), strict=True):
                if is_lora_layer(module) and name in module.lora_A:
                    stacked.append(module.lora_A[name].weight.detach())
                    placed.append((offset, module.lora_B[name].weight.detach() * module.scaling[name]))
            if not stacked:
                continue  # this block's adapter does not wrap these products: the base alone
            a = torch.cat(stacked)
            b = a.new_zeros(sum(widths), a.shape[0])
            column = 0
            for offset, scaled in placed:
                b[offset : offset + scaled.shape[0], column : column + scaled.shape[1]] = scaled
                column += scaled.shape[1]
            blocks.append((rows, a, b))
        return _LoraTerms.build(blocks, self.segments[-1][1].stop) if blocks else None

    @staticmethod
    def _add_lora(out: torch.Tensor, x: torch.Tensor, terms: _LoraTerms | None) -> None:
        """Add each row's low-rank term to the product ``out`` [N, O] of ``x`` [N, I], in place."""
        if terms is not None:
            terms.add_to(out, x)

    def _weight(self, weight: torch.Tensor, rows: int) -> torch.Tensor:
        if self.backend == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)
        if self.backend in REDUCED_BACKENDS:
            return reduced_kernels.pack(self.backend, weight, rows)
        return weight.detach()

    def _stacked_weight(self, parts: list[torch.Tensor], rows: int) -> torch.Tensor:
        """``_weight`` of the row blocks ``parts`` stacked (``[q; k; v]``, ``[gate; up]``).

        The bf16 copy casts each block into its rows of one bfloat16 tensor: no float32 stack, which
        took a fifth of the copy's rebuild after every optimizer step.
        """
        if self.backend != "bf16":
            return self._weight(torch.cat(parts), rows)
        stacked = parts[0].new_empty(sum(p.shape[0] for p in parts), parts[0].shape[1], dtype=torch.bfloat16)
        start = 0
        for part in parts:
            stacked[start : start + part.shape[0]].copy_(part)
            start += part.shape[0]
        return self._weight(stacked, rows)

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.backend == "onednn":
            return _onednn_linear(x, weight, bias)
        if self.backend in REDUCED_BACKENDS:
            out = reduced_kernels.linear(self.backend, x, weight)
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None or self.backend != "plain":
            return contextlib.nullcontext()
        # no weight-cast cache: a CUDA graph may capture the step (the cache is not graph-safe)
        return torch.autocast(device.type, dtype=self.autocast_dtype, cache_enabled=False)

    def _qkv(self, x: torch.Tensor, layer: _Layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query [N, Q], key and value [N, K] of one position per row (LoRA terms added)."""
        q_end = self.q_width + self.kv_width
        if len(layer.qkv) == 1:  # one packed product
            if self.backend == "bf16" and "qkv" not in layer.lora and layer.q_norm is None:
                # left in bf16: the rotation, the bias and the cache widen it exactly, as .float() would
                qkv = reduced_kernels.bf16_product(x.to(torch.bfloat16), layer.qkv[0])
                if layer.qkv_bias[0] is not None:
                    qkv = qkv + layer.qkv_bias[0]
            else:
                qkv = self._linear(x, layer.qkv[0], layer.qkv_bias[0])
                self._add_lora(qkv, x, layer.lora.get("qkv"))
            return qkv[:, : self.q_width], qkv[:, self.q_width : q_end], qkv[:, q_end:]
        q, k, v = (self._linear(x, w, b) for w, b in zip(layer.qkv, layer.qkv_bias, strict=True))
        if "qkv" in layer.lora:
            term = layer.lora["qkv"].term(x)
            q, k, v = q + term[:, : self.q_width], k + term[:, self.q_width : q_end], v + term[:, q_end:]
        return q, k, v

    def _mlp(self, x: torch.Tensor, layer: _Layer) -> torch.Tensor:
        terms, middle = layer.lora.get("gate_up"), self.intermediate
        if self.bf16_middle and not layer.lora and len(layer.gate_up) == 1:
            gate_up = reduced_kernels.bf16_product(x.to(torch.bfloat16), layer.gate_up[0])
            inner = layer.act(gate_up[:, :middle]).mul_(gate_up[:, middle:])  # bf16, as under autocast
            return reduced_kernels.bf16_product(inner, layer.down)
        if len(layer.gate_up) == 1:
            gate_up = self._linear(x, layer.gate_up[0])
            self._add_lora(gate_up, x, terms)
            gate, up = gate_up[:, :middle], gate_up[:, middle:]
        else:
            gate, up = (self._linear(x, w) for w in layer.gate_up)
            if terms is not None:
                term = terms.term(x)
                gate, up = gate + term[:, :middle], up + term[:, middle:]
        inner = layer.act(gate) * up
        return self._output(inner, layer.down, layer.lora.get("down"))

    def _output(self, x: torch.Tensor, weight: torch.Tensor, terms: _LoraTerms | None) -> torch.Tensor:
        """``x @ weight.T`` with the rows' LoRA terms, for the residual stream: the bf16 copy's
        product stays in bf16 where no terms are added (``_residual`` widens it exactly as
        ``.float()`` would, without a tensor of its own)."""
        if self.backend == "bf16" and terms is None:
            return reduced_kernels.bf16_product(x.to(torch.bfloat16), weight)
        out = self._linear(x, weight)
        if terms is not None:
            terms.add_to(out, x)
        return out

    def _residual(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``h + out``: in place on the copying backends' float32 residual stream (a tensor of the
        step's own), as written for the plain backend (autocast promotes, a CUDA graph captures)."""
        return h + out if self.backend == "plain" else h.add_(out)

    def _norm(self, h: torch.Tensor, module: nn.Module, layer: _Layer | None) -> torch.Tensor:
        """RMSNorm of the residual stream, in the dtype the next product takes: bf16 for the bf16
        copy (float32 where LoRA terms read it too), as ``_normed`` computes it on the copying
        backends; ``_rms_norm`` on the plain backend."""
        if self.backend == "plain" or h.dtype != torch.float32:
            return _rms_norm(h, module)
        if self.backend != "bf16" or (layer is not None and layer.lora):
            return _normed(h, module)
        out = self._scratch.get(h.shape)  # read by the next product before the next norm writes it
        if out is None:
            out = self._scratch[h.shape] = h.new_empty(h.shape, dtype=torch.bfloat16)
        return _normed(h, module, out)

    def _rotated(
        self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Query [N, kv_heads, group, d] and key [N, kv_heads, 1, d], normed (Qwen3) and rotated.

        ``cos``/``sin``: [N, 1, 1, d], ``sin`` as ``_signed_sin`` gives it.
        """
        rows, d = q.shape[0], self.head_dim
        kv_heads = self.kv_width // d
        group = self.q_width // self.kv_width
        if layer.q_norm is None and len(layer.qkv) == 1:
            # the query and key heads are adjacent in the packed product: rotate them together
            qk = q.as_strided((rows, (self.q_width + self.kv_width) // d, d), (q.stride(0), d, 1))
            qk = _rotate(qk, cos[:, 0], sin[:, 0])
            q = qk[:, : kv_heads * group].reshape(rows, kv_heads, group, d)
            return q, qk[:, kv_heads * group :].view(rows, kv_heads, 1, d)
        q, k = q.reshape(rows, kv_heads, group, d), k.reshape(rows, kv_heads, 1, d)
        if layer.q_norm is not None:  # Qwen3: per-head norms with their own weights first
            q, k = _rms_norm(q, layer.q_norm), _rms_norm(k, layer.k_norm)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _attend(
        self,
        layer: _Layer,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """[N, Q] attention output; keys/values [N, kv_heads, L, d], bias as ``_bias`` gives it.

        The copying backends (the CPU) call ``scaled_dot_product_attention`` once, the query's
        heads of a key head as its query positions: one call where the explicit product, softmax
        and product took eight, 30 to 45 us a layer less on SmolLM2 (float32 throughout; equal to
        the explicit arithmetic to float32 rounding, ``tests/test_fused_step.py``).
        """
        if self.backend != "plain":
            attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=layer.scaling)
            return attended.reshape(q.shape[0], self.q_width)
        rows, d = q.shape[0], self.head_dim
        kv_heads, length = keys.shape[1], keys.shape[2]
        group = self.q_width // self.kv_width
        q = q.reshape(rows * kv_heads, group, d)
        keys_t = keys.reshape(rows * kv_heads, length, d).transpose(1, 2)
        scores = torch.baddbmm(
            bias, q if q.dtype == keys.dtype else q.to(keys.dtype), keys_t, alpha=layer.scaling
        )
        probs = torch.softmax(scores if scores.dtype == torch.float32 else scores.float(), dim=-1)
        probs = probs if probs.dtype == values.dtype else probs.to(values.dtype)
        attended = torch.bmm(probs, values.reshape(rows * kv_heads, length, d))
        return attended.view(rows, self.q_width)

    def _bias(self, key_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """0 where a row attends, -inf on its padding, for every layer: [N, 1, 1, L] for the copying
        backends' ``scaled_dot_product_attention``, [N * kv_heads, group, L] for the plain one's."""
        rows, length = key_mask.shape
        kv_heads = self.kv_width // self.head_dim
        group = self.q_width // self.kv_width
        bias = torch.zeros(rows, 1, 1, length, dtype=dtype, device=key_mask.device)
        bias = bias.masked_fill(~key_mask.bool()[:, None, None, :], -math.inf)
        if self.backend != "plain":
            return bias
        return bias.expand(rows, kv_heads, group, length).reshape(rows * kv_heads, group, length)

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        key_mask: torch.Tensor,
        cache_layers: list,
    ) -> torch.Tensor:
        """Logits [N, V] of one new position per row; appends its keys and values to the cache.

        Args:
            tokens: [N] the previous step's tokens.
            positions: [N] their position ids.
            key_mask: [N, L] which cached positions (the new one included, last) each row attends to.
            cache_layers: the ``PreallocatedLayer``s of the cache, one per decoder layer.

        In ``torch.inference_mode()`` (less bookkeeping per operation than ``no_grad``: SmolLM2,
        20.7 -> 19.6 ms a token in bf16): the logits are inference tensors, which the sampler
        reads out of place; the cache's buffers are written in place, as under ``no_grad``.
        """
        with torch.inference_mode(), self._autocast(tokens.device):
            h = self.embed[tokens]  # [N, H]
            cos, sin = self.rotary(h[:, None], positions[:, None])  # [N, 1, d]
            cos, sin = cos[:, None], _signed_sin(sin[:, None])  # [N, 1, 1, d]
            bias = None
            for layer, cache in zip(self.layers, cache_layers, strict=True):
                q, k, v = self._qkv(self._norm(h, layer.norm_in, layer), layer)
                q, k = self._rotated(layer, q, k, cos, sin)
                v = v.reshape(v.shape[0], -1, 1, self.head_dim)
                keys, values = cache.update(k, v)  # [N, kv_heads, L, d]
                if bias is None:
                    bias = self._bias(key_mask, torch.promote_types(keys.dtype, q.dtype))
                attended = self._attend(layer, q, keys, values, bias)
                h = self._residual(h, self._output(attended, layer.o, layer.lora.get("o")))
                h = self._residual(h, self._mlp(self._norm(h, layer.norm_post, layer), layer))
            return self._linear(self._norm(h, self.final_norm, None), self.head)

    def rotary_table(self, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [capacity, d] of positions 0..capacity-1 (``rope_is_static`` models)."""
        probe = self.embed[:1, None].expand(1, capacity, -1)
        cos, sin = self.rotary(probe, torch.arange(capacity, device=device)[None])
        return cos[0], sin[0]

    def static_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        bias_rows: torch.Tensor,
        index: torch.Tensor,
        buffers: list[tuple[torch.Tensor, torch.Tensor]],
        table: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``step`` with fixed shapes and no host reads, for CUDA graph capture.

        Attends over the cache's whole capacity with ``bias_rows`` masking what a row does not
        see (its padding and the positions not written yet), and writes the new keys and values
        at ``index``.

        Args:
            tokens, positions: [N] as in ``step``.
            bias_rows: [N, C] 0 where a row attends, -inf elsewhere (C: the cache's capacity).
            index: [1] the cache position this step writes.
            buffers: each layer's full key and value buffers [N, kv_heads, C, d].
            table: ``rotary_table(C)``.
        """
        if self.segments:
            raise NotImplementedError(
                "a CUDA-graphed decode step with LoRA terms (FusedDecoder(adapter_rows=...))"
            )
        rows, capacity = bias_rows.shape
        kv_heads = self.kv_width // self.head_dim
        group = self.q_width // self.kv_width
        with self._autocast(tokens.device):
            h = self.embed[tokens]
            cos, sin = (t[positions].to(h.dtype)[:, None, None] for t in table)  # [N, 1, 1, d]
            sin = _signed_sin(sin)
            bias = None
            for layer, (key_buffer, value_buffer) in zip(self.layers, buffers, strict=True):
                q, k, v = self._qkv(_rms_norm(h, layer.norm_in), layer)
                q, k = self._rotated(layer, q, k, cos, sin)
                key_buffer.index_copy_(2, index, k.to(key_buffer.dtype))
                value_buffer.index_copy_(2, index, v.reshape(rows, kv_heads, 1, -1).to(value_buffer.dtype))
                if bias is None:
                    dtype = torch.promote_types(key_buffer.dtype, q.dtype)
                    bias = bias_rows.to(dtype)[:, None, None, :].expand(rows, kv_heads, group, capacity)
                    bias = bias.reshape(rows * kv_heads, group, capacity)
                attended = self._attend(layer, q, key_buffer, value_buffer, bias)
                h = h + self._linear(attended, layer.o)
                h = h + self._mlp(_rms_norm(h, layer.norm_post), layer)
            return self._linear(_rms_norm(h, self.final_norm), self.head)
