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
warning, to the naive path for good; after it passed, the head is not run in that forward at
all. Those model-facing parts live in ``ops/head_forward.py`` (re-exported here).

The chunk's temporaries (its logits, their exponentials, a bf16 product's raw output and the
bf16 copy of the weight and of its gradient's products) are kept scratch buffers
(``ops/workspace.py``): every chunk, call and step touches the same pages instead of fresh ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from posttrain.ops import tied_embedding, workspace
from posttrain.ops.head_forward import (  # noqa: F401  (re-exported: callers reach them here)
    causal_lm,
    head_input,
    head_product_dtype,
    logits_match_head,
    run_with_hidden,
    supports_chunked,
    vocab_size,
)

DEFAULT_CHUNK_SIZE = 256
"""Token rows projected at once. One chunk's float32 logits take ``chunk_size * V * 4`` bytes (50 MB
for SmolLM2's V = 49152), and the head keeps two such scratch buffers (the logits and, for the
entropy, their exponentials) between calls. On the embedded model 256 rows gave 16 % less peak step memory than 1024 at
T = 1024 (``benchmarks/logprobs_memory.py``), and a [256, H] x [H, V] product is still a large matmul."""

# ---- the kernel ----------------------------------------------------------------------------


def _scaled_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    reuse: bool = False,
    name: str = "head_logits",
) -> torch.Tensor:
    """``(h @ W^T + b) / temperature`` in float32 (float64 stays float64): [c, H] -> [c, V].

    A fresh tensor, or with ``reuse`` the scratch buffer ``name`` (``ops/workspace.py``; a
    lower-precision product passes through ``"head_product"``): the caller then lets it die before
    the next call with that name. Either way safe to change in place.
    """
    if not reuse:
        z = nn.functional.linear(h, weight, bias)
        z = z.to(_stats_dtype(z.dtype))  # a fresh tensor either way: safe to divide in place
        return z.div_(temperature) if temperature != 1.0 else z
    shape, stats = (h.shape[0], weight.shape[0]), _stats_dtype(weight.dtype)
    z = workspace.scratch(name, shape, stats, h.device)
    product = z if weight.dtype == stats else workspace.scratch("head_product", shape, weight.dtype, h.device)
    if bias is None:
        torch.mm(h, weight.t(), out=product)
    else:
        torch.addmm(bias, h, weight.t(), out=product)
    if product is not z:  # a bf16 (or float16) product: its logits widened before any statistic
        z.copy_(product)
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
    u = _scaled_logits(h, weight, bias, temperature, reuse=True)  # [c, V], z for now
    peak, argmax = u.max(dim=-1)  # [c], [c]
    u.sub_(peak.unsqueeze(1))  # u = z - m <= 0, exactly 0 at the argmax
    logps = u.gather(1, _as_columns(targets))  # [c, M]: u_y for now
    # exp in place unless the entropy still needs u: one [c, V] buffer, two with the entropy
    e = torch.exp(u, out=_exp_buffer(u)) if with_entropy else u.exp_()  # [c, V]
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
    u = _scaled_logits(h, weight, bias, temperature, reuse=True).sub_(peak.unsqueeze(1))  # [c, V]: z - m
    if g_ent is None:
        grad = u.exp_().mul_((-g_lp * p_top).unsqueeze(1))  # d log p_y / dz = onehot(y) - p: the -p part
    else:
        probs = torch.exp(u, out=_exp_buffer(u))  # [c, V]: p * (1 + S)
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
    if grad.dtype == weight.dtype:
        return grad
    # the product's dtype, over the raw product's buffer (consumed by now)
    return workspace.scratch("head_product", grad.shape, weight.dtype, grad.device).copy_(grad)


