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
architectures, LoRA or quantised layers, sliding windows, autocast); the lean loop then calls
the model as usual.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from posttrain.generation.transformers_backend import (
    _only_full_attention_layers,
    core_model,
    is_packable_linear,
    onednn_linear_available,
)

#: ``model_type``s whose decoder layers this step reproduces (the families the tests check).
FUSED_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})


def _rms_norm_module(module: object) -> bool:
    return (
        isinstance(module, nn.Module)
        and type(module).__name__.endswith("RMSNorm")
        and hasattr(module, "variance_epsilon")
        and getattr(module, "weight", None) is not None
        and "forward" not in module.__dict__
    )


def fused_decoder_blocker(model: nn.Module) -> str | None:
    """Why ``FusedDecoder`` cannot run ``model``'s decode steps, or None when it can.

    Args:
        model: the model about to generate (a ``PreTrainedModel``; wrappers are not looked through,
            so a PEFT model falls back).
    """
    if not onednn_linear_available():
        return "no oneDNN linear product in this torch build"
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in FUSED_MODEL_TYPES:
        return f"model type {getattr(config, 'model_type', None)!r}"
    if core_model(model) is not model:
        return "a wrapped model (PEFT)"
    if "forward" in model.__dict__:
        return "the model's forward is wrapped (mixed-precision autocast, hooks)"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast"
    if not _only_full_attention_layers(model):
        return "sliding-window attention"
    backbone = getattr(model, "model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if backbone is None or not is_packable_linear(head) or head.bias is not None:
        return "the LM head is not a plain float32 linear layer"
    embed = getattr(backbone, "embed_tokens", None)
    if (
        type(embed) is not nn.Embedding
        or embed.weight.dtype != torch.float32
        or embed.weight.device.type != "cpu"
    ):
        return "the input embedding is not a plain float32 embedding on the CPU"
    if not _rms_norm_module(getattr(backbone, "norm", None)) or getattr(backbone, "rotary_emb", None) is None:
        return "no final RMSNorm or rotary embedding"
    for layer in backbone.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attn, f"{n}_proj", None) for n in "qkvo"]
        projections += [getattr(mlp, f"{n}_proj", None) for n in ("gate", "up", "down")]
        if not all(is_packable_linear(p) for p in projections):
            return "a projection is not a plain float32 linear layer (LoRA, quantised, offloaded)"
        if any(p.bias is not None for p in projections[4:]) or projections[3].bias is not None:
            return "biases on the output or MLP projections"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
            norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
        if not all(_rms_norm_module(n) for n in norms):
            return "a norm is not an RMSNorm"
        if "forward" in layer.__dict__ or "forward" in attn.__dict__ or "forward" in mlp.__dict__:
            return "a layer's forward is replaced (hooks or offloading)"
        if getattr(attn, "scaling", None) is None or getattr(mlp, "act_fn", None) is None:
            return "an attention layer without scaling or an MLP without act_fn"
    return None


@dataclass
class _Layer:
    norm_in: nn.Module
    qkv: torch.Tensor  # packed [q; k; v]
    qkv_bias: torch.Tensor | None
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o: torch.Tensor
    norm_post: nn.Module
    gate_up: torch.Tensor  # packed [gate; up]
    down: torch.Tensor
    act: nn.Module
    scaling: float


