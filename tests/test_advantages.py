"""Golden tests for group-relative advantages, each case worked by hand in its docstring.

Conventions used throughout (see ``posttrain.grpo.advantages``): the standard deviation is the
unbiased one (divide by ``n - 1``) and scaled advantages divide by ``std + EPS`` with
``EPS = 1e-4``.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from posttrain.grpo import advantages as adv

EPS = 1e-4
NAN = float("nan")

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def close(actual: torch.Tensor, expected: list[float] | torch.Tensor) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, 2.0])


def test_eps_is_documented_value():
    assert adv.EPS == EPS


def test_scale_group_by_hand():
    """rewards [1,0,0,1 | 3,1,2,2], G=4.

    Group 1: mean 0.5, deviations [.5,-.5,-.5,.5], sum of squares 1, unbiased var 1/3,
    std sqrt(1/3) = 0.577350; A = +-0.5 / (0.577350 + 1e-4) = +-0.865875.
    Group 2: mean 2, deviations [1,-1,0,0], sum of squares 2, var 2/3, std 0.816497;
    A = +-1 / (0.816497 + 1e-4) = +-1.224595, and 0 for the two 2's.
    No group has zero std: frac_reward_zero_std = 0.
    """
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    a2 = 1.0 / (math.sqrt(2 / 3) + EPS)
    assert a1 == pytest.approx(0.865875, abs=1e-6)
    assert a2 == pytest.approx(1.224595, abs=1e-6)
    out, metrics = adv.group_relative(REWARDS, 4, "group")
    close(out, [a1, -a1, -a1, a1, a2, -a2, 0.0, 0.0])
    assert metrics == {"frac_reward_zero_std": 0.0}


def test_scale_batch_by_hand():
    """rewards [1,0,0,1 | 3,1,2,2], G=4, scale="batch".

    Centred within groups (group means 0.5 and 2): [.5,-.5,-.5,.5, 1,-1,0,0].
    Batch std of the raw rewards: mean 10/8 = 1.25, deviations
    [-.25,-1.25,-1.25,-.25,1.75,-.25,.75,.75], squares sum to
    .0625+1.5625+1.5625+.0625+3.0625+.0625+.5625+.5625 = 7.5, var 7.5/7 = 1.071429,
    std 1.035098. A = centred / (1.035098 + 1e-4): +-0.482999 and +-0.965998.
    """
    sb = math.sqrt(7.5 / 7)
    assert sb == pytest.approx(1.035098, abs=1e-6)
    h, o = 0.5 / (sb + EPS), 1.0 / (sb + EPS)
    out, metrics = adv.group_relative(REWARDS, 4, "batch")
    close(out, [h, -h, -h, h, o, -o, 0.0, 0.0])
    assert metrics["frac_reward_zero_std"] == 0.0


def test_scale_none_by_hand():
    """scale="none" (Dr. GRPO): only centred, no division and no EPS: [.5,-.5,-.5,.5, 1,-1,0,0]."""
    out, _ = adv.group_relative(REWARDS, 4, "none")
    close(out, [0.5, -0.5, -0.5, 0.5, 1.0, -1.0, 0.0, 0.0])


def test_compute_sum_then_normalize_single_function_matches_group_relative():
    """compute() with one function of weight 1 is group_relative on that column."""
    for scale in ("group", "batch", "none"):
        out, metrics = adv.compute(REWARDS.unsqueeze(1), torch.tensor([1.0]), 4, scale)
        ref, ref_metrics = adv.group_relative(REWARDS, 4, scale)
        close(out, ref)
        assert metrics == ref_metrics


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_constant_group_gets_zero_advantage_and_counts_in_frac_zero_std(scale):
    """rewards [1,1,1,1 | 0,1,0,1], G=4.

    Group 1 agrees: centred values are 0, std 0, so A = 0 / (0 + 1e-4) = 0 (no division by
    zero). Group 2: mean .5, deviations +-.5, var (4 * .25) / 3 = 1/3, std 0.577350.
    "group": A = +-0.5 / (0.577350 + 1e-4) = +-0.865875.
    "batch": batch mean .75, deviations [.25,.25,.25,.25,-.75,.25,-.75,.25], squares sum
    6*.0625 + 2*.5625 = 1.5, var 1.5/7, std 0.462910; A = +-0.5 / (0.462910 + 1e-4) = +-1.079890
    on group 2, 0 on group 1.
    frac_reward_zero_std = 4 samples of 8 = 0.5.
    """
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    out, metrics = adv.group_relative(rewards, 4, scale)
    s = math.sqrt(1 / 3) if scale == "group" else math.sqrt(1.5 / 7)
    a = 0.5 / (s + EPS)
    close(out, [0.0, 0.0, 0.0, 0.0, -a, a, -a, a])
    assert metrics["frac_reward_zero_std"] == pytest.approx(0.5)


def test_all_groups_constant():
    """Every group agrees: all advantages 0 and frac_reward_zero_std = 1."""
    out, metrics = adv.group_relative(torch.tensor([2.0, 2.0, -1.0, -1.0]), 2, "group")
    close(out, [0.0, 0.0, 0.0, 0.0])
    assert metrics["frac_reward_zero_std"] == 1.0


def test_group_std_is_unbiased_and_repeated():
    """[1,0,0,1 | 3,1,2,2]: stds sqrt(1/3) and sqrt(2/3), each repeated 4 times."""
    s1, s2 = math.sqrt(1 / 3), math.sqrt(2 / 3)
    close(adv.group_std(REWARDS, 4), [s1] * 4 + [s2] * 4)


def test_weighted_sum_with_weights_and_missing_entries():
    """weights [2, 0.5]; rows (NaN = the function returned None):

    [1, NaN] -> 2*1 = 2 ; [NaN, 2] -> .5*2 = 1 ; [0.5, 1] -> 2*.5 + .5*1 = 1.5 ;
    [-1, 4] -> -2 + 2 = 0. Missing entries are skipped (nansum), not propagated.
    """
    rewards = torch.tensor([[1.0, NAN], [NAN, 2.0], [0.5, 1.0], [-1.0, 4.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no sample is fully missing: no warning
        out = adv.weighted_sum(rewards, torch.tensor([2.0, 0.5]))
    close(out, [2.0, 1.0, 1.5, 0.0])


def test_weighted_sum_warns_when_a_sample_has_no_reward():
    """Row 1 is [NaN, NaN]: its reward is 0 and the warning names sample 1."""
    rewards = torch.tensor([[1.0, 2.0], [NAN, NAN], [NAN, 3.0]])
    with pytest.warns(UserWarning, match=r"samples \[1\]"):
        out = adv.weighted_sum(rewards, torch.tensor([1.0, 1.0]))
    close(out, [3.0, 0.0, 3.0])


def test_compute_with_missing_rewards_sum_then_normalize():
    """weights [1, 1], G=2; rows [1,NaN],[NaN,3] | [2,2],[0,NaN].

    Weighted sums (nansum): [1, 3 | 4, 0]. Group 1: mean 2, deviations -+1, std
    sqrt(2/1) = 1.414214: A = -+1 / 1.414314 = -+0.707057. Group 2: mean 2, deviations +-2,
    std sqrt(8) = 2.828427: A = +-2 / 2.828527 = +-0.707082.
    """
    rewards = torch.tensor([[1.0, NAN], [NAN, 3.0], [2.0, 2.0], [0.0, NAN]])
    out, _ = adv.compute(rewards, torch.tensor([1.0, 1.0]), 2, "group")
    a1 = 1 / (math.sqrt(2) + EPS)
    a2 = 2 / (math.sqrt(8) + EPS)
    close(out, [-a1, a1, a2, -a2])


def test_normalize_then_sum_two_functions_by_hand():
    """GDPO, G=3, weights [1, 2], two groups.

    f1 = [1,0,0 | 2,2,2], f2 = [0,1,2 | 3,1,2].

    Per function, per group:
      f1 group 1: mean 1/3, deviations [2/3,-1/3,-1/3], squares 6/9, var (6/9)/2 = 1/3,
        std 0.577350 -> [1.154501, -0.577250, -0.577250].
      f1 group 2: all 2 -> deviations 0 -> [0, 0, 0].
      f2 group 1: mean 1, deviations [-1,0,1], var 2/2 = 1, std 1 -> [-0.9999, 0, 0.9999].
      f2 group 2: mean 2, deviations [1,-1,0], var 1, std 1 -> [0.9999, -0.9999, 0].
    Weighted sum s = f1 + 2 f2 = [-0.845299, -0.577250, 1.422550, 1.999800, -1.999800, 0].
    Batch normalisation: mean(s) = 0 (each per-function group sums to 0); unbiased
    std = sqrt(sum s^2 / 5) = sqrt(11.069797 / 5) = 1.487938;
    A = s / (1.487938 + 1e-4) = [-0.568063, -0.387927, 0.955990, 1.343917, -1.343917, 0].
    frac_reward_zero_std is measured on the weighted sums f1 + 2 f2 = [1,2,4 | 8,4,6]: none
    agrees, so 0.
    """
    f1 = [1.0, 0.0, 0.0, 2.0, 2.0, 2.0]
    f2 = [0.0, 1.0, 2.0, 3.0, 1.0, 2.0]
    rewards = torch.tensor([f1, f2]).T  # [6, 2]
    weights = torch.tensor([1.0, 2.0])

    s13 = math.sqrt(1 / 3)
    n1 = [(2 / 3) / (s13 + EPS), (-1 / 3) / (s13 + EPS), (-1 / 3) / (s13 + EPS), 0.0, 0.0, 0.0]
    u = 1 / (1 + EPS)
    n2 = [-u, 0.0, u, u, -u, 0.0]
    s = [a + 2 * b for a, b in zip(n1, n2, strict=True)]
    mean = sum(s) / 6
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 5)
    assert mean == pytest.approx(0.0, abs=1e-12)
    assert std == pytest.approx(1.487938, abs=1e-6)
    expected = [(x - mean) / (std + EPS) for x in s]
    assert expected == pytest.approx([-0.568063, -0.387927, 0.955990, 1.343917, -1.343917, 0.0], abs=1e-6)

    out, metrics = adv.compute(rewards, weights, 3, aggregation="normalize_then_sum")
    close(out, expected)
    assert metrics["frac_reward_zero_std"] == 0.0
    # The direct function gives the same thing.
    direct, _ = adv.decoupled_group_normalized(rewards, weights, 3)
    close(direct, expected)


def test_normalize_then_sum_missing_entries_left_out_of_statistics():
    """GDPO, G=3, one group, weights [1, 1]; f1 = [1, 0, NaN], f2 = [0, 1, 2].

    f1 over its 2 present entries: mean .5, deviations +-.5, unbiased var (.25+.25)/1 = .5,
    std 0.707107 -> [0.707007, -0.707007] and 0 for the missing entry.
    f2: mean 1, deviations [-1,0,1], std 1 -> [-0.9999, 0, 0.9999].
    s = [-0.292893, -0.707007, 0.999900]; mean 0; std sqrt(sum s^2 / 2) = 0.890350;
    A = s / (0.890350 + 1e-4) = [-0.328927, -0.793988, 1.122916].
    """
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [NAN, 2.0]])
    a = 0.5 / (math.sqrt(0.5) + EPS)
    u = 1 / (1 + EPS)
    s = [a - u, -a, u]
    mean = sum(s) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in s) / 2)
    expected = [(x - mean) / (std + EPS) for x in s]
    assert expected == pytest.approx([-0.328927, -0.793988, 1.122916], abs=1e-6)
    out, _ = adv.compute(rewards, torch.tensor([1.0, 1.0]), 3, aggregation="normalize_then_sum")
    assert not torch.isnan(out).any()
    close(out, expected)


def test_single_function_normalize_then_sum_is_batch_normalised_group_advantage():
    """Limit case: ONE reward function with weight 1.

    sum_then_normalize, scale="group": A_i = (R_i - m_g) / (s_g + EPS) where m_g, s_g are the
    mean and unbiased std of R over the group (the weighted sum with w = 1 is R itself).
    normalize_then_sum: per function, the same thing, (R_i - m_g) / (s_g + EPS) = A_i, times
    w = 1 and summed over one function: A'_i = A_i exactly. Then GDPO batch-normalises:
    result = (A - mean(A)) / (std(A) + EPS). Since each group's A sums to 0, mean(A) = 0, so
    also result = A / (std(A) + EPS).

    On [1,0,0,1 | 3,1,2,2]: A = [a1,-a1,-a1,a1, a2,-a2,0,0] with a1 = 0.865875,
    a2 = 1.224595; std(A) = sqrt((4 a1^2 + 2 a2^2) / 7) = sqrt(5.998227 / 7) = 0.925683.
    """
    rewards = REWARDS.unsqueeze(1)
    w = torch.tensor([1.0])
    group_a, _ = adv.compute(rewards, w, 4, "group", "sum_then_normalize")
    gdpo, _ = adv.compute(rewards, w, 4, aggregation="normalize_then_sum")

    close(gdpo, (group_a - group_a.mean()) / (group_a.std() + EPS))
    close(gdpo, group_a / (group_a.std() + EPS))
    a1 = 0.5 / (math.sqrt(1 / 3) + EPS)
    a2 = 1.0 / (math.sqrt(2 / 3) + EPS)
    std_a = math.sqrt((4 * a1**2 + 2 * a2**2) / 7)
    assert std_a == pytest.approx(0.925683, abs=1e-6)
    close(gdpo, [x / (std_a + EPS) for x in [a1, -a1, -a1, a1, a2, -a2, 0.0, 0.0]])


def test_normalize_then_sum_scale_argument_is_ignored():
    """GDPO has its own normalisation; scale_rewards does not change its result."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 1.0], [1.0, 1.0]])
    w = torch.tensor([1.0, 0.5])
    ref, _ = adv.compute(rewards, w, 2, "group", "normalize_then_sum")
    for scale in ("batch", "none"):
        out, _ = adv.compute(rewards, w, 2, scale, "normalize_then_sum")
        close(out, ref)


