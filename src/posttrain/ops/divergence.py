"""Per-token divergences between a student's and a teacher's next-token distributions, chunked.

Distillation compares two full distributions over the vocabulary at every completion position.
Built naively, that is two ``[B, T, V]`` float32 tensors (for the embedded model at 1024 tokens,
200 MB per row per model) kept alive for backward, plus their softmax copies. Here each side
arrives as final hidden states ``[N, H]`` and its LM head (or, for a model whose logits are not
plainly ``lm_head(hidden)``, as its ``[N, V]`` logits) and ``TokenDivergence`` projects
``chunk_size`` positions at a time, keeping only ``[N]`` results. The teacher never receives a
gradient.

The student's gradient is built in the same pass, as fused linear-cross-entropy kernels do: each
chunk's gradient wrt the logits turns at once into the rows' gradient wrt the hidden states
(``[N, H]``) and a running sum for the head (``[V, H]`` and ``[V]`` float32, weighted by the
loss's position weights: equal by default). Backward scales them by the upstream gradient, which
is exact for the hidden states whatever the upstream, and for the head when the upstream is
proportional to the stated weights (a token sum or mean, or the per-sample means a caller
announces through ``loss_weights``). When it is not, backward recomputes each chunk's logits of
both sides for the head's gradient (the one case that projects twice). Per chunk that is 4
matrix products (2 projections, 2 gradient products) where a recompute in backward takes 6.

The divergences, per position, with ``s = log p_S`` (student) and ``t = log p_T`` (teacher),
both of ``logits / temperature`` (``DIVERGENCES``):

- ``beta = 0``: forward KL, ``KL(T || S) = sum p_T (t - s)``; ``d/dz_S = p_S - p_T``;
- ``beta = 1``: reverse KL, ``KL(S || T) = sum p_S (s - t)``; ``d/dz_S = p_S (s - t - KL)``;
- ``0 < beta < 1``: the generalised Jensen-Shannon divergence of GKD (arXiv 2306.13649),
  ``beta KL(T || M) + (1 - beta) KL(S || M)`` with the mixture ``M = beta p_T + (1 - beta) p_S``;
  ``d/dz_S = (1 - beta) p_S (d - sum p_S d)`` with ``d = s - log M``.

The endpoints follow the reference and the spec (``beta=0`` is the forward KL, ``beta=1`` the
reverse KL), although the mixture formula itself tends to 0 there (its ``1/beta`` and
``1/(1 - beta)`` rescalings tend to the two KLs): ``docs/distillation.md`` says so.

Numerics at high confidence (paper index: "A fix for softmax and cross-entropy"). Where a
probability nears 1, or the student's and the teacher's nearly coincide, the float32 textbook
formulas lose the small values that carry the gradient: ``logsumexp`` rounds the argmax's
``log p`` to 0, and ``p_S - p_T`` of two probabilities that both round to 1 is 0. Here:

- ``log_softmax`` normalises with the argmax excluded: ``log p = (z - max) - log1p(S)`` with
  ``S`` the sum of ``exp(z - max)`` over the other entries, so ``log p`` of the argmax is
  ``-log1p(S)``, not 0;
- differences of probabilities are taken in log space, each in one form for every
  ``delta = t - s`` (relative precision where ``delta`` is small, the absolute rounding of
  ``delta`` itself elsewhere): ``p_S - p_T = sign(delta) max(p_S, p_T) expm1(-|delta|)``
  (every factor exact, nothing cancels), and ``log M - s = log(beta exp(delta) + 1 - beta)`` as
  ``log1p(beta expm1(delta))`` for ``beta <= 0.5`` and as its mirror
  ``delta + log1p((1 - beta) expm1(-delta))`` for ``beta > 0.5`` (``_log_mixture_ratio``: the
  argument of ``log1p`` stays above -0.5, and ``expm1`` is capped where it would overflow).

The tests build logits where the textbook float32 formula returns a zero gradient and check
these against float64.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.ops import chunked, tied_embedding, topk
from posttrain.ops.chunked import DEFAULT_CHUNK_SIZE
from posttrain.ops.divergence_head import HeadInputs, head_products, in_products, scratch_like, side_logits

__all__ = [
    "DIVERGENCES",
    "HeadInputs",
    "divergence_name",
    "log_softmax",
    "token_divergence",
    "divergence_from_logps",
    "target_logps",
    "top_ids",
]

DIVERGENCES = {
    "forward_kl": "KL(teacher || student): mass-covering, the soft-target cross-entropy's gradient (beta = 0)",
    "reverse_kl": "KL(student || teacher): mode-seeking, on-policy distillation's objective (beta = 1)",
    "jsd": "generalised Jensen-Shannon divergence with the mixture beta p_T + (1 - beta) p_S (0 < beta < 1)",
}

_CANCEL = 0.5  # |t - s| below this: log-space differences (no overflow, no cancellation)


def divergence_name(beta: float) -> str:
    """Which row of ``DIVERGENCES`` a ``beta`` selects."""
    return "forward_kl" if beta == 0.0 else "reverse_kl" if beta == 1.0 else "jsd"


def log_softmax(z: torch.Tensor) -> torch.Tensor:
    """``log_softmax`` over the last dim, exact for the argmax at high confidence, values and gradients.

    Normalises with the argmax excluded: ``log p = (z - max) - log1p(S)``, ``S = sum over the
    other entries of exp(z - max)``. ``torch.log_softmax`` computes ``log(1 + S)``, which rounds
    to 0 once ``S`` is below float32's epsilon; and its gradient at the argmax, ``g_a - p_a G``,
    cancels to 0 there. Here the backward writes it as ``c G - sum_{k != a} g_k`` with
    ``c = 1 - p_a = S / (1 + S)`` (``_StableLogSoftmax``). Returns a new tensor of ``z``'s dtype.
    """
    return _StableLogSoftmax.apply(z)


class _StableLogSoftmax(torch.autograd.Function):
    """``log_softmax`` normalised with the argmax excluded; saves log p [..., V], S and the argmax."""

    @staticmethod
    def forward(ctx: Any, z: torch.Tensor) -> torch.Tensor:
        top, where = z.max(dim=-1, keepdim=True)
        u = z - top  # [..., V]
        rest = u.exp().scatter_(-1, where, 0.0).sum(dim=-1, keepdim=True)  # [..., 1]
        logp = u.sub_(torch.log1p(rest))
        ctx.save_for_backward(logp, rest, where)
        return logp

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        logp, rest, where = ctx.saved_tensors
        total = g.sum(dim=-1, keepdim=True)  # G
        grad = g - logp.exp() * total  # g - p G, exact away from the argmax
        others = g.scatter(-1, where, 0.0).sum(dim=-1, keepdim=True)  # sum_{k != a} g_k, no cancellation
        at_top = rest / (1.0 + rest) * total - others  # g_a - p_a G = c G - sum_{k != a} g_k
        return grad.scatter_(-1, where, at_top)


_EXP_SAFE = 80.0  # expm1 of at most this stays finite in float32 (overflow above 88.7)


def _log_mixture_ratio(delta: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(M / p_S) = log(beta exp(delta) + 1 - beta)`` elementwise, ``delta = t - s`` (autograd-safe).

    One form per ``beta``, each valid for every ``delta``: relative precision where ``delta`` is
    small, and the absolute rounding of ``delta`` itself (a few units) elsewhere:

    - ``beta <= 0.5``: ``log1p(beta expm1(delta))``. The argument of ``log1p`` is above
      ``-beta >= -0.5`` (no ill-conditioning near -1) and nothing cancels, so the small values
      where ``delta`` is small keep their relative precision. ``delta`` is capped at
      ``_EXP_SAFE`` inside and the excess added back: above it the value is ``delta + log beta``.
    - ``beta > 0.5``: the mirror ``delta + log1p((1 - beta) expm1(-delta))``: the argument is
      above ``-(1 - beta) > -0.5``; near ``delta = 0`` the sum loses at most a factor
      ``1 / beta < 2``; far below 0 it tends to ``log(1 - beta)`` (``delta`` floored at
      ``-_EXP_SAFE``, where it has converged).
    """
    if beta <= 0.5:
        ratio = torch.log1p(beta * torch.expm1(delta.clamp(max=_EXP_SAFE)))
        return ratio + (delta - _EXP_SAFE).clamp(min=0.0)
    floored = delta.clamp(min=-_EXP_SAFE)
    return floored + torch.log1p((1.0 - beta) * torch.expm1(-floored))


