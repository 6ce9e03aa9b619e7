"""Chunked log-probs at high confidence (ops/chunked.py): float32 results against a float64 reference.

With one logit 25 above the rest of a ~1000-token vocabulary, ``p_argmax = 1 - S`` with
``S ~ 1e-8``, below float32's epsilon: the naive ``z_y - logsumexp(z)`` gives the argmax's
log-prob as 0 and ``onehot - exp(log p)`` its gradient as 0 ("softmax collapse"). The chunked
kernel's normalisation leaves the argmax out of ``S`` and must match float64 ``log_softmax`` to a
relative 1e-3 in the log-probs, the entropy and every gradient. Each test also shows that the
naive float32 formula misses there, so the comparison means something.

The logits are set exactly: ``hidden`` is the identity (one row per token position, ``H = N``)
and ``weight`` is the designed ``[N, V]`` raw-logit matrix transposed, so ``hidden @ weight^T``
is that matrix, and the gradient wrt ``weight`` is the gradient wrt the raw logits itself.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.ops import chunked, topk

N, V = 6, 1000  # token rows, vocabulary
GAP = 25.0  # the argmax's lead over the rest: S ~ V * exp(-25) ~ 1e-8
TEMPERATURE = 0.7
ENTROPY_COEF = 0.3
REL = 1e-3


def designed_logits(seed: int = 0) -> torch.Tensor:
    """[N, V] float64 logits ``z`` (after the temperature): small noise, one entry GAP above it per row."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, V, generator=g, dtype=torch.float64) * 0.5
    top = torch.randint(0, V, (N,), generator=g)
    z[torch.arange(N), top] = z.max(dim=1).values + GAP
    return z


def kernel_inputs(z: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [N, N], weight [V, N])`` with ``hidden @ weight^T / TEMPERATURE == z``; leaves."""
    hidden = torch.eye(N, dtype=dtype).requires_grad_()
    weight = (z * TEMPERATURE).T.contiguous().to(dtype).requires_grad_()
    return hidden, weight


def targets_for(z: torch.Tensor, many: bool) -> torch.Tensor:
    """[N] or [N, 3] targets: the argmax in even rows, other tokens (and the argmax) in odd rows."""
    top = z.argmax(dim=1)
    other = (top + 1 + torch.arange(N)) % V
    single = torch.where(torch.arange(N) % 2 == 0, top, other)
    if not many:
        return single
    # even rows: the argmax three times (the collapse needs every target of a row on it);
    # odd rows: another token, the argmax and a third token
    third = torch.where(torch.arange(N) % 2 == 0, top, (top + 7) % V)
    return torch.stack([single, top, third], dim=1)


def target_weights(targets: torch.Tensor) -> torch.Tensor:
    """Per-target loss weights of mixed signs (no row sums to 0)."""
    return torch.linspace(-1.0, 2.0, targets.numel(), dtype=torch.float64).view(targets.shape) + 0.05


def loss_of(logps, entropy, targets) -> torch.Tensor:
    loss = (logps * target_weights(targets).to(logps.dtype)).sum()
    return loss + ENTROPY_COEF * entropy.sum() if entropy is not None else loss


def chunked_run(z, targets, dtype, chunk_size, with_entropy):
    """logps, entropy and the gradients wrt hidden and weight of ``chunked.token_stats``."""
    hidden, weight = kernel_inputs(z, dtype)
    logps, entropy = chunked.token_stats(
        hidden,
        weight,
        None,
        targets,
        TEMPERATURE,
        chunk_size,
        with_entropy=with_entropy,
        entropy_grad=with_entropy,
    )
    loss_of(logps, entropy, targets).backward()
    return {"logps": logps, "entropy": entropy, "hidden": hidden.grad, "weight": weight.grad}


def reference_run(z, targets, dtype=torch.float64, with_entropy=False, naive_lse=False):
    """The same quantities from full ``log_softmax`` logits (float64: the reference; float32: naive).

    ``naive_lse`` takes ``z_y - logsumexp(z)`` (the kernel's former formula) instead.
    """
    hidden, weight = kernel_inputs(z, dtype)
    logits = hidden @ weight.T / TEMPERATURE  # [N, V]
    logp = logits - torch.logsumexp(logits, -1, keepdim=True) if naive_lse else logits.log_softmax(-1)
    cols = targets if targets.dim() == 2 else targets.unsqueeze(1)
    logps = logp.gather(1, cols).view(targets.shape)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    loss_of(logps, entropy, targets).backward()
    return {"logps": logps, "entropy": entropy, "hidden": hidden.grad, "weight": weight.grad}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest elementwise relative error (the reference has no zero entries here)."""
    return float(((got.detach().double() - want.detach()) / want.detach()).abs().max())


def row_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error of a row relative to that row's largest entry (for sums with cancellation)."""
    err = (got.detach().double() - want.detach()).abs().amax(dim=-1)
    return float((err / want.detach().abs().amax(dim=-1)).max())


def test_the_logits_collapse_in_naive_float32():
    """The premise: p_argmax is within float32's epsilon of 1, and float64 still resolves it."""
    z = designed_logits()
    rest = z.softmax(-1).topk(2, dim=-1).values[:, 1:].sum(-1)  # a lower bound on 1 - p_argmax
    one_minus_p = -torch.expm1(z.log_softmax(-1).max(dim=-1).values)
    assert (one_minus_p < torch.finfo(torch.float32).eps / 2).all() and (rest > 0).all()
    z32 = z.float()
    assert (z32.log_softmax(-1).max(dim=-1).values == 0).all()  # log p_argmax rounds to 0
    assert (z32.max(-1).values - torch.logsumexp(z32, -1)).abs().max() < 1e-6  # ~0 too, not ~ -1e-8


@pytest.mark.parametrize("many", [False, True], ids=["one-target", "three-targets"])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["logps", "logps+entropy"])
def test_float32_matches_float64_where_naive_float32_fails(many, with_entropy):
    z = designed_logits()
    targets = targets_for(z, many)
    want = reference_run(z, targets, with_entropy=with_entropy)
    got = chunked_run(z, targets, torch.float32, 4, with_entropy)
    naive = reference_run(z, targets, torch.float32, with_entropy=with_entropy)
    former = reference_run(z, targets, torch.float32, with_entropy=with_entropy, naive_lse=True)
    top = z.argmax(dim=1)
    at_top = targets == (top.unsqueeze(1) if many else top)  # [N] or [N, M]

    # log-probs: relative 1e-3 everywhere, the argmax's ~ -1e-8 included; naive float32 says 0
    assert rel_err(got["logps"], want["logps"]) < REL
    assert (naive["logps"][at_top] == 0).all() and (want["logps"][at_top] < -1e-9).all()
    assert rel_err(former["logps"][at_top], want["logps"][at_top]) > 0.5
    # the gradient wrt the raw logits (= weight's, transposed): every entry, the argmax's ~1e-8 too
    assert rel_err(got["weight"], want["weight"]) < REL
    argmax_grad = naive["weight"].T[torch.arange(N), top]  # [N]
    assert rel_err(argmax_grad, want["weight"].T[torch.arange(N), top]) > 0.5
    # the gradient wrt hidden sums each row of it: judged per row
    assert row_err(got["hidden"], want["hidden"]) < REL
    assert row_err(naive["hidden"], want["hidden"]) > 0.1
    if with_entropy:
        assert rel_err(got["entropy"], want["entropy"]) < REL
        assert rel_err(naive["entropy"], want["entropy"]) > 0.01  # loses p_a log p_a ~ -S


