"""KL, entropy, off-policy masking, sampler importance weights and TR-DPO sync, by hand.

Each golden test compares the tensor code with a plain-Python transcription of the paper's
formula (loops and ``math.exp``), written here independently of the implementation.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from posttrain.grpo import regularizers as reg

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

# Two groups of two completions, three tokens; the last token of completions 1 and 3 is padding.
LOGPS = [[-0.5, -1.2, -0.1], [-2.0, -0.3, -9.0], [-0.7, -0.7, -1.5], [-1.1, -0.2, -9.0]]
REF = [[-0.6, -0.9, -0.4], [-1.5, -0.3, 0.0], [-1.0, -0.5, -1.5], [-0.8, -0.6, 0.0]]
OLD = [[-0.4, -1.0, -0.3], [-2.2, -0.5, 0.0], [-0.7, -0.9, -1.0], [-1.0, -0.1, 0.0]]
MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]]


def t(values, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=requires_grad)


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7, equal_nan=True)


def k3_by_hand(logp: float, ref: float) -> float:
    """DeepSeekMath eq. 4: pi_ref/pi_theta - log(pi_ref/pi_theta) - 1."""
    return math.exp(ref - logp) - (ref - logp) - 1.0


# ------------------------------------------------------------------------------------------
# KL
# ------------------------------------------------------------------------------------------


def test_kl_k3_by_hand():
    """k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 for every token."""
    expected = [
        [k3_by_hand(lp, rf) for lp, rf in zip(row_l, row_r, strict=True)]
        for row_l, row_r in zip(LOGPS, REF, strict=True)
    ]
    close(reg.kl_k3(t(LOGPS), t(REF)), expected)


def test_kl_of_identical_policies_is_zero():
    logps = t(LOGPS)
    close(reg.kl_k3(logps, logps.clone()), torch.zeros(4, 3))
    close(reg.bias_corrected_kl(logps, t(OLD), logps.clone()), torch.zeros(4, 3))


def test_bias_corrected_kl_by_hand():
    """DeepSeek-V3.2 eq. 7: D_t = (pi_theta/pi_old) * k3_t = exp(logp_t - old_t) * k3_t."""
    expected = [
        [math.exp(lp - od) * k3_by_hand(lp, rf) for lp, od, rf in zip(rl, ro, rr, strict=True)]
        for rl, ro, rr in zip(LOGPS, OLD, REF, strict=True)
    ]
    close(reg.bias_corrected_kl(t(LOGPS), t(OLD), t(REF)), expected)


def test_bias_corrected_kl_gradient_on_policy_is_reverse_kl_gradient():
    """At ratio 1 (old = logp.detach()) the value equals k3's but the gradient does not.

    d/dlogp [exp(lp - old) * k3] = r k3 + r (1 - exp(ref - lp)); at r = 1 with
    k3 = exp(d) - d - 1, d = ref - lp, this is -d = lp - ref. Plain k3: 1 - exp(ref - lp).
    """
    logps = t(LOGPS, requires_grad=True)
    corrected = reg.bias_corrected_kl(logps, logps.detach(), t(REF))
    close(corrected.detach(), reg.kl_k3(t(LOGPS), t(REF)))
    (grad_corrected,) = torch.autograd.grad(corrected.sum(), logps)
    (grad_plain,) = torch.autograd.grad(reg.kl_k3(logps, t(REF)).sum(), logps)
    close(
        grad_corrected,
        [[lp - rf for lp, rf in zip(rl, rr, strict=True)] for rl, rr in zip(LOGPS, REF, strict=True)],
    )
    close(
        grad_plain,
        [
            [1 - math.exp(rf - lp) for lp, rf in zip(rl, rr, strict=True)]
            for rl, rr in zip(LOGPS, REF, strict=True)
        ],
    )
    assert not torch.allclose(grad_corrected, grad_plain)


def test_bias_corrected_kl_gradient_off_policy_follows_product_rule():
    """With old != logp: grad = r k3 + r (1 - exp(ref - lp)), r = exp(lp - old)."""
    logps = t(LOGPS, requires_grad=True)
    (grad,) = torch.autograd.grad(reg.bias_corrected_kl(logps, t(OLD), t(REF)).sum(), logps)
    expected = [
        [
            math.exp(lp - od) * k3_by_hand(lp, rf) + math.exp(lp - od) * (1 - math.exp(rf - lp))
            for lp, od, rf in zip(rl, ro, rr, strict=True)
        ]
        for rl, ro, rr in zip(LOGPS, OLD, REF, strict=True)
    ]
    close(grad, expected)


def test_bias_corrected_kl_sequence_ratio_hook():
    """A sequence ratio s_i = exp(mean_t (lp - old)) (GSPO, over valid tokens) weighs each k3_it."""
    logps, old, mask = t(LOGPS, requires_grad=True), t(OLD), t(MASK)
    seq_ratio = torch.exp(((logps - old) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True))
    out = reg.bias_corrected_kl(logps, old, t(REF), ratio=seq_ratio)
    expected = []
    for rl, ro, rr, rm in zip(LOGPS, OLD, REF, MASK, strict=True):
        s = math.exp(sum((lp - od) * m for lp, od, m in zip(rl, ro, rm, strict=True)) / sum(rm))
        expected.append([s * k3_by_hand(lp, rf) for lp, rf in zip(rl, rr, strict=True)])
    close(out, expected)
    out.sum().backward()  # the sequence weight carries gradient to every token of its sequence
    assert logps.grad is not None and torch.all(logps.grad[:, 0] != 0)


# ------------------------------------------------------------------------------------------
# Entropy
# ------------------------------------------------------------------------------------------

ENTROPY = [[0.5, 2.0, 1.0], [3.0, 0.1, 50.0], [0.2, 0.2, 4.0], [1.5, 0.7, 50.0]]  # 50: padding


def test_entropy_bonus_by_hand_leaves_padding_out():
    """H = sum(H_t m_t) / sum(m_t) = (3.5 + 3.1 + 4.4 + 2.2) / 10 = 1.32."""
    total, count = 0.0, 0
    for row_h, row_m in zip(ENTROPY, MASK, strict=True):
        for h, m in zip(row_h, row_m, strict=True):
            total, count = total + h * m, count + m
    close(reg.entropy_bonus(t(ENTROPY), t(MASK)), total / count)
    close(reg.entropy_bonus(t(ENTROPY), t(MASK)), 1.32)


def test_entropy_bonus_gradient_flows_through_entropy():
    """dH / dH_t = m_t / sum(m) = 0.1 on valid tokens, 0 on padding."""
    entropy = t(ENTROPY, requires_grad=True)
    reg.entropy_bonus(entropy, torch.tensor(MASK, dtype=torch.bool)).backward()
    close(entropy.grad, [[m / 10 for m in row] for row in MASK])


def test_entropy_bonus_without_tokens_is_zero():
    close(reg.entropy_bonus(t(ENTROPY), torch.zeros(4, 3)), 0.0)


def quantile_by_hand(values: list[float], q: float) -> float:
    """Linear-interpolation quantile: position q (n - 1) in the sorted values."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 0.75, 1.0])