def _rms_norm(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """``transformers``' RMSNorm on a float32 tensor, operation for operation."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return module.weight * (x * torch.rsqrt(variance + module.variance_epsilon))


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


class FusedDecoder:
    """One model's decode steps with fused, prepacked products (see the module docstring).

    Build it inside ``torch.no_grad()`` for one generation call: it holds a packed copy of the
    weights (about the size of the model's linear layers), freed with the object.

    Args:
        model: a model ``fused_decoder_blocker`` accepts.
        rows: rows per decode step (the packing's batch-size hint).
    """

    def __init__(self, model: nn.Module, rows: int) -> None:
        reason = fused_decoder_blocker(model)
        if reason is not None:
            raise ValueError(f"FusedDecoder cannot run this model: {reason}")
        backbone = model.model
        self.embed = backbone.embed_tokens.weight.detach()
        self.rotary = backbone.rotary_emb
        self.final_norm = backbone.norm
        self.head = self._pack(model.get_output_embeddings().weight, rows)
        self.layers: list[_Layer] = []
        for layer in backbone.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
            biases = [p.bias for p in (q, k, v)]
            qkv_bias = None
            if any(b is not None for b in biases):
                qkv_bias = torch.cat(
                    [
                        b.detach() if b is not None else p.weight.new_zeros(p.out_features)
                        for b, p in zip(biases, (q, k, v), strict=True)
                    ]
                )
            self.layers.append(
                _Layer(
                    norm_in=layer.input_layernorm,
                    qkv=self._pack(torch.cat([q.weight, k.weight, v.weight]), rows),
                    qkv_bias=qkv_bias,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    o=self._pack(attn.o_proj.weight, rows),
                    norm_post=layer.post_attention_layernorm,
                    gate_up=self._pack(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), rows),
                    down=self._pack(mlp.down_proj.weight, rows),
                    act=mlp.act_fn,
                    scaling=float(attn.scaling),
                )
            )
        first = backbone.layers[0].self_attn
        self.head_dim = first.head_dim
        self.q_width = first.q_proj.out_features
        self.kv_width = first.k_proj.out_features
        self.intermediate = backbone.layers[0].mlp.gate_proj.out_features

    @staticmethod
    def _pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), rows)

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
        """
        rows, d = tokens.shape[0], self.head_dim
        kv_heads = self.kv_width // d
        group = self.q_width // self.kv_width
        length = key_mask.shape[1]
        h = self.embed[tokens]  # [N, H]
        cos, sin = self.rotary(h[:, None], positions[:, None])  # [N, 1, d]
        cos, sin = cos[:, None], sin[:, None]  # [N, 1, 1, d]
        # 0 where a row attends, -inf on its padding; one [N * kv_heads, group, L] bias for all layers
        bias = torch.zeros(rows, 1, 1, length, dtype=h.dtype, device=h.device)
        bias = bias.masked_fill(~key_mask.bool()[:, None, None, :], -math.inf)
        bias = bias.expand(rows, kv_heads, group, length).reshape(rows * kv_heads, group, length)
        for layer, cache in zip(self.layers, cache_layers, strict=True):
            x = _rms_norm(h, layer.norm_in)
            qkv = _linear(x, layer.qkv, layer.qkv_bias)
            v = qkv[:, self.q_width + self.kv_width :].view(rows, kv_heads, 1, d)
            if layer.q_norm is None:  # rotate the query and key heads together: [N, heads + kv_heads, d]
                qk = _rotate(qkv[:, : self.q_width + self.kv_width].view(rows, -1, d), cos[:, 0], sin[:, 0])
                q = qk[:, : kv_heads * group].reshape(rows, kv_heads, group, d)
                k = qk[:, kv_heads * group :].view(rows, kv_heads, 1, d)
            else:  # Qwen3: per-head norms with their own weights first
                q = _rms_norm(qkv[:, : self.q_width].view(rows, kv_heads, group, d), layer.q_norm)
                k = _rms_norm(
                    qkv[:, self.q_width : self.q_width + self.kv_width].view(rows, kv_heads, 1, d),
                    layer.k_norm,
                )
                q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            keys, values = cache.update(k, v)  # [N, kv_heads, L, d]
            scores = torch.baddbmm(
                bias,
                q.reshape(rows * kv_heads, group, d),
                keys.reshape(rows * kv_heads, length, d).transpose(1, 2),
                alpha=layer.scaling,
            )
            attended = torch.bmm(torch.softmax(scores, dim=-1), values.reshape(rows * kv_heads, length, d))
            h = h + _linear(attended.view(rows, self.q_width), layer.o)
            x = _rms_norm(h, layer.norm_post)
            gate_up = _linear(x, layer.gate_up)
            h = h + _linear(
                layer.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :], layer.down
            )
        return _linear(_rms_norm(h, self.final_norm), self.head)
