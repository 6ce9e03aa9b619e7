"""Golden tests of the DPO loss table (posttrain.dpo.losses).

Each loss type's formula is transcribed here plainly, per element with Python's ``math`` on
hand-made numbers, and compared with ``dpo_loss``; nothing here calls the module's helpers to
build an expected value.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.dpo.losses import (
    F_DIVERGENCE_TYPES,
    LOSS_TYPES,
    DPOLossOutput,
    LossSpec,
    PairLogps,
    RunningMean,
    check_loss_settings,
    dpo_loss,
    f_divergence_score,
    ld_logps,
    wpo_weights,
)

# Four hand-made pairs: u_w = [0.5, -0.5, 1.2, 1.7], u_l = [-1.0, 0.8, -0.6, -1.1]; no two
# policy or reference margins tie (aot sorts them) and no hinge sits on its kink.
CW = [-10.0, -12.5, -7.0, -20.0]
RW = [-11.0, -9.0, -15.0, -19.0]
RCW = [-10.5, -12.0, -8.2, -21.7]
RRW = [-10.0, -9.8, -14.4, -17.9]
NW = [5.0, 8.0, 3.0, 12.0]
NL = [6.0, 4.0, 9.0, 10.0]
BETA = 0.5


def logsig(x: float) -> float:
    """log σ(x), written out."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def score(u: float, kind: str, alpha: float = 0.5) -> float:
    """The f-DPO score by hand."""
    if kind == "reverse_kl":
        return u
    if kind == "forward_kl":
        return 1.0 - math.exp(-u)
    if kind == "js_divergence":
        return math.log(2.0 * sig(u))
    if alpha == 1.0:
        return u
    return (math.exp(min((alpha - 1.0) * u, 80.0)) - 1.0) / (alpha - 1.0)


def batch(
    dtype: torch.dtype = torch.float64, requires_grad: bool = False, reference: bool = True
) -> PairLogps:
    def t(values: list[float], grad: bool = False) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, requires_grad=grad)

    return PairLogps(
        chosen=t(CW, requires_grad),
        rejected=t(RW, requires_grad),
        ref_chosen=t(RCW, requires_grad) if reference else None,
        ref_rejected=t(RRW, requires_grad) if reference else None,
        chosen_lengths=t(NW),
        rejected_lengths=t(NL),
    )


# --------------------------------------------------------------------------- golden formulas
# Per-pair goldens take one pair ``p`` (cw, rw, uw, ul, sw, sl, nw, nl) and the settings ``k``.


def g_sigmoid(p, k):
    z = k["beta"] * (p["sw"] - p["sl"])
    return -(1 - k["eps"]) * logsig(z) - k["eps"] * logsig(-z)


def g_hinge(p, k):
    return max(0.0, 1.0 - k["beta"] * (p["sw"] - p["sl"]))


def g_ipo(p, k):
    return (p["sw"] / p["nw"] - p["sl"] / p["nl"] - 1.0 / (2.0 * k["beta"])) ** 2


def g_exo_pair(p, k):
    z, eps = k["beta"] * (p["sw"] - p["sl"]), k["eps"]
    return sig(z) * (logsig(z) - math.log(1 - eps)) + sig(-z) * (logsig(-z) - math.log(eps))


def g_nca_pair(p, k):
    a, b = k["beta"] * p["uw"], k["beta"] * p["ul"]
    return -logsig(a) - 0.5 * logsig(-a) - 0.5 * logsig(-b)


def g_robust(p, k):
    z, eps = k["beta"] * (p["sw"] - p["sl"]), k["eps"]
    return (-(1 - eps) * logsig(z) + eps * logsig(-z)) / (1 - 2 * eps)


def g_bco_pair(p, k):
    a, b, d = k["beta"] * p["uw"], k["beta"] * p["ul"], k["delta"]
    return -logsig(a - d) - logsig(-(b - d))


def g_sppo_hard(p, k):
    return (p["uw"] - 1 / (2 * k["beta"])) ** 2 + (p["ul"] + 1 / (2 * k["beta"])) ** 2


def g_apo_zero(p, k):
    return 1 - sig(k["beta"] * p["uw"]) + sig(k["beta"] * p["ul"])


def g_apo_down(p, k):
    return sig(k["beta"] * p["uw"]) + 1 - sig(k["beta"] * (p["uw"] - p["ul"]))


