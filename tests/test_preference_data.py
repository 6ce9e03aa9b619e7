"""Preference data: formats, the implicit prompt, tokenisation, truncation, clear errors, collation."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_tiny_tokenizer

from posttrain.data.preference import (
    collate_pairs,
    collate_ref_logps,
    detect_preference_format,
    extract_prompt,
    pair_lengths,
    prepare_preference_dataset,
    tokenize_pair,
)

#: A ChatML template that shows whether tools and a custom variable reached it.
FLAG_TEMPLATE = (
    "{% if tools %}[tools:{{ tools | length }}]{% endif %}{% if flag %}[flag]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

USER = {"role": "user", "content": "hello"}
HI = {"role": "assistant", "content": "hi there"}
ONE = {"role": "assistant", "content": "one"}
ARITH = {"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " 6"}


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def pieces(tok, ids) -> list[str]:
    """The text of each token."""
    return [tok.decode([i]) for i in ids]


def enc(tok, text) -> list[int]:
    """Token ids of a text, no special tokens added (the tiny tokenizer adds none anyway)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def pair(tok, r, **kw):
    kw.setdefault("max_length", None)
    return tokenize_pair(r, tok, **kw)


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize(
    ("r", "fmt"),
    [
        (ARITH, "explicit"),
        ({"chosen": "a b", "rejected": "a c"}, "implicit"),
        ({"prompt": [USER], "chosen": [HI], "rejected": [ONE], "extra": 1}, "explicit"),
        ({"chosen": [USER, HI], "rejected": [USER, ONE]}, "implicit"),
    ],
)
def test_detect_preference_format(r, fmt):
    assert detect_preference_format(list(r), r) == fmt


def test_missing_columns_are_named_with_the_columns_present():
    with pytest.raises(ValueError) as err:
        detect_preference_format(
            ["prompt", "chosen", "answer"], {"prompt": "a", "chosen": "b", "answer": "c"}
        )
    msg = str(err.value)
    assert "no 'rejected' column; its columns are ['prompt', 'chosen', 'answer']" in msg
    assert "rename" in msg
    with pytest.raises(ValueError, match=r"no 'chosen' or 'rejected' column.*suits KTO"):
        detect_preference_format(["prompt", "completion", "label"], {})


# ----------------------------------------------------------------------------- implicit prompt


@pytest.mark.parametrize(
    ("chosen", "rejected", "split"),
    [
        # The shared prefix ends with a space: the space goes back to the completions.
        ("The sky is blue", "The sky is red", ("The sky is", " blue", " red")),
        # No space at the boundary: the prompt is the whole shared prefix.
        ("2+3=5", "2+3=6", ("2+3=", "5", "6")),
        # One is a prefix of the other: each completion keeps at least one character.
        ("Hello", "Hello there", ("Hell", "o", "o there")),
        # Identical: the last character is the completion.
        ("same", "same", ("sam", "e", "e")),
        # Capped prefix that ends with a space: the space moves too.
        ("Hi  x", "Hi  xy", ("Hi ", " x", " xy")),
    ],
)
def test_implicit_prompt_of_strings(chosen, rejected, split):
    out = extract_prompt({"chosen": chosen, "rejected": rejected, "score": 3}, 0)
    assert (out["prompt"], out["chosen"], out["rejected"]) == split
    assert out["prompt"] + out["chosen"] == chosen and out["prompt"] + out["rejected"] == rejected
    assert out["score"] == 3


def test_implicit_prompt_of_conversations():
    u2 = {"role": "user", "content": "more"}
    u3 = {"role": "user", "content": "other"}
    # The shared messages up to the final assistant turn.
    out = extract_prompt({"chosen": [USER, HI, u2, HI], "rejected": [USER, HI, u2, ONE]})
    assert out == {"prompt": [USER, HI, u2], "chosen": [HI], "rejected": [ONE]}
    # They part at a user message: the prompt stops before the last assistant message both share.
    out = extract_prompt({"chosen": [USER, HI, u2, HI], "rejected": [USER, HI, u3, ONE]})
    assert out == {"prompt": [USER], "chosen": [HI, u2, HI], "rejected": [HI, u3, ONE]}
    # Identical conversations: the final assistant turn is the completion.
    out = extract_prompt({"chosen": [USER, HI], "rejected": [USER, HI]})
    assert out == {"prompt": [USER], "chosen": [HI], "rejected": [HI]}
    # ShareGPT messages become role/content ones.
    share = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]
    out = extract_prompt({"chosen": share, "rejected": [USER, ONE]})
    assert out == {"prompt": [USER], "chosen": [HI], "rejected": [ONE]}