def _log_mixture_ratio_(delta: torch.Tensor, beta: float) -> torch.Tensor:
    """``_log_mixture_ratio`` into the ``"div_work"`` scratch buffer, with in-place steps and no
    autograd (the kernel's)."""
    out = scratch_like(delta, "div_work")
    if beta <= 0.5:
        over = bool(delta.amax() > _EXP_SAFE)
        ratio = torch.clamp(delta, max=_EXP_SAFE, out=out).expm1_().mul_(beta).log1p_()
        return ratio.add_((delta - _EXP_SAFE).clamp_(min=0.0)) if over else ratio
    floored = delta.clamp(min=-_EXP_SAFE) if bool(delta.amin() < -_EXP_SAFE) else delta
    return torch.neg(floored, out=out).expm1_().mul_(1.0 - beta).log1p_().add_(floored)


def _divergence(s: torch.Tensor, t: torch.Tensor, beta: float) -> torch.Tensor:
    """The per-position divergence of log-distributions ``s`` and ``t`` ([..., V] -> [...]), out of
    place and differentiable by autograd (for small tensors: ``divergence_from_logps``)."""
    delta = t - s
    if beta == 0.0:  # KL(T || S)
        return (t.exp() * delta).sum(dim=-1)
    if beta == 1.0:  # KL(S || T)
        return -(s.exp() * delta).sum(dim=-1)
    ratio = _log_mixture_ratio(delta, beta)  # log M - s
    kl_sm = -(s.exp() * ratio).sum(dim=-1)
    kl_tm = (t.exp() * (delta - ratio)).sum(dim=-1)  # t - log M = delta - (log M - s)
    return beta * kl_tm + (1.0 - beta) * kl_sm