def _exp_buffer(u: torch.Tensor) -> torch.Tensor:
    """The scratch buffer for ``exp(u)`` when ``u`` is still needed: [c, V] like ``u``."""
    return workspace.scratch("head_exp", tuple(u.shape), u.dtype, u.device)


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
        ctx.product_dtype = product_dtype
        saved_weight = weight  # backward casts it again (into the scratch buffer) rather than keep a copy
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
        ctx.save_for_backward(hidden, saved_weight, bias, targets, peak, rest, argmax, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(top, *([] if with_entropy and entropy_grad else [entropy]))
        return logps, entropy, top

    @staticmethod
    def backward(
        ctx: Any, grad_logps: torch.Tensor | None, grad_entropy: torch.Tensor | None, grad_top: Any = None
    ):
        hidden, saved_weight, bias, targets, peak, rest, argmax, entropy = ctx.saved_tensors
        weight = _product_weight(saved_weight, ctx.product_dtype)
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
        grad_h, grad_w, *others = _finish(grad_h, grad_w, grad_b, ctx.dtypes)
        return grad_h, tied_embedding.hand_over(saved_weight, grad_w), *others


def _in_product_dtype(
    product_dtype: torch.dtype | None,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The head's inputs cast to the dtype its products run in (``None``: left as they are).

    Under ``bf16=True`` the model's own forward multiplies in bf16 (autocast) while the head's
    inputs arrive in float32; casting them here runs the [c, H] x [H, V] products (forward, and
    backward's recompute and two gradient products) in bf16 too, their outputs turned to float32
    before any softmax statistic. Forward saves the cast hidden states and bias; the weight goes
    through ``_product_weight`` in forward and again in backward.
    """
    if product_dtype is None:
        return hidden, weight, bias
    if bias is not None and bias.is_floating_point():
        bias = bias.to(product_dtype)
    return hidden.to(product_dtype), _product_weight(weight, product_dtype), bias


def _product_weight(
    weight: torch.Tensor, product_dtype: torch.dtype | None, name: str = "head_weight"
) -> torch.Tensor:
    """``weight`` [V, H] in the products' dtype, cast into the scratch buffer ``name``.

    Not kept from forward to backward: the cast (3 ms for SmolLM2's head into the kept pages)
    costs less than holding a [V, H] copy alive, and a fresh copy's page faults, each step.
    """
    if product_dtype is None or weight.dtype == product_dtype:
        return weight
    return workspace.scratch(name, tuple(weight.shape), product_dtype, weight.device).copy_(weight)


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
    return add_weight_product(grad_w, g.t(), h)  # the first chunk's product starts it


def add_weight_product(grad_w: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``grad_w + a @ b`` in place (``a @ b`` itself when ``grad_w`` is None), summed in float32 or wider.

    A bf16 product lands in the kept ``"head_weight_grad"`` scratch buffer before the float32
    sum, so no fresh [V, H] block is mapped for it chunk after chunk; the sum widens it a block of
    rows at a time (``add_in_blocks``).
    """
    stats = _stats_dtype(a.dtype)
    if a.dtype == stats:
        return (a @ b) if grad_w is None else grad_w.addmm_(a, b)
    shape = (a.shape[0], b.shape[1])
    product = torch.mm(a, b, out=workspace.scratch("head_weight_grad", shape, a.dtype, a.device))
    return product.to(stats) if grad_w is None else add_in_blocks(grad_w, product)


#: bytes of the widest block ``add_in_blocks`` widens at once: well below glibc's mapping threshold
ADD_BLOCK_BYTES = 1 << 20


def add_in_blocks(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``total += part`` in place for a ``part`` [R, C] of a narrower dtype, a block of rows at a time.

    One ``add_`` of mixed dtypes widens the whole ``part`` into a temporary of ``total``'s dtype
    first: for SmolLM2's [49152, 576] head a fresh 113 MB block (its own mapping, page-faulted at
    every chunk), 29 ms against 7 ms by blocks of rows whose widened copy fits in 1 MB of heap.
    The sums are the same, element for element.
    """
    rows = max(1, ADD_BLOCK_BYTES // max(1, part[0].numel() * total.element_size()))
    for start in range(0, part.shape[0], rows):
        total[start : start + rows].add_(part[start : start + rows])
    return total


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


def positions_from_images(model: torch.nn.Module) -> bool:
    """Whether the model derives its positions from its image inputs (a ``get_rope_index``: Qwen-VL's
    3-D rotary positions), so a forward with images must not be given ``position_ids``."""
    lm = causal_lm(model)
    return hasattr(lm, "get_rope_index") or hasattr(getattr(lm, "model", None), "get_rope_index")