def test_row_with_a_prompt_is_left_alone():
    assert extract_prompt(ARITH) == ARITH


@pytest.mark.parametrize(
    ("r", "needle"),
    [
        ({"chosen": "Yes", "rejected": "No"}, "share no leading text"),
        ({"chosen": " x", "rejected": " y"}, "share no leading text"),  # only the moved space
        (
            {"chosen": [USER, HI], "rejected": [{"role": "user", "content": "bye"}, HI]},
            "share no leading messages followed, in both, by an assistant message",
        ),
    ],
)
def test_implicit_prompt_missing_names_the_row_and_the_fix(r, needle):
    with pytest.raises(ValueError) as err:
        extract_prompt(r, 4)
    msg = str(err.value)
    assert msg.startswith("Row 4: ")
    assert needle in msg
    assert "Add a 'prompt' column" in msg


def test_implicit_rows_tokenise_as_their_explicit_split(tok):
    implicit = pair(tok, {"chosen": "What is 2 + 3? 5", "rejected": "What is 2 + 3? 6"})
    assert implicit == pair(tok, ARITH)


# ----------------------------------------------------------------------------- tokenising


def test_explicit_standard_pair_token_by_token(tok):
    out = pair(tok, ARITH)
    assert set(out) == {"prompt_ids", "chosen_ids", "rejected_ids"}
    assert out["prompt_ids"] == tok("What is 2 + 3?")["input_ids"]
    assert pieces(tok, out["prompt_ids"]) == ["Wh", "at", " is", " ", "2", " ", "+", " ", "3", "?"]
    assert pieces(tok, out["chosen_ids"]) == [" ", "5", "<|im_end|>"]
    assert pieces(tok, out["rejected_ids"]) == [" ", "6", "<|im_end|>"]
    for side, text in (("chosen_ids", " 5"), ("rejected_ids", " 6")):
        assert out["prompt_ids"] + out[side] == tok("What is 2 + 3?" + text + "<|im_end|>")["input_ids"]


def test_explicit_conversational_pair_token_by_token(tok):
    out = pair(tok, {"prompt": [USER], "chosen": [HI], "rejected": [ONE]})
    prompt_text = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert out["prompt_ids"] == enc(tok, prompt_text)
    assert pieces(tok, out["prompt_ids"]) == [
        "<|im_start|>", "u", "ser", "\n", "he", "ll", "o", "<|im_end|>", "\n",
        "<|im_start|>", "as", "s", "is", "t", "an", "t", "\n",
    ]  # fmt: skip
    assert pieces(tok, out["chosen_ids"]) == ["hi", " th", "er", "e", "<|im_end|>", "\n"]
    assert pieces(tok, out["rejected_ids"]) == ["one", "<|im_end|>", "\n"]
    # The template writes the end of turn: no EOS is appended to messages.
    assert out["chosen_ids"].count(tok.eos_token_id) == 1