def g_discopop(p, k):
    z = k["beta"] * (p["sw"] - p["sl"])
    m = sig(z / k["tau"])
    return (1 - m) * (-logsig(z)) + m * math.exp(-z)


def g_sigmoid_norm(p, k):
    return -logsig(k["beta"] * (p["sw"] / p["nw"] - p["sl"] / p["nl"]))


def g_udpo(p, k):
    z, eps = k["beta"] * (p["sw"] - p["sl"]), k["eps"]
    a = eps / (1 - eps)
    alpha = (1 + math.sqrt(a)) / (1 - math.sqrt(a))
    return -alpha * math.log((math.exp(z) + a) / (math.exp(z) + 1))


def _sorted_logistic(d, k):
    eps = k["eps"]
    return [-(1 - eps) * logsig(k["beta"] * x) - eps * logsig(-k["beta"] * x) for x in d]


def g_aot(pairs, k):
    policy = sorted(p["cw"] - p["rw"] for p in pairs)
    reference = sorted(p["rcw"] - p["rrw"] for p in pairs)
    return _sorted_logistic([a - b for a, b in zip(policy, reference, strict=True)], k)


def g_aot_unpaired(pairs, k):
    d = [a - b for a, b in zip(sorted(p["uw"] for p in pairs), sorted(p["ul"] for p in pairs), strict=True)]
    return _sorted_logistic(d, k)


def g_sft(pairs, k):
    value = -sum(p["cw"] for p in pairs) / sum(p["nw"] for p in pairs)
    return [value] * len(pairs)


PER_PAIR = {
    "sigmoid": g_sigmoid,
    "hinge": g_hinge,
    "ipo": g_ipo,
    "exo_pair": g_exo_pair,
    "nca_pair": g_nca_pair,
    "robust": g_robust,
    "bco_pair": g_bco_pair,
    "sppo_hard": g_sppo_hard,
    "apo_zero": g_apo_zero,
    "apo_down": g_apo_down,
    "discopop": g_discopop,
    "sigmoid_norm": g_sigmoid_norm,
    "udpo": g_udpo,
}
PER_BATCH = {"aot": g_aot, "aot_unpaired": g_aot_unpaired, "sft": g_sft}
GOLDEN_EPS = {"exo_pair": 1e-3, "robust": 0.1, "udpo": 0.2, "sigmoid": 0.1, "aot": 0.1, "aot_unpaired": 0.1}


def golden_per_pair(loss_type, f_div="reverse_kl", alpha=0.5, beta=BETA, eps=0.0, tau=0.05, delta=0.0):
    pairs = []
    for cw, rw, rcw, rrw, nw, nl in zip(CW, RW, RCW, RRW, NW, NL, strict=True):
        uw, ul = cw - rcw, rw - rrw
        pairs.append(
            dict(cw=cw, rw=rw, rcw=rcw, rrw=rrw, uw=uw, ul=ul, nw=nw, nl=nl)
            | dict(sw=score(uw, f_div, alpha), sl=score(ul, f_div, alpha))
        )
    k = dict(beta=beta, eps=eps, tau=tau, delta=delta)
    if loss_type in PER_BATCH:
        return PER_BATCH[loss_type](pairs, k)
    return [PER_PAIR[loss_type](p, k) for p in pairs]


def golden(loss_type, **kw):
    values = golden_per_pair(loss_type, **kw)
    return sum(values) / len(values)


def test_every_loss_type_has_a_golden_formula():
    assert set(PER_PAIR) | set(PER_BATCH) == set(LOSS_TYPES)


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_loss_equals_its_golden_formula(loss_type):
    eps = GOLDEN_EPS.get(loss_type, 0.0)
    delta = 0.3 if loss_type == "bco_pair" else 0.0
    out = dpo_loss(batch(), loss_type, beta=BETA, label_smoothing=eps, bco_delta=delta)
    expected = golden(loss_type, eps=eps, delta=delta)
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert out.per_type[loss_type].item() == pytest.approx(expected, rel=1e-5)


F_DIV_CASES = [
    (name, kind, alpha)
    for name, spec in LOSS_TYPES.items()
    if spec.accepts_f_divergence and name != "sft"
    for kind, alpha in [
        ("forward_kl", 0.5),
        ("js_divergence", 0.5),
        ("alpha_divergence", 0.5),
        ("alpha_divergence", 2.0),
    ]
]