def _log_probs_(z: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p, p)`` of [c, V] logits, ``z`` overwritten with ``log p`` and ``p`` in the scratch
    buffer ``name``; normalised with the argmax excluded, as ``log_softmax`` (``p`` of the argmax
    is ``1 / (1 + S)``, of the others ``exp(z - max) / (1 + S)``)."""
    top, where = z.max(dim=-1, keepdim=True)
    u = z.sub_(top)
    p = torch.exp(u, out=scratch_like(u, name))
    rest = p.scatter_(-1, where, 0.0).sum(dim=-1, keepdim=True)  # S
    u.sub_(torch.log1p(rest))
    inv = (1.0 + rest).reciprocal_()
    return u, p.mul_(inv).scatter_(-1, where, inv)


def _grad_factor(beta: float) -> float:
    """The constant ``k`` of ``_chunk``'s gradient: ``d divergence / d z_S = k * g``."""
    return 1.0 if beta == 0.0 else -1.0 if beta == 1.0 else -(1.0 - beta)


def _chunk(
    z_s: torch.Tensor, z_t: torch.Tensor, beta: float, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's divergence, the student's entropy and the divergence's gradient wrt ``z_S``.

    Args:
        z_s, z_t: [c, V] student and teacher logits divided by the temperature, float32 or wider;
            both are overwritten. Its other [c, V] tensors are scratch buffers (``ops/workspace.py``),
            the gradient among them: dead at the next call.
        beta: 0 forward KL, 1 reverse KL, else the generalised JSD.
        with_grad: also return the gradient.

    Returns:
        ``(divergence [c], entropy [c], g [c, V] or None)``: ``d divergence / d z_S = k * g`` with
        ``k = _grad_factor(beta)``, a constant left for the caller to apply on a small tensor
        ([c, H] or [N]) rather than on [c, V].
    """
    s, p = _log_probs_(z_s, "div_student_p")
    t, q = _log_probs_(z_t, "div_teacher_p")
    delta = t.sub_(s)  # t - s
    entropy = s.mul_(p).sum(dim=-1).neg_()  # torch's sums accumulate in blocks: exact over V terms
    if beta == 0.0:  # KL(T || S); gradient p - q
        div = torch.mul(q, delta, out=scratch_like(q, "div_work")).sum(dim=-1)
        if not with_grad:
            return div, entropy, None
        # p - q = sign(delta) * max(p, q) * expm1(-|delta|): each factor exact, nothing cancels
        g = torch.abs(delta, out=scratch_like(q, "div_work")).neg_().expm1_().mul_(torch.maximum(p, q, out=q))
        return div, entropy, g.copysign_(delta.neg_())
    if beta == 1.0:  # KL(S || T); gradient p (s - t - KL) = -(p delta + p KL)
        p_delta = delta.mul_(p)
        div = p_delta.sum(dim=-1).neg_()
        return div, entropy, p_delta.addcmul_(p, div.unsqueeze(-1)) if with_grad else None
    ratio = _log_mixture_ratio_(delta, beta)  # log M - s = -d
    kl_tm = delta.sub_(ratio).mul_(q).sum(dim=-1)  # KL(T || M): t - log M = delta - (log M - s)
    p_ratio = ratio.mul_(p)
    kl_sm = p_ratio.sum(dim=-1).neg_()  # KL(S || M)
    div = beta * kl_tm + (1.0 - beta) * kl_sm
    # (1 - beta) p (d - KL(S || M)) = -(1 - beta) (p (log M - s) + p KL(S || M))
    return div, entropy, p_ratio.addcmul_(p, kl_sm.unsqueeze(-1)) if with_grad else None


def divergence_from_logps(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float
) -> torch.Tensor:
    """The per-position divergence of two log-distributions over the last dim (no custom gradient).

    The same formulas as the chunked kernel, out of place so autograd differentiates them, for
    small tensors and tests: [..., V] x 2 -> [...].
    """
    return _divergence(student_logps, teacher_logps, beta)


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """``x / temperature`` for [N, V] logits, in float32 or wider (a new tensor)."""
    z = x.to(torch.promote_types(x.dtype, torch.float32), copy=True)
    return z.div_(temperature) if temperature != 1.0 else z


def _gradient_pass(
    s_x: torch.Tensor,
    s_w: torch.Tensor | None,
    s_b: torch.Tensor | None,
    t_x: torch.Tensor,
    t_w: torch.Tensor | None,
    t_b: torch.Tensor | None,
    beta: float,
    temperature: float,
    chunk_size: int,
    weights: torch.Tensor | None,
    want: tuple[bool, bool, bool],
    dtypes: tuple[torch.dtype | None, torch.dtype | None],
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Project chunk by chunk; write the divergence and entropy into ``out``, and build the gradients.

    Args:
        s_x, s_w, s_b, t_x, t_w, t_b, beta, temperature, chunk_size, dtypes: as ``TokenDivergence``.
        weights: [N] the weight of each position's divergence in the head's gradient (``None``: 1).
        want: whether to build the gradient of the student's hidden states, head weight, head bias.
        out: ``(divergence [N], entropy [N])`` to fill, or ``None`` (a recompute in backward).

    Returns:
        ``(gx, gw, gb)``: with ``g_i = d divergence_i / d z_S,i / k`` (``_chunk``),
        ``gx`` [N, H] holds each row's ``g_i @ W`` (logits: [N, V], ``g_i`` itself) without weights,
        ``gw`` [V, H] ``sum_i weights_i g_i x_i^T`` and ``gb`` [V] ``sum_i weights_i g_i``, float32
        or wider; ``None`` where not wanted. The temperature's ``1 / T`` is not applied.
    """
    want_x, want_w, want_b = want
    n = s_x.shape[0]
    acc = torch.promote_types(s_w.dtype if s_w is not None else s_x.dtype, torch.float32)
    gx = gw = gb = None
    if want_x:
        gx = s_x.new_empty(n, s_w.shape[1], dtype=acc) if s_w is not None else torch.empty_like(s_x)
    if want_w:
        gw = torch.zeros_like(s_w, dtype=acc)
    if want_b:
        gb = torch.zeros_like(s_b, dtype=acc)
    student = in_products(s_w, s_b, dtypes[0], "head_weight")
    teacher = in_products(t_w, t_b, dtypes[1], "div_teacher_weight")
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        z_s = side_logits(s_x[rows], student, temperature, "div_student_logits")
        z_t = side_logits(t_x[rows], teacher, temperature, "div_teacher_logits")
        div, entropy, g = _chunk(z_s, z_t.to(z_s.dtype), beta, want_x or want_w or want_b)
        if out is not None:
            out[0][rows], out[1][rows] = div, entropy
        if g is None:
            continue
        if s_w is None:  # logits given: their gradient is g
            gx[rows] = g
            continue
        w_rows = weights[rows].to(acc) if weights is not None and (gw is not None or gb is not None) else None
        if gb is not None:
            gb.add_(g.t() @ w_rows if w_rows is not None else g.sum(dim=0))
        head_products(g, s_x[rows], student[0], w_rows, gx[rows] if gx is not None else None, gw)
    return gx, gw, gb


def _common_factor(scale: torch.Tensor, weights: torch.Tensor | None) -> float | None:
    """``c`` with ``scale = c * weights`` (``weights`` ``None``: all 1) to rounding, else ``None``.

    Rounding: each entry within 16 units of ``scale``'s precision of ``c * weights`` (the two sides
    of a per-sample mean round differently); the head's gradient is then off by at most that.
    """
    s = scale.double()
    w = weights.to(s.device, torch.float64) if weights is not None else torch.ones_like(s)
    norm = float(w @ w)
    if norm == 0.0:
        return 0.0 if not bool(s.any()) else None
    c = float(s @ w) / norm
    tol = 16 * torch.finfo(scale.dtype).eps
    return c if bool(((s - c * w).abs() <= tol * (c * w).abs()).all()) else None


class TokenDivergence(torch.autograd.Function):
    """The per-position divergence of student and teacher, chunked; gradient to the student only.

    Inputs: student hidden [N, H] (or logits [N, V]), its head weight [V, H] (or ``None``) and bias,
    the teacher's three the same way, then beta, temperature, chunk_size, the loss's weights [N]
    (or ``None``), ``fuse`` and ``dtypes`` (the student's and the teacher's ``product_dtype``;
    the student's gradient products run in the student's). Outputs: divergence [N] and the student's entropy [N] (not
    differentiable), float32 or wider.

    With ``fuse`` (``token_divergence`` sets it when autograd records), forward also builds the
    student's gradient as it goes, fused linear-cross-entropy style: each row's gradient wrt its
    hidden state (``[N, H]``, exact for any upstream gradient once scaled per row) and the
    weighted sums for the head (``[V, H]`` and ``[V]``, float32). Backward then scales them:
    by ``grad_div`` row by row for the hidden states, and, when ``grad_div`` is proportional to
    the weights (a token sum or mean: all equal), by the one factor for the head. Otherwise it
    recomputes each chunk's logits of both sides for the head's gradient. Saved for backward: the
    inputs (for that recompute, and for a second backward through a retained graph).
    """

    @staticmethod
    def forward(
        ctx: Any,
        s_x: torch.Tensor,
        s_w: torch.Tensor | None,
        s_b: torch.Tensor | None,
        t_x: torch.Tensor,
        t_w: torch.Tensor | None,
        t_b: torch.Tensor | None,
        beta: float,
        temperature: float,
        chunk_size: int,
        weights: torch.Tensor | None,
        fuse: bool,
        dtypes: tuple[torch.dtype | None, torch.dtype | None],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = s_x.shape[0]
        dtype = torch.promote_types(s_x.dtype if s_w is None else s_w.dtype, torch.float32)
        div = s_x.new_empty(n, dtype=dtype)
        entropy = s_x.new_empty(n, dtype=dtype)
        needs = ctx.needs_input_grad
        want = (
            fuse and needs[0],
            fuse and s_w is not None and needs[1],
            fuse and s_b is not None and needs[2],
        )
        gx, gw, gb = _gradient_pass(
            s_x, s_w, s_b, t_x, t_w, t_b, beta, temperature, chunk_size, weights, want, dtypes, (div, entropy)
        )
        ctx.save_for_backward(s_x, s_w, s_b, t_x, t_w, t_b)
        ctx.beta, ctx.temperature, ctx.chunk_size, ctx.weights = beta, temperature, chunk_size, weights
        ctx.dtypes = dtypes
        ctx.fused = (gx, gw, gb) if any(want) else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx: Any, grad_div: torch.Tensor | None, grad_entropy: Any = None):
        fused, ctx.fused = ctx.fused, None  # consumed: a second backward (retained graph) recomputes
        s_x, s_w, s_b, t_x, t_w, t_b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        want = [needs[0], s_w is not None and needs[1], s_b is not None and needs[2]]
        if grad_div is None or not any(want):
            return (None,) * 12
        grad_div = grad_div.to(torch.promote_types(grad_div.dtype, torch.float32))
        scale = grad_div * (_grad_factor(ctx.beta) / ctx.temperature)  # d loss / d z_S,i = scale_i g_i
        gx = gw = gb = None
        if fused is not None:
            gx, gw, gb = fused
            want[0] = want[0] and gx is None
            if gw is not None or gb is not None:
                c = _common_factor(scale, ctx.weights)
                if c is not None:
                    gw = gw.mul_(c) if gw is not None else None
                    gb = gb.mul_(c) if gb is not None else None
                    want[1] = want[2] = False
                else:  # the upstream gradient is not proportional to the weights: rebuilt below
                    gw = gb = None
        if any(want):  # recompute each chunk; the head's sums weighted by the upstream gradient itself
            rx, rw, rb = _gradient_pass(
                s_x,
                s_w,
                s_b,
                t_x,
                t_w,
                t_b,
                ctx.beta,
                ctx.temperature,
                ctx.chunk_size,
                scale,
                tuple(want),
                ctx.dtypes,
            )
            gx = rx if want[0] else gx
            gw, gb = (rw, rb) if want[1] or want[2] else (gw, gb)
        grad_x = gx.mul_(scale.unsqueeze(-1).to(gx.dtype)).to(s_x.dtype) if gx is not None else None
        grad_w = tied_embedding.hand_over(s_w, gw.to(s_w.dtype)) if gw is not None else None
        grad_b = gb.to(s_b.dtype) if gb is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None, None


def token_divergence(
    student: HeadInputs,
    teacher: HeadInputs,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    loss_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence of student and teacher at each position, and the student's entropy.

    Args:
        student: the student's side, [N, H] hidden states with its head (or [N, V] logits); the
            gradient flows to its hidden states and head.
        teacher: the teacher's side at the same N positions; no gradient flows to it.
        beta: 0 forward KL, 1 reverse KL, in between the generalised JSD (``DIVERGENCES``).
        temperature: both sides' logits are divided by it.
        chunk_size: positions projected onto the vocabulary at once.
        loss_weights: [N] how the loss will weigh each position's divergence, up to one common
            factor (``None``: equally, a token sum or mean). Under autograd the student's gradient
            is built during this call for these weights; a loss whose gradient reaches the
            divergence in other proportions is still differentiated exactly, but its head
            gradient costs a second projection of every chunk (``TokenDivergence``). Without
            gradient recording they are not used.

    Returns:
        ``(divergence [N], entropy [N])`` in float32 (float64 for float64 inputs); the entropy
        carries no gradient.

    Raises:
        ValueError: the two vocabularies differ, the positions differ, ``beta`` is outside
            [0, 1], or ``loss_weights`` is not one number per position.
    """
    _check_divergence_inputs(student, teacher, beta, chunk_size, loss_weights)
    sides = (student.hidden, student.weight, student.bias)
    fuse = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in sides)
    weights = loss_weights.detach() if loss_weights is not None and fuse else None
    teacher_x = teacher.hidden.detach()
    t_w = teacher.weight.detach() if teacher.weight is not None else None
    t_b = teacher.bias.detach() if teacher.bias is not None else None
    return TokenDivergence.apply(
        student.hidden,
        student.weight,
        student.bias,
        teacher_x,
        t_w,
        t_b,
        float(beta),
        float(temperature),
        chunk_size,
        weights,
        fuse,
        (student.product_dtype, teacher.product_dtype),
    )


def _check_divergence_inputs(
    student: HeadInputs,
    teacher: HeadInputs,
    beta: float,
    chunk_size: int,
    loss_weights: torch.Tensor | None,
) -> None:
    """None, once ``beta``, ``chunk_size``, the weights and the two sides' vocabularies and positions fit."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 forward KL, 1 reverse KL), got {beta}.")
    if student.vocab_size != teacher.vocab_size:
        raise ValueError(
            f"The student's vocabulary has {student.vocab_size} logits and the teacher's {teacher.vocab_size}; "
            "the divergence compares them token by token, so they must be equal."
        )
    if student.hidden.shape[0] != teacher.hidden.shape[0]:
        raise ValueError(
            f"{student.hidden.shape[0]} student positions against {teacher.hidden.shape[0]} teacher positions."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions, got {chunk_size}.")
    if loss_weights is not None and tuple(loss_weights.shape) != (student.hidden.shape[0],):
        raise ValueError(
            f"loss_weights has shape {tuple(loss_weights.shape)}; it needs one weight per position, "
            f"shape ({student.hidden.shape[0]},) (or None for equal weights)."
        )


def target_logps(
    side: HeadInputs, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """Log-probs of given token ids at each position of one side, with gradient to its inputs.

    Args:
        side: [N, H] hidden states with the head (chunked, ``ops/chunked.py``), or [N, V] logits.
        targets: [N] or [N, K] token ids.
        temperature: the logits are divided by it.

    Returns:
        [N] or [N, K] log-probs, float32 or wider.
    """
    if side.weight is not None:
        logps, _ = chunked.token_stats(
            side.hidden,
            side.weight,
            side.bias,
            targets,
            temperature,
            chunk_size,
            product_dtype=side.product_dtype,
        )
        return logps
    many = targets if targets.dim() == 2 else targets.unsqueeze(-1)
    logps = log_softmax(_scaled(side.hidden, temperature)).gather(-1, many)
    return logps if targets.dim() == 2 else logps.squeeze(-1)


@torch.no_grad()
def top_ids(
    side: HeadInputs, k: int, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """The ``k`` most likely token ids at each position of one side: [N, k], without gradient."""
    if side.weight is not None:
        dummy = torch.zeros(side.hidden.shape[0], dtype=torch.long, device=side.hidden.device)
        _, _, ids = topk.token_topk(side.hidden, side.weight, side.bias, dummy, temperature, k, chunk_size)
        return ids
    return side.hidden.topk(k, dim=-1).indices
