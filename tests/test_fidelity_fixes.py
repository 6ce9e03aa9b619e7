"""Departures from the reference found by ``benchmarks/differential.py`` (docs/fidelity.md) that
were posttrain's: VESPO's weight against the sampler, and a step's ``sampling/*`` metrics under
gradient accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.batch import Rollout
from posttrain.grpo import objectives
from posttrain.grpo.loss import LossSettings, grpo_loss
from posttrain.ops.logprobs import PolicyOutput
from posttrain.ops.reductions import Normalizers
from posttrain.sampling.metrics import combine_step_metrics
from posttrain.sampling.rollout import ScoredRollout


def test_vespo_weighs_against_the_sampler_and_applies_no_second_correction() -> None:
    """VESPO's ``W = pi_theta(y) / mu(y)`` with ``mu`` the sampler (arXiv 2602.10693): on-policy
    (old = current) the Gamma weight still moves with the sampler's log-probs, and the loss is
    not multiplied again by the sampler importance weights."""
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]], requires_grad=True)
    sampler = logps.detach() + torch.tensor([[0.2, -0.1, 0.3], [-0.4, 0.1, 0.0]])
    mask = torch.ones(2, 3)
    rollout = Rollout(
        torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
        torch.ones(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.bool), sampler_logps=sampler,
    )  # fmt: skip
    adv = torch.tensor([1.0, -0.5])
    batch = ScoredRollout(rollout, torch.zeros(2, 1), adv, norms=Normalizers(tokens=6.0, sequences=2.0))
    settings = LossSettings(objective=objectives.ObjectiveSettings(loss_type="vespo"))
    result = grpo_loss(PolicyOutput(logps=logps, entropy=torch.zeros(2, 3)), batch, mask, settings, 0.0)
    # by hand, not through the function under test: W = prod_t pi(y_t) / mu(y_t) per sequence, and
    # the paper's kernel phi(W) = W^k exp(lambda (1 - W)) with the pair of the advantage's sign
    s = settings.objective
    phi = []
    for row, a in enumerate(adv.tolist()):
        w = math.exp(sum(logps[row, t].item() - sampler[row, t].item() for t in range(3)))
        k, lam = (s.vespo_k_pos, s.vespo_lambda_pos) if a > 0 else (s.vespo_k_neg, s.vespo_lambda_neg)
        phi.append(w**k * math.exp(lam * (1 - w)))
    want = sum(-phi[r] * adv[r].item() * logps[r, t].item() for r in range(2) for t in range(3)) / 6.0
    assert result.loss.item() == pytest.approx(want, rel=1e-6)
    assert all(abs(p - 1.0) > 1e-3 for p in phi)  # the sampler moved it; against old it would be 1
    # against the old policy (the bug) W = 1, phi = 1, and the loss would be the plain policy gradient
    assert result.loss.item() != pytest.approx(
        sum(-adv[r].item() * logps[r].sum().item() for r in range(2)) / 6.0
    )
    assert "sampling/importance_sampling_ratio/max" in result.sampling  # measured, not applied


def test_a_steps_sampling_metrics_are_over_all_its_micro_batches() -> None:
    """Max of the maxes, min of the mins, the means weighted by how many values each is over."""
    first = {
        "sampling/importance_sampling_ratio/max": 1.9,
        "sampling/importance_sampling_ratio/min": 0.8,
        "sampling/importance_sampling_ratio/mean": 1.0,
        "sampling/importance_sampling_ratio/count": 3.0,
    }
    second = {
        "sampling/importance_sampling_ratio/max": 1.2,
        "sampling/importance_sampling_ratio/min": 0.5,
        "sampling/importance_sampling_ratio/mean": 2.0,
        "sampling/importance_sampling_ratio/count": 1.0,
    }
    empty = {
        "sampling/importance_sampling_ratio/max": math.nan,
        "sampling/importance_sampling_ratio/min": math.nan,
        "sampling/importance_sampling_ratio/mean": math.nan,
        "sampling/importance_sampling_ratio/count": 0.0,
    }
    combined = combine_step_metrics([first, second, empty])  # fmt: skip
    assert combined == pytest.approx(
        {"sampling/importance_sampling_ratio/max": 1.9, "sampling/importance_sampling_ratio/min": 0.5,
         "sampling/importance_sampling_ratio/mean": 1.25}
    )  # fmt: skip