@pytest.mark.parametrize(("loss_type", "kind", "alpha"), F_DIV_CASES)
def test_f_divergence_losses_equal_their_golden_formula(loss_type, kind, alpha):
    eps = GOLDEN_EPS.get(loss_type, 0.0)
    out = dpo_loss(
        batch(),
        loss_type,
        beta=BETA,
        label_smoothing=eps,
        f_divergence_type=kind,
        f_alpha_divergence_coef=alpha,
    )
    assert out.loss.item() == pytest.approx(golden(loss_type, f_div=kind, alpha=alpha, eps=eps), rel=1e-5)


def test_sft_ignores_the_f_divergence_and_the_reference():
    with_kl = dpo_loss(batch(), "sft", beta=BETA, f_divergence_type="js_divergence").loss
    free = dpo_loss(batch(reference=False), "sft", beta=BETA)
    assert with_kl.item() == pytest.approx(golden("sft"), rel=1e-5)
    assert free.loss.item() == pytest.approx(golden("sft"), rel=1e-5)
    # Without a reference, the rewards are β·ℓ.
    assert free.chosen_rewards.tolist() == pytest.approx([BETA * x for x in CW])
    assert free.rejected_rewards.tolist() == pytest.approx([BETA * x for x in RW])


def test_rewards_are_beta_times_the_log_ratios_and_detached():
    out = dpo_loss(batch(requires_grad=True), "sigmoid", beta=BETA)
    assert out.chosen_rewards.tolist() == pytest.approx(
        [BETA * (a - b) for a, b in zip(CW, RCW, strict=True)]
    )
    assert out.rejected_rewards.tolist() == pytest.approx(
        [BETA * (a - b) for a, b in zip(RW, RRW, strict=True)]
    )
    assert not out.chosen_rewards.requires_grad and not out.rejected_rewards.requires_grad
    assert not out.per_type["sigmoid"].requires_grad and out.loss.requires_grad
    assert isinstance(out, DPOLossOutput)


# --------------------------------------------------------------------------- f-divergence scores


@pytest.mark.parametrize("kind", F_DIVERGENCE_TYPES)
@pytest.mark.parametrize("alpha", [0.5, 2.0, -1.0])
def test_f_divergence_scores_by_hand(kind, alpha):
    us = [-3.0, -0.4, 0.0, 0.7, 5.0]
    got = f_divergence_score(torch.tensor(us, dtype=torch.float64), kind, alpha)
    assert got.tolist() == pytest.approx([score(u, kind, alpha) for u in us], rel=1e-6, abs=1e-12)


def test_alpha_divergence_edges():
    u = torch.tensor([-2.0, 0.3, 4.0], dtype=torch.float64)
    # α = 0 is forward KL exactly, α = 1 its limit reverse KL, and α near 1 approaches it.
    assert torch.allclose(f_divergence_score(u, "alpha_divergence", 0.0), 1 - torch.exp(-u))
    assert torch.equal(f_divergence_score(u, "alpha_divergence", 1.0), u)
    assert torch.allclose(f_divergence_score(u, "alpha_divergence", 1.0 + 1e-9), u, atol=1e-7)
    # js is log(2σ(u)).
    assert torch.allclose(f_divergence_score(u, "js_divergence"), torch.log(2 * torch.sigmoid(u)))


def test_alpha_divergence_clamps_the_exponent_at_80_and_stops_its_gradient():
    u = torch.tensor([-200.0, -100.0, 1.0], dtype=torch.float64, requires_grad=True)
    s = f_divergence_score(u, "alpha_divergence", 0.5)  # exponent -0.5 u: 100, 50, -0.5
    expected = [(math.exp(80.0) - 1) / -0.5, (math.exp(50.0) - 1) / -0.5, (math.exp(-0.5) - 1) / -0.5]
    assert s.tolist() == pytest.approx(expected, rel=1e-9)
    (grad,) = torch.autograd.grad(s.sum(), u)
    assert grad[0].item() == 0.0  # past the clamp
    assert grad[1].item() == pytest.approx(math.exp(50.0), rel=1e-9)  # d/du (e^{-u/2} - 1)/(-1/2) = e^{-u/2}
    # Float32 stays finite at the clamp.
    assert torch.isfinite(f_divergence_score(torch.tensor([-1e4]), "alpha_divergence", 0.5)).all()


