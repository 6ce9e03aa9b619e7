"""Completion log-probs and entropy from hidden states, chunk by chunk, recomputed in backward.

The naive way to score ``N = B * T`` completion tokens builds ``[N, V]`` logits (V is the
vocabulary, 49152 for SmolLM2) and keeps them, plus float32 log-softmax copies, alive until
the backward pass. Here the model's backbone yields the final hidden states ``[N, H]`` and
``TokenStats`` projects them onto the vocabulary ``chunk_size`` rows at a time, keeping only
``[N]`` results (the chosen token's log-prob, the log-partition and the entropy). Its backward
recomputes each chunk's logits and turns ``grad_logps`` and ``grad_entropy`` into gradients of
the hidden states and of the LM head's weight (and bias). At most one chunk's ``[chunk, V]``
float32 logits (and two or three work copies of it) exist at any time, in forward and backward.

The math, with ``z = (h @ W^T + b) / temperature``, its row maximum ``m`` at index ``a`` (the
argmax), ``u = z - m`` and ``S = sum_{j != a} exp(u_j)`` (the argmax left out of the sum):

- log-partition ``lse = m + log1p(S)``; ``log p_j = u_j - log1p(S)``, ``p_j = exp(u_j) / (1 + S)``;
- log-prob of target ``y``: ``u_y - log1p(S)``; ``d/dz = onehot(y) - p``, where the argmax's
  entry ``onehot(y)_a - p_a`` is formed as ``(onehot(y)_a - 1) + S / (1 + S)``;
- entropy ``H = -sum(p * log p) = log1p(S) - sum(exp(u) * u) / (1 + S)``; ``dH/dz = -p * (log p + H)``.

Why not ``z_y - logsumexp(z)`` and ``onehot(y) - exp(log p)``: at high confidence (``p_a`` within
float32's epsilon of 1, say ``1 - 1e-9``) ``logsumexp(z)`` rounds to ``z_a`` (or is off by
``eps * |z|``), so the argmax's log-prob comes out 0 (or wrong by ~1e-7) instead of ``~ -S``, and
its gradient ``1 - exp(0) = 0`` is lost while the other entries keep their tiny ``-p_j`` (the row
no longer sums to zero; "softmax collapse", arXiv 2610.31642). Leaving the argmax out of ``S``
(never ``sum(exp(u)) - 1``) keeps ``log1p(S) ~ S`` to float32's relative precision, and with it
``log p_a``, ``1 - p_a`` and ``H``. Forward keeps ``m``, ``S`` and ``a`` of each row (three ``[N]``
vectors) for backward, which writes the argmax's column of the gradient from them.

How the hidden states are obtained: the model is called as usual, through whatever wraps it
(DDP, a ``PeftModel``), with ``logits_to_keep=1`` so its own head projects a single position;
a forward hook on the decoder (``get_decoder()``) captures ``last_hidden_state``. Going through
the wrapper keeps DDP's gradient synchronisation, PEFT's forward and a Mixture-of-Experts
model's router loss (``aux_loss``) exactly as in the naive path; gradient checkpointing of the
decoder layers is unaffected. The one projected position doubles as a check: the first time a
model is seen, its own logits there are compared with ``lm_head(hidden)``; a model that
transforms its logits in a way ``supports_chunked`` does not know of is then sent, with a
warning, to the naive path for good.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from posttrain.ops import precision

DEFAULT_CHUNK_SIZE = 256
"""Token rows projected at once. One chunk's float32 logits take ``chunk_size * V * 4`` bytes (50 MB
for SmolLM2's V = 49152), and forward holds two such buffers at most, backward one (two with the
entropy's gradient). On the embedded model 256 rows gave 16 % less peak step memory than 1024 at
T = 1024 (``benchmarks/logprobs_memory.py``), and a [256, H] x [H, V] product is still a large matmul."""

# config fields of transformers models whose logits are not plainly lm_head(hidden)
_LOGIT_TRANSFORMS: dict[str, Callable[[Any], bool]] = {
    "final_logit_softcapping": lambda v: v is not None and v != 0,  # Gemma 2/3: cap * tanh(z / cap)
    "logit_scale": lambda v: v is not None and v != 1,  # Cohere: z * logit_scale
    "logits_scaling": lambda v: v is not None and v != 1,  # Granite: z / logits_scaling
}


# ---- the kernel ----------------------------------------------------------------------------


def _scaled_logits(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """``(h @ W^T + b) / temperature`` in float32 (float64 stays float64): [c, H] -> [c, V]."""
    z = nn.functional.linear(h, weight, bias)
    z = z.to(_stats_dtype(z.dtype))  # a fresh tensor either way: safe to divide in place
    return z.div_(temperature) if temperature != 1.0 else z


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the softmax statistics are taken in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _chunk_stats(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    with_top: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Log-prob of each target and the softmax's row statistics of one chunk: [c, H] -> [c] vectors.

    ``targets`` is [c], or [c, M] for M targets per row (the log-probs are then [c, M]).

    Returns:
        ``(logps, peak, rest, argmax, entropy, top)``: the targets' log-probs; the row maximum
        ``m`` of ``z``, ``S = sum_{j != a} exp(z_j - m)`` and the argmax ``a`` (long), all [c];
        the entropy [c] (``None`` unless ``with_entropy``) and the top log-prob ``-log1p(S)``
        [c] (``None`` unless ``with_top``).
    """
    u = _scaled_logits(h, weight, bias, temperature)  # [c, V], z for now
    peak, argmax = u.max(dim=-1)  # [c], [c]
    u.sub_(peak.unsqueeze(1))  # u = z - m <= 0, exactly 0 at the argmax
    logps = u.gather(1, _as_columns(targets))  # [c, M]: u_y for now
    # exp in place unless the entropy still needs u: one [c, V] buffer, two with the entropy
    e = u.exp() if with_entropy else u.exp_()  # [c, V]
    rest = _sum_but_argmax(e, argmax)  # [c]: S
    log_norm = torch.log1p(rest)  # [c]: lse - m, and -log p_a
    logps = logps.sub_(log_norm.unsqueeze(1)).view(targets.shape)  # [c] or [c, M]
    top = -log_norm if with_top else None  # [c]; == logps where the target is the argmax (u_a = 0)
    entropy = None
    if with_entropy:
        # H = -sum p (u - log1p(S)) = log1p(S) - sum(exp(u) * u) / (1 + S): two terms >= 0 (no
        # cancellation), so an entropy ~S at high confidence keeps its relative precision
        spread = e.mul_(u).sum(dim=-1)  # [c], over e's storage; the argmax adds 0 (u_a = 0)
        entropy = log_norm - spread / (1 + rest)
    return logps, peak, rest, argmax, entropy, top


