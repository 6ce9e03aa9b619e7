"""Per-token divergences between a student's and a teacher's next-token distributions, chunked.

Distillation compares two full distributions over the vocabulary at every completion position.
Built naively, that is two ``[B, T, V]`` float32 tensors (for the embedded model at 1024 tokens,
200 MB per row per model) kept alive for backward, plus their softmax copies. Here each side
arrives as final hidden states ``[N, H]`` and its LM head (or, for a model whose logits are not
plainly ``lm_head(hidden)``, as its ``[N, V]`` logits) and ``TokenDivergence`` projects
``chunk_size`` positions at a time, keeping only ``[N]`` results. Backward recomputes each
chunk's logits of both sides and turns the gradient of the divergence into gradients of the
student's hidden states and head; the teacher never receives one.

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
- differences of probabilities are taken in log space: ``p_S - p_T = -p_S expm1(t - s)`` and
  ``s - log M = -log1p(beta expm1(t - s))`` where ``|t - s|`` is small (the cancelling case),
  the direct forms elsewhere.

The tests build logits where the textbook float32 formula returns a zero gradient and check
these against float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.ops import chunked
from posttrain.ops.chunked import DEFAULT_CHUNK_SIZE

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


def _divergence(
    s: torch.Tensor, t: torch.Tensor, beta: float, with_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's divergence, the student's entropy and the divergence's gradient wrt ``z_S``.

    Args:
        s, t: [c, V] student and teacher log-probs (``log_softmax`` of ``logits / temperature``).
        beta: 0 forward KL, 1 reverse KL, else the generalised JSD.
        with_grad: also return ``d divergence / d z_S`` (``z_S`` the scaled student logits).

    Returns:
        ``(divergence [c], entropy [c], grad [c, V] or None)``.
    """
    p_s = s.exp()
    entropy = -(p_s * s).sum(dim=-1)
    delta = t - s  # [c, V]
    close = delta.abs() < _CANCEL
    grad = None
    if beta == 0.0:  # KL(T || S)
        p_t = t.exp()
        div = (p_t * delta).sum(dim=-1)
        if with_grad:  # p_S - p_T, in log space where the two nearly coincide
            grad = torch.where(close, -p_s * torch.expm1(delta.clamp(max=_CANCEL)), p_s - p_t)
    elif beta == 1.0:  # KL(S || T)
        d = -delta
        div = (p_s * d).sum(dim=-1)
        if with_grad:
            grad = p_s * (d - div.unsqueeze(-1))
    else:
        # d = s - log M, M = beta p_T + (1 - beta) p_S = p_S (1 + beta expm1(t - s))
        near = -torch.log1p(beta * torch.expm1(delta.clamp(max=_CANCEL)))
        far = s - torch.logaddexp(t + math.log(beta), s + math.log1p(-beta))
        d = torch.where(close, near, far)
        kl_sm = (p_s * d).sum(dim=-1)  # KL(S || M)
        kl_tm = (t.exp() * (delta + d)).sum(dim=-1)  # KL(T || M): t - log M = (t - s) + d
        div = beta * kl_tm + (1.0 - beta) * kl_sm
        if with_grad:
            grad = (1.0 - beta) * p_s * (d - kl_sm.unsqueeze(-1))
    return div, entropy, grad


def divergence_from_logps(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float
) -> torch.Tensor:
    """The per-position divergence of two log-distributions over the last dim (no custom gradient).

    The same formulas as the chunked kernel, for small tensors and tests: [..., V] x 2 -> [...].
    """
    div, _, _ = _divergence(student_logps, teacher_logps, beta, with_grad=False)
    return div


@dataclass
class HeadInputs:
    """One model's side of a divergence: what its LM head turns into next-token logits.

    Attributes:
        hidden: [N, H] final hidden states in the head's dtype, or [N, V] logits when ``weight`` is
            ``None`` (a model whose logits are not plainly ``lm_head(hidden)``).
        weight: [V, H] the LM head's weight, or ``None``.
        bias: [V] the LM head's bias, or ``None``.
    """

    hidden: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def vocab_size(self) -> int:
        """V: the number of logits per position."""
        return self.weight.shape[0] if self.weight is not None else self.hidden.shape[-1]

    def rows(self, keep: torch.Tensor) -> HeadInputs:
        """The positions where ``keep`` ([...] bool, the hidden states' leading shape) is true."""
        return HeadInputs(self.hidden[keep], self.weight, self.bias)


def _scaled(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, temperature: float):
    """``(x @ W^T + b) / temperature`` (or ``x / temperature`` for logits) in float32 or wider."""
    z = nn.functional.linear(x, weight, bias) if weight is not None else x.clone()
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


