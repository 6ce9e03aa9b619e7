"""The per-position head summaries of ``sequence_token_stats`` (DPO's logits metrics, WPO's weight)
equal the same quantities taken from full logits."""

from __future__ import annotations

import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.ops.logprobs import sequence_token_stats


def test_logit_mean_and_log_sq_norm_match_full_logits():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    ids = torch.randint(0, len(tok), (3, 11))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    chunked = sequence_token_stats(
        model, ids, mask, positions, chunk_size=4, with_logit_mean=True, with_log_sq_norm=True
    )
    full = sequence_token_stats(
        model, ids, mask, positions, chunk_size=None, with_logit_mean=True, with_log_sq_norm=True
    )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, :-1].double()
    probs = torch.softmax(logits, dim=-1)
    expected_mean = logits.mean(dim=-1)
    expected_sq = torch.log((probs**2).sum(dim=-1))
    real = mask[:, :-1].bool()  # positions whose hidden state is a real token's (padding's are not defined)
    for stats in (chunked, full):
        torch.testing.assert_close(stats.logit_mean.double()[real], expected_mean[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats.log_sq_norm.double()[real], expected_sq[real], rtol=1e-5, atol=1e-5)
        assert not stats.logit_mean.requires_grad and not stats.log_sq_norm.requires_grad
    assert chunked.logps.requires_grad


def test_summaries_are_off_by_default():
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    ids = torch.randint(0, len(tok), (2, 5))
    stats = sequence_token_stats(model, ids, None, torch.arange(5).expand(2, 5))
    assert stats.logit_mean is None and stats.log_sq_norm is None


def test_accuracy_counts_every_argmax_target_on_both_paths():
    """``mean_token_accuracy`` counts ``logps == top``: on greedy text every target is the argmax,
    so both the chunked and the full-logits path (sharded heads, models without a chunked head)
    must count every one. The full path once took ``top`` as ``max - logsumexp`` against log-probs
    normalised with the argmax left out, and missed hits that differed in the last bit."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    with torch.no_grad():  # sharpen the head: confident predictions are where the forms round apart
        model.lm_head.weight.mul_(40.0)
    prompt = torch.randint(3, len(tok), (4, 3))
    ids = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=24,
                         min_new_tokens=24, pad_token_id=0)  # fmt: skip
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=positions).logits[:, :-1]
    greedy = logits.argmax(dim=-1) == ids[:, 1:]  # [4, 26]: every generated target, by construction
    assert greedy[:, 2:].all()
    for chunk_size in (4, None):
        stats = sequence_token_stats(model, ids, None, positions, chunk_size=chunk_size, with_top=True)
        assert torch.equal(stats.logps.detach() == stats.top, greedy), chunk_size
