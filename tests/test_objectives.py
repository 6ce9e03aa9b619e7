"""The clipped surrogate, its gradient, the loss reductions and the clip statistics, by hand."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.grpo import objectives as obj

EPS_LOW, EPS_HIGH = 0.2, 0.28  # clip range [0.8, 1.28]
RATIOS = [0.5, 0.9, 1.0, 1.1, 1.5]

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def settings(loss_type: str) -> obj.ObjectiveSettings:
    """The objective settings of these tests: clip range [0.8, 1.28], token level."""
    return obj.ObjectiveSettings(loss_type=loss_type, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH)


def ratio_logps(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logps = log r (with gradient), old_logps = 0: the importance ratio is exactly r."""
    logps = torch.tensor(ratios, dtype=torch.float32).log().requires_grad_(True)
    return logps, torch.zeros_like(logps)


def test_importance_ratio():
    logps = torch.tensor([[0.0, math.log(2.0)], [-1.0, -3.0]])
    old = torch.tensor([[0.0, 0.0], [-1.0, -2.0]])
    close(obj.importance_ratio(logps, old), [[1.0, 2.0], [1.0, math.exp(-1.0)]])


def test_clipped_surrogate_by_hand():
    """l = -min(r A, clip(r, 0.8, 1.28) A), ratios r = [0.5, 0.9, 1.0, 1.1, 1.5].

    A = +2:  r A          = [1.0, 1.8, 2.0, 2.2, 3.0]
             clip(r) A    = [1.6, 1.8, 2.0, 2.2, 2.56]
             -min         = [-1.0, -1.8, -2.0, -2.2, -2.56]   (high ratio clipped)
    A = -1:  r A          = [-0.5, -0.9, -1.0, -1.1, -1.5]
             clip(r) A    = [-0.8, -0.9, -1.0, -1.1, -1.28]
             -min         = [0.8, 0.9, 1.0, 1.1, 1.5]         (low ratio clipped)
    A = 0:   all 0.
    """
    logps, old = ratio_logps([RATIOS, RATIOS, RATIOS])
    out = obj.clipped_surrogate(logps, old, torch.tensor([2.0, -1.0, 0.0]), EPS_LOW, EPS_HIGH)
    close(
        out,
        [
            [-1.0, -1.8, -2.0, -2.2, -2.56],
            [0.8, 0.9, 1.0, 1.1, 1.5],
            [0.0, 0.0, 0.0, 0.0, 0.0],
        ],
    )


def test_clipped_surrogate_gradient_zero_exactly_where_clipped():
    """d l / d logp = d l / d r * r (since r = exp(logp - old)).

    A = +2: unclipped tokens give -A r = [-1.0, -1.8, -2.0, -2.2, .]; r = 1.5 > 1.28 with A > 0
    is clipped: gradient 0. The low ratio 0.5 is NOT clipped for A > 0 (min picks r A).
    A = -1: unclipped give -A r = [., 0.9, 1.0, 1.1, 1.5]; r = 0.5 < 0.8 with A < 0 is
    clipped: gradient 0. The high ratio 1.5 is NOT clipped for A < 0.
    """
    logps, old = ratio_logps([RATIOS, RATIOS])
    out = obj.clipped_surrogate(logps, old, torch.tensor([2.0, -1.0]), EPS_LOW, EPS_HIGH)
    out.sum().backward()
    grad = logps.grad
    close(grad, [[-1.0, -1.8, -2.0, -2.2, 0.0], [0.0, 0.9, 1.0, 1.1, 1.5]])
    zero = grad == 0
    assert zero.tolist() == [[False, False, False, False, True], [True, False, False, False, False]]


def test_ratio_one_gives_reinforce_gradient_token_reduction():
    """old_logps = logps.detach(): r = 1, the clip is inactive, and for "dapo" (token sum over
    the denominator) d loss / d logp_t = -A_i * m_it / denominator."""
    torch.manual_seed(0)
    logps = (torch.randn(3, 5) - 2.0).requires_grad_(True)
    advantages = torch.tensor([1.5, -0.7, 0.3])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    denominator = 7.0
    loss, _ = obj.policy_loss(
        logps, logps.detach(), advantages, mask, settings("dapo"), obj.Normalizers(tokens=denominator)
    )
    loss.backward()
    expected = -advantages.unsqueeze(1) * mask.float() / denominator
    close(logps.grad, expected)
    # The value itself: -sum_i A_i * len_i / denominator = -(1.5*3 - 0.7*5 + 0.3*1) / 7.
    close(loss, torch.tensor(-(1.5 * 3 - 0.7 * 5 + 0.3 * 1) / 7))


def test_ratio_one_gives_reinforce_gradient_sequence_reduction():
    """For "grpo" (mean per sequence), d loss / d logp_t = -A_i * m_it / (len_i * denominator)."""
    torch.manual_seed(1)
    logps = (torch.randn(3, 4) - 1.0).requires_grad_(True)
    advantages = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    denominator = 3.0
    loss, _ = obj.policy_loss(
        logps, logps.detach(), advantages, mask, settings("grpo"), obj.Normalizers(sequences=denominator)
    )
    loss.backward()
    lengths = mask.sum(dim=1, keepdim=True).float()
    close(logps.grad, -advantages.unsqueeze(1) * mask.float() / (lengths * denominator))