# --------------------------------------------------------------------------- label smoothing


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "aot", "aot_unpaired"])
@pytest.mark.parametrize("eps", [0.0, 0.05, 0.3])
def test_label_smoothing(loss_type, eps):
    out = dpo_loss(batch(), loss_type, beta=BETA, label_smoothing=eps)
    assert out.loss.item() == pytest.approx(golden(loss_type, eps=eps), rel=1e-5)


def test_robust_and_sigmoid_agree_without_smoothing_and_udpo_reduces_to_dpo():
    plain = sum(-logsig(BETA * ((a - b) - (c - d))) for a, b, c, d in zip(CW, RCW, RW, RRW, strict=True)) / 4
    for loss_type in ("sigmoid", "robust", "udpo"):
        assert dpo_loss(batch(), loss_type, beta=BETA).loss.item() == pytest.approx(plain, rel=1e-6)


def test_label_smoothing_is_ignored_by_types_that_do_not_use_it():
    for name, spec in LOSS_TYPES.items():
        if not spec.uses_label_smoothing and not spec.needs_label_smoothing:
            a = dpo_loss(batch(), name, beta=BETA).loss
            b = dpo_loss(batch(), name, beta=BETA, label_smoothing=0.2).loss
            assert torch.equal(a, b), name


def test_extreme_margins_stay_finite():
    huge = PairLogps(
        chosen=torch.tensor([-400.0, 0.0]),
        rejected=torch.tensor([0.0, -400.0]),
        ref_chosen=torch.zeros(2),
        ref_rejected=torch.zeros(2),
        chosen_lengths=torch.ones(2),
        rejected_lengths=torch.ones(2),
    )
    for name in ("discopop", "udpo", "exo_pair", "sigmoid", "robust"):
        loss = dpo_loss(huge, name, beta=1.0, label_smoothing=0.1).loss
        assert torch.isfinite(loss), name
    # discopop at z = -400: (1 - m) ≈ 1 times -log σ(-400) = 400, plus m e^{400} with m ≈ e^{-8000} ≈ 0.
    pair = dpo_loss(huge, "discopop", beta=1.0)
    assert pair.loss.item() == pytest.approx((400.0 + 0.0) / 2, rel=1e-5)


# --------------------------------------------------------------------------- combinations and weights


def test_a_list_of_loss_types_is_the_weighted_sum_of_their_means():
    types, weights = ["sigmoid", "ipo", "sft", "bco_pair"], [0.7, 0.2, 1.5, -0.3]
    out = dpo_loss(batch(), types, beta=BETA, loss_weights=weights)
    expected = sum(w * golden(t) for t, w in zip(types, weights, strict=True))
    assert out.loss.item() == pytest.approx(expected, rel=1e-5)
    assert set(out.per_type) == set(types)
    for t in types:
        assert out.per_type[t].item() == pytest.approx(golden(t), rel=1e-5)
    # Default weights are 1.0 each.
    unweighted = dpo_loss(batch(), types, beta=BETA).loss.item()
    assert unweighted == pytest.approx(sum(golden(t) for t in types), rel=1e-5)


def test_pair_weights_multiply_every_per_pair_loss():
    w = [0.5, 1.5, 0.25, 2.0]
    weights = torch.tensor(w, dtype=torch.float64)
    for loss_type in ("sigmoid", "hinge", "sft"):
        out = dpo_loss(batch(), loss_type, beta=BETA, pair_weights=weights)
        per_pair = golden_per_pair(loss_type)
        expected = sum(a * b for a, b in zip(w, per_pair, strict=True)) / 4
        assert out.loss.item() == pytest.approx(expected, rel=1e-5)


def test_half_precision_is_computed_in_float32():
    out = dpo_loss(batch(torch.bfloat16), ["sigmoid", "ipo"], beta=BETA)
    assert out.loss.dtype == torch.float32
    ref = dpo_loss(batch(), ["sigmoid", "ipo"], beta=BETA).loss.item()
    assert out.loss.item() == pytest.approx(ref, rel=5e-2)
    # Integer lengths are accepted too.
    p = batch()
    p = PairLogps(
        p.chosen, p.rejected, p.ref_chosen, p.ref_rejected, p.chosen_lengths.long(), p.rejected_lengths.long()
    )
    assert dpo_loss(p, "ipo", beta=BETA).loss.item() == pytest.approx(golden("ipo"), rel=1e-6)