def test_target_argmax_row_sums_to_zero():
    """d log p_a / dz = onehot(a) - p sums to zero; naive float32 leaves only the -p_j (the 1 - p_a is 0)."""
    z = designed_logits()
    top = z.argmax(dim=1)
    runs = {
        "kernel": chunked_run(z, top, torch.float32, 4, False),
        "naive": reference_run(z, top, torch.float32),
    }
    sums = {}
    for name, got in runs.items():
        grad_z = got["weight"].T.double()  # [N, V]
        sums[name] = grad_z.sum(dim=-1).abs() / grad_z.abs().amax(dim=-1)  # relative to the row's largest
    assert (sums["kernel"] < 1e-3).all()
    assert (sums["naive"] > 0.5).all()


@pytest.mark.parametrize("many", [False, True], ids=["one-target", "three-targets"])
def test_chunked_equals_unchunked(many):
    z = designed_logits(seed=1)
    targets = targets_for(z, many)
    whole = chunked_run(z, targets, torch.float32, chunk_size=N, with_entropy=True)
    for chunk_size in (1, 4):
        parts = chunked_run(z, targets, torch.float32, chunk_size=chunk_size, with_entropy=True)
        for name in whole:
            # relative per element, and an absolute floor at float32 rounding of the tensor's largest
            # entry: an entry 1e-11 of it moved by 3e-16 under AVX2 kernels (another summation order)
            floor = 1e-7 * whole[name].abs().max().item()
            torch.testing.assert_close(parts[name], whole[name], rtol=1e-5, atol=floor)


def test_float64_head_stays_float64_and_exact():
    z = designed_logits()
    targets = targets_for(z, many=True)
    got = chunked_run(z, targets, torch.float64, chunk_size=4, with_entropy=True)
    want = reference_run(z, targets, with_entropy=True)
    assert got["logps"].dtype == got["entropy"].dtype == got["weight"].dtype == torch.float64
    for name in ("logps", "entropy", "weight"):
        assert rel_err(got[name], want[name]) < 1e-6


def test_top_logprob_and_token_topk():
    z = designed_logits()
    targets = targets_for(z, many=False)
    want = z.log_softmax(-1)  # [N, V] float64
    hidden, weight = kernel_inputs(z, torch.float32)
    with torch.no_grad():
        logps, _, top = chunked.token_stats(hidden, weight, None, targets, TEMPERATURE, 4, with_top=True)
        topk_logps, top_logps, top_ids = topk.token_topk(hidden, weight, None, targets, TEMPERATURE, 3, 4)
    assert rel_err(top, want.max(dim=-1).values) < REL
    is_top = targets == z.argmax(dim=1)
    assert torch.equal(top == logps, is_top)  # the mean_token_accuracy test stays exact
    assert rel_err(topk_logps, want.gather(1, targets.unsqueeze(1)).squeeze(1)) < REL
    assert torch.equal(top_ids, want.topk(3, dim=-1).indices)
    assert rel_err(top_logps, want.topk(3, dim=-1).values) < REL
    assert torch.equal(top_logps[:, 0], top)