def test_reduce_loss_token_vs_sequence_by_hand():
    """per_token [[1,2,3,4],[10,20,99,99]], mask [[1,1,1,1],[1,1,0,0]] (99 masked out).

    "token": (1+2+3+4+10+20) / denominator = 40 / 6 = 6.666667 (every token weighs the same,
    so the long sequence weighs 4/6).
    "sequence": per-sequence means 10/4 = 2.5 and 30/2 = 15, summed over denominator 2:
    (2.5 + 15) / 2 = 8.75 (each sequence weighs the same).
    """
    per_token = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    close(obj.reduce_loss(per_token, mask, "token", obj.Normalizers(tokens=6.0)), torch.tensor(40 / 6))
    close(obj.reduce_loss(per_token, mask, "sequence", obj.Normalizers(sequences=2.0)), torch.tensor(8.75))


def test_reduce_loss_sequence_with_empty_row_counts_zero():
    """A fully masked row contributes 0 (its length is clamped to 1), not NaN."""
    per_token = torch.tensor([[2.0, 4.0], [5.0, 5.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    close(obj.reduce_loss(per_token, mask, "sequence", obj.Normalizers(sequences=2.0)), torch.tensor(3.0 / 2))


def test_reduce_loss_unknown_reduction():
    with pytest.raises(ValueError, match="reduction"):
        obj.reduce_loss(torch.zeros(1, 1), torch.ones(1, 1), "median", obj.Normalizers())


def test_loss_types_table():
    assert obj.LOSS_TYPES["dapo"].reduction == "token"
    assert obj.LOSS_TYPES["grpo"].reduction == "sequence"
    assert obj.LOSS_TYPES["dapo"].term is obj.clipped_surrogate


@pytest.mark.parametrize("loss_type", ["nonsense", "ppo"])
def test_policy_loss_unknown_loss_type(loss_type):
    x = torch.zeros(1, 2)
    with pytest.raises(NotImplementedError, match=loss_type):
        obj.policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), settings(loss_type), obj.Normalizers())


def test_policy_loss_value_by_hand_dapo_and_grpo():
    """Per-token losses of test_clipped_surrogate_by_hand, rows A=+2 and A=-1, with mask
    [[1,1,1,0,0],[1,1,1,1,1]]:
    row 0 masked sum = -1.0 - 1.8 - 2.0 = -4.8 over 3 tokens; row 1 sum = 0.8+0.9+1.0+1.1+1.5 =
    5.3 over 5 tokens.
    dapo, denominator 8: (-4.8 + 5.3) / 8 = 0.0625.
    grpo, denominator 2: (-4.8/3 + 5.3/5) / 2 = (-1.6 + 1.06) / 2 = -0.27.
    """
    logps, old = ratio_logps([RATIOS, RATIOS])
    a = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    loss, _ = obj.policy_loss(logps, old, a, mask, settings("dapo"), obj.Normalizers(tokens=8.0))
    close(loss.detach(), torch.tensor(0.0625))
    loss, _ = obj.policy_loss(logps, old, a, mask, settings("grpo"), obj.Normalizers(sequences=2.0))
    close(loss.detach(), torch.tensor(-0.27))


def test_clip_fractions_by_hand():
    """eps 0.2 / 0.28: clipped low iff r < 0.8 and A < 0, high iff r > 1.28 and A > 0.

    row 0, A = +1, r = [0.5, 0.9, 1.5, 2.0], mask [1,1,1,0]: high at 1.5 only (2.0 is masked),
      0.5 is not low-clipped (A > 0): low 0, high 1/3, region 1/3, tokens 3.
    row 1, A = -1, r = [0.5, 1.5, 0.7, 3.0], mask all: low at 0.5 and 0.7: low 2/4, high 0
      (A < 0), region 1/2, tokens 4.
    row 2, A = 0, r = [0.1, 5.0, 1.0, 1.0]: nothing clipped, tokens 4.
    row 3, fully masked: all fractions 0 (no division by zero), tokens 0.
    """
    ratio = torch.tensor(
        [[0.5, 0.9, 1.5, 2.0], [0.5, 1.5, 0.7, 3.0], [0.1, 5.0, 1.0, 1.0], [0.1, 5.0, 0.1, 5.0]]
    )
    advantages = torch.tensor([1.0, -1.0, 0.0, 1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]])
    stats = obj.clip_fractions(ratio, advantages, mask, EPS_LOW, EPS_HIGH)
    close(stats["low"], [0.0, 0.5, 0.0, 0.0])
    close(stats["high"], [1 / 3, 0.0, 0.0, 0.0])
    close(stats["region"], [1 / 3, 0.5, 0.0, 0.0])
    close(stats["tokens"], [3.0, 4.0, 4.0, 0.0])


def test_policy_loss_returns_clip_fractions_of_its_ratio():
    """policy_loss's stats are clip_fractions of exp(logps - old_logps), without gradient."""
    logps, old = ratio_logps([RATIOS, RATIOS])
    a = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    _, stats = obj.policy_loss(logps, old, a, mask, settings("dapo"), obj.Normalizers())
    # row 0 (A > 0): 1.5 clipped high -> 1/5; row 1 (A < 0): 0.5 clipped low -> 1/4.
    close(stats["high"], [0.2, 0.0])
    close(stats["low"], [0.0, 0.25])
    close(stats["region"], [0.2, 0.25])
    close(stats["tokens"], [5.0, 4.0])
    assert not any(v.requires_grad for v in stats.values())
