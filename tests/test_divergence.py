"""The distillation engine (``ops/divergence.py``): each divergence against its formula worked by
hand, chunked against unchunked (values and gradients), and the float32 gradients that the
textbook formulas lose at high confidence, against float64.

Formulas (GKD, arXiv 2306.13649; the reference's conventions): with teacher ``T`` and student
``S``, forward KL ``KL(T || S) = sum T log(T / S)``, reverse KL ``KL(S || T)``, and the generalised
JSD ``beta KL(T || M) + (1 - beta) KL(S || M)``, ``M = beta T + (1 - beta) S``; ``beta = 0`` is
the forward KL and ``beta = 1`` the reverse KL.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.ops import divergence as divergence_module
from posttrain.ops.divergence import (
    HeadInputs,
    TokenDivergence,
    divergence_from_logps,
    divergence_name,
    log_softmax,
    token_divergence,
)

STUDENT = [0.7, 0.2, 0.1]
TEACHER = [0.5, 0.3, 0.2]


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))


def by_hand(beta: float) -> float:
    if beta == 0.0:
        return kl(TEACHER, STUDENT)
    if beta == 1.0:
        return kl(STUDENT, TEACHER)
    mix = [beta * t + (1 - beta) * s for s, t in zip(STUDENT, TEACHER, strict=True)]
    return beta * kl(TEACHER, mix) + (1 - beta) * kl(STUDENT, mix)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_each_divergence_equals_its_formula(beta) -> None:
    s = torch.tensor(STUDENT).log().unsqueeze(0)
    t = torch.tensor(TEACHER).log().unsqueeze(0)
    got = divergence_from_logps(s, t, beta).item()
    assert got == pytest.approx(by_hand(beta), rel=1e-5)


def test_hand_values_differ_between_the_divergences() -> None:
    """The table's rows are different functions (the hand values are not one number)."""
    values = [by_hand(b) for b in (0.0, 0.5, 1.0)]
    assert len({round(v, 6) for v in values}) == 3
    assert divergence_name(0.0) == "forward_kl"
    assert divergence_name(1.0) == "reverse_kl"
    assert divergence_name(0.3) == "jsd"


def test_the_mixture_rescaled_tends_to_the_two_kls() -> None:
    """Why the endpoints are special: JSD(beta) / beta -> KL(T || S) as beta -> 0, and
    JSD(beta) / (1 - beta) -> KL(S || T) as beta -> 1; the raw mixture formula tends to 0."""
    s = torch.tensor(STUDENT, dtype=torch.float64).log().unsqueeze(0)
    t = torch.tensor(TEACHER, dtype=torch.float64).log().unsqueeze(0)
    small = 1e-6
    assert (divergence_from_logps(s, t, small) / small).item() == pytest.approx(
        kl(TEACHER, STUDENT), rel=1e-4
    )
    near_one = 1 - 1e-6
    rescaled = divergence_from_logps(s, t, near_one) / (1 - near_one)
    assert rescaled.item() == pytest.approx(kl(STUDENT, TEACHER), rel=1e-4)