def test_multi_turn_completion_and_tool_messages(tok):
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    result = {"role": "tool", "content": "42"}
    out = pair(tok, {"prompt": [USER, call, result], "chosen": [HI], "rejected": [ONE]})
    assert tok.decode(out["prompt_ids"]).endswith("<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(out["chosen_ids"]) == "hi there<|im_end|>\n"


def test_eos_appended_once_and_custom_eos(tok):
    out = pair(tok, {**ARITH, "chosen": " 5<|im_end|>"})
    assert out["chosen_ids"] == [223, 23, tok.eos_token_id]
    assert out["rejected_ids"].count(tok.eos_token_id) == 1
    out = pair(tok, ARITH, eos_token="<|endoftext|>")
    assert pieces(tok, out["chosen_ids"]) == [" ", "5", "<|endoftext|>"]


def test_prompt_tokens_that_merge_with_a_completion_warn_and_stay_shared(tok):
    r = {"prompt": "The sky is ", "chosen": "blue", "rejected": "red"}
    with pytest.warns(
        UserWarning, match=r"Row 2: the tokenised prompt is not a prefix.*part at token 4 of 5"
    ):
        out = pair(tok, r, index=2)
    assert pieces(tok, out["prompt_ids"]) == ["The", " s", "ky", " is"]
    assert pieces(tok, out["chosen_ids"]) == [" b", "lu", "e", "<|im_end|>"]
    assert pieces(tok, out["rejected_ids"]) == [" ", "r", "e", "d", "<|im_end|>"]
    for side, text in (("chosen_ids", "blue"), ("rejected_ids", "red")):
        assert out["prompt_ids"] + out[side] == tok("The sky is " + text + "<|im_end|>")["input_ids"]


def test_tools_and_template_kwargs_reach_the_template_row_values_win(tok):
    tok2 = build_tiny_tokenizer()
    tok2.chat_template = FLAG_TEMPLATE
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    r = {"prompt": [USER], "chosen": [HI], "rejected": [ONE]}
    plain = pair(tok2, r)
    assert tok2.decode(plain["prompt_ids"]).startswith("<|im_start|>user")
    out = pair(tok2, r, tools=[tool], chat_template_kwargs={"flag": True})
    assert tok2.decode(out["prompt_ids"]).startswith("[tools:1][flag]<|im_start|>user")
    assert out["chosen_ids"] == plain["chosen_ids"]
    out = pair(tok2, {**r, "tools": [tool, tool], "chat_template_kwargs": {"flag": False}}, tools=[tool])
    assert tok2.decode(out["prompt_ids"]).startswith("[tools:2]<|im_start|>user")


def test_ref_columns_carried_and_other_columns_ignored(tok):
    out = pair(tok, {**ARITH, "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5, "source": "x"})
    assert out["ref_chosen_logps"] == -1.5 and out["ref_rejected_logps"] == -2.5
    assert "source" not in out


# ----------------------------------------------------------------------------- truncation


def test_keep_start_cuts_each_side_and_drops_rows_without_room(tok):
    # prompt 10 tokens, chosen 3, rejected 3
    out = pair(tok, ARITH, max_length=12)
    assert len(out["prompt_ids"]) == 10
    assert pieces(tok, out["chosen_ids"]) == [" ", "5"]
    assert pieces(tok, out["rejected_ids"]) == [" ", "6"]
    assert pair(tok, ARITH, max_length=11)["chosen_ids"] == [223]
    assert pair(tok, ARITH, max_length=10) is None
    assert pair(tok, ARITH, max_length=13) == pair(tok, ARITH)
    # chosen and rejected are cut separately
    long = pair(tok, {**ARITH, "rejected": " one two three four"}, max_length=13)
    assert len(long["chosen_ids"]) == 3 and len(long["rejected_ids"]) == 3


def test_keep_end_is_deprecated_and_cuts_the_prompt_start(tok):
    with pytest.warns(FutureWarning, match="keep_end' is deprecated"):
        out = pair(tok, ARITH, max_length=8, truncation_mode="keep_end")
    full = pair(tok, ARITH)
    assert out["prompt_ids"] == full["prompt_ids"][5:]
    assert out["chosen_ids"] == full["chosen_ids"] and out["rejected_ids"] == full["rejected_ids"]
    with pytest.warns(FutureWarning):
        out = pair(tok, ARITH, max_length=2, truncation_mode="keep_end")
    assert out["prompt_ids"] == [] and out["chosen_ids"] == [23, 2]


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"truncation_mode": "middle"}, "truncation_mode='middle' is not supported"),
        ({"max_length": 0}, "max_length=0 must be a positive integer"),
    ],
)
def test_bad_truncation_options(tok, kw, needle):
    with pytest.raises(ValueError, match=needle):
        pair(tok, ARITH, **kw)


# ----------------------------------------------------------------------------- bad rows


@pytest.mark.parametrize(
    ("r", "needle"),
    [
        ({**ARITH, "chosen": ""}, "Row 5: column 'chosen' is empty"),
        ({**ARITH, "rejected": None}, "Row 5: column 'rejected' is empty"),
        (
            {"prompt": [USER], "chosen": [{"role": "assistant", "content": ""}], "rejected": [ONE]},
            "Row 5: column 'chosen' is empty",
        ),
        ({"chosen": [], "rejected": [USER, ONE]}, "Row 5: column 'chosen' is empty"),
        (
            {"prompt": "hello", "chosen": [HI], "rejected": [ONE]},
            "Row 5: the columns mix formats: 'prompt' is text",
        ),
        ({"prompt": [USER], "chosen": "hi", "rejected": [ONE]}, "'chosen' is text, 'rejected' is a list"),
        ({**ARITH, "chosen": 5}, "Row 5: column 'chosen' holds int, not text or a list of messages"),
        ({"prompt": [USER], "chosen": HI, "rejected": [ONE]}, "column 'chosen' holds dict"),
        (
            {"prompt": [USER, HI], "chosen": [ONE], "rejected": [ONE]},
            "Row 5: message 2 of column 'prompt + chosen'",
        ),
        ({**ARITH, "prompt": ""}, "Row 5: the prompt tokenises to no tokens"),
    ],
)
def test_bad_rows_name_the_row_column_and_fix(tok, r, needle):
    with pytest.raises(ValueError) as err:
        pair(tok, r, index=5)
    assert needle in str(err.value)


