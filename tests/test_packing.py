"""Packing (BFD, BFD-split, wrapped), collation into Sequences, and attention kept inside packed sequences."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.data.packing import (
    best_fit_decreasing,
    collate_packed,
    collate_padded,
    cu_seqlens,
    pack,
    packed_attention_mask,
    position_ids_from_seq_lengths,
    resolve_strategy,
    segment_ids,
    seq_lengths_from_position_ids,
)


def rows_of(*seqs):
    """Rows whose loss mask is 1 everywhere but their own first token (as prepare_dataset makes them)."""
    return [{"input_ids": list(s), "loss_mask": [0, *[1] * (len(s) - 1)][: len(s)]} for s in seqs]


EXAMPLE = rows_of([1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11])


# ----------------------------------------------------------------------------- strategies


def test_strategy_names_and_alias():
    assert resolve_strategy("bfd-requeue") == "bfd_split"
    with pytest.raises(ValueError, match=r"'ffd'.*\['bfd', 'bfd_split', 'wrapped', 'bfd-requeue'\]"):
        pack(EXAMPLE, 4, "ffd")


def test_bfd_golden_truncates_over_long_rows():
    """Longest first: [1..4] (5 cut) fills bin 0; [8,9,10] opens bin 1 (room 1); [6,7] cannot fit there and
    opens bin 2 (room 2); [11] goes to the tightest bin it fits, bin 1."""
    bins = pack(EXAMPLE, 4, "bfd")
    assert [b["input_ids"] for b in bins] == [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]]
    assert [b["seq_lengths"] for b in bins] == [[4], [3, 1], [2]]
    assert [b["loss_mask"] for b in bins] == [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1]]


def test_bfd_split_golden_keeps_every_token():
    """[1..5] becomes [1..4] and [5]; the length-1 pieces ([5], then [11]) fill bin 1 (room 1) then bin 2."""
    bins = pack(EXAMPLE, 4, "bfd-requeue")
    assert [b["input_ids"] for b in bins] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert [b["seq_lengths"] for b in bins] == [[4], [3, 1], [2, 1]]
    assert [b["loss_mask"] for b in bins] == [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 0]]


def test_wrapped_concatenates_and_cuts():
    bins = pack(EXAMPLE, 4, "wrapped")
    assert [b["input_ids"] for b in bins] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    assert [b["seq_lengths"] for b in bins] == [[4], [4], [3]]
    assert bins[1]["loss_mask"] == [0, 0, 1, 0]  # masks travel with their tokens; a cut starts untrained
    # rows prepared with first_token_target=True: a joined row's first token is a target
    lm_rows = [{"input_ids": r["input_ids"], "loss_mask": [1] * len(r["input_ids"])} for r in EXAMPLE]
    assert [b["loss_mask"] for b in pack(lm_rows, 4, "wrapped")] == [[0, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1]]


def naive_bfd(lengths, capacity):
    """Quadratic best-fit decreasing, the definition itself."""
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[b].append(i)
        rooms[b] -= lengths[i]
    return bins


def test_best_fit_decreasing_matches_the_definition_on_random_sizes():
    rng = random.Random(0)
    for _ in range(50):
        capacity = rng.randint(1, 40)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(0, 60))]
        assert best_fit_decreasing(lengths, capacity) == naive_bfd(lengths, capacity)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_bins_fit_and_account_for_every_kept_token(strategy):
    rng = random.Random(1)
    rows = rows_of(*[[rng.randint(3, 99) for _ in range(rng.randint(0, 30))] for _ in range(40)])
    bins = pack(rows, 16, strategy)
    assert all(len(b["input_ids"]) == sum(b["seq_lengths"]) <= 16 for b in bins)
    assert all(len(b["input_ids"]) == len(b["loss_mask"]) for b in bins)
    packed = sorted(t for b in bins for t in b["input_ids"])
    keep = None if strategy != "bfd" else 16
    assert packed == sorted(t for r in rows for t in r["input_ids"][:keep])
    if strategy == "wrapped":
        assert all(len(b["input_ids"]) == 16 for b in bins[:-1])


def test_pack_errors_and_empty_rows():
    assert pack([{"input_ids": [], "loss_mask": []}, *EXAMPLE[1:2]], 4) == [
        {"input_ids": [6, 7], "loss_mask": [0, 1], "seq_lengths": [2]}
    ]
    with pytest.raises(ValueError, match=r"Row 0 has columns \['input_ids'\]; packing needs"):
        pack([{"input_ids": [1]}], 4)
    with pytest.raises(ValueError, match=r"Row 1: 'input_ids' has 2 tokens but 'loss_mask' has 1"):
        pack([EXAMPLE[0], {"input_ids": [1, 2], "loss_mask": [1]}], 4)
    with pytest.raises(ValueError, match="max_length=0 must be a positive integer"):
        pack(EXAMPLE, 0)


# ----------------------------------------------------------------------------- collation


def test_collate_padded_right_pads_and_clears_column_zero():
    batch = collate_padded(
        [{"input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}],
        pad_token_id=0,
        pad_to_multiple_of=4,
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3]] * 2
    assert batch.num_targets == int(batch.loss_mask.sum()) == 2


def test_collate_padded_refuses_bins_of_several_sequences():
    with pytest.raises(ValueError, match="Row 0 is a packed bin of 2 sequences.*collate_packed"):
        collate_padded(pack(EXAMPLE, 4)[1:2], pad_token_id=0)


def test_collate_packed_one_row_per_bin_with_a_padding_segment():
    """Bin [8,9,10 | 11] and bin [6,7]: positions restart per sequence; the padding of the short row is its own
    segment; the first token of every sequence is no target."""
    bins = pack(EXAMPLE, 4)[1:]
    batch = collate_packed(bins, pad_token_id=0)
    assert batch.attention_mask is None
    assert batch.input_ids.tolist() == [[8, 9, 10, 11], [6, 7, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 1, 0, 0]]
    assert seq_lengths_from_position_ids(batch.position_ids) == [[3, 1], [2, 2]]


def test_collate_packed_flattened_and_plain_rows():
    flat = collate_packed(pack(EXAMPLE, 4, "bfd_split"), flatten=True)
    assert flat.input_ids.tolist() == [[1, 2, 3, 4, 8, 9, 10, 5, 6, 7, 11]]
    assert flat.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 0, 0, 1, 0]]
    assert flat.loss_mask.tolist() == [[0, 1, 1, 1, 0, 1, 1, 0, 0, 1, 0]]
    cu, longest = cu_seqlens(flat.position_ids)
    assert cu.tolist() == [0, 4, 7, 8, 10, 11] and cu.dtype == torch.int32 and longest == 4
    plain = collate_packed(rows_of([1, 2], [3, 4, 5]), flatten=True, pad_to_multiple_of=8)
    assert plain.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert plain.loss_mask.tolist() == [[0, 1, 0, 1, 1, 0, 0, 0]]


def test_collate_packed_checks_seq_lengths():
    with pytest.raises(ValueError, match=r"Row 0: seq_lengths \[2\] do not split its 3 tokens"):
        collate_packed([{"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "seq_lengths": [2]}])


def test_boundaries_helpers():
    pos = torch.tensor(position_ids_from_seq_lengths([3, 1, 2]))
    assert pos.tolist() == [0, 1, 2, 0, 0, 1]
    assert seq_lengths_from_position_ids(pos) == [[3, 1, 2]]
    assert segment_ids(pos[None]).tolist() == [[0, 0, 0, 1, 2, 2]]


def test_packed_attention_mask_golden():
    """Positions [0,1,0,1,2]: sequences {0,1} and {2,3,4}; token i sees j when same sequence and j <= i."""
    mask = packed_attention_mask(torch.tensor([[0, 1, 0, 1, 2]]), torch.float32)
    allowed = [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert mask.shape == (1, 1, 5, 5)
    assert (mask[0, 0] == 0).long().tolist() == allowed
    assert mask.min().item() == torch.finfo(torch.float32).min


# ----------------------------------------------------------------------------- the model sees separate sequences


@pytest.fixture(scope="module")
def tiny():
    tok = build_tiny_tokenizer()
    return tok, build_tiny_model(tok).eval()


def token_logps(model, input_ids, **kw):
    """[N, L-1] log p(x_t | x_<t) for t >= 1."""
    logits = model(input_ids=input_ids, **kw).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [True, False])
def test_packed_rows_with_the_block_mask_equal_separate_sequences(tiny, impl, flatten):
    tok, model = tiny
    model.set_attn_implementation(impl)
    texts = ["The sky is blue and the sun is bright.", "one two three", "What is 2 + 3?", "hello", "a cat"]
    rows = rows_of(*[tok(t)["input_ids"] for t in texts])
    bins = pack(rows, 16, "bfd")
    assert max(len(b["seq_lengths"]) for b in bins) > 1  # some bin really holds several sequences
    batch = collate_packed(bins, flatten=flatten, pad_token_id=0)
    with torch.no_grad():
        mask = packed_attention_mask(batch.position_ids, torch.float32)
        packed = token_logps(model, batch.input_ids, attention_mask=mask, position_ids=batch.position_ids)
        seen = 0
        for r, lengths in enumerate(seq_lengths_from_position_ids(batch.position_ids)):
            start = 0
            for n in lengths:
                ids = batch.input_ids[r, start : start + n]
                if n > 1 and batch.loss_mask[r, start + 1 : start + n].any():  # a real sequence, not padding
                    alone = token_logps(model, ids[None])[0]
                    torch.testing.assert_close(packed[r, start : start + n - 1], alone, atol=1e-5, rtol=0)
                    seen += 1
                start += n
    assert seen == len(texts)
