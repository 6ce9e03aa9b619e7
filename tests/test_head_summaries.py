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