def test_empty_completion_error_gives_the_fix(tok):
    with pytest.raises(ValueError, match=r"dataset.filter\(lambda r: len\(r\['chosen'\]\) > 0\)"):
        pair(tok, {**ARITH, "chosen": ""}, index=0)


def test_conversations_without_a_chat_template_are_refused(tok):
    bare = build_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        pair(bare, {"prompt": [USER], "chosen": [HI], "rejected": [ONE]})
    with pytest.raises(ValueError, match="no chat template"):
        prepare_preference_dataset([{"chosen": [USER, HI], "rejected": [USER, ONE]}], bare)


# ----------------------------------------------------------------------------- whole datasets

ROWS = [
    {**ARITH, "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0, "source": "a"},
    {
        "prompt": "The sky is blue and the sun is bright.",
        "chosen": " yes",
        "rejected": " no",
        "ref_chosen_logps": -3.0,
        "ref_rejected_logps": -4.0,
        "source": "b",
    },
    {"prompt": "one two", "chosen": " three", "rejected": " four", "ref_chosen_logps": -5.0,
     "ref_rejected_logps": -6.0, "source": "c"},
]  # fmt: skip


def test_prepare_list_and_dataset_give_the_same_rows_with_ref_columns(tok):
    from datasets import Dataset

    as_list = prepare_preference_dataset(ROWS, tok, max_length=None)
    as_ds = prepare_preference_dataset(Dataset.from_list(ROWS), tok, max_length=None)
    assert as_ds.column_names == [
        "prompt_ids",
        "chosen_ids",
        "rejected_ids",
        "ref_chosen_logps",
        "ref_rejected_logps",
    ]
    assert as_ds.to_list() == as_list
    assert [r["ref_chosen_logps"] for r in as_list] == [-1.0, -3.0, -5.0]
    assert as_list[0] == {**pair(tok, ARITH), "ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}


def test_prepare_conversational_list_and_dataset_agree(tok):
    from datasets import Dataset

    rows = [
        {"chosen": [USER, HI], "rejected": [USER, ONE]},
        {"prompt": [USER], "chosen": [ONE], "rejected": [HI]},
    ]
    implicit = prepare_preference_dataset(rows[:1], tok)
    assert implicit == prepare_preference_dataset(Dataset.from_list(rows[:1]), tok).to_list()
    explicit = prepare_preference_dataset(rows[1:], tok)
    assert explicit == prepare_preference_dataset(Dataset.from_list(rows[1:]), tok).to_list()
    assert implicit[0]["chosen_ids"] == explicit[0]["rejected_ids"]


def test_prepare_drops_rows_whose_prompt_reaches_max_length_with_a_count(tok):
    from datasets import Dataset

    # prompts: 10, 13 and 4 tokens
    with pytest.warns(
        UserWarning, match=r"1 of 3 rows have a prompt of max_length=12 tokens or more.*rows 1\)"
    ):
        kept = prepare_preference_dataset(ROWS, tok, max_length=12)
    assert [r["ref_chosen_logps"] for r in kept] == [-1.0, -5.0]
    assert all(len(r["prompt_ids"]) + len(r["chosen_ids"]) <= 12 for r in kept)
    with pytest.warns(UserWarning, match="1 of 3 rows"):
        as_ds = prepare_preference_dataset(Dataset.from_list(ROWS), tok, max_length=12)
    assert as_ds.to_list() == kept


def test_prepare_raises_when_every_row_is_dropped(tok):
    from datasets import Dataset

    for data in (ROWS, Dataset.from_list(ROWS)):
        with pytest.raises(ValueError) as err:
            prepare_preference_dataset(data, tok, max_length=4)
        msg = str(err.value)
        assert "All 3 rows" in msg and "max_length=4" in msg
        assert "raise max_length above the prompt lengths (the shortest dropped prompt has 4 tokens)" in msg


def test_identical_pairs_warn_with_a_count_and_an_all_identical_dataset_is_refused(tok):
    rows = [dict(ARITH), {**ARITH, "rejected": " 5"}, {"chosen": "same", "rejected": "same"}]
    with pytest.warns(UserWarning, match=r"2 of 3 rows have identical 'chosen' and 'rejected'.*rows 1, 2\)"):
        kept = prepare_preference_dataset(rows, tok)
    assert len(kept) == 3
    with pytest.raises(ValueError) as err:
        prepare_preference_dataset(rows[1:], tok)
    msg = str(err.value)
    assert "In every row (2 rows, e.g. rows 0, 1)" in msg and "teaches nothing" in msg
    assert "not the same column" in msg


def test_identical_after_truncation_counts_too(tok):
    r = {"prompt": "one", "chosen": " two three", "rejected": " two four"}
    with pytest.raises(ValueError, match=r"identical after tokenisation and truncation to max_length=3"):
        prepare_preference_dataset([r], tok, max_length=3)


def test_prepare_checks_columns_and_options_first(tok):
    from datasets import Dataset

    with pytest.raises(ValueError, match=r"no 'rejected' column; its columns are \['prompt', 'chosen'\]"):
        prepare_preference_dataset([{"prompt": "a", "chosen": "b"}], tok)
    with pytest.raises(ValueError, match="no rows"):
        prepare_preference_dataset([], tok)
    bad = [ARITH, {**ARITH, "chosen": ""}]
    for data in (bad, Dataset.from_list(bad)):
        with pytest.raises(ValueError, match="Row 1: column 'chosen' is empty"):
            prepare_preference_dataset(data, tok)
    mixed = prepare_preference_dataset(
        [ARITH, {"prompt": None, "chosen": "What is 2 + 3? 5", "rejected": "What is 2 + 3? 6"}], tok
    )
    assert mixed[0] == mixed[1]
    with pytest.warns(FutureWarning) as record:
        prepare_preference_dataset(ROWS, tok, truncation_mode="keep_end")
    assert len([w for w in record if w.category is FutureWarning]) == 1


def test_prepare_keeps_quiet_on_clean_data(tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(prepare_preference_dataset(ROWS, tok)) == 3


# ----------------------------------------------------------------------------- collation


def test_collate_pairs_by_hand():
    rows = [
        {"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9, 10]},
        {"prompt_ids": [11], "chosen_ids": [12, 13], "rejected_ids": [14]},
    ]
    pairs = collate_pairs(rows, pad_token_id=0)
    c, r = pairs.chosen, pairs.rejected
    assert c.input_ids.tolist() == [[5, 6, 7, 0, 0], [11, 12, 13, 0, 0]]
    assert c.loss_mask.tolist() == [[0, 0, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert c.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert r.input_ids.tolist() == [[5, 6, 8, 9, 10], [11, 14, 0, 0, 0]]
    assert r.loss_mask.tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert c.position_ids is None and r.position_ids is None
    assert c.input_ids.dtype == torch.long
    assert (c.num_targets, r.num_targets) == (3, 4)
    wide = collate_pairs(rows, pad_token_id=99, pad_to_multiple_of=4)
    assert wide.chosen.input_ids.tolist()[1] == [11, 12, 13, 99, 99, 99, 99, 99]
    assert wide.rejected.loss_mask.shape == (2, 8)
    assert pair_lengths(rows) == [5, 3]


def test_collate_pairs_of_prepared_rows_marks_exactly_the_completions(tok):
    rows = prepare_preference_dataset(ROWS, tok)
    pairs = collate_pairs(rows, pad_token_id=tok.eos_token_id)
    for i, row in enumerate(rows):
        for side, key in ((pairs.chosen, "chosen_ids"), (pairs.rejected, "rejected_ids")):
            marked = side.input_ids[i][side.loss_mask[i].bool()].tolist()
            assert marked == row[key]
            n = len(row["prompt_ids"]) + len(row[key])
            assert side.input_ids[i, :n].tolist() == row["prompt_ids"] + row[key]
    chosen, rejected = collate_ref_logps(rows)
    assert chosen.tolist() == [-1.0, -3.0, -5.0] and rejected.tolist() == [-2.0, -4.0, -6.0]


def test_collate_errors():
    with pytest.raises(ValueError, match="no rows"):
        collate_pairs([], 0)
    with pytest.raises(ValueError, match="Set tokenizer.pad_token"):
        collate_pairs([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]}], None)
    with pytest.raises(ValueError, match="Row 0: 'rejected_ids' is empty"):
        collate_pairs([{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": []}], 0)
    assert collate_ref_logps([{"prompt_ids": [1]}]) is None
    with pytest.raises(ValueError, match="Row 1 has no ref_chosen_logps"):
        collate_ref_logps([{"ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0}, {}])
