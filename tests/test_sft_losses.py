"""SFT losses (NLL, DFT) and metrics: golden values worked by hand, gradients, accumulation invariance."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.sft.losses import (
    LOSS_TYPES,
    dft_loss,
    entropy_mean,
    mean_token_accuracy,
    nll_loss,
    resolve_loss_type,
)

#: Probabilities of the target tokens; the mask leaves out (0, 0) and (1, 2).
PROBS = torch.tensor([[0.5, 0.25, 1.0], [0.8, 0.1, 0.3]], dtype=torch.float64)
MASK = torch.tensor([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_nll_golden():
    """Targets p = .25, 1, .8, .1: -(ln .25 + ln 1 + ln .8 + ln .1) / 4
    = (1.3862944 + 0 + 0.2231436 + 2.3025851) / 4 = 3.9120231 / 4 = 0.9780058."""
    loss = nll_loss(PROBS.log(), MASK, 4)
    torch.testing.assert_close(loss.item(), 0.97800577, rtol=1e-5, atol=0)
    # the divisor is the given count, not the mask's: 8 targets in the whole batch halve it
    torch.testing.assert_close(nll_loss(PROBS.log(), MASK, 8).item(), 0.97800577 / 2, rtol=1e-5, atol=0)


def test_dft_golden():
    """-(.25 ln .25 + 1 ln 1 + .8 ln .8 + .1 ln .1) / 4 = (0.3465736 + 0 + 0.1785149 + 0.2302585) / 4
    = 0.7553470 / 4 = 0.1888367."""
    loss = dft_loss(PROBS.log(), MASK, 4)
    torch.testing.assert_close(loss.item(), 0.18883675, rtol=1e-5, atol=0)


def test_dft_gradient_is_probability_times_the_nll_gradient():
    """d/dlogp of -sg(p) logp mask / N is -p mask / N: the weight is detached, so no p * logp term."""
    logps = PROBS.log().requires_grad_()
    dft_loss(logps, MASK, 4).backward()
    torch.testing.assert_close(logps.grad, -PROBS * MASK / 4)
    logps.grad = None
    nll_loss(logps, MASK, 4).backward()
    torch.testing.assert_close(logps.grad, -MASK / 4)


def test_dft_gradient_through_logits():
    """Through a softmax: grad_logits(DFT) = p_target * grad_logits(NLL) row by row."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 4, 0], [2, 2, 3]])
    mask = MASK

    def grads(fn):
        logits.grad = None
        logps = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
        fn(logps, mask, 4).backward()
        return logits.grad.clone(), logps.detach().exp()

    g_dft, p = grads(dft_loss)
    g_nll, _ = grads(nll_loss)
    torch.testing.assert_close(g_dft, p[..., None] * g_nll)


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_two_micro_batches_with_the_global_count_equal_one_batch(loss_type):
    """Rows split 1 + 1 with num_items = targets of both: the losses and gradients add up to the 2-row batch."""
    fn = LOSS_TYPES[loss_type]
    num_items = MASK.sum()
    whole_logps = PROBS.log().requires_grad_()
    whole = fn(whole_logps, MASK, num_items)
    whole.backward()
    parts_logps = PROBS.log().requires_grad_()
    parts = sum(fn(parts_logps[i : i + 1], MASK[i : i + 1], num_items) for i in range(2))
    parts.backward()
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(parts_logps.grad, whole_logps.grad)
    # dividing each micro-batch by its own count instead would differ once the rows' counts differ
    uneven = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    local = sum(fn(PROBS.log()[i : i + 1], uneven[i : i + 1], uneven[i].sum()) for i in range(2)) / 2
    assert not math.isclose(local.item(), fn(PROBS.log(), uneven, uneven.sum()).item(), rel_tol=1e-6)


def test_loss_type_table_and_deprecated_alias():
    assert resolve_loss_type("nll") is nll_loss and resolve_loss_type("dft") is dft_loss
    with pytest.warns(FutureWarning, match="'chunked_nll' is deprecated and means 'nll'"):
        assert resolve_loss_type("chunked_nll") is nll_loss
    with pytest.raises(ValueError, match=r"loss_type='sum'.*\['nll', 'dft', 'chunked_nll'\]"):
        resolve_loss_type("sum")


def test_loss_input_errors():
    with pytest.raises(ValueError, match="num_items=0.0: the accumulation batch has no target token"):
        nll_loss(PROBS.log(), MASK, 0)
    with pytest.raises(ValueError, match=r"logps \(2, 3\) and mask \(2, 2\) must have the same shape"):
        dft_loss(PROBS.log(), MASK[:, :2], 4)


def test_mean_token_accuracy_golden():
    """Masked positions (0,1) F, (0,2) T, (1,0) F, (1,1) F: 1 right of 4 = 0.25; no target gives 0."""
    correct = torch.tensor([[True, False, True], [False, False, True]])
    assert mean_token_accuracy(correct, MASK).item() == pytest.approx(0.25, rel=1e-6)
    assert mean_token_accuracy(correct, torch.zeros_like(MASK)).item() == 0.0


def test_entropy_mean_golden():
    """Entropies 2 and 4 on the targets, 100 off them: mean (2 + 4) / 2 = 3."""
    entropy = torch.tensor([[100.0, 2.0], [4.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    value = entropy_mean(entropy, mask)
    assert value.item() == pytest.approx(3.0, rel=1e-6) and not value.requires_grad