def _textbook(z_s: torch.Tensor, z_t: torch.Tensor, beta: float) -> torch.Tensor:
    """The textbook formulas with torch's log_softmax, differentiable by autograd."""
    s, t = torch.log_softmax(z_s, -1), torch.log_softmax(z_t, -1)
    if beta == 0.0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1.0:
        return (s.exp() * (s - t)).sum(-1)
    m = torch.logsumexp(torch.stack([s + math.log(1 - beta), t + math.log(beta)]), 0)
    return beta * (t.exp() * (t - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_unchunked_values_and_gradients(beta, temperature) -> None:
    """float64, so the comparison is exact to rounding: hidden states and head (with bias) against
    autograd of the textbook formula on full logits, for chunks of 5 and one chunk of all rows."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 23, 8, 40
    hs = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64)
    ht, wt = (
        torch.randn(n, h, generator=g, dtype=torch.float64),
        torch.randn(v, h, generator=g, dtype=torch.float64),
    )
    weights = torch.rand(n, generator=g, dtype=torch.float64)

    leaves = [x.clone().requires_grad_() for x in (hs, w, b)]
    want = _textbook((leaves[0] @ leaves[1].T + leaves[2]) / temperature, (ht @ wt.T) / temperature, beta)
    (want * weights).sum().backward()
    for chunk in (5, n):
        mine = [x.clone().requires_grad_() for x in (hs, w, b)]
        got, _ = token_divergence(HeadInputs(*mine), HeadInputs(ht, wt), beta, temperature, chunk)
        (got * weights).sum().backward()
        torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-12)
        for ours, theirs in zip(mine, leaves, strict=True):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-9, atol=1e-12)


def test_logits_sides_equal_hidden_sides() -> None:
    """A model whose logits are not lm_head(hidden) is given as logits: same values and gradient."""
    g = torch.Generator().manual_seed(1)
    hs, w = torch.randn(7, 6, generator=g), torch.randn(30, 6, generator=g)
    ht, wt = torch.randn(7, 6, generator=g), torch.randn(30, 6, generator=g)
    hidden = hs.clone().requires_grad_()
    by_hidden, _ = token_divergence(HeadInputs(hidden, w), HeadInputs(ht, wt), 0.5, chunk_size=3)
    by_hidden.sum().backward()
    logits = (hs @ w.T).requires_grad_()
    by_logits, _ = token_divergence(HeadInputs(logits), HeadInputs(ht @ wt.T), 0.5, chunk_size=3)
    by_logits.sum().backward()
    torch.testing.assert_close(by_hidden, by_logits, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(hidden.grad, logits.grad @ w, rtol=1e-5, atol=1e-7)


def test_entropy_is_the_students() -> None:
    z = torch.tensor([[2.0, 0.0, -1.0, 0.5]])
    _, entropy = token_divergence(HeadInputs(z), HeadInputs(torch.zeros(1, 4)), 1.0)
    p = torch.softmax(z, -1)
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-6)
    assert not entropy.requires_grad


def test_identical_distributions_give_zero_and_no_gradient() -> None:
    z = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    for beta in (0.0, 0.5, 1.0):
        student = z.clone().requires_grad_()
        div, _ = token_divergence(HeadInputs(student), HeadInputs(z.clone()), beta)
        div.sum().backward()
        assert div.abs().max().item() < 1e-6
        assert student.grad.abs().max().item() < 1e-7


# ---- high confidence: the small gradients survive in float32 ---------------------------------------


def _confident_logits(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher both put 1 - 1e-11 or so on token 0 (the margin 30 vs 30.5), the rest
    spread: every probability difference lives in the 1e-13..1e-11 range."""
    v = 64
    g = torch.Generator().manual_seed(3)
    rest_s = torch.randn(2, v - 1, generator=g, dtype=torch.float64) * 0.3
    rest_t = torch.randn(2, v - 1, generator=g, dtype=torch.float64) * 0.3
    z_s = torch.cat([torch.full((2, 1), 30.0, dtype=torch.float64), rest_s], 1)
    z_t = torch.cat([torch.full((2, 1), 30.5, dtype=torch.float64), rest_t], 1)
    return z_s.to(dtype), z_t.to(dtype)


def test_log_softmax_keeps_the_argmax_log_prob() -> None:
    z64, _ = _confident_logits(torch.float64)
    exact = torch.log_softmax(z64, -1)[:, 0]  # about -1e-11
    ours = log_softmax(z64.float())[:, 0].double()
    naive = torch.log_softmax(z64.float(), -1)[:, 0].double()
    assert exact.abs().min() > 1e-13
    torch.testing.assert_close(ours, exact, rtol=1e-4, atol=0)
    assert not torch.allclose(naive, exact, rtol=0.1, atol=0)  # the textbook float32 loses it


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_float32_gradient_survives_at_high_confidence(beta) -> None:
    z_s64, z_t64 = _confident_logits(torch.float64)
    exact = z_s64.clone().requires_grad_()
    _textbook(exact, z_t64, beta).sum().backward()

    z_s, z_t = _confident_logits(torch.float32)
    ours = z_s.clone().requires_grad_()
    div, _ = token_divergence(HeadInputs(ours), HeadInputs(z_t), beta)
    div.sum().backward()
    naive = z_s.clone().requires_grad_()
    _textbook(naive, z_t, beta).sum().backward()

    target = exact.grad[:, 0]  # the argmax's gradient: a tiny number that must not vanish
    assert target.abs().min() > 1e-13
    torch.testing.assert_close(ours.grad[:, 0].double(), target, rtol=2e-3, atol=0)
    torch.testing.assert_close(ours.grad.double(), exact.grad, rtol=2e-3, atol=1e-16)
    if beta in (0.0, 1.0):  # autograd of the textbook mixture happens to keep it; the KLs' do not
        assert not torch.allclose(naive.grad[:, 0].double(), target, rtol=0.5, atol=0)


def test_bad_inputs_are_named() -> None:
    a, b = HeadInputs(torch.zeros(2, 5)), HeadInputs(torch.zeros(2, 6))
    with pytest.raises(ValueError, match="5 logits and the teacher's 6"):
        token_divergence(a, b, 1.0)
    with pytest.raises(ValueError, match="beta must be in"):
        token_divergence(a, HeadInputs(torch.zeros(2, 5)), 1.5)
    with pytest.raises(ValueError, match="2 student positions against 3"):
        token_divergence(a, HeadInputs(torch.zeros(3, 5)), 1.0)


def test_the_full_logits_path_is_exact_at_high_confidence_too() -> None:
    """``selective_log_softmax`` and ``entropy_from_logits`` (the path of models the chunked head
    cannot serve) keep the argmax's log-prob and gradient, as the chunked path does."""
    from posttrain.ops.logprobs import entropy_from_logits, selective_log_softmax

    z64, _ = _confident_logits(torch.float64)
    z64 = z64.unsqueeze(0)  # [1, 2, V]
    targets = torch.tensor([[0, 5]])  # the argmax, and another token
    exact = z64.clone().requires_grad_()
    torch.log_softmax(exact, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    ours = z64.float().requires_grad_()
    logps = selective_log_softmax(ours, targets)
    logps.sum().backward()
    torch.testing.assert_close(
        logps.double(),
        torch.log_softmax(z64, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        rtol=1e-4,
        atol=0,
    )
    assert exact.grad[0, 0, 0] > 1e-13  # 1 - p of the argmax
    torch.testing.assert_close(ours.grad[0, 0, 0].double(), exact.grad[0, 0, 0], rtol=1e-3, atol=0)
    naive = z64.float().requires_grad_()
    torch.log_softmax(naive, -1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    assert naive.grad[0, 0, 0] == 0.0  # what the textbook float32 gives
    want = -(torch.softmax(z64, -1) * torch.log_softmax(z64, -1)).sum(-1)
    torch.testing.assert_close(entropy_from_logits(z64.float()).double(), want, rtol=1e-4, atol=0)


# ---- the gradient built in forward (fused) against the recompute in backward -----------------------


def _problem(seed: int, dtype: torch.dtype = torch.float32, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    n, h, v = 23, 8, 40
    hs = torch.randn(n, h, generator=g, dtype=dtype)
    w = torch.randn(v, h, generator=g, dtype=dtype)
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    ht, wt = torch.randn(n, h, generator=g, dtype=dtype), torch.randn(v, h, generator=g, dtype=dtype)
    return hs, w, b, ht, wt


def _recomputed(hs, w, b, ht, wt, beta, temperature, chunk, upstream):
    """Values and gradients with nothing built in forward: every gradient from backward's recompute."""
    leaves = [x.clone().requires_grad_() if x is not None else None for x in (hs, w, b)]
    div, _ = TokenDivergence.apply(*leaves, ht, wt, None, beta, temperature, chunk, None, False, (None, None))
    (div * upstream).sum().backward()
    return div.detach(), [x.grad if x is not None else None for x in leaves]


def _counting_passes(monkeypatch) -> list[int]:
    """Count the chunked passes over the vocabulary (forward's and any backward recompute)."""
    calls: list[int] = []
    original = divergence_module._gradient_pass

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(divergence_module, "_gradient_pass", counted)
    return calls


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_gradient_equals_the_recompute_for_a_token_mean(beta, temperature, monkeypatch) -> None:
    """A token sum times a constant (the trainers' reduction): one pass over the vocabulary, and the
    values and gradients of the recompute path."""
    hs, w, b, ht, wt = _problem(4)
    want, want_grads = _recomputed(hs, w, b, ht, wt, beta, temperature, 5, torch.full((23,), 1 / 7))
    calls = _counting_passes(monkeypatch)
    mine = [x.clone().requires_grad_() for x in (hs, w, b)]
    got, _ = token_divergence(HeadInputs(*mine), HeadInputs(ht, wt), beta, temperature, 5)
    (got.sum() / 7).backward()
    assert len(calls) == 1  # no recompute in backward
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(mine, want_grads, strict=True):
        torch.testing.assert_close(ours.grad, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_non_uniform_upstream_gradient_falls_back_to_the_recompute(beta, monkeypatch) -> None:
    """Per-position weights applied after the divergence (not announced): the head's gradient is
    recomputed (a second pass), and every gradient equals the recompute path's."""
    hs, w, b, ht, wt = _problem(5)
    upstream = torch.rand(23, generator=torch.Generator().manual_seed(6)) + 0.1
    want, want_grads = _recomputed(hs, w, b, ht, wt, beta, 1.0, 5, upstream)
    calls = _counting_passes(monkeypatch)
    mine = [x.clone().requires_grad_() for x in (hs, w, b)]
    got, _ = token_divergence(HeadInputs(*mine), HeadInputs(ht, wt), beta, chunk_size=5)
    (got * upstream).sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-7)
    for ours, theirs in zip(mine, want_grads, strict=True):
        torch.testing.assert_close(ours.grad, theirs, rtol=1e-5, atol=1e-7)


def test_announced_loss_weights_keep_the_single_pass(monkeypatch) -> None:
    """Weights given as ``loss_weights`` (up to a factor) and then applied: one pass, the same
    gradients; a per-sample mean's weights rounded differently still count as proportional."""
    hs, w, b, ht, wt = _problem(7)
    lengths = torch.tensor([5.0] * 5 + [11.0] * 11 + [7.0] * 7)  # three samples' token means
    upstream = (1.0 / lengths) / 3.0
    want, want_grads = _recomputed(hs, w, b, ht, wt, 0.5, 1.0, 4, upstream)
    calls = _counting_passes(monkeypatch)
    mine = [x.clone().requires_grad_() for x in (hs, w, b)]
    got, _ = token_divergence(
        HeadInputs(*mine), HeadInputs(ht, wt), 0.5, chunk_size=4, loss_weights=1.0 / lengths
    )
    (got * upstream).sum().backward()
    assert len(calls) == 1
    for ours, theirs in zip(mine, want_grads, strict=True):
        torch.testing.assert_close(ours.grad, theirs, rtol=1e-5, atol=1e-7)
    # announced weights that the loss then does not use: still exact, through the recompute
    calls.clear()
    again = [x.clone().requires_grad_() for x in (hs, w, b)]
    div, _ = token_divergence(
        HeadInputs(*again), HeadInputs(ht, wt), 0.5, chunk_size=4, loss_weights=1.0 / lengths
    )
    (div * upstream.flip(0)).sum().backward()
    assert len(calls) == 2
    _, flipped = _recomputed(hs, w, b, ht, wt, 0.5, 1.0, 4, upstream.flip(0))
    for ours, theirs in zip(again, flipped, strict=True):
        torch.testing.assert_close(ours.grad, theirs, rtol=1e-5, atol=1e-7)


def test_tied_head_gradient_adds_the_embedding_path() -> None:
    """The head weight is also the embedding table: its gradient is the sum of both uses, fused or not,
    against autograd of the textbook formula in float64."""
    g = torch.Generator().manual_seed(8)
    v, h, n = 40, 8, 23
    table = torch.randn(v, h, generator=g, dtype=torch.float64)
    ids = torch.randint(0, v, (n,), generator=g)
    mix = torch.randn(h, h, generator=g, dtype=torch.float64)
    ht, wt = (
        torch.randn(n, h, generator=g, dtype=torch.float64),
        torch.randn(v, h, generator=g, dtype=torch.float64),
    )

    def student(weight):
        return torch.tanh(weight[ids] @ mix)  # the embedding, then a layer

    exact = table.clone().requires_grad_()
    (_textbook(student(exact) @ exact.T, ht @ wt.T, 0.5).sum() / n).backward()
    for uniform in (True, False):
        tied = table.clone().requires_grad_()
        div, _ = token_divergence(HeadInputs(student(tied), tied), HeadInputs(ht, wt), 0.5, chunk_size=6)
        upstream = (
            torch.full((n,), 1.0 / n, dtype=torch.float64) if uniform else torch.linspace(0.5, 1.5, n) / n
        )
        (div * upstream).sum().backward()
        if uniform:
            torch.testing.assert_close(tied.grad, exact.grad, rtol=1e-9, atol=1e-12)
        else:
            check = table.clone().requires_grad_()
            (_textbook(student(check) @ check.T, ht @ wt.T, 0.5) * upstream).sum().backward()
            torch.testing.assert_close(tied.grad, check.grad, rtol=1e-9, atol=1e-12)


def test_frozen_head_and_logits_sides_take_any_upstream_in_one_pass(monkeypatch) -> None:
    """Only the hidden states (a frozen head, LoRA-style) or the logits need a gradient: each row's is
    exact under any weighting, so no recompute."""
    hs, w, _, ht, wt = _problem(9, bias=False)
    upstream = torch.rand(23, generator=torch.Generator().manual_seed(10))
    _, (want_x, _, _) = _recomputed(hs, w.requires_grad_(False), None, ht, wt, 0.5, 1.0, 5, upstream)
    calls = _counting_passes(monkeypatch)
    hidden = hs.clone().requires_grad_()
    div, _ = token_divergence(HeadInputs(hidden, w), HeadInputs(ht, wt), 0.5, chunk_size=5)
    (div * upstream).sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(hidden.grad, want_x, rtol=1e-5, atol=1e-7)
    logits = (hs @ w.T).requires_grad_()
    div, _ = token_divergence(HeadInputs(logits), HeadInputs(ht @ wt.T), 0.5, chunk_size=5)
    (div * upstream).sum().backward()
    assert len(calls) == 2
    torch.testing.assert_close(logits.grad @ w, want_x, rtol=1e-5, atol=1e-6)


def test_a_retained_graph_differentiates_twice() -> None:
    """The gradient built in forward is used once; a second backward recomputes and adds the same."""
    hs, w, b, ht, wt = _problem(11)
    mine = [x.clone().requires_grad_() for x in (hs, w, b)]
    div, _ = token_divergence(HeadInputs(*mine), HeadInputs(ht, wt), 0.5, chunk_size=5)
    loss = div.mean()
    loss.backward(retain_graph=True)
    once = [x.grad.clone() for x in mine]
    loss.backward()
    for x, first in zip(mine, once, strict=True):
        torch.testing.assert_close(x.grad, 2 * first, rtol=1e-6, atol=1e-7)


def test_no_gradient_recording_builds_no_gradient(monkeypatch) -> None:
    """Under ``torch.no_grad`` (evaluation) forward computes the values only."""
    hs, w, b, ht, wt = _problem(12)
    built: list[tuple[bool, ...]] = []
    original = divergence_module._gradient_pass

    def spy(*args, **kwargs):
        built.append(tuple(args[10]))
        return original(*args, **kwargs)

    monkeypatch.setattr(divergence_module, "_gradient_pass", spy)
    with torch.no_grad():
        token_divergence(HeadInputs(hs.requires_grad_(), w.requires_grad_(), b), HeadInputs(ht, wt), 0.5)
    assert built == [(False, False, False)]


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_float32_wide_logit_ranges_match_float64(beta) -> None:
    """Log-prob gaps beyond 80 between student and teacher (where ``expm1`` would overflow without
    its cap) and both signs of the gap: float32 values and gradients against the float64 textbook
    on the same (float32-representable) logits. Log-probs near -100 carry float32's absolute
    rounding of about 1e-5, hence the absolute tolerances (the reverse KL's ``s - t - KL`` of
    such magnitudes sets them)."""
    g = torch.Generator().manual_seed(13)
    z_s = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 30).float().double()
    z_t = (torch.randn(6, 50, generator=g, dtype=torch.float64) * 30).float().double()
    exact = z_s.clone().requires_grad_()
    want = _textbook(exact, z_t, beta)
    want.sum().backward()
    gaps = torch.log_softmax(z_t, -1) - torch.log_softmax(z_s, -1)
    assert gaps.max() > 100 and gaps.min() < -100
    ours = z_s.float().requires_grad_()
    got, _ = token_divergence(HeadInputs(ours), HeadInputs(z_t.float()), beta)
    got.sum().backward()
    assert torch.isfinite(ours.grad).all()
    torch.testing.assert_close(got.double(), want.detach(), rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours.grad.double(), exact.grad, rtol=1e-4, atol=2e-5 if beta == 1.0 else 2e-7)


def test_loss_weights_of_the_wrong_shape_are_named() -> None:
    a = HeadInputs(torch.zeros(3, 5, requires_grad=True))
    with pytest.raises(ValueError, match=r"loss_weights has shape \(2,\); it needs one weight per position"):
        token_divergence(a, HeadInputs(torch.zeros(3, 5)), 0.5, loss_weights=torch.ones(2))


# ---- bf16 products and scratch buffers ----------------------------------------------------------


def _heads(seed: int = 3, n: int = 37, h: int = 16, v: int = 300) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) * scale for shape, scale in [((n, h), 1), ((v, h), 0.5)] * 2]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("uniform", [True, False])
def test_bf16_products_are_the_bf16_linear_layers_logits(beta, uniform) -> None:
    """``product_dtype=bf16``: each side's logits are what a bf16 ``linear`` gives (bf16-rounded
    hidden states, weight and output; float32 statistics after it), and the student's gradient is
    within bf16's rounding of autograd's through that layer, on the fused pass (a token sum) and on
    backward's recompute (any other upstream gradient)."""
    hs, ws, ht, wt = _heads()
    coef = torch.ones(hs.shape[0]) if uniform else torch.linspace(0.2, 1.8, hs.shape[0])

    def run(dtype):
        xs, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        if dtype is None:  # the reference: autograd through a bf16 linear layer's logits
            bf16 = [
                torch.nn.functional.linear(x.bfloat16(), m.bfloat16()).float() for x, m in [(xs, w), (ht, wt)]
            ]
            student, teacher = HeadInputs(bf16[0]), HeadInputs(bf16[1])
        else:
            student, teacher = HeadInputs(xs, w, None, dtype), HeadInputs(ht, wt, None, dtype)
        div, entropy = token_divergence(student, teacher, beta, 0.7, chunk_size=16)
        return div, entropy, torch.autograd.grad((div * coef).sum(), (xs, w))

    div, entropy, grads = run(torch.bfloat16)
    want_div, want_entropy, want_grads = run(None)
    torch.testing.assert_close(div, want_div, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, want_grads, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
    fp32, _ = token_divergence(HeadInputs(hs, ws), HeadInputs(ht, wt), beta, 0.7, chunk_size=16)
    assert (div - fp32).abs().max().item() > 1e-4  # the products did run in bf16


def test_each_side_keeps_its_own_product_dtype() -> None:
    """A bf16 student against a float32 teacher: only the student's products are rounded."""
    hs, ws, ht, wt = _heads(seed=5)
    mixed, _ = token_divergence(
        HeadInputs(hs, ws, None, torch.bfloat16), HeadInputs(ht, wt), 0.5, chunk_size=8
    )
    bf16_logits = torch.nn.functional.linear(hs.bfloat16(), ws.bfloat16()).float()
    want, _ = token_divergence(HeadInputs(bf16_logits), HeadInputs(ht, wt), 0.5, chunk_size=8)
    torch.testing.assert_close(mixed, want, rtol=1e-5, atol=1e-6)


def test_the_engine_reuses_its_scratch_buffers_and_leaves_no_stale_values() -> None:
    """A second call of the same shape allocates no new buffer, and a call after a call on other
    inputs gives the first call's values bit for bit (no chunk reads another's leftovers)."""
    from posttrain.ops import workspace

    workspace.release()
    first, other = _heads(seed=7), _heads(seed=8)

    def run(heads, dtype):
        xs, w, xt, wtt = heads
        xs, w = xs.clone().requires_grad_(), w.clone().requires_grad_()
        div, _ = token_divergence(
            HeadInputs(xs, w, None, dtype), HeadInputs(xt, wtt, None, dtype), 0.3, chunk_size=16
        )
        return (div, *torch.autograd.grad(div.sum(), (xs, w)))

    try:
        for dtype in (None, torch.bfloat16):
            a = run(first, dtype)
            held = workspace.held_bytes()
            assert held > 0
            run(other, dtype)
            again = run(first, dtype)
            assert workspace.held_bytes() == held
            for x, y in zip(a, again, strict=True):
                assert torch.equal(x, y)
    finally:
        workspace.release()
