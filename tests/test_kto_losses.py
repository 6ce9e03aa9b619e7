"""Golden tests of kto/losses.py: each loss against a plain-math transcription of its formula, the
KL estimate worked by hand (clamp at 0, no gradient, the sums of several processes), and the paper's
imbalance rule."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.kto import losses


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# Four examples: policy and reference summed log-probs, and labels (True: desirable).
LOGPS = [-3.0, -5.5, -2.25, -7.0]
REF = [-3.5, -5.0, -2.0, -8.0]
LABELS = [True, False, True, False]


def tensors(logps=LOGPS, ref=REF, labels=LABELS):
    return torch.tensor(logps), torch.tensor(ref), torch.tensor(labels)


# ---- the KL estimate ------------------------------------------------------------------------------


def test_kl_estimate_is_the_mean_mismatched_log_ratio_by_hand():
    # Pairs (x_i, y_j): policy -4.0, -6.0, -1.0; reference -4.5, -5.0, -2.0 -> ratios 0.5, -1.0, 1.0.
    z0 = losses.kl_estimate(torch.tensor([-4.0, -6.0, -1.0]), torch.tensor([-4.5, -5.0, -2.0]))
    assert z0.item() == pytest.approx((0.5 - 1.0 + 1.0) / 3)


def test_kl_estimate_is_clamped_at_zero():
    # Ratios -1.0 and 0.5: mean -0.25 -> 0.
    z0 = losses.kl_estimate(torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -2.5]))
    assert z0.item() == 0.0


def test_kl_estimate_carries_no_gradient():
    kl = torch.tensor([-1.0, -2.0], requires_grad=True)
    z0 = losses.kl_estimate(kl, torch.tensor([-3.0, -3.0]))
    assert z0.item() == pytest.approx(1.5)
    assert not z0.requires_grad
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    out = losses.kto_loss(logps, torch.tensor([-1.0, -2.0]), torch.tensor([True, False]), beta=1.0, kl=z0)
    out.loss.backward()
    assert kl.grad is None  # z₀ is a constant of the loss


def test_kl_estimate_over_processes_uses_every_pair():
    """Process A has ratios [2.0], process B [-1.0, -1.0]: the mean over the 3 pairs is 0, clamped 0;
    the mean of the two per-process means (0.5) would differ."""
    other = torch.tensor([-2.0, 2.0])  # process B's (sum, count)

    def all_reduce(totals: torch.Tensor) -> torch.Tensor:
        return totals + other

    z0 = losses.kl_estimate(torch.tensor([-1.0]), torch.tensor([-3.0]), all_reduce=all_reduce)
    assert z0.item() == 0.0
    other = torch.tensor([-1.0, 2.0])  # ratios [-0.5, -0.5]: (2 - 1) / 3
    z0 = losses.kl_estimate(torch.tensor([-1.0]), torch.tensor([-3.0]), all_reduce=all_reduce)
    assert z0.item() == pytest.approx(1.0 / 3.0)


# ---- the losses -----------------------------------------------------------------------------------


def kto_by_hand(beta, z0, wd, wu):
    total = 0.0
    for logp, ref, desirable in zip(LOGPS, REF, LABELS, strict=True):
        u = logp - ref
        total += wd * (1 - sig(beta * (u - z0))) if desirable else wu * (1 - sig(beta * (z0 - u)))
    return total / len(LOGPS)


def apo_by_hand(beta, wd, wu):
    total = 0.0
    for logp, ref, desirable in zip(LOGPS, REF, LABELS, strict=True):
        u = logp - ref
        total += wd * (1 - sig(beta * u)) if desirable else wu * sig(beta * u)
    return total / len(LOGPS)


@pytest.mark.parametrize(
    "beta,z0,wd,wu", [(0.1, 0.0, 1.0, 1.0), (0.5, 0.3, 1.33, 0.7), (2.0, 1.25, 1.0, 2.0)]
)
def test_kto_loss_equals_the_formula(beta, z0, wd, wu):
    logps, ref, labels = tensors()
    out = losses.kto_loss(
        logps, ref, labels, beta=beta, desirable_weight=wd, undesirable_weight=wu, kl=torch.tensor(z0)
    )
    assert out.loss.item() == pytest.approx(kto_by_hand(beta, z0, wd, wu), rel=1e-6)
    assert out.kl.item() == pytest.approx(z0)
    expected_rewards = [beta * (a - b) for a, b in zip(LOGPS, REF, strict=True)]
    assert out.rewards.tolist() == pytest.approx(expected_rewards, rel=1e-6)


@pytest.mark.parametrize("beta,wd,wu", [(0.1, 1.0, 1.0), (0.5, 1.33, 0.7)])
def test_apo_zero_unpaired_equals_the_formula_and_ignores_z0(beta, wd, wu):
    logps, ref, labels = tensors()
    out = losses.kto_loss(
        logps,
        ref,
        labels,
        loss_type="apo_zero_unpaired",
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        kl=torch.tensor(5.0),
    )
    assert out.loss.item() == pytest.approx(apo_by_hand(beta, wd, wu), rel=1e-6)
    assert out.kl is None


def test_policy_equal_to_reference_gives_half_of_each_weight():
    logps = torch.tensor([-2.0, -3.0, -4.0])
    out = losses.kto_loss(
        logps,
        logps.clone(),
        torch.tensor([True, True, False]),
        desirable_weight=1.2,
        undesirable_weight=0.6,
        kl=torch.tensor(0.0),
    )
    assert out.loss.item() == pytest.approx((0.6 + 0.6 + 0.3) / 3)


def test_kto_gradient_by_hand():
    """d/dℓ of λ_D(1 - σ(β(u - z₀))) is -λ_D β σ'(β(u - z₀)); undesirable: +λ_U β σ'(β(z₀ - u))."""
    beta, z0 = 0.5, 0.2
    logps = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    out = losses.kto_loss(
        logps, ref, torch.tensor([True, False]), beta=beta, desirable_weight=2.0, kl=torch.tensor(z0)
    )
    out.loss.backward()
    u = [0.5, -1.0]
    dsig = lambda x: sig(x) * (1 - sig(x))  # noqa: E731
    expected = [-2.0 * beta * dsig(beta * (u[0] - z0)) / 2, 1.0 * beta * dsig(beta * (z0 - u[1])) / 2]
    assert logps.grad.tolist() == pytest.approx(expected, rel=1e-5)


def test_bad_calls_are_refused():
    logps, ref, labels = tensors()
    with pytest.raises(ValueError, match="needs the KL estimate"):
        losses.kto_loss(logps, ref, labels)
    with pytest.raises(ValueError, match="not a KTO loss type"):
        losses.kto_loss(logps, ref, labels, loss_type="sigmoid", kl=torch.tensor(0.0))
    with pytest.raises(ValueError, match="one value per example"):
        losses.kto_loss(logps, ref[:2], labels, kl=torch.tensor(0.0))


def test_the_table_lists_both_loss_types():
    assert set(losses.LOSS_TYPES) == {"kto", "apo_zero_unpaired"}
    assert losses.LOSS_TYPES["kto"].uses_kl and not losses.LOSS_TYPES["apo_zero_unpaired"].uses_kl


# ---- the imbalance rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nd,nu,wd,wu", [(10, 10, 1.0, 1.0), (12, 10, 1.0, 1.0), (40, 30, 1.0, 1.0), (10, 30, 3.5, 1.0)]
)
def test_balanced_weights_give_no_advice(nd, nu, wd, wu):
    assert losses.balance_advice(nd, nu, wd, wu) is None


def test_imbalanced_weights_give_the_counts_and_a_weight_in_range():
    advice = losses.balance_advice(10, 30, 1.0, 1.0)  # ratio 1/3
    assert advice is not None and "10 desirable and 30 undesirable" in advice and "0.333" in advice
    assert "between 3 and 4" in advice  # 30/10 * [1, 4/3]
    advice = losses.balance_advice(30, 10, 1.0, 1.0)  # ratio 3
    assert "between 0.333 and 0.444" in advice


def test_one_kind_only_is_advised_against():
    assert "only desirable" in losses.balance_advice(8, 0, 1.0, 1.0)
    assert "only undesirable" in losses.balance_advice(0, 8, 1.0, 1.0)
