"""EOS masking, rollout assembly and splitting, left padding, and the log-prob kernels."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.batch import Rollout
from posttrain.generation.base import Samples, build_rollout, mask_after_eos
from posttrain.grpo.objectives import Normalizers
from posttrain.ops.logprobs import entropy_from_logits, position_ids_from_mask, selective_log_softmax
from posttrain.ops.padding import left_pad
from posttrain.sampling.rollout import ScoredRollout

EOS, PAD = 2, 0

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


# ---- mask_after_eos ----------------------------------------------------------------------------


def test_mask_after_eos_cases():
    completion = ids(
        [
            [5, 6, EOS, 7, 8],  # EOS in the middle: kept, what follows masked
            [EOS, 5, 6, 7, 8],  # EOS first: only it counts
            [5, 6, 7, 8, 9],  # no EOS: cut at the length limit, everything counts
            [5, 6, 7, 8, EOS],  # EOS last
            [5, EOS, 6, EOS, 7],  # only the first EOS matters
        ]
    )
    mask, terminated = mask_after_eos(completion, [EOS])
    assert mask.tolist() == [
        [1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 1, 0, 0, 0],
    ]
    assert terminated.tolist() == [True, True, False, True, True]
    assert mask.dtype == torch.long


def test_mask_after_eos_several_eos_ids():
    """With EOS ids {2, 3} the earliest of either ends the completion."""
    completion = ids([[5, 3, 2, 9], [5, 9, 9, 2], [3, 2, 9, 9], [9, 9, 9, 9]])
    mask, terminated = mask_after_eos(completion, [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert terminated.tolist() == [True, True, True, False]


# ---- build_rollout -----------------------------------------------------------------------------


def test_build_rollout_replaces_masked_tokens_by_pad():
    prompt_ids = ids([[PAD, 11, 12], [13, 14, 15]])
    prompt_mask = ids([[0, 1, 1], [1, 1, 1]])
    logps = -torch.rand(2, 4)
    samples = Samples(completion_ids=ids([[5, EOS, 7, 8], [5, 6, 7, 8]]), logps=logps)
    r = build_rollout(prompt_ids, prompt_mask, samples, [EOS], PAD)
    assert r.completion_ids.tolist() == [[5, EOS, PAD, PAD], [5, 6, 7, 8]]
    assert r.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert r.is_terminated.tolist() == [True, False]
    assert r.completion_lengths.tolist() == [2, 4]
    assert r.prompt_ids is prompt_ids and r.prompt_mask is prompt_mask
    assert r.sampler_logps is logps


def test_build_rollout_pad_equal_to_eos():
    """pad_token_id == eos (a common setup): the first EOS still ends the completion."""
    samples = Samples(completion_ids=ids([[5, EOS, EOS, EOS]]))
    r = build_rollout(ids([[1]]), ids([[1]]), samples, [EOS], EOS)
    assert r.completion_mask.tolist() == [[1, 1, 0, 0]]
    assert r.completion_ids.tolist() == [[5, EOS, EOS, EOS]]
    assert r.sampler_logps is None


def test_build_rollout_empty_completions_have_no_tokens():
    """A backend that returns no tokens at all ([N, 0]): nothing was sampled, so no completion
    token should count (mask 0, length 0)."""
    samples = Samples(completion_ids=torch.zeros((2, 0), dtype=torch.long))
    r = build_rollout(ids([[1], [1]]), ids([[1], [1]]), samples, [EOS], PAD)
    assert r.completion_ids.shape == (2, 1)
    assert r.completion_lengths.tolist() == [0, 0]


# ---- ScoredRollout.split -----------------------------------------------------------------------


def make_scored() -> ScoredRollout:
    prompt_ids = ids([[0, 0, 11, 12], [0, 0, 0, 13], [14, 15, 16, 17], [0, 0, 18, 19]])
    prompt_mask = (prompt_ids != 0).long()
    completion_ids = ids([[21, EOS, 0, 0, 0], [22, 23, 24, EOS, 0], [25, 0, 0, 0, 0], [26, 27, EOS, 0, 0]])
    completion_mask = ids([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 1, 0, 0]])
    sampler = -torch.arange(20, dtype=torch.float32).view(4, 5)
    rollout = Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        is_terminated=torch.tensor([True, True, False, True]),
        sampler_logps=sampler,
    )
    return ScoredRollout(
        rollout=rollout,
        rewards=torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]),
        advantages=torch.tensor([0.1, 0.2, 0.3, 0.4]),
        old_logps=torch.arange(20, dtype=torch.float32).view(4, 5),
        norms=Normalizers(tokens=3.5),
        extra={"tag": "x"},
    )


def test_split_trims_padding_per_chunk_and_keeps_rows_aligned():
    scored = make_scored()
    first, second = scored.split(2)

    # Rows 0-1: longest prompt 2 tokens, longest completion 4 tokens.
    r = first.rollout
    assert r.prompt_ids.tolist() == [[11, 12], [0, 13]]
    assert r.prompt_mask.tolist() == [[1, 1], [0, 1]]
    assert r.completion_ids.tolist() == [[21, EOS, 0, 0], [22, 23, 24, EOS]]
    assert r.completion_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert r.is_terminated.tolist() == [True, True]
    assert r.sampler_logps.tolist() == [[0.0, -1.0, -2.0, -3.0], [-5.0, -6.0, -7.0, -8.0]]
    assert first.old_logps.tolist() == [[0.0, 1.0, 2.0, 3.0], [5.0, 6.0, 7.0, 8.0]]
    torch.testing.assert_close(first.advantages, torch.tensor([0.1, 0.2]))
    torch.testing.assert_close(first.rewards, torch.tensor([[1.0, 10.0], [2.0, 20.0]]))

    # Rows 2-3: the prompt of row 2 fills all 4 columns; longest completion 3 tokens.
    r = second.rollout
    assert r.prompt_ids.tolist() == [[14, 15, 16, 17], [0, 0, 18, 19]]
    assert r.completion_ids.tolist() == [[25, 0, 0], [26, 27, EOS]]
    assert r.completion_mask.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert r.is_terminated.tolist() == [False, True]
    assert second.old_logps.tolist() == [[10.0, 11.0, 12.0], [15.0, 16.0, 17.0]]
    assert r.sampler_logps.shape == (2, 3)
    torch.testing.assert_close(second.advantages, torch.tensor([0.3, 0.4]))
    torch.testing.assert_close(second.rewards, torch.tensor([[3.0, 30.0], [4.0, 40.0]]))

    for chunk in (first, second):
        assert chunk.norms.tokens == 3.5
        assert chunk.extra == {"tag": "x"}
    # The original is left untouched.
    assert scored.rollout.completion_ids.shape == (4, 5)
    assert scored.rollout.prompt_ids.shape == (4, 4)


def test_split_single_rows_follow_their_values():
    scored = make_scored()
    chunks = scored.split(4)
    lengths = [2, 4, 1, 3]
    prompt_lengths = [2, 1, 4, 2]
    for i, c in enumerate(chunks):
        assert c.rollout.completion_ids.shape == (1, lengths[i])
        assert c.rollout.prompt_ids.shape == (1, prompt_lengths[i])
        assert c.rollout.prompt_mask.all()
        assert c.rollout.completion_mask.all()
        assert c.advantages.tolist() == pytest.approx([0.1 * (i + 1)])
        assert c.rewards.tolist() == [[float(i + 1), 10.0 * (i + 1)]]
        assert c.old_logps[0, 0].item() == 5.0 * i


def test_split_one_chunk_trims_whole_batch():
    (whole,) = make_scored().split(1)
    assert whole.rollout.prompt_ids.shape == (4, 4)
    assert whole.rollout.completion_ids.shape == (4, 4)  # longest completion is 4 of 5 columns


def test_split_without_optional_tensors_and_all_masked():
    rollout = Rollout(
        prompt_ids=ids([[1], [2]]),
        prompt_mask=ids([[1], [1]]),
        completion_ids=ids([[0, 0], [0, 0]]),
        completion_mask=ids([[0, 0], [0, 0]]),
        is_terminated=torch.tensor([False, False]),
    )
    scored = ScoredRollout(rollout=rollout, rewards=torch.zeros(2, 1), advantages=torch.zeros(2))
    (chunk,) = scored.split(1)
    assert chunk.old_logps is None and chunk.rollout.sampler_logps is None
    assert chunk.rollout.completion_ids.shape == (2, 1)  # at least one column is kept


def test_split_uneven_raises():
    with pytest.raises(ValueError, match="4 rows cannot be split into 3"):
        make_scored().split(3)


# ---- left_pad ----------------------------------------------------------------------------------


def test_left_pad():
    out, mask = left_pad([[1, 2, 3], [4], []], pad_token_id=9)
    assert out.tolist() == [[1, 2, 3], [9, 9, 4], [9, 9, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert out.dtype == mask.dtype == torch.long


def test_left_pad_multiple_of():
    out, mask = left_pad([[1, 2, 3], [4]], pad_token_id=0, multiple_of=4)
    assert out.tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]]
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]
    out, _ = left_pad([[1, 2, 3, 4], [5]], pad_token_id=0, multiple_of=4)  # already a multiple
    assert out.shape == (2, 4)
    out, _ = left_pad([[1] * 5], pad_token_id=0, multiple_of=4)
    assert out.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]


def test_left_pad_empty_batch():
    out, mask = left_pad([], pad_token_id=0, multiple_of=8)
    assert out.shape == mask.shape == (0, 0)


def test_position_ids_skip_left_padding():
    mask = ids([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


# ---- log-prob kernels --------------------------------------------------------------------------


def test_selective_log_softmax_matches_full_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 17, generator=gen) * 3
    targets = torch.randint(0, 17, (3, 6), generator=gen)
    naive = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    out = selective_log_softmax(logits, targets)
    assert out.shape == (3, 6)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-6)


def test_selective_log_softmax_gradient_matches_naive():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 4), generator=gen)
    a, b = base.clone().requires_grad_(True), base.clone().requires_grad_(True)
    selective_log_softmax(a, targets).sum().backward()
    torch.log_softmax(b, dim=-1).gather(-1, targets.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_selective_log_softmax_low_precision_input_is_computed_in_float32():
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(2, 3, 13, generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 13, (2, 3), generator=gen)
    out = selective_log_softmax(logits, targets)
    assert out.dtype == torch.float32
    naive = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-6)


def test_entropy_from_logits_matches_naive():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, 19, generator=gen) * 2
    logp = torch.log_softmax(logits, dim=-1)
    naive = -(logp.exp() * logp).sum(dim=-1)
    out = entropy_from_logits(logits)
    assert out.shape == (3, 5)
    torch.testing.assert_close(out, naive, rtol=1e-5, atol=1e-6)


def test_entropy_limits():
    """Uniform logits over V give log V; one dominant logit gives about 0."""
    v = 8
    uniform = torch.zeros(1, 1, v)
    peaked = torch.tensor([[[100.0] + [0.0] * (v - 1)]])
    torch.testing.assert_close(
        entropy_from_logits(uniform), torch.tensor([[float(torch.log(torch.tensor(v)))]])
    )
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)
