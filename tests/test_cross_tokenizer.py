"""Cross-tokenizer distillation math (``ops/token_alignment.py``, ``ops/cross_tokenizer.py``).

Two tiny byte-level BPE tokenizers are built here from explicit merges (no training, so every
token is known), over the same 256-byte alphabet with different special tokens and merges. They cut
``"café au lait"`` (13 bytes: ``é`` is ``\\xc3\\xa9``) differently::

    student  caf | é     | ␣a | u | ␣lait        bytes (0,3) (3,5) (5,7) (7,8) (8,13)
    teacher  ca  | f\\xc3 | \\xa9 | ␣au | ␣la | it   bytes (0,2) (2,5) (3,5) (5,8) (8,11) (11,13)

The teacher's ``f\\xc3`` holds half of ``é``: the tokenizer reports the whole character for it and
for ``\\xa9``, so their byte spans overlap and they form one unit. The groups, by hand:
``café`` (student 0-1, teacher 0-2), `` au`` (two student tokens, one teacher token), `` lait``
(one student token, two teacher tokens).
"""

from __future__ import annotations

import math

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.ops.cross_tokenizer import (
    build_projection_matrix,
    common_map_from_projection,
    hybrid_terms,
    load_projection_matrix,
    matched_tokens,
    merge_group_distributions,
    save_projection_matrix,
    tempered_log_softmax,
    token_bytes,
    uld_distance,
    uld_loss,
    xtoken_h_kl,
    xtoken_p_kl,
)
from posttrain.ops.token_alignment import AlignedGroup, align_spans, byte_offsets, char_to_byte_offsets

TEXT = "café au lait"
STUDENT_MERGES = [
    ("c", "a"),
    ("ca", "f"),
    ("Ã", "©"),
    ("Ġ", "a"),
    ("Ġ", "l"),
    ("Ġl", "a"),
    ("Ġla", "i"),
    ("Ġlai", "t"),
    ("Ġ", "Ã"),  # half of a character after a space
]
TEACHER_MERGES = [("c", "a"), ("f", "Ã"), ("Ġ", "a"), ("Ġa", "u"), ("Ġ", "l"), ("Ġl", "a"), ("i", "t")]