def _sum_but_argmax(e: torch.Tensor, argmax: torch.Tensor) -> torch.Tensor:
    """``S = sum_{j != a} e_j`` of each row: [c, V] (its argmax's entry zeroed in place), [c] -> [c].

    Zeroing the argmax's ``exp(0) = 1`` before summing, not subtracting 1 after: ``1 + S`` would
    round to 1 for an ``S`` below float32's epsilon, which is exactly the high-confidence case.
    """
    return e.scatter_(1, argmax.unsqueeze(1), 0.0).sum(dim=-1)


def _chunk_grad_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    peak: torch.Tensor,
    rest: torch.Tensor,
    argmax: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Gradient of the loss wrt one chunk's raw logits ``h @ W^T + b``, in the weight's dtype: [c, V].

    ``peak``, ``rest`` and ``argmax`` are forward's ``m``, ``S`` and ``a`` of these rows ([c]
    each). One [c, V] float32 buffer without the entropy's gradient, two with it. The
    1 / temperature of ``dz / dlogits`` is folded into the [c] coefficients, and so is the
    softmax's ``1 / (1 + S)`` (``p = exp(u) / (1 + S)``).
    """
    g_cols = _as_columns(grad_logps / temperature) if grad_logps is not None else None  # [c, M]
    g_lp = g_cols.sum(dim=1) if g_cols is not None else None  # [c]: every target's -p part at once
    g_ent = grad_entropy / temperature if grad_entropy is not None else None  # [c]
    p_top = 1 / (1 + rest)  # [c]: p_a, and p_j = exp(u_j) * p_top
    u = _scaled_logits(h, weight, bias, temperature).sub_(peak.unsqueeze(1))  # [c, V]: z - m
    if g_ent is None:
        grad = u.exp_().mul_((-g_lp * p_top).unsqueeze(1))  # d log p_y / dz = onehot(y) - p: the -p part
    else:
        probs = u.exp()  # [c, V]: p * (1 + S)
        # -g_ent * p * (log p + H) - g_lp * p = exp(u) * (alpha * u + beta), log p = u - log1p(S)
        # (no -g_lp part when only the entropy has a gradient)
        h_shift = entropy - torch.log1p(rest)  # [c]: H + log p - u
        alpha = -g_ent * p_top
        beta = alpha * h_shift - (g_lp * p_top if g_lp is not None else 0)
        grad = u.mul_(alpha.unsqueeze(1)).add_(beta.unsqueeze(1)).mul_(probs)  # over u's storage
    column = argmax.unsqueeze(1)  # [c, 1]
    at_top = torch.zeros_like(rest)  # [c]: the argmax's entry, from S rather than 1 - p_a
    if g_cols is not None:
        grad.scatter_add_(1, _as_columns(targets), g_cols.to(grad.dtype))  # the onehot(y) parts
        hit = g_cols.mul(_as_columns(targets) == column).sum(dim=1)  # [c]: g of the targets == a
        at_top += (hit - g_lp) + g_lp * (rest * p_top)  # onehot_a - p_a = (onehot_a - 1) + S / (1 + S)
    if g_ent is not None:
        at_top += alpha * h_shift  # -g_ent * p_a * (log p_a + H), log p_a = -log1p(S)
    grad.scatter_(1, column, at_top.unsqueeze(1).to(grad.dtype))
    return grad.to(weight.dtype)


def _as_columns(values: torch.Tensor) -> torch.Tensor:
    """[c] -> [c, 1]; [c, M] stays."""
    return values.unsqueeze(1) if values.dim() == 1 else values


class TokenStats(torch.autograd.Function):
    """Chosen-token log-probs and entropy of ``softmax((h @ W^T + b) / temperature)``, chunked.

    Inputs: hidden [N, H], weight [V, H], bias [V] or ``None``, targets [N] or [N, M] (long), then the
    Python values temperature, chunk_size, with_entropy, entropy_grad, with_top. Outputs: logps
    [N] (or [N, M]: one per target), entropy [N] (float32, or float64 for a float64 head; an empty tensor when
    ``with_entropy`` is off; not differentiable unless ``entropy_grad``) and the top log-prob
    [N] (empty unless ``with_top``; never differentiable; equal to ``logps`` where the target is
    the argmax). Saved for backward: hidden, weight, the targets and four [N] vectors (the row
    maximum, ``S``, the argmax and the entropy; see the module docstring).
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        entropy_grad: bool,
        with_top: bool = False,
        product_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, dtype = hidden.shape[0], _stats_dtype(weight.dtype)
        ctx.dtypes = hidden.dtype, weight.dtype, bias.dtype if bias is not None else None
        hidden, weight, bias = _in_product_dtype(product_dtype, hidden, weight, bias)
        logps = hidden.new_empty(targets.shape, dtype=dtype)  # [N] or [N, M]
        peak = hidden.new_empty(n, dtype=dtype)  # [N]: m
        rest = hidden.new_empty(n, dtype=dtype)  # [N]: S
        argmax = targets.new_empty(n)  # [N]: a
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)  # [N] or [0]
        top = hidden.new_empty(n if with_top else 0, dtype=dtype)  # [N] or [0]
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            lp, pk, rs, am, ent, tp = _chunk_stats(
                hidden[rows], weight, bias, targets[rows], temperature, with_entropy, with_top
            )
            logps[rows], peak[rows], rest[rows], argmax[rows] = lp, pk, rs, am
            if ent is not None:
                entropy[rows] = ent
            if tp is not None:
                top[rows] = tp
        ctx.save_for_backward(hidden, weight, bias, targets, peak, rest, argmax, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(top, *([] if with_entropy and entropy_grad else [entropy]))
        return logps, entropy, top

    @staticmethod
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, grad_top: Any = None
    ):
        hidden, weight, bias, targets, peak, rest, argmax, entropy = ctx.saved_tensors
        if entropy.numel() == 0:
            grad_entropy = None
        grad_h, grad_b = _grad_buffers(ctx.needs_input_grad, hidden, bias, ctx.dtypes)
        grad_w = None  # [V, H]: the first chunk's product, the others added to it
        if grad_logps is None and grad_entropy is None:
            return _finish(grad_h, grad_w, grad_b, ctx.dtypes)
        chunk = ctx.chunk_size
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            g = _chunk_grad_logits(  # [c, V]
                hidden[rows],
                weight,
                bias,
                targets[rows],
                peak[rows],
                rest[rows],
                argmax[rows],
                entropy[rows] if grad_entropy is not None else None,
                grad_logps[rows] if grad_logps is not None else None,
                grad_entropy[rows] if grad_entropy is not None else None,
                ctx.temperature,
            )
            grad_w = _accumulate(
                g, hidden[rows], weight, rows, grad_h, grad_w, grad_b, ctx.needs_input_grad[1]
            )
        return _finish(grad_h, grad_w, grad_b, ctx.dtypes)