def test_high_entropy_mask_by_hand(rho):
    """Keep valid t with H_t >= tau, tau the (1 - rho) quantile of the 10 valid entropies."""
    valid_values = [h for rh, rm in zip(ENTROPY, MASK, strict=True) for h, m in zip(rh, rm, strict=True) if m]
    tau = quantile_by_hand(valid_values, 1 - rho)
    expected = [
        [bool(m) and h >= tau for h, m in zip(rh, rm, strict=True)]
        for rh, rm in zip(ENTROPY, MASK, strict=True)
    ]
    out = reg.high_entropy_mask(t(ENTROPY), t(MASK), rho)
    assert out.dtype == torch.bool
    assert out.tolist() == expected


def test_high_entropy_mask_limits():
    """rho = 1 keeps every valid token; rho = 0 keeps only the maximum (4.0); padding never."""
    mask = t(MASK)
    assert torch.equal(reg.high_entropy_mask(t(ENTROPY), mask, 1.0), mask.bool())
    only_max = reg.high_entropy_mask(t(ENTROPY), mask, 0.0)
    assert only_max.nonzero().tolist() == [[2, 2]]


def test_high_entropy_mask_keeps_ties_and_uses_population():
    """Ties at the threshold are kept; a given population sets the threshold instead."""
    entropy = t([[1.0, 1.0, 1.0, 2.0]])
    mask = torch.ones(1, 4)
    assert reg.high_entropy_mask(entropy, mask, 0.5).tolist() == [[True, True, True, True]]
    population = t([0.0, 5.0, 10.0])  # median 5: nobody here reaches it
    assert not reg.high_entropy_mask(entropy, mask, 0.5, population=population).any()