def _byte_chars() -> list[str]:
    """Byte-level BPE's stand-in character for each byte, in byte order (space is Ġ)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    assert set(out) == set(pre_tokenizers.ByteLevel.alphabet())
    return out


def build_bpe(merges: list[tuple[str, str]], specials: list[str]) -> PreTrainedTokenizerFast:
    """Specials first, then the 256 bytes in byte order, then one token per merge."""
    vocab: dict[str, int] = {}
    for piece in [*specials, *_byte_chars(), *(a + b for a, b in merges)]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[-1])


@pytest.fixture(scope="module")
def student():
    return build_bpe(STUDENT_MERGES, ["<|endoftext|>"])


@pytest.fixture(scope="module")
def teacher():
    return build_bpe(TEACHER_MERGES, ["<s>", "</s>"])


def probs(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# --- span alignment -------------------------------------------------------------------------------


def test_byte_offsets_of_the_two_tokenizers(student, teacher) -> None:
    s, t = byte_offsets(student, TEXT), byte_offsets(teacher, TEXT)
    assert student.convert_ids_to_tokens(s.ids) == ["caf", "Ã©", "Ġa", "u", "Ġlait"]
    assert s.offsets == [(0, 3), (3, 5), (5, 7), (7, 8), (8, 13)]
    assert teacher.convert_ids_to_tokens(t.ids) == ["ca", "fÃ", "©", "Ġau", "Ġla", "it"]
    assert t.offsets == [(0, 2), (2, 5), (3, 5), (5, 8), (8, 11), (11, 13)]


def test_align_spans_by_hand(student, teacher) -> None:
    """café: 2 student tokens vs 3 teacher tokens (one straddling é); ' au': 2 vs 1; ' lait': 1 vs 2."""
    alignment = align_spans(byte_offsets(student, TEXT).offsets, byte_offsets(teacher, TEXT).offsets)
    assert alignment.groups == (
        AlignedGroup(student=(0, 2), teacher=(0, 3), span=(0, 5)),
        AlignedGroup(student=(2, 4), teacher=(3, 4), span=(5, 8)),
        AlignedGroup(student=(4, 5), teacher=(4, 6), span=(8, 13)),
    )
    assert alignment.student_skipped == () and alignment.teacher_skipped == ()
    assert alignment.student_ranges().tolist() == [[0, 2], [2, 4], [4, 5]]
    assert alignment.teacher_ranges().tolist() == [[0, 3], [3, 4], [4, 6]]
    assert alignment.shifted(student=10, teacher=20).groups[0].teacher == (20, 23)
    assert len(alignment.drop_last()) == 2


def test_euro_sign_is_three_bytes() -> None:
    assert char_to_byte_offsets("a€b", [(0, 1), (1, 2), (2, 3)]) == [(0, 1), (1, 4), (4, 5)]


def test_zero_width_and_skipped_tokens_open_no_group() -> None:
    """A BOS (0, 0) and an EOS past the text (5, 5), and an EOS skipped on request."""
    student = [(0, 0), (0, 3), (3, 5)]
    teacher = [(0, 5), (5, 5)]
    alignment = align_spans(student, teacher)
    assert alignment.groups == (AlignedGroup((1, 3), (0, 1), (0, 5)),)
    assert alignment.student_skipped == (0,) and alignment.teacher_skipped == (1,)
    with_eos = align_spans([(0, 3), (3, 5), (5, 10)], [(0, 5), (5, 10)], student_skip=[2], teacher_skip=[1])
    assert with_eos.groups == (AlignedGroup((0, 2), (0, 1), (0, 5)),)
    assert with_eos.student_skipped == (2,) and with_eos.teacher_skipped == (1,)


def test_a_ragged_end_joins_the_last_group() -> None:
    alignment = align_spans([(0, 2), (2, 4), (4, 6)], [(0, 2), (2, 5)])
    assert alignment.groups == (AlignedGroup((0, 1), (0, 1), (0, 2)), AlignedGroup((1, 3), (1, 2), (2, 6)))


# --- merging a group's rows -----------------------------------------------------------------------

ROWS = [[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.25, 0.25, 0.5], [0.7, 0.2, 0.1]]
TOKENS = torch.tensor([2, 1, 0, 2])


def test_merge_group_distributions_by_hand() -> None:
    """Groups {1, 2} and {3} of a 4-token sequence; row t predicts token t + 1.

    bayesian chain, group {1, 2}: rows 0-1: p_0 * p_1(token 2 = 0) = [0.5, 0.3, 0.2] * 0.1.
    observed chain, group {1, 2}: rows 1-2: p_1 * p_2(token 3 = 2) = [0.1, 0.6, 0.3] * 0.5.
    first: the first row; mean: the mean of the rows' log-probs.
    """
    logps = probs(ROWS).log()
    groups = torch.tensor([[1, 3], [3, 4]])
    merged, valid = merge_group_distributions(logps, TOKENS, groups, strategy="bayesian", merge="chain")
    torch.testing.assert_close(merged.exp(), probs([[0.05, 0.03, 0.02], ROWS[2]]), rtol=1e-6, atol=0)
    assert valid.tolist() == [True, True]
    merged, valid = merge_group_distributions(logps, TOKENS, groups, strategy="observed", merge="chain")
    torch.testing.assert_close(merged.exp(), probs([[0.05, 0.3, 0.15], ROWS[3]]), rtol=1e-6, atol=0)
    assert valid.tolist() == [True, True]
    merged, _ = merge_group_distributions(logps, TOKENS, groups, strategy="observed", merge="first")
    torch.testing.assert_close(merged, logps[[1, 3]])
    merged, _ = merge_group_distributions(logps, TOKENS, groups, strategy="observed", merge="mean")
    torch.testing.assert_close(merged[0], (logps[1] + logps[2]) / 2)


def test_groups_outside_the_sequence_are_invalid() -> None:
    logps = probs(ROWS).log()
    _, valid = merge_group_distributions(logps, TOKENS, torch.tensor([[0, 1], [1, 2]]), strategy="bayesian")
    assert valid.tolist() == [False, True]  # token 0 has no row before it
    _, valid = merge_group_distributions(logps, TOKENS, torch.tensor([[2, 4]]), strategy="observed")
    assert valid.tolist() == [False]  # chaining row 3 needs a token 4
    with pytest.raises(ValueError, match="strategy"):
        merge_group_distributions(logps, TOKENS, torch.tensor([[0, 1]]), strategy="greedy")


# --- ULD ------------------------------------------------------------------------------------------


def test_uld_distance_by_hand() -> None:
    """sort(p_s) = [.5, .3, .2, 0] (padded), sort(p_t) = [.6, .25, .1, .05]: L1 = .1 + .05 + .1 + .05."""
    s, t = probs([[0.5, 0.2, 0.3]]), probs([[0.1, 0.6, 0.25, 0.05]])
    torch.testing.assert_close(
        uld_distance(s, t), torch.tensor([0.3], dtype=torch.float64), rtol=1e-6, atol=0
    )
    # top 2 with a tail bucket: |.5 - .6| + |.3 - .25| + |(1 - .8) - (1 - .85)| = .2
    torch.testing.assert_close(
        uld_distance(s, t, top_k=2), torch.tensor([0.2], dtype=torch.float64), rtol=1e-6, atol=0
    )
    assert uld_distance(t, s).item() == pytest.approx(0.3, rel=1e-6)  # the longer side may be the student's


def test_uld_loss_ignores_token_identity_and_is_zero_for_equal_distributions() -> None:
    gen = torch.Generator().manual_seed(0)
    s = torch.rand(5, 7, generator=gen, dtype=torch.float64).softmax(-1)
    t = torch.rand(5, 11, generator=gen, dtype=torch.float64).softmax(-1)
    index = torch.tensor([0, 0, 1, 1, 1])
    loss, _ = uld_loss(s, t, index, 2)
    permuted, _ = uld_loss(
        s[:, torch.randperm(7, generator=gen)], t[:, torch.randperm(11, generator=gen)], index, 2
    )
    torch.testing.assert_close(permuted, loss, rtol=1e-6, atol=0)
    assert loss.item() > 0
    same, _ = uld_loss(s, s[:, torch.randperm(7, generator=gen)], index, 2)
    assert same.item() == pytest.approx(0.0, abs=1e-12)


def test_uld_loss_is_the_batch_mean_of_per_sample_group_means() -> None:
    """Sample 0 has groups 0-1, sample 1 group 2, sample 2 none (it does not count)."""
    gen = torch.Generator().manual_seed(1)
    s = torch.rand(3, 4, generator=gen, dtype=torch.float64).softmax(-1)
    t = torch.rand(3, 6, generator=gen, dtype=torch.float64).softmax(-1)
    d = uld_distance(s, t)
    ce = torch.tensor(2.0, dtype=torch.float64)
    loss, metrics = uld_loss(
        s, t, torch.tensor([0, 0, 1]), 3, crossentropy=ce, distillation_weight=0.5, crossentropy_weight=0.1
    )
    expected = 0.5 * ((d[0] + d[1]) / 2 + d[2]) / 2 + 0.1 * 2.0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["crossentropy"] == 2.0
    with pytest.raises(ValueError, match="cross-entropy"):
        uld_loss(s, t, torch.tensor([0, 0, 1]), 3, crossentropy_weight=1.0)


# --- hybrid, matched tokens, H-KL -----------------------------------------------------------------

P_S = [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2]]
P_T = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.6, 0.1, 0.2]]
# s0 -> t0 (1.0); s1 -> t1, t2 (0.5 each: below 0.6, uncommon); s2 -> t3 (0.7), t2 (0.3).
W = torch.sparse_coo_tensor(
    torch.tensor([[0, 1, 1, 2, 2], [0, 1, 2, 3, 2]]),
    torch.tensor([1.0, 0.5, 0.5, 0.7, 0.3]),
    (3, 4),
    check_invariants=True,
).coalesce()
# Row 0: common s0~t0, s2~t3; renormalised s = [.5, .2] / .7, t = [.4, .1] / .5 = [.8, .2].
KL_COMMON_0 = 0.8 * math.log(0.8 / (5 / 7)) + 0.2 * math.log(0.2 / (2 / 7))
L1_UNCOMMON_0 = 0.2  # student [.3] vs teacher [.3, .2]


def test_hybrid_terms_by_hand() -> None:
    terms = hybrid_terms(probs(P_S[:1]), probs(P_T[:1]), torch.tensor([0, -1, 3]))
    assert terms.common.item() == pytest.approx(KL_COMMON_0, rel=1e-6)
    assert terms.uncommon.item() == pytest.approx(L1_UNCOMMON_0, rel=1e-6)
    loss, metrics = uld_loss(
        probs(P_S[:1]), probs(P_T[:1]), torch.tensor([0]), 1, common_map=torch.tensor([0, -1, 3]),
        matched_weight=2.0, unmatched_weight=0.5,
    )  # fmt: skip
    assert loss.item() == pytest.approx(2.0 * KL_COMMON_0 + 0.5 * L1_UNCOMMON_0, rel=1e-6)
    assert metrics["matched_loss"] == pytest.approx(KL_COMMON_0, rel=1e-6)
    assert metrics["unmatched_loss"] == pytest.approx(L1_UNCOMMON_0, rel=1e-6)


def test_xtoken_h_kl_by_hand() -> None:
    assert common_map_from_projection(W, 0.6).tolist() == [0, -1, 3]
    assert common_map_from_projection(W, 0.5).tolist() == [0, 1, 3]  # a tie goes to the lowest id
    terms = xtoken_h_kl(probs(P_S[:1]).log(), probs(P_T[:1]).log(), W.double())
    assert terms.common.item() == pytest.approx(KL_COMMON_0, rel=1e-6)
    assert terms.uncommon.item() == pytest.approx(L1_UNCOMMON_0, rel=1e-6)
    assert terms.total().item() == pytest.approx(KL_COMMON_0 + L1_UNCOMMON_0, rel=1e-6)


def test_matched_tokens_of_the_two_tokenizers(student, teacher) -> None:
    """The 256 bytes and ca, Ġa, Ġl, Ġla are in both; the specials, caf, Ã©, Ġlai, Ġlait, ĠÃ are not."""
    match = matched_tokens(student, teacher)
    assert match.shape == (len(student),)
    assert int((match >= 0).sum()) == 256 + 4
    s_id, t_id = student.convert_tokens_to_ids, teacher.convert_tokens_to_ids
    for piece in ("a", "Ã", "ca", "Ġa", "Ġla"):
        assert match[s_id(piece)] == t_id(piece)
    for piece in ("caf", "Ã©", "Ġlait", "ĠÃ", "<|endoftext|>"):
        assert match[s_id(piece)] == -1
    assert token_bytes(teacher)[t_id("fÃ")] == b"f\xc3"


# --- the projection matrix ------------------------------------------------------------------------


def _row(matrix: torch.Tensor, i: int) -> dict[int, float]:
    dense = matrix.to_dense()[i]
    return {j: round(dense[j].item(), 6) for j in dense.nonzero().squeeze(-1).tolist()}


def test_projection_matrix_rows(student, teacher) -> None:
    s_id, t_id = student.convert_tokens_to_ids, teacher.convert_tokens_to_ids
    first = build_projection_matrix(student, teacher)
    assert first.is_sparse and first.shape == (len(student), len(teacher))
    torch.testing.assert_close(first.to_dense().sum(-1), torch.ones(len(student)))
    assert _row(first, s_id("ca")) == {t_id("ca"): 1.0}  # in both vocabularies: itself, weight 1
    assert _row(first, s_id("Ã")) == {t_id("Ã"): 1.0}  # half a character, in both
    assert _row(first, s_id("caf")) == {t_id("ca"): 1.0}  # re-tokenised ca|f: the first piece
    assert _row(first, s_id("Ã©")) == {t_id("Ã"): 1.0}  # é is Ã|© for the teacher
    assert _row(first, s_id("<|endoftext|>")) == {t_id("</s>"): 1.0}  # EOS to EOS
    spread = build_projection_matrix(student, teacher, multi_token="spread")
    assert _row(spread, s_id("Ġlait")) == {t_id("Ġla"): round(2 / 3, 6), t_id("it"): round(1 / 3, 6)}
    # " \xc3" is half a character: cut into the longest teacher tokens, Ġ|Ã
    assert _row(spread, s_id("ĠÃ")) == {t_id("Ġ"): round(2 / 3, 6), t_id("Ã"): round(1 / 3, 6)}
    top1 = build_projection_matrix(student, teacher, top_k=1, multi_token="spread")
    assert _row(top1, s_id("Ġlait")) == {t_id("Ġla"): 1.0}
    padded = build_projection_matrix(student, teacher, student_vocab_size=len(student) + 3)
    assert _row(padded, len(student) + 2) == {t_id("</s>"): 1.0}  # a padding row: the teacher's EOS


def test_projection_matrix_round_trip_and_wrong_shape(tmp_path, student, teacher) -> None:
    matrix = build_projection_matrix(student, teacher, multi_token="spread")
    path = tmp_path / "projection.pt"
    save_projection_matrix(matrix, path)
    loaded = load_projection_matrix(path, len(student), len(teacher))
    torch.testing.assert_close(loaded.to_dense(), matrix.to_dense())
    with pytest.raises(ValueError) as info:
        load_projection_matrix(path, len(student), 300)
    assert f"({len(student)}, {len(teacher)})" in str(info.value)  # found
    assert f"({len(student)}, 300)" in str(info.value)  # expected


# --- P-KL -----------------------------------------------------------------------------------------


def test_xtoken_p_kl_by_hand() -> None:
    """q = p_s W: row 0 [.5, .15, .21, .14], row 1 [.2, .3, .36, .14]. Teacher mass over the batch
    [.5, .9, .3, .3]: the global top-2 is {t1, t0}. Per row sum over K of p_t log(p_t / q)."""
    s, t = probs(P_S).log(), probs(P_T).log()
    got = xtoken_p_kl(s, t, W, top_k=2)
    expected = [
        0.4 * math.log(0.4 / 0.5) + 0.3 * math.log(0.3 / 0.15),
        0.1 * math.log(0.1 / 0.2) + 0.6 * math.log(0.6 / 0.3),
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)
    q = probs([[0.5, 0.15, 0.21, 0.14], [0.2, 0.3, 0.36, 0.14]])
    full = (probs(P_T) * (probs(P_T) / q).log()).sum(-1)  # K = everything: the plain forward KL
    torch.testing.assert_close(xtoken_p_kl(s, t, W, top_k=4), full, rtol=1e-6, atol=0)


# --- gradients ------------------------------------------------------------------------------------


def test_gradients_reach_the_student_only() -> None:
    gen = torch.Generator().manual_seed(2)
    student_logits = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher_logits = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    s, t = tempered_log_softmax(student_logits, 2.0), tempered_log_softmax(teacher_logits, 0.5)
    uld, _ = uld_loss(s.exp(), t.exp(), torch.tensor([0, 1]), 2, common_map=torch.tensor([0, -1, 3]))
    total = uld + xtoken_p_kl(s, t, W, 2).sum() + xtoken_h_kl(s, t, W).total().sum()
    total = total + uld_distance(s.exp(), t.exp(), top_k=2).sum()
    total.backward()
    assert teacher_logits.grad is None
    assert student_logits.grad is not None and student_logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="> 0"):
        tempered_log_softmax(student_logits, 0.0)


def test_gradients_match_finite_differences() -> None:
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    t = probs(P_T).log()
    assert torch.autograd.gradcheck(lambda x: xtoken_p_kl(x.log_softmax(-1), t, W, 2), (z,))
    assert torch.autograd.gradcheck(lambda x: uld_distance(x.softmax(-1), t.exp()), (z,))
    assert torch.autograd.gradcheck(lambda x: xtoken_h_kl(x.log_softmax(-1), t, W).total(), (z,))


def test_a_batch_end_to_end(student, teacher) -> None:
    """What a trainer does: align (the last group dropped), merge each side's rows per group, ULD.

    Kept, the last group would be invalid on the teacher's side: ``observed`` chains its rows 4-5,
    and row 5 predicts a token 6 the sequence does not have.
    """
    s, t = byte_offsets(student, TEXT), byte_offsets(teacher, TEXT)
    full = align_spans(s.offsets, t.offsets)
    _, last_valid = merge_group_distributions(
        torch.zeros(len(t.ids), len(teacher)), torch.tensor(t.ids), full.teacher_ranges()[-1:]
    )
    assert last_valid.tolist() == [False]
    alignment = full.drop_last()
    gen = torch.Generator().manual_seed(4)
    s_logits = torch.randn(len(s.ids), len(student), generator=gen, requires_grad=True)
    t_logits = torch.randn(len(t.ids), len(teacher), generator=gen)
    s_merged, s_valid = merge_group_distributions(
        tempered_log_softmax(s_logits), torch.tensor(s.ids), alignment.student_ranges()
    )
    t_merged, t_valid = merge_group_distributions(
        tempered_log_softmax(t_logits), torch.tensor(t.ids), alignment.teacher_ranges()
    )
    keep = s_valid & t_valid
    assert keep.tolist() == [True, True]
    loss, metrics = uld_loss(s_merged[keep].exp(), t_merged[keep].exp(), torch.zeros(2, dtype=torch.long), 1)
    loss.backward()
    assert math.isfinite(metrics["distillation_loss"]) and s_logits.grad.abs().sum() > 0