def _in_product_dtype(
    product_dtype: torch.dtype | None, *tensors: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """The head's inputs cast once to the dtype its products run in (``None``: left as they are).

    Under ``bf16=True`` the model's own forward multiplies in bf16 (autocast) while the head's
    inputs arrive in float32; casting them here runs the [c, H] x [H, V] products (forward, and
    backward's recompute and two gradient products) in bf16 too, their outputs turned to float32
    before any softmax statistic. Forward saves the cast copies, so backward does not cast again.
    """
    if product_dtype is None:
        return tensors
    return tuple(t.to(product_dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def _grad_buffers(
    needs: tuple[bool, ...],
    hidden: torch.Tensor,
    bias: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Zeroed gradient buffers of the hidden states (their own dtype) and the bias (float32 or wider).

    The weight's gradient gets none: the first chunk's product becomes it (``_accumulate``), which
    spares zero-filling (and, where it is a fresh mapping, page-faulting twice) a [V, H] buffer.
    """
    grad_h = torch.zeros_like(hidden, dtype=dtypes[0]) if needs[0] else None  # [N, H]
    if bias is None or not needs[2]:
        return grad_h, None
    return grad_h, torch.zeros_like(bias, dtype=_stats_dtype(dtypes[2]))  # [V]


def _accumulate(
    g: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rows: slice,
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    needs_w: bool,
) -> torch.Tensor | None:
    """Add one chunk's share: ``dh = g @ W``, ``dW += g^T @ h``, ``db += sum(g)``; g: [c, V], h: [c, H].

    Returns the weight's gradient so far ([V, H], float32 or wider; ``None`` unless ``needs_w``).
    """
    if grad_h is not None:
        grad_h[rows] = g @ weight  # [c, H]
    if grad_b is not None:
        grad_b.add_(g.sum(dim=0, dtype=grad_b.dtype))  # [V]
    if not needs_w:
        return None
    if grad_w is None:  # the first chunk
        return (g.t() @ h).to(_stats_dtype(g.dtype))
    if g.dtype == grad_w.dtype:
        return grad_w.addmm_(g.t(), h)
    return grad_w.add_(g.t() @ h)  # bf16 products, summed in float32


def _finish(
    grad_h: torch.Tensor | None,
    grad_w: torch.Tensor | None,
    grad_b: torch.Tensor | None,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype | None],
) -> tuple[torch.Tensor | None, ...]:
    """Backward's return value: the buffers in their inputs' dtypes, ``None`` for the rest."""
    grad_w = grad_w.to(dtypes[1]) if grad_w is not None else None
    grad_b = grad_b.to(dtypes[2]) if grad_b is not None else None
    return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    with_top: bool = False,
    product_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Log-probs and entropy of ``targets`` under ``softmax((hidden @ W^T + b) / temperature)``.

    Args:
        hidden: [..., H] final hidden states, already in the head's dtype.
        weight: [V, H] LM head weight; bias: [V] or ``None``.
        targets: [...] token ids, or [..., M]: M token ids per position (their log-probs share
            one projection onto the vocabulary).
        temperature: the logits are divided by it.
        chunk_size: token rows projected onto the vocabulary at once.
        with_entropy: also return the entropy.
        entropy_grad: let the entropy carry a gradient (otherwise it is detached).
        with_top: also return the top log-prob of each position (no gradient); the target is the
            argmax exactly where it equals the target's log-prob (``mean_token_accuracy``).
        product_dtype: the dtype the vocabulary products run in (``head_product_dtype``: bf16
            under ``bf16=True`` where bf16 products are native); ``None``: the head's own. The
            softmax statistics are float32 either way.

    Returns:
        ``(logps, entropy)``, float32 with ``targets``' shape; ``entropy`` (and ``top``) have
        ``hidden``'s leading shape; ``entropy`` is ``None`` unless asked for; with ``with_top``,
        ``(logps, entropy, top)``.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of token rows, got {chunk_size}.")
    shape = hidden.shape[:-1]
    flat_h = hidden.reshape(-1, hidden.shape[-1])  # [N, H]
    many = targets.dim() == hidden.dim()  # [..., M]: several targets per position
    flat_t = targets.reshape(-1, targets.shape[-1]) if many else targets.reshape(-1)
    logps, entropy, top = TokenStats.apply(
        flat_h,
        weight,
        bias,
        flat_t,
        temperature,
        chunk_size,
        with_entropy,
        entropy_grad,
        with_top,
        product_dtype,
    )
    out = logps.view(targets.shape), (entropy.view(shape) if with_entropy else None)
    return (*out, top.view(shape)) if with_top else out


# ---- which models, and their hidden states --------------------------------------------------


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / DeepSpeed / PEFT wrappers (the one with the LM head)."""
    while True:
        if hasattr(model, "get_base_model"):  # PeftModel
            model = model.get_base_model()
        elif not hasattr(model, "get_output_embeddings") and isinstance(
            getattr(model, "module", None), nn.Module
        ):
            model = model.module  # DistributedDataParallel, DeepSpeedEngine, FSDP (v1)
        else:
            return model


def vocab_size(model: nn.Module) -> int:
    """The number of logits the model's LM head produces (wrappers looked through)."""
    return int(causal_lm(model).get_output_embeddings().weight.shape[0])


def _is_sharded(model: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the head's weight is partitioned (FSDP, DeepSpeed ZeRO-3): not whole outside forward."""
    wrappers = []
    while isinstance(getattr(model, "module", None), nn.Module):
        wrappers.append(type(model).__name__)
        model = model.module
    dtensor = type(weight).__name__ == "DTensor" or type(weight.data).__name__ == "DTensor"
    return (
        dtensor or hasattr(weight, "ds_id") or weight.numel() == 0 or "FullyShardedDataParallel" in wrappers
    )


def _plain_linear_head(head: Any) -> bool:
    """An ``nn.Linear`` itself (not LoRA, quantized or offloaded), with at most input pre-hooks."""
    return (
        type(head) is nn.Linear
        and not hasattr(head, "_hf_hook")  # accelerate offloading / device maps replace forward
        and not head._forward_hooks
        and not head._forward_pre_hooks_with_kwargs
    )


def supports_chunked(model: nn.Module) -> bool:
    """Whether the chunked path computes exactly what ``model(...).logits`` would.

    True for a transformers causal LM (plain, inside DDP, or a ``PeftModel`` whose adapters do not
    touch the LM head) whose logits are ``lm_head(decoder(x).last_hidden_state)``: the head is a
    plain ``nn.Linear``, tied to the input embeddings or not, possibly cast to float32 by
    ``cast_lm_head_to_fp32`` (its input pre-hooks are applied to the hidden states). Mixture-of-
    Experts models qualify: their router loss comes from the same forward call.

    False (the naive full-logits path is used) for: logits transformed after the head (Gemma's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``); an LM head
    that is wrapped (LoRA on ``lm_head``, ``modules_to_save``, quantized, offloaded) or has output
    hooks; a sharded head weight (FSDP, DeepSpeed ZeRO-3); a model without ``get_decoder``. A
    model that transforms its logits some other way is caught at its first call (module docstring).
    """
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_output_embeddings") or not hasattr(lm, "get_decoder"):
        return False
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(test(getattr(text_config, name, None)) for name, test in _LOGIT_TRANSFORMS.items()):
        return False
    head = lm.get_output_embeddings()
    return _plain_linear_head(head) and not _is_sharded(model, head.weight)


def head_input(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``hidden`` as the LM head sees it: its input pre-hooks applied (the float32 cast), in its dtype."""
    head = causal_lm(model).get_output_embeddings()
    for hook in head._forward_pre_hooks.values():
        result = hook(head, (hidden,))
        if result is not None:
            hidden = result[0] if isinstance(result, tuple) else result
    return hidden.to(head.weight.dtype)


def head_product_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``token_stats`` should run ``model``'s vocabulary products in: bf16 or ``None``.

    bf16 when the model's latest ``run_with_hidden`` forward ran under bf16 autocast (``bf16=True``:
    accelerate wraps the forward, not the loss that calls the head afterwards) and bf16 products
    are native on the head's device (a GPU; a CPU with AVX512-BF16 or AMX). The head then
    multiplies in the precision the rest of the model did, as autocast would have run
    ``lm_head``, but with float32 logits and statistics. ``None`` elsewhere: no autocast, float16
    autocast (its gradients need the loss scaler's range), or a CPU that would emulate bf16.
    """
    lm = causal_lm(model)
    if _AUTOCAST_SEEN.get(lm) is not torch.bfloat16:
        return None
    weight = lm.get_output_embeddings().weight
    if weight.dtype != torch.float32 or not precision.fast_bf16(weight.device):
        return None
    return torch.bfloat16


def run_with_hidden(model: nn.Module, **inputs: Any) -> tuple[Any, torch.Tensor]:
    """Call ``model(**inputs, logits_to_keep=1)`` and catch the decoder's final hidden states.

    Returns:
        The model's output (its ``logits`` cover the last position only) and the hidden
        states [B, L, H] of every position.
    """
    captured: list[torch.Tensor] = []
    lm = causal_lm(model)

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        hidden = getattr(output, "last_hidden_state", None)
        hidden = hidden if hidden is not None else output[0]
        captured.append(hidden)
        # the head's product runs under the same autocast (accelerate wraps the whole forward
        # and casts the logits back to float32, so their dtype does not tell)
        device = hidden.device.type
        _AUTOCAST_SEEN[lm] = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None

    handle = causal_lm(model).get_decoder().register_forward_hook(keep)
    try:
        out = model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(causal_lm(model)).__name__}.get_decoder() was not called in forward.")
    return out, captured[-1]


_VERIFIED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()
#: the autocast dtype the model's latest ``run_with_hidden`` forward ran under (None: none)
_AUTOCAST_SEEN: weakref.WeakKeyDictionary[nn.Module, torch.dtype | None] = weakref.WeakKeyDictionary()


def logits_match_head(model: nn.Module, out: Any, hidden: torch.Tensor) -> bool:
    """Once per model: whether its own last-position logits equal ``lm_head(hidden)`` there.

    Args:
        model: the model called by ``run_with_hidden``.
        out: its output; ``out.logits`` is [B, 1, V].
        hidden: [B, L, H] the captured hidden states.

    Returns:
        The verdict, remembered for the model; a ``False`` also warns once.
    """
    lm = causal_lm(model)
    if lm in _VERIFIED:
        return _VERIFIED[lm]
    head = lm.get_output_embeddings()
    with torch.no_grad():
        ours = nn.functional.linear(
            head_input(model, hidden[:, -1]), head.weight, head.bias
        ).float()  # [B, V]
        theirs = out.logits[:, -1].float()  # [B, V]
        # bf16 logits (autocast) come from a bf16 product, ours from a float32 one (or another
        # bf16 kernel): judge them at the precision they were computed in, not the weights'
        dtypes = [head.weight.dtype, out.logits.dtype, _AUTOCAST_SEEN.get(lm) or head.weight.dtype]
        precision = max(torch.finfo(d).eps for d in dtypes)
        tol = 8 * precision
        ok = bool(torch.allclose(ours, theirs, rtol=tol, atol=tol * float(theirs.abs().max())))
    _VERIFIED[lm] = ok
    if not ok:
        warnings.warn(
            f"{type(lm).__name__} computes its logits differently from lm_head(hidden_states); its completion "
            "log-probs are taken from full logits instead of the chunked path (more memory).",
            stacklevel=3,
        )
    return ok
