"""Golden tests of orpo/losses.py and cpo/losses.py against plain-math transcriptions.

The batch (hand-made): three pairs with summed completion log-probs and lengths

    chosen   ℓ_w = [-4.0, -12.5, -0.3]    n_w = [4, 10, 3]
    rejected ℓ_l = [-6.0,  -9.0, -20.0]   n_l = [3,  6, 8]

so the mean token log-probs are ℓ̄_w = [-1, -1.25, -0.1] and ℓ̄_l = [-2, -1.5, -2.5]. For ORPO
with β = 0.1, pair 1: odds(-1) = -1 - log(1 - e^-1) = -0.5413, odds(-2) = -2 - log(1 - e^-2)
= -1.8546, o = 1.3133, log σ(o) = -0.2382; the NLL is (4 + 12.5 + 0.3) / 17 = 0.9882. The
transcriptions below use only ``math`` on Python floats.
"""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.cpo import losses as cpo
from posttrain.dpo.losses import ALPHA_EXPONENT_CLAMP, PairLogps
from posttrain.orpo import losses as orpo

CHOSEN = [-4.0, -12.5, -0.3]
REJECTED = [-6.0, -9.0, -20.0]
N_W = [4.0, 10.0, 3.0]
N_L = [3.0, 6.0, 8.0]


def batch(dtype: torch.dtype = torch.float32, requires_grad: bool = False) -> PairLogps:
    chosen = torch.tensor(CHOSEN, dtype=dtype, requires_grad=requires_grad)
    rejected = torch.tensor(REJECTED, dtype=dtype, requires_grad=requires_grad)
    return PairLogps(
        chosen,
        rejected,
        chosen_lengths=torch.tensor(N_W, dtype=dtype),
        rejected_lengths=torch.tensor(N_L, dtype=dtype),
    )


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


# ---- ORPO ---------------------------------------------------------------------------------------


def orpo_by_hand(beta: float) -> float:
    def odds(m: float) -> float:
        return m - math.log(1.0 - math.exp(m))

    terms = []
    for cw, cl, nw, nl in zip(CHOSEN, REJECTED, N_W, N_L, strict=True):
        o = odds(cw / nw) - odds(cl / nl)
        terms.append(log_sigmoid(o))
    nll = -sum(CHOSEN) / sum(N_W)
    return nll - beta * sum(terms) / len(terms)


@pytest.mark.parametrize("beta", [0.1, 1.0, 0.0])
def test_orpo_loss_equals_the_formula(beta):
    out = orpo.orpo_loss(batch(), beta)
    assert out.loss.item() == pytest.approx(orpo_by_hand(beta), rel=1e-5)
    assert out.nll_loss.item() == pytest.approx(16.8 / 17.0, rel=1e-6)


def test_orpo_worked_example_in_the_docstring():
    out = orpo.orpo_loss(batch(), 0.1)
    assert out.pair_metrics["log_odds_chosen"][0].item() == pytest.approx(1.3133, abs=1e-4)
    assert out.pair_metrics["log_odds_ratio"][0].item() == pytest.approx(-0.2382, abs=1e-4)


def test_orpo_metrics_are_the_mean_logps_and_detached():
    logps = batch(requires_grad=True)
    out = orpo.orpo_loss(logps, 0.5)
    torch.testing.assert_close(out.chosen_logps, torch.tensor([-1.0, -1.25, -0.1]))
    torch.testing.assert_close(out.rejected_logps, torch.tensor([-2.0, -1.5, -2.5]))
    torch.testing.assert_close(out.chosen_rewards, 0.5 * out.chosen_logps)
    torch.testing.assert_close(out.rejected_rewards, 0.5 * out.rejected_logps)
    torch.testing.assert_close(
        out.pair_metrics["log_odds_ratio"],
        torch.nn.functional.logsigmoid(out.pair_metrics["log_odds_chosen"]),
    )
    detached = [out.nll_loss, out.chosen_logps, out.chosen_rewards, *out.pair_metrics.values()]
    assert out.loss.requires_grad and not any(t.requires_grad for t in detached)


def test_orpo_step_denominators_split_a_batch_exactly():
    """Two halves, each divided by the whole batch's pairs and chosen tokens, sum to the whole."""
    whole = orpo.orpo_loss(batch(), 0.1).loss
    full = batch()
    parts = []
    for rows in (slice(0, 1), slice(1, 3)):
        half = PairLogps(
            full.chosen[rows],
            full.rejected[rows],
            chosen_lengths=full.chosen_lengths[rows],
            rejected_lengths=full.rejected_lengths[rows],
        )
        parts.append(orpo.orpo_loss(half, 0.1, num_pairs=3, num_tokens=17.0).loss)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