class TokenDivergence(torch.autograd.Function):
    """The per-position divergence of student and teacher, chunked; gradient to the student only.

    Inputs: student hidden [N, H] (or logits [N, V]), its head weight [V, H] (or ``None``) and bias,
    the teacher's three the same way, then the Python values beta, temperature, chunk_size.
    Outputs: divergence [N] and the student's entropy [N] (not differentiable), float32 or wider.
    Saved for backward: the inputs; each chunk's logits are recomputed.
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = s_x.shape[0]
        dtype = torch.promote_types(s_x.dtype if s_w is None else s_w.dtype, torch.float32)
        div = s_x.new_empty(n, dtype=dtype)
        entropy = s_x.new_empty(n, dtype=dtype)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            s = log_softmax(_scaled(s_x[rows], s_w, s_b, temperature))
            t = log_softmax(_scaled(t_x[rows], t_w, t_b, temperature)).to(s.dtype)
            div[rows], entropy[rows], _ = _divergence(s, t, beta, with_grad=False)
        ctx.save_for_backward(s_x, s_w, s_b, t_x, t_w, t_b)
        ctx.beta, ctx.temperature, ctx.chunk_size = beta, temperature, chunk_size
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(entropy)
        return div, entropy

    @staticmethod
    def backward(ctx: Any, grad_div: torch.Tensor | None, grad_entropy: Any = None):
        s_x, s_w, s_b, t_x, t_w, t_b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        grad_x = torch.zeros_like(s_x) if needs[0] else None
        acc = torch.promote_types(s_w.dtype, torch.float32) if s_w is not None else None
        grad_w = torch.zeros_like(s_w, dtype=acc) if s_w is not None and needs[1] else None
        grad_b = torch.zeros_like(s_b, dtype=acc) if s_b is not None and needs[2] else None
        if grad_div is not None:
            temperature = ctx.temperature
            for start in range(0, s_x.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                s = log_softmax(_scaled(s_x[rows], s_w, s_b, temperature))
                t = log_softmax(_scaled(t_x[rows], t_w, t_b, temperature)).to(s.dtype)
                _, _, g = _divergence(s, t, ctx.beta, with_grad=True)
                g = g.mul_((grad_div[rows] / temperature).unsqueeze(-1).to(g.dtype))  # dz_raw = dz / T
                if s_w is None:
                    if grad_x is not None:
                        grad_x[rows] = g.to(s_x.dtype)
                    continue
                g = g.to(s_w.dtype)
                if grad_x is not None:
                    grad_x[rows] = g @ s_w
                if grad_w is not None:
                    grad_w.add_(g.t().to(acc) @ s_x[rows].to(acc))
                if grad_b is not None:
                    grad_b.add_(g.sum(dim=0, dtype=acc))
        grad_w = grad_w.to(s_w.dtype) if grad_w is not None else None
        grad_b = grad_b.to(s_b.dtype) if grad_b is not None else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def token_divergence(
    student: HeadInputs,
    teacher: HeadInputs,
    beta: float,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The divergence of student and teacher at each position, and the student's entropy.

    Args:
        student: the student's side, [N, H] hidden states with its head (or [N, V] logits); the
            gradient flows to its hidden states and head.
        teacher: the teacher's side at the same N positions; no gradient flows to it.
        beta: 0 forward KL, 1 reverse KL, in between the generalised JSD (``DIVERGENCES``).
        temperature: both sides' logits are divided by it.
        chunk_size: positions projected onto the vocabulary at once.

    Returns:
        ``(divergence [N], entropy [N])`` in float32 (float64 for float64 inputs); the entropy
        carries no gradient.

    Raises:
        ValueError: the two vocabularies differ, the positions differ, or ``beta`` is outside
            [0, 1].
    """
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
        logps, _ = chunked.token_stats(side.hidden, side.weight, side.bias, targets, temperature, chunk_size)
        return logps
    many = targets if targets.dim() == 2 else targets.unsqueeze(-1)
    logps = log_softmax(_scaled(side.hidden, None, None, temperature)).gather(-1, many)
    return logps if targets.dim() == 2 else logps.squeeze(-1)


@torch.no_grad()
def top_ids(
    side: HeadInputs, k: int, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> torch.Tensor:
    """The ``k`` most likely token ids at each position of one side: [N, k], without gradient."""
    if side.weight is not None:
        dummy = torch.zeros(side.hidden.shape[0], dtype=torch.long, device=side.hidden.device)
        _, _, ids = chunked.token_topk(side.hidden, side.weight, side.bias, dummy, temperature, k, chunk_size)
        return ids
    return side.hidden.topk(k, dim=-1).indices
