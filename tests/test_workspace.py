"""Scratch buffers kept between calls (ops/workspace.py) and the chunked head that uses them.

The head's largest temporaries (a chunk's logits, their exponentials, the bf16 copy of the
weight and of its gradient's products) live in kept buffers, so a later chunk, call or step
touches the same pages. What a user relies on: the numbers do not change, and a kept buffer
is never alive in two places (two forwards before one backward, two threads).
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.ops import chunked, head_forward, workspace

TEMPERATURE = 0.7


@pytest.fixture(autouse=True)
def fresh_pool():
    workspace.release()
    yield
    workspace.release()


def test_the_same_name_and_dtype_get_the_same_pages():
    a = workspace.scratch("x", (4, 5), torch.float32, torch.device("cpu"))
    b = workspace.scratch("x", (2, 5), torch.float32, torch.device("cpu"))
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 5) and b.is_contiguous()
    other_name = workspace.scratch("y", (4, 5), torch.float32, torch.device("cpu"))
    other_dtype = workspace.scratch("x", (4, 5), torch.bfloat16, torch.device("cpu"))
    assert len({a.data_ptr(), other_name.data_ptr(), other_dtype.data_ptr()}) == 3
    assert workspace.held_bytes() == 20 * 4 + 20 * 4 + 20 * 2


def test_a_larger_shape_grows_the_buffer_and_release_frees_it():
    workspace.scratch("x", (3,), torch.float32, torch.device("cpu"))
    grown = workspace.scratch("x", (10, 10), torch.float32, torch.device("cpu"))
    assert grown.shape == (10, 10) and workspace.held_bytes() == 400
    workspace.release()
    assert workspace.held_bytes() == 0


def test_other_devices_get_fresh_tensors_and_keep_nothing():
    t = workspace.scratch("x", (3, 3), torch.float32, torch.device("meta"))
    assert t.device.type == "meta" and t.shape == (3, 3)
    assert workspace.held_bytes() == 0


def test_each_thread_has_its_own_buffers():
    mine = workspace.scratch("x", (8,), torch.float32, torch.device("cpu"))
    theirs = []
    thread = threading.Thread(
        target=lambda: theirs.append(
            workspace.scratch("x", (8,), torch.float32, torch.device("cpu")).data_ptr()
        )
    )
    thread.start()
    thread.join()
    assert theirs[0] != mine.data_ptr()


def _head(seed: int, rows: int = 37, vocab: int = 300, width: int = 24):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g).mul_(0.5).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return hidden, weight, targets


@pytest.mark.parametrize("product_dtype", [None, torch.bfloat16])
def test_two_forwards_before_one_backward_keep_their_own_gradients(product_dtype):
    """Two heads (a policy and another model, or two micro-batches) project through the same kept
    buffers before backward runs: each backward must still see its own weight and hidden states."""
    first, second = _head(1), _head(2, rows=21)

    def loss(head):
        hidden, weight, targets = head
        logps, entropy = chunked.token_stats(
            hidden, weight, None, targets, TEMPERATURE, 16, True, True, product_dtype=product_dtype
        )
        return (logps * torch.linspace(-1, 1, logps.numel())).sum() + 0.3 * entropy.sum()

    alone = [torch.autograd.grad(loss(head), head[:2]) for head in (first, second)]
    together = torch.autograd.grad(loss(first) + loss(second), first[:2] + second[:2])
    for want, got in zip([*alone[0], *alone[1]], together, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_weight_cast_is_not_kept_alive_between_forward_and_backward():
    """Under bf16 products, forward casts the [V, H] weight into the kept buffer and backward casts
    it again; the graph keeps the float32 weight (already alive), not a second copy."""
    hidden, weight, targets = _head(3)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chunked.token_stats(hidden, weight, None, targets, product_dtype=torch.bfloat16)
    assert any(t.data_ptr() == weight.data_ptr() for t in saved)
    assert not any(t.dtype == torch.bfloat16 and t.shape == weight.shape for t in saved)


def test_the_head_reuses_its_pages_across_calls():
    hidden, weight, targets = _head(4, rows=64, vocab=512)
    chunked.token_stats(hidden, weight, None, targets, 1.0, 32, True)[0].sum().backward()
    held = workspace.held_bytes()
    assert held >= 2 * 32 * 512 * 4  # a chunk's logits and their exponentials
    chunked.token_stats(hidden, weight, None, targets, 1.0, 32, True)[0].sum().backward()
    assert workspace.held_bytes() == held


def test_a_verified_model_skips_its_head_in_the_forward():
    """Once its logits have been checked against lm_head(hidden), the model's own head is not run:
    ``out.logits`` has no vocabulary entries, the head's forward is restored after the call, and
    the chunked log-probs are unchanged."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)
    ids = torch.randint(3, len(tok), (2, 7))
    head_forward._VERIFIED.pop(model, None)
    out, hidden = chunked.run_with_hidden(model, input_ids=ids)
    assert out.logits.shape == (2, 1, model.config.vocab_size)
    assert chunked.logits_match_head(model, out, hidden)
    again, hidden_again = chunked.run_with_hidden(model, input_ids=ids)
    assert again.logits.shape == (2, 1, 0)
    assert "forward" not in model.lm_head.__dict__
    torch.testing.assert_close(hidden_again, hidden, rtol=0, atol=0)
    with pytest.raises(IndexError):  # a failing forward restores the head too
        chunked.run_with_hidden(model, input_ids=ids + 10**6)
    assert "forward" not in model.lm_head.__dict__