def test_orpo_gradients_match_finite_differences():
    chosen = torch.tensor(CHOSEN, dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor(REJECTED, dtype=torch.float64, requires_grad=True)
    n_w, n_l = torch.tensor(N_W, dtype=torch.float64), torch.tensor(N_L, dtype=torch.float64)

    def loss(c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return orpo.orpo_loss(PairLogps(c, r, chosen_lengths=n_w, rejected_lengths=n_l), 0.3).loss

    assert torch.autograd.gradcheck(loss, (chosen, rejected))


@pytest.mark.parametrize("x", [-1e-7, -1e-3, -0.5, -math.log(2.0), -0.7, -3.0, -40.0])
def test_log1mexp_is_accurate_over_the_whole_range(x):
    value = orpo.log1mexp(torch.tensor(x, dtype=torch.float64)).item()
    assert value == pytest.approx(math.log(-math.expm1(x)), rel=1e-12)
    single = orpo.log1mexp(torch.tensor(x, dtype=torch.float32)).item()
    assert single == pytest.approx(math.log(-math.expm1(x)), rel=1e-5)


def test_log_odds_is_finite_at_probability_one_and_its_cap_stops_only_the_second_term():
    """ℓ̄ = 0 (every token certain) would give log(1 - e^0) = -inf; past the cap only ℓ̄ keeps a gradient."""
    mean = torch.tensor([0.0, -1e-9, -0.5], dtype=torch.float64, requires_grad=True)
    odds = orpo.log_odds(mean)
    assert torch.isfinite(odds).all()
    assert odds[0].item() == pytest.approx(-math.log(-math.expm1(orpo.LOGP_CEILING)), rel=1e-9)
    odds.sum().backward()
    # d/dx [x - log(1 - e^x)] = 1 / (1 - e^x) below the cap; 1 (the first term alone) past it.
    assert mean.grad[0].item() == 1.0 and mean.grad[1].item() == 1.0
    assert mean.grad[2].item() == pytest.approx(1.0 / (1.0 - math.exp(-0.5)), rel=1e-12)


def test_orpo_refuses_bad_input():
    with pytest.raises(ValueError, match="beta"):
        orpo.orpo_loss(batch(), -0.1)
    with pytest.raises(ValueError, match="chosen_lengths"):
        orpo.orpo_loss(PairLogps(torch.zeros(2), torch.zeros(2)), 0.1)
    with pytest.raises(ValueError, match="shape"):
        orpo.orpo_loss(
            PairLogps(
                torch.zeros(2), torch.zeros(3), chosen_lengths=torch.ones(2), rejected_lengths=torch.ones(2)
            ),
            0.1,
        )


def test_half_precision_is_computed_in_float32():
    out = orpo.orpo_loss(batch(torch.bfloat16), 0.1)
    assert out.loss.dtype == torch.float32
    out = cpo.cpo_loss(batch(torch.bfloat16), "simpo", beta=2.0)
    assert out.loss.dtype == torch.float32


# ---- CPO, SimPO, AlphaPO ------------------------------------------------------------------------


def cpo_by_hand(
    loss_type: str, beta: float, eps: float, gamma: float, alpha: float, cpo_alpha: float | None
) -> float:
    normalised = loss_type in ("ipo", "simpo", "alphapo")

    def reward(logp: float) -> float:
        return logp if alpha == 0 else (1.0 - math.exp(-alpha * logp)) / alpha

    per_pair = []
    for cw, cl, nw, nl in zip(CHOSEN, REJECTED, N_W, N_L, strict=True):
        lw, ll = (cw / nw, cl / nl) if normalised else (cw, cl)
        z = reward(lw) - reward(ll)
        if loss_type in ("simpo", "alphapo"):
            z -= gamma / beta
        if loss_type == "hinge":
            per_pair.append(max(0.0, 1.0 - beta * z))
        elif loss_type == "ipo":
            per_pair.append((z - 1.0 / (2.0 * beta)) ** 2)
        else:
            per_pair.append(-(1.0 - eps) * log_sigmoid(beta * z) - eps * log_sigmoid(-beta * z))
    weight = cpo_alpha if cpo_alpha is not None else (0.0 if loss_type == "alphapo" else 1.0)
    return sum(per_pair) / len(per_pair) + weight * (-sum(CHOSEN) / sum(N_W))


CASES = [
    ("sigmoid", 0.1, 0.0, 0.5, 0.0, None),
    ("sigmoid", 0.1, 0.2, 0.5, 0.0, 0.5),
    ("sigmoid", 0.1, 0.0, 0.5, 0.05, None),
    ("sigmoid", 0.1, 0.1, 0.5, -0.3, 2.0),
    ("hinge", 0.3, 0.0, 0.5, 0.0, None),  # margins 2, -3.5, 19.7: active, active, inactive
    ("hinge", 0.3, 0.0, 0.5, -0.1, 0.0),
    ("ipo", 0.5, 0.0, 0.5, 0.0, None),
    ("ipo", 0.5, 0.0, 0.5, 0.7, 1.0),
    ("simpo", 2.5, 0.0, 1.375, 0.0, 0.0),
    ("simpo", 2.5, 0.15, 1.375, 0.0, None),
    ("simpo", 2.0, 0.0, 0.5, 0.25, None),
    ("alphapo", 2.5, 0.0, 0.1, 0.25, None),
    ("alphapo", 2.5, 0.1, 0.1, -0.5, 0.3),
]


@pytest.mark.parametrize(("loss_type", "beta", "eps", "gamma", "alpha", "cpo_alpha"), CASES)
def test_cpo_loss_equals_the_formula(loss_type, beta, eps, gamma, alpha, cpo_alpha):
    out = cpo.cpo_loss(
        batch(),
        loss_type,
        beta=beta,
        label_smoothing=eps,
        simpo_gamma=gamma,
        alpha=alpha,
        cpo_alpha=cpo_alpha,
    )
    assert out.loss.item() == pytest.approx(
        cpo_by_hand(loss_type, beta, eps, gamma, alpha, cpo_alpha), rel=1e-5
    )
    assert out.nll_loss.item() == pytest.approx(
        16.8 / 17.0, rel=1e-6
    )  # summed tokens, whatever the loss type


def test_cpo_rewards_and_logps_are_what_the_loss_uses():
    out = cpo.cpo_loss(batch(), "simpo", beta=2.0, alpha=0.25)
    mean_w = torch.tensor([-1.0, -1.25, -0.1])
    torch.testing.assert_close(out.chosen_logps, mean_w)
    torch.testing.assert_close(out.chosen_rewards, 2.0 * (1.0 - torch.exp(-0.25 * mean_w)) / 0.25)
    out = cpo.cpo_loss(batch(), "sigmoid", beta=0.1)
    torch.testing.assert_close(out.chosen_logps, torch.tensor(CHOSEN))
    torch.testing.assert_close(out.rejected_rewards, 0.1 * torch.tensor(REJECTED))
    assert out.pair_metrics == {}
    assert not out.chosen_rewards.requires_grad


def test_cpo_alpha_defaults_per_loss_type_and_a_given_value_is_kept():
    """alphapo's NLL weight defaults to 0 (the reference forces it); a value given is kept."""
    none = cpo.cpo_loss(batch(), "alphapo", beta=2.5, simpo_gamma=0.1, alpha=0.25)
    zero = cpo.cpo_loss(batch(), "alphapo", beta=2.5, simpo_gamma=0.1, alpha=0.25, cpo_alpha=0.0)
    half = cpo.cpo_loss(batch(), "alphapo", beta=2.5, simpo_gamma=0.1, alpha=0.25, cpo_alpha=0.5)
    assert none.loss.item() == zero.loss.item()
    assert half.loss.item() == pytest.approx(zero.loss.item() + 0.5 * 16.8 / 17.0, rel=1e-6)
    assert (
        cpo.LOSS_TYPES["sigmoid"].default_cpo_alpha == 1.0
        and cpo.LOSS_TYPES["simpo"].default_cpo_alpha == 1.0
    )


def test_cpo_step_denominators_split_a_batch_exactly():
    whole = cpo.cpo_loss(batch(), "simpo", beta=2.0, alpha=0.25).loss
    full = batch()
    parts = []
    for rows in (slice(0, 2), slice(2, 3)):
        part = PairLogps(
            full.chosen[rows],
            full.rejected[rows],
            chosen_lengths=full.chosen_lengths[rows],
            rejected_lengths=full.rejected_lengths[rows],
        )
        parts.append(cpo.cpo_loss(part, "simpo", beta=2.0, alpha=0.25, num_pairs=3, num_tokens=17.0).loss)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("loss_type", list(cpo.LOSS_TYPES))
def test_cpo_gradients_match_finite_differences(loss_type):
    n_w, n_l = torch.tensor(N_W, dtype=torch.float64), torch.tensor(N_L, dtype=torch.float64)

    def loss(c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        logps = PairLogps(c, r, chosen_lengths=n_w, rejected_lengths=n_l)
        return cpo.cpo_loss(logps, loss_type, beta=0.2, simpo_gamma=0.3, alpha=0.1).loss

    # Away from the hinge's kink: margins well inside one side.
    chosen = torch.tensor([-4.0, -12.5, -0.3], dtype=torch.float64, requires_grad=True)
    rejected = torch.tensor([-6.0, -9.0, -3.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(loss, (chosen, rejected))


# ---- the AlphaPO reward on long completions ----------------------------------------------------


def test_alphapo_reward_matches_the_formula_below_the_cap():
    for alpha in (0.25, -0.5, 1e-6, 3.0):
        for logp in (-0.01, -1.3, -20.0):
            if -alpha * logp > ALPHA_EXPONENT_CLAMP:
                continue
            value = cpo.shaped_reward(torch.tensor([logp], dtype=torch.float64), alpha).item()
            assert value == pytest.approx(-math.expm1(-alpha * logp) / alpha, rel=1e-12)
            assert value == pytest.approx((1.0 - math.exp(-alpha * logp)) / alpha, rel=1e-5)
    logps = torch.tensor([-1.0, -2.0])
    assert torch.equal(cpo.shaped_reward(logps, 0.0), logps)


def test_alphapo_reward_on_long_summed_completions_stays_finite():
    """Summed log-probs of long completions: e^{-αℓ} = e^{750} overflows; the reference gives NaN."""
    chosen, rejected = torch.tensor([-3000.0]), torch.tensor([-3200.0])
    naive = (1 - torch.exp(-0.25 * chosen)) / 0.25 - (1 - torch.exp(-0.25 * rejected)) / 0.25
    assert torch.isnan(naive).all()  # -inf - (-inf)
    for c, r in ((-3000.0, -3200.0), (-200.0, -400.0), (-400.0, -200.0)):
        chosen = torch.tensor([c], requires_grad=True)
        rejected = torch.tensor([r], requires_grad=True)
        logps = PairLogps(
            chosen, rejected, chosen_lengths=torch.tensor([900.0]), rejected_lengths=torch.tensor([950.0])
        )
        for loss_type in ("sigmoid", "hinge"):
            out = cpo.cpo_loss(logps, loss_type, beta=0.1, alpha=0.25)
            (grad_c, grad_r) = torch.autograd.grad(out.loss, (chosen, rejected))
            assert torch.isfinite(out.loss) and torch.isfinite(grad_c) and torch.isfinite(grad_r)
            assert torch.isfinite(out.chosen_rewards).all() and torch.isfinite(out.rejected_rewards).all()


def test_alphapo_reward_has_no_gradient_past_the_cap():
    """dr/dℓ = e^{-αℓ} below the cap; 0 past it (the reward is held at its value there)."""
    logps = torch.tensor([-100.0, -400.0], dtype=torch.float64, requires_grad=True)  # exponents 25 and 100
    reward = cpo.shaped_reward(logps, 0.25)
    reward.sum().backward()
    assert logps.grad[0].item() == pytest.approx(math.exp(25.0), rel=1e-12)
    assert logps.grad[1].item() == 0.0
    assert reward[1].item() == pytest.approx(-math.expm1(ALPHA_EXPONENT_CLAMP) / 0.25, rel=1e-12)


# ---- settings -----------------------------------------------------------------------------------


def test_check_loss_settings_names_the_parameter_and_the_fix():
    with pytest.raises(
        ValueError,
        match=r"loss_type='kto' is not supported; use one of \['sigmoid', 'hinge', 'ipo', 'simpo', 'alphapo'\]",
    ):
        cpo.check_loss_settings("kto", 0.1)
    with pytest.raises(ValueError, match="beta=0"):
        cpo.check_loss_settings("sigmoid", 0)
    for eps in (-0.1, 0.5, 1.0):
        with pytest.raises(ValueError, match=r"label_smoothing=.* must lie in \[0, 0.5\)"):
            cpo.check_loss_settings("sigmoid", 0.1, eps)
    for loss_type in ("hinge", "ipo"):
        with pytest.raises(ValueError, match=f"has no effect with loss_type='{loss_type}'"):
            cpo.check_loss_settings(loss_type, 0.1, 0.1)
    with pytest.raises(ValueError, match="alpha=nan"):
        cpo.check_loss_settings("simpo", 2.0, alpha=float("nan"))
    with pytest.raises(ValueError, match="cpo_alpha=-1"):
        cpo.check_loss_settings("simpo", 2.0, cpo_alpha=-1.0)
    assert cpo.check_loss_settings("alphapo", 2.5) is cpo.LOSS_TYPES["alphapo"]