def test_quantile_beyond_torch_size_limit(monkeypatch):
    """The sort-based fallback interpolates as torch.quantile does."""
    values = torch.rand(101, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = [torch.quantile(values, q) for q in (0.0, 0.13, 0.8, 1.0)]
    monkeypatch.setattr(reg, "_QUANTILE_MAX_ELEMENTS", 10)
    for q, want in zip((0.0, 0.13, 0.8, 1.0), expected, strict=True):
        close(reg._quantile(values, q), want)


def test_high_entropy_mask_edge_cases():
    assert not reg.high_entropy_mask(t(ENTROPY), torch.zeros(4, 3), 0.2).any()
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        reg.high_entropy_mask(t(ENTROPY), t(MASK), 1.5)


@pytest.mark.parametrize(
    ("coef", "entropy", "expected"),
    [
        (0.01, 0.1, 0.015),  # below target: + delta
        (0.01, 0.2, 0.015),  # at target: + delta ("falls to or below")
        (0.01, 0.3, 0.005),  # above target: - delta
        (0.098, 0.1, 0.1),  # clamped at coef_max
        (0.003, 0.9, 0.001),  # clamped at coef_min
    ],
)
def test_next_entropy_coef(coef, entropy, expected):
    """Skywork-OR1 Sec. 3.3: c' = clip(c + delta if e <= target else c - delta, min, max)."""
    got = reg.next_entropy_coef(coef, entropy, target=0.2, delta=0.005, coef_min=0.001, coef_max=0.1)
    assert isinstance(got, float)
    assert math.isclose(got, expected, rel_tol=1e-9)


def test_applied_entropy_coef():
    """alpha = c * 1[e <= target]."""
    assert reg.applied_entropy_coef(0.05, 0.1, 0.2) == 0.05
    assert reg.applied_entropy_coef(0.05, 0.2, 0.2) == 0.05
    assert reg.applied_entropy_coef(0.05, 0.21, 0.2) == 0.0


# ------------------------------------------------------------------------------------------
# Off-policy sequence masking
# ------------------------------------------------------------------------------------------


def test_off_policy_sequence_mask_by_hand():
    """DeepSeek-V3.2 eq. 9: drop i iff A_i < 0 and mean_t(old_t - logp_t) over valid t > delta."""
    old = [[0.0, 0.0, 0.0], [0.0, 0.0, 30.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    cur = [[-1.0, -1.0, -1.0], [-0.4, -0.4, 0.0], [-2.0, -2.0, -2.0], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]]
    mask = [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    adv = [-1.0, -1.0, 1.0, -0.3, 0.0]
    delta = 0.5
    expected = []
    for ro, rc, rm, a in zip(old, cur, mask, adv, strict=True):
        div = sum((o - c) * m for o, c, m in zip(ro, rc, rm, strict=True)) / max(sum(rm), 1)
        expected.append(not (a < 0 and div > delta))
    assert expected == [False, True, True, True, True]  # padding's 30 nats are ignored in row 1
    out = reg.off_policy_sequence_mask(t(old), t(cur, requires_grad=True), t(adv), t(mask), delta)
    assert out.dtype == torch.bool and out.tolist() == expected


def test_off_policy_sequence_mask_boundary_is_strict():
    """A divergence exactly equal to delta is kept (the paper's '>')."""
    out = reg.off_policy_sequence_mask(t([[0.0, 0.0]]), t([[-0.5, -0.5]]), t([-1.0]), t([[1, 1]]), 0.5)
    assert out.tolist() == [True]


# ------------------------------------------------------------------------------------------
# Sampler / trainer importance weights
# ------------------------------------------------------------------------------------------

# Per-token ratios pi_train / pi_sampler; the last token of row 1 is padding (ratio 100 there).
RATIOS = [[0.2, 1.0, 2.5, 4.0], [0.5, 3.0, 1.2, 100.0], [1.0, 1.0, 1.0, 1.0]]
IS_MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
# (1.0, 1.0): ratios exactly 1 (log-ratio 0) sit on both inclusive bounds and survive MIS.
BOUNDS = [(None, 3.0), (0.5, 3.0), (0.5, None), (None, None), (0.9, 1.1), (1.0, 1.0)]


def constrain_by_hand(w: float, mode: str, lo, hi) -> float:
    """TIS: clip(w, C_min, C_max); MIS: w * 1[C_min <= w <= C_max]; None: no bound."""
    if mode.endswith("truncate"):
        if lo is not None:
            w = max(w, lo)
        if hi is not None:
            w = min(w, hi)
        return w
    inside = (lo is None or w >= lo) and (hi is None or w <= hi)
    return w if inside else 0.0


def is_weights_by_hand(mode: str, lo, hi):
    """Token: w_t per token. Sequence: W_i = prod_t w_t over valid t, the same on every token.

    w_t = exp(log w_t): the ratio the log-probs given to the code represent, so that a ratio on a
    bound (3.0 = exp(log 3.0) up to one ulp) is judged the same way on both sides.
    """
    weights, counted = [], []
    for row_r, row_m in zip(RATIOS, IS_MASK, strict=True):
        row = [math.exp(math.log(w)) for w in row_r]
        if mode.startswith("sequence"):
            seq = constrain_by_hand(math.prod(w for w, m in zip(row, row_m, strict=True) if m), mode, lo, hi)
            weights.append([seq * m for m in row_m])
            counted.append(seq)
        else:
            row_w = [constrain_by_hand(w, mode, lo, hi) * m for w, m in zip(row, row_m, strict=True)]
            weights.append(row_w)
            counted += [w for w, m in zip(row_w, row_m, strict=True) if m]
    return weights, counted


@pytest.mark.parametrize(("mode", "bounds"), list(itertools.product(reg.IS_MODES, BOUNDS)))
def test_sampler_is_weights_by_hand(mode, bounds):
    lo, hi = bounds
    trainer = t([[math.log(w) for w in row] for row in RATIOS], requires_grad=True)
    sampler = torch.zeros(3, 4, dtype=torch.float64)
    weights, metrics = reg.sampler_is_weights(trainer, sampler, t(IS_MASK), mode, lo, hi)
    expected, counted = is_weights_by_hand(mode, lo, hi)
    close(weights, expected)
    assert not weights.requires_grad
    close(metrics["sampling/importance_sampling_ratio/min"], min(counted))
    close(metrics["sampling/importance_sampling_ratio/mean"], sum(counted) / len(counted))
    close(metrics["sampling/importance_sampling_ratio/max"], max(counted))
    diffs = [
        abs(math.log(w))
        for row, rm in zip(RATIOS, IS_MASK, strict=True)
        for w, m in zip(row, rm, strict=True)
        if m
    ]
    close(metrics["sampling/sampling_logp_difference/mean"], sum(diffs) / len(diffs))
    close(metrics["sampling/sampling_logp_difference/max"], max(diffs))


def test_sampler_is_weights_hand_values():
    """Spot values: sequence ratio of row 0 is 0.2 * 1 * 2.5 * 4 = 2.0 (inside [0.5, 3])."""
    trainer = t([[math.log(w) for w in row] for row in RATIOS])
    sampler = torch.zeros(3, 4, dtype=torch.float64)
    w, _ = reg.sampler_is_weights(trainer, sampler, t(IS_MASK), "sequence_mask", 0.5, 3.0)
    close(w[0], [2.0] * 4)
    close(w[1], [1.8, 1.8, 1.8, 0.0])  # 0.5 * 3 * 1.2, padding left out of product and weights
    w, _ = reg.sampler_is_weights(trainer, sampler, t(IS_MASK), "sequence_mask", 0.5, 1.5)
    close(w[0], [0.0] * 4)  # 2.0 > C_max: the whole sequence is dropped
    w, _ = reg.sampler_is_weights(trainer, sampler, t(IS_MASK), "token_truncate", 0.5, 3.0)
    close(w[0], [0.5, 1.0, 2.5, 3.0])
    close(w[1], [0.5, 3.0, 1.2, 0.0])


def test_sampler_is_weights_are_one_when_sampler_matches():
    logps = t(LOGPS)
    for mode in reg.IS_MODES:
        w, m = reg.sampler_is_weights(logps, logps.clone(), t(MASK), mode, 0.5, 2.0)
        close(w, MASK)
        close(m["sampling/sampling_logp_difference/max"], 0.0)


def test_sampler_is_weights_empty_and_bad_mode():
    _, metrics = reg.sampler_is_weights(t(LOGPS), t(OLD), torch.zeros(4, 3), "sequence_mask", None, 3.0)
    assert all(math.isnan(v.item()) for k, v in metrics.items() if not k.endswith("/count"))
    assert all(v.item() == 0 for k, v in metrics.items() if k.endswith("/count"))  # nothing measured
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        reg.sampler_is_weights(t(LOGPS), t(OLD), t(MASK), "token", None, 3.0)


# ------------------------------------------------------------------------------------------
# TR-DPO reference synchronisation
# ------------------------------------------------------------------------------------------


def test_mix_into_reference_by_hand():
    """TR-DPO Sec. 3: ref <- alpha * policy + (1 - alpha) * ref, element by element."""
    ref_values, pol_values, alpha = [[1.0, -2.0], [0.5]], [[3.0, 2.0], [-0.5]], 0.6
    refs = [torch.nn.Parameter(t(v)) for v in ref_values]
    pols = [torch.nn.Parameter(t(v)) for v in pol_values]
    reg.mix_into_reference(refs, pols, alpha)
    for ref, rv, pv in zip(refs, ref_values, pol_values, strict=True):
        close(ref.detach(), [alpha * p + (1 - alpha) * r for r, p in zip(rv, pv, strict=True)])
        assert ref.grad_fn is None
    close(pols[0].detach(), pol_values[0])  # the policy is untouched


def test_mix_into_reference_limits_and_dtype():
    ref, pol = t([1.0, 2.0]).float(), t([5.0, 6.0])
    reg.mix_into_reference([ref], [pol], 0.0)
    close(ref, [1.0, 2.0])
    reg.mix_into_reference([ref], [pol], 1.0)
    assert ref.dtype == torch.float32
    close(ref, [5.0, 6.0])
    with pytest.raises(ValueError):
        reg.mix_into_reference([ref], [pol, pol], 0.5)
    with pytest.raises(ValueError, match="ref_model_mixup_alpha"):
        reg.mix_into_reference([ref], [pol], 1.5)


def test_should_sync_reference():
    assert [s for s in range(0, 13) if reg.should_sync_reference(s, 4)] == [4, 8, 12]
    assert reg.should_sync_reference(1, 1)
    with pytest.raises(ValueError, match="ref_model_sync_steps"):
        reg.should_sync_reference(4, 0)