# --------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_autograd_matches_finite_differences(loss_type):
    p = batch(requires_grad=True)
    eps = GOLDEN_EPS.get(loss_type, 0.0)

    def f(cw, rw, rcw, rrw):
        logps = PairLogps(cw, rw, rcw, rrw, p.chosen_lengths, p.rejected_lengths)
        return dpo_loss(logps, loss_type, beta=BETA, label_smoothing=eps).loss

    assert torch.autograd.gradcheck(f, (p.chosen, p.rejected, p.ref_chosen, p.ref_rejected))


def test_sigmoid_gradient_by_hand():
    eps = 0.1
    p = batch(requires_grad=True)
    loss = dpo_loss(p, "sigmoid", beta=BETA, label_smoothing=eps).loss
    grad_w, grad_l = torch.autograd.grad(loss, [p.chosen, p.rejected])
    for i in range(4):
        z = BETA * ((CW[i] - RCW[i]) - (RW[i] - RRW[i]))
        dz = (-(1 - eps) * sig(-z) + eps * sig(z)) * BETA / 4
        assert grad_w[i].item() == pytest.approx(dz, rel=1e-6)
        assert grad_l[i].item() == pytest.approx(-dz, rel=1e-6)


def test_sft_gradient_flows_only_through_the_chosen():
    p = batch(requires_grad=True)
    loss = dpo_loss(p, "sft", beta=BETA).loss
    grads = torch.autograd.grad(loss, [p.chosen, p.rejected, p.ref_chosen, p.ref_rejected], allow_unused=True)
    assert grads[0].tolist() == pytest.approx([-1.0 / sum(NW)] * 4)
    assert all(g is None for g in grads[1:])


def test_pair_weights_from_wpo_carry_no_gradient():
    token_logps = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.3, 0.6, 0.7]], dtype=torch.float64))
    token_logps.requires_grad_(True)
    weights = wpo_weights(token_logps, torch.zeros_like(token_logps), torch.ones_like(token_logps))
    assert not weights.requires_grad


# --------------------------------------------------------------------------- WPO and LD-DPO


def test_wpo_weights_by_hand():
    probs = [[0.9, 0.5, 0.2, 0.7], [0.1, 0.4, 0.8, 0.6]]
    sq_norms = [[0.8, 0.4, 0.3, 0.5], [0.2, 0.3, 0.6, 0.9]]
    mask = [[0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    got = wpo_weights(
        torch.log(torch.tensor(probs, dtype=torch.float64)),
        torch.log(torch.tensor(sq_norms, dtype=torch.float64)),
        torch.tensor(mask, dtype=torch.float64),
    )
    expected = []
    for p_row, q_row, m_row in zip(probs, sq_norms, mask, strict=True):
        terms = [math.log(p) - math.log(q) for p, q, m in zip(p_row, q_row, m_row, strict=True) if m]
        expected.append(math.exp(sum(terms) / len(terms)))
    assert got.tolist() == pytest.approx(expected, rel=1e-9)
    # A row without completion tokens weighs 1.
    assert wpo_weights(torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1, 3)).tolist() == [1.0]


def test_ld_logps_by_hand():
    token_logps = torch.tensor(
        [[-9.0, -1.0, -2.0, -3.0, -4.0, -9.0], [-9.0, -9.0, -0.5, -1.5, -9.0, -9.0]], dtype=torch.float64
    )
    # Row 0: prompt, 4 completion tokens, padding; row 1: 2 prompt tokens, 2 completion tokens, padding.
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.float64)
    public = torch.tensor([2.0, 2.0])  # min(4, 2) for the pair (row 0, row 1)
    got = ld_logps(token_logps, mask, public, alpha=0.25)
    assert got.tolist() == pytest.approx([-1.0 - 2.0 + 0.25 * (-3.0 - 4.0), -0.5 - 1.5], rel=1e-12)
    assert ld_logps(token_logps, mask, public, alpha=1.0).tolist() == pytest.approx([-10.0, -2.0])
    assert ld_logps(token_logps, mask, public, alpha=0.0).tolist() == pytest.approx([-3.0, -2.0])
    # Bool masks work the same.
    assert ld_logps(token_logps, mask.bool(), public, alpha=0.25).tolist() == got.tolist()