def test_single_completion_groups_get_zero_advantage():
    """G=1 (num_generations_eval=1 passes config validation): each group is one completion,
    centred value r - r = 0, and its rewards trivially all agree, so A = 0 as for any constant
    group. torch.std of one element (n - 1 = 0) is NaN, and 0 / (NaN + 1e-4) = NaN."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: degrees of freedom <= 0
        out, _ = adv.group_relative(torch.tensor([1.0, 2.0, 3.0]), 1, "group")
    close(out, [0.0, 0.0, 0.0])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_completion_groups_count_as_zero_std(scale):
    """G=1: every group's rewards agree (there is one), so frac_reward_zero_std = 1."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _, metrics = adv.group_relative(torch.tensor([1.0, 2.0, 3.0]), 1, scale)
    assert metrics["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
def test_groups_not_whole_raise(aggregation):
    rewards = torch.zeros(7, 2)
    with pytest.raises(ValueError, match="whole groups"):
        adv.compute(rewards, torch.ones(2), 4, aggregation=aggregation)


def test_group_relative_groups_not_whole_raise():
    with pytest.raises(ValueError, match="num_generations=3"):
        adv.group_relative(torch.zeros(4), 3)


def test_unknown_scale_raises():
    with pytest.raises(ValueError, match="scale_rewards"):
        adv.compute(torch.zeros(4, 1), torch.ones(1), 2, scale="median")


def test_unknown_aggregation_raises():
    with pytest.raises(ValueError, match="multi_objective_aggregation"):
        adv.compute(torch.zeros(4, 1), torch.ones(1), 2, aggregation="max")