# --------------------------------------------------------------------------- BCO running mean


def test_running_mean_and_its_exact_state_round_trip():
    rm = RunningMean()
    assert rm.value == 0.0 and rm.count == 0
    assert rm.update(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx(2.0)
    rm.update(torch.tensor([[4.0], [10.0]]))
    assert rm.value == pytest.approx(4.0) and rm.count == 5
    restored = RunningMean()
    restored.load_state_dict(rm.state_dict())
    assert restored.value == rm.value and restored.count == rm.count
    more = torch.tensor([0.1, -0.7, 3.3])
    assert restored.update(more) == rm.update(more)
    assert restored.state_dict() == rm.state_dict()


def test_bco_pair_with_the_running_mean_as_delta():
    rm = RunningMean()
    out = dpo_loss(batch(), "bco_pair", beta=BETA)
    rm.update(torch.cat([out.chosen_rewards, out.rejected_rewards]))
    rewards = [BETA * (a - b) for a, b in zip(CW, RCW, strict=True)] + [
        BETA * (a - b) for a, b in zip(RW, RRW, strict=True)
    ]
    assert rm.value == pytest.approx(sum(rewards) / 8)
    shifted = dpo_loss(batch(), "bco_pair", beta=BETA, bco_delta=rm.value)
    assert shifted.loss.item() == pytest.approx(golden("bco_pair", delta=rm.value), rel=1e-6)
    assert out.loss.item() == pytest.approx(golden("bco_pair", delta=0.0), rel=1e-6)  # the reference's


# --------------------------------------------------------------------------- the table


def test_the_table_flags():
    assert all(isinstance(spec, LossSpec) and spec.doc for spec in LOSS_TYPES.values())
    assert [n for n, s in LOSS_TYPES.items() if not s.uses_reference] == ["sft"]
    assert {n for n, s in LOSS_TYPES.items() if s.accepts_f_divergence} == {
        "sigmoid",
        "sigmoid_norm",
        "hinge",
        "ipo",
        "exo_pair",
        "robust",
        "discopop",
        "sft",
    }
    assert [n for n, s in LOSS_TYPES.items() if s.needs_label_smoothing] == ["exo_pair"]
    assert {n for n, s in LOSS_TYPES.items() if s.uses_label_smoothing} == {
        "sigmoid",
        "exo_pair",
        "robust",
        "aot",
        "aot_unpaired",
        "udpo",
    }


# --------------------------------------------------------------------------- validation


def check(**overrides):
    kw = dict(
        loss_type="sigmoid",
        loss_weights=None,
        f_divergence_type="reverse_kl",
        label_smoothing=0.0,
        ld_alpha=None,
        use_weighting=False,
    )
    return check_loss_settings(**(kw | overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(loss_type="dpo"), r"loss_type='dpo' is not supported; use one of \['sigmoid', 'hinge'"),
        (dict(loss_type=["sigmoid", "nope"]), r"loss_type='nope' is not supported"),
        (dict(loss_type=[]), r"loss_type is empty"),
        (dict(loss_type=["sigmoid", "sigmoid"]), r"more than once; give each loss type once"),
        (dict(f_divergence_type="kl"), r"f_divergence_type='kl' is not supported; use one of \['reverse_kl'"),
        (
            dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
            r"loss_weights has 1 weight\(s\) for 2 loss",
        ),
        (dict(loss_weights=[float("nan")]), r"loss_weights=\[nan\] must be finite"),
        (dict(ld_alpha=1.5), r"ld_alpha=1.5 must lie in \[0, 1\]"),
        (dict(ld_alpha=-0.1), r"ld_alpha=-0.1 must lie in \[0, 1\]"),
        (dict(label_smoothing=-0.1), r"label_smoothing=-0.1 must lie in \[0, 1\]"),
        (dict(loss_type="exo_pair"), r"label_smoothing=0.0 with loss_type 'exo_pair'.*1e-3"),
        (
            dict(loss_type="exo_pair", label_smoothing=1.0),
            r"with loss_type 'exo_pair': it must lie in \(0, 1\)",
        ),
        (
            dict(loss_type="robust", label_smoothing=0.5),
            r"label_smoothing=0.5 with loss_type 'robust'.*\[0, 0.5\)",
        ),
        (dict(loss_type="udpo", label_smoothing=0.7), r"label_smoothing=0.7 with loss_type 'udpo'"),
        (
            dict(loss_type=["sigmoid", "nca_pair"], f_divergence_type="js_divergence"),
            r"f_divergence_type='js_divergence' is not supported by loss_type \['nca_pair'\]; "
            r"use f_divergence_type='reverse_kl'",
        ),
    ],
)
def test_check_loss_settings_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        check(**overrides)


def test_check_loss_settings_accepts_and_normalises():
    assert check() == (["sigmoid"], [1.0])
    assert check(loss_type=("sigmoid", "sft"), loss_weights=[2, 0.5]) == (["sigmoid", "sft"], [2.0, 0.5])
    assert check(loss_type="robust", label_smoothing=0.49, ld_alpha=0.0, use_weighting=True)[0] == ["robust"]
    check(loss_type=["ipo", "sft"], f_divergence_type="alpha_divergence")


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_weighting_with_sorting_losses_is_not_implemented(loss_type):
    with pytest.raises(
        NotImplementedError, match=rf"use_weighting=True is not implemented for loss_type \['{loss_type}'\]"
    ):
        check(loss_type=loss_type, use_weighting=True)
    with pytest.raises(NotImplementedError, match="use_weighting"):
        dpo_loss(batch(), loss_type, beta=BETA, pair_weights=torch.ones(4, dtype=torch.float64))


def test_dpo_loss_errors():
    with pytest.raises(ValueError, match=r"beta=0.0 must be > 0"):
        dpo_loss(batch(), "sigmoid", beta=0.0)
    with pytest.raises(ValueError, match=r"discopop_tau=0.0 must be > 0"):
        dpo_loss(batch(), "discopop", beta=BETA, discopop_tau=0.0)
    with pytest.raises(ValueError, match=r"loss_type \['sigmoid'\] needs the reference log-probabilities"):
        dpo_loss(batch(reference=False), ["sft", "sigmoid"], beta=BETA)
    p = batch()
    no_lengths = PairLogps(p.chosen, p.rejected, p.ref_chosen, p.ref_rejected)
    for name in ("ipo", "sigmoid_norm", "sft"):
        with pytest.raises(ValueError, match=rf"loss_type='{name}' normalises by the completion lengths"):
            dpo_loss(no_lengths, name, beta=BETA)
    with pytest.raises(ValueError, match=r"PairLogps.rejected \(3,\) must have the shape of chosen \(4,\)"):
        dpo_loss(PairLogps(p.chosen, p.rejected[:3], p.ref_chosen, p.ref_rejected), "sigmoid", beta=BETA)
    with pytest.raises(ValueError, match=r"PairLogps.chosen must be \[N\]"):
        dpo_loss(PairLogps(p.chosen[None], p.rejected[None]), "sft", beta=BETA)
    with pytest.raises(ValueError, match=r"pair_weights \(2,\) must have the shape of the pairs \(4,\)"):
        dpo_loss(p, "sigmoid", beta=BETA, pair_weights=torch.ones(2))
    with pytest.raises(ValueError, match=r"f_alpha_divergence_coef=inf must be a finite"):
        dpo_loss(
            p, "sigmoid", beta=BETA, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=math.inf
        )
    with pytest.raises(ValueError, match=r"f_divergence_type='tv' is not supported"):
        f_divergence_score(p.chosen, "tv")


def test_helper_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"ld_alpha=2.0 must lie in \[0, 1\]"):
        ld_logps(x, x, torch.zeros(2), 2.0)
    with pytest.raises(ValueError, match=r"public_lengths \(3,\) \[N\]"):
        ld_logps(x, x, torch.zeros(3), 0.5)
    with pytest.raises(ValueError, match=r"must all be \[N, T\]"):
        wpo_weights(x, x[:, :2], x)
    with pytest.raises(ValueError, match=r"RunningMean state must be"):
        RunningMean().load_state_dict({"mean": 1.0})
    with pytest.raises(ValueError, match=r"RunningMean state must be"):
        RunningMean().load_state_dict({"sum": 1.0, "count": -1})
