"""SFT data: format detection, tokenisation and target masks, clear errors, whole-dataset preparation."""

from __future__ import annotations

import warnings

import pytest
from conftest import CHAT_TEMPLATE, build_tiny_tokenizer

from posttrain.data.chat import has_generation_markers
from posttrain.data.sft import (
    check_messages,
    common_prefix_length,
    detect_format,
    prepare_dataset,
    tokenize_row,
    truncate,
)

#: The ChatML template of conftest with the assistant turns wrapped in generation markers.
GEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: A template that shows whether tools and a custom variable reached it.
FLAG_TEMPLATE = (
    "{% if tools %}[tools:{{ tools | length }}]{% endif %}{% if flag %}[flag]{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)

CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def targets(tok, out) -> str:
    """The text of the tokens marked as targets."""
    return tok.decode([t for t, m in zip(out["input_ids"], out["loss_mask"], strict=True) if m])


def row(tok, r, fmt, **kw):
    kw.setdefault("max_length", None)
    return tokenize_row(r, tok, fmt, **kw)


# ----------------------------------------------------------------------------- detect_format


@pytest.mark.parametrize(
    ("r", "fmt"),
    [
        ({"text": "a"}, "language_modeling"),
        ({"messages": CHAT}, "conversational"),
        ({"conversations": [{"from": "human", "value": "x"}]}, "conversational"),
        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
        ({"prompt": CHAT[:1], "completion": CHAT[1:]}, "prompt_completion"),
        ({"input_ids": [1, 2], "text": "kept from before"}, "tokenized"),
    ],
)
def test_detect_format_by_columns(r, fmt):
    assert detect_format(list(r), r) == fmt


def test_detect_format_custom_text_field():
    assert detect_format(["body"], {"body": "x"}, dataset_text_field="body") == "language_modeling"


@pytest.mark.parametrize(
    ("r", "needle"),
    [
        (
            {"question": "a", "answer": "b"},
            "no column SFT can train on; its columns are ['question', 'answer']",
        ),
        ({"text": "a", "messages": CHAT}, "several SFT formats"),
        ({"prompt": "a"}, "no 'completion' column"),
        ({"prompt": "a", "completion": CHAT[1:]}, "both be strings or both be lists"),
        ({"text": CHAT}, "column 'text' holds list"),
    ],
)
def test_detect_format_errors_name_columns_and_fix(r, needle):
    with pytest.raises(ValueError) as err:
        detect_format(list(r), r)
    assert needle in str(err.value)


# ----------------------------------------------------------------------------- language modelling


def test_text_gets_eos_and_every_token_but_the_first_is_a_target(tok):
    out = row(tok, {"text": "The sky is blue"}, "language_modeling")
    assert out["input_ids"] == tok("The sky is blue<|im_end|>")["input_ids"]
    assert out["input_ids"][-1] == tok.eos_token_id
    assert out["loss_mask"] == [0] + [1] * (len(out["input_ids"]) - 1)


def test_eos_not_doubled_and_custom_eos(tok):
    out = row(tok, {"text": "hi<|im_end|>"}, "language_modeling")
    assert out["input_ids"].count(tok.eos_token_id) == 1
    out = row(tok, {"text": "hi"}, "language_modeling", eos_token="<|endoftext|>")
    assert out["input_ids"][-1] == tok.convert_tokens_to_ids("<|endoftext|>")


def test_formatting_func_gives_the_text_and_must_return_a_string(tok):
    out = row(
        tok, {"q": "one", "a": "two"}, "language_modeling", formatting_func=lambda r: r["q"] + " " + r["a"]
    )
    assert out["input_ids"] == tok("one two<|im_end|>")["input_ids"]
    with pytest.raises(ValueError, match=r"Row 7: formatting_func returned list, not a string"):
        row(tok, {"q": "x"}, "language_modeling", formatting_func=lambda r: [r["q"]], index=7)


def test_completion_only_loss_true_on_text_is_refused(tok):
    with pytest.raises(
        ValueError, match="completion_only_loss=True.*language_modeling.*completion_only_loss=None"
    ):
        row(tok, {"text": "a"}, "language_modeling", completion_only_loss=True)


# ----------------------------------------------------------------------------- prompt-completion


def test_prompt_completion_targets_are_the_completion_and_eos(tok):
    out = row(tok, {"prompt": "What is 2 + 3? ", "completion": "<answer>5</answer>"}, "prompt_completion")
    prompt_len = len(tok("What is 2 + 3? ")["input_ids"])
    assert out["input_ids"] == tok("What is 2 + 3? <answer>5</answer><|im_end|>")["input_ids"]
    assert out["loss_mask"] == [0] * prompt_len + [1] * (len(out["input_ids"]) - prompt_len)
    assert targets(tok, out) == "<answer>5</answer><|im_end|>"


def test_completion_only_loss_false_trains_on_the_prompt_too(tok):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the prompt ends on a token boundary: no warning
        r = {"prompt": "one two", "completion": " three"}
        out = row(tok, r, "prompt_completion", completion_only_loss=False)
    assert out["loss_mask"] == [0] + [1] * (len(out["input_ids"]) - 1)


def test_completion_starts_at_the_common_prefix_when_tokens_merge(tok):
    """'The sky is bl' ends in token 'l' but 'The sky is blue' merges 'lu': they share 5 tokens, not 6."""
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    with pytest.warns(UserWarning, match="part at token 5 of 6"):
        out = row(tok, {"prompt": "The sky is bl", "completion": "ue and"}, "prompt_completion")
    assert out["loss_mask"][:5] == [0] * 5 and all(out["loss_mask"][5:])


def test_conversational_prompt_completion_targets_the_assistant_turn(tok):
    out = row(tok, {"prompt": CHAT[:1], "completion": CHAT[1:]}, "prompt_completion")
    assert out["input_ids"] == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert targets(tok, out) == "hi there<|im_end|>\n"


def test_empty_completion_is_an_error_naming_the_row(tok):
    with pytest.raises(ValueError, match=r"Row 3: the completion is empty"):
        row(tok, {"prompt": "a", "completion": ""}, "prompt_completion", index=3)
    with pytest.raises(ValueError, match=r"Row 4: the completion is empty"):
        row(tok, {"prompt": CHAT[:1], "completion": []}, "prompt_completion", index=4)


# ----------------------------------------------------------------------------- conversational


def test_messages_rendered_with_the_template_all_targets(tok):
    out = row(tok, {"messages": CHAT}, "conversational")
    assert out["input_ids"] == tok.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    assert out["loss_mask"] == [0] + [1] * (len(out["input_ids"]) - 1)


def test_sharegpt_rows_equal_role_content_rows(tok):
    share = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi there"}]
    assert row(tok, {"conversations": share}, "conversational") == row(
        tok, {"messages": CHAT}, "conversational"
    )
    with pytest.raises(ValueError, match="comes from 'robot'"):
        row(tok, {"conversations": [{"from": "robot", "value": "x"}]}, "conversational")


def test_assistant_only_loss_targets_exactly_the_assistant_tokens(tok):
    chat = [*CHAT, {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    out = row(tok, {"messages": chat}, "conversational", assistant_only_loss=True,
              chat_template_kwargs={"chat_template": GEN_TEMPLATE})  # fmt: skip
    expected = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                       chat_template=GEN_TEMPLATE)  # fmt: skip
    assert out["input_ids"] == expected["input_ids"]
    assert out["loss_mask"] == expected["assistant_masks"]
    assert targets(tok, out) == "hi there<|im_end|>two<|im_end|>"


def test_assistant_only_loss_in_prompt_completion_and_the_tokenizer_template(tok):
    t = build_tiny_tokenizer()
    t.chat_template = GEN_TEMPLATE
    out = row(t, {"prompt": CHAT[:1], "completion": CHAT[1:]}, "prompt_completion", assistant_only_loss=True)
    assert targets(t, out) == "hi there<|im_end|>"  # the newline after the turn is not the assistant's


def test_assistant_only_loss_without_generation_markers_names_the_fix(tok):
    assert not has_generation_markers(CHAT_TEMPLATE) and has_generation_markers(GEN_TEMPLATE)
    assert has_generation_markers({"default": CHAT_TEMPLATE, "tool_use": GEN_TEMPLATE})
    with pytest.raises(ValueError, match=r"assistant_only_loss=True needs a chat template.*generation"):
        row(tok, {"messages": CHAT}, "conversational", assistant_only_loss=True)
    with pytest.raises(ValueError, match="assistant_only_loss=False"):
        row(tok, {"text": "a"}, "language_modeling", assistant_only_loss=True)


def test_tools_and_template_kwargs_per_row_win_over_defaults():
    t = build_tiny_tokenizer()
    t.chat_template = FLAG_TEMPLATE
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}
    plain = row(t, {"messages": CHAT}, "conversational")
    flagged = row(
        t, {"messages": CHAT, "chat_template_kwargs": {"flag": True, "other": None}}, "conversational"
    )
    tooled = row(t, {"messages": CHAT, "tools": '[{"type": "function", "function": {"name": "g"}}]'},
                 "conversational", tools=[tool, tool])  # fmt: skip
    defaults = row(
        t, {"messages": CHAT}, "conversational", tools=[tool, tool], chat_template_kwargs={"flag": 1}
    )
    assert not t.decode(plain["input_ids"]).startswith("[")
    assert t.decode(flagged["input_ids"]).startswith("[flag]")
    assert t.decode(tooled["input_ids"]).startswith("[tools:1]")  # the row's one tool, not the two defaults
    assert t.decode(defaults["input_ids"]).startswith("[tools:2][flag]")


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "empty conversation"),
        ([{"content": "x"}], "message 0 of column 'messages' has role None"),
        ([{"role": "user"}], "message 0 ('user') of column 'messages' has no 'content'"),
        (  # Arrow fills a missing key with None: refused too, not rendered as "None"
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
            "message 1 ('assistant') of column 'messages' has no 'content'",
        ),
        (
            [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            "system message may only come first",
        ),
        ([{"role": "assistant", "content": "a"}], "'assistant' message at the start"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
            "'user' message after a 'user'",
        ),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"},
                {"role": "tool", "content": "c"},
            ],
            "'tool' message after a 'assistant' message; a tool message answers an assistant message that has",
        ),
    ],
)
def test_message_order_errors_name_row_and_position(messages, needle):
    with pytest.raises(ValueError) as err:
        check_messages(messages, "messages", 5)
    assert str(err.value).startswith("Row 5:") and needle in str(err.value)


def test_tool_messages_after_a_tool_call_are_accepted(tok):
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    chat = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "3"},
    ]
    check_messages(chat, "messages", 0)
    assert len(row(tok, {"messages": chat}, "conversational")["input_ids"]) > 0


# ----------------------------------------------------------------------------- pre-tokenised


def test_tokenized_rows_combine_labels_assistant_and_completion_masks(tok):
    r = {
        "input_ids": [5, 6, 7, 8, 9],
        "labels": [-100, 6, 7, 8, 9],
        "assistant_masks": [1, 1, 1, 1, 0],
        "completion_mask": [0, 0, 1, 1, 1],
    }
    assert row(tok, r, "tokenized")["loss_mask"] == [0, 0, 1, 1, 0]
    assert row(tok, r, "tokenized", completion_only_loss=False)["loss_mask"] == [0, 1, 1, 1, 0]
    assert row(tok, {"input_ids": [5, 6, 7]}, "tokenized")["loss_mask"] == [0, 1, 1]


@pytest.mark.parametrize(
    ("r", "kw", "needle"),
    [
        ({"input_ids": [1, 2], "labels": [1, 3]}, {}, "labels[1] = 3 differs from input_ids[1] = 2"),
        ({"input_ids": [1, 2], "labels": [1]}, {}, "'labels' has 1 entries but 'input_ids' has 2"),
        ({"input_ids": [1, 2], "completion_mask": [1]}, {}, "'completion_mask' has 1 entries"),
        ({"input_ids": [1, 2]}, {"completion_only_loss": True}, "has no 'completion_mask'"),
    ],
)
def test_tokenized_row_errors(tok, r, kw, needle):
    with pytest.raises(ValueError) as err:
        row(tok, r, "tokenized", index=2, **kw)
    assert "Row 2" in str(err.value) and needle in str(err.value)


# ----------------------------------------------------------------------------- truncation


def test_truncation_keeps_start_or_end_and_clears_the_new_first_target(tok):
    r = {"input_ids": [10, 11, 12, 13, 14]}
    assert row(tok, r, "tokenized", max_length=3) == {"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1]}
    kept = row(tok, r, "tokenized", max_length=3, truncation_mode="keep_end")
    assert kept == {"input_ids": [12, 13, 14], "loss_mask": [0, 1, 1]}
    with pytest.raises(ValueError, match=r"truncation_mode='middle'.*\['keep_start', 'keep_end'\]"):
        truncate([1, 2], [1, 1], 1, "middle")


def test_prompt_longer_than_max_length_leaves_no_target(tok):
    out = row(
        tok, {"prompt": "one two three four five", "completion": "six"}, "prompt_completion", max_length=3
    )
    assert len(out["input_ids"]) == 3 and not any(out["loss_mask"])


def test_unknown_format(tok):
    with pytest.raises(ValueError, match="Unknown SFT format 'chat'"):
        row(tok, {"text": "a"}, "chat")


# ----------------------------------------------------------------------------- prepare_dataset

ROWS = [
    {"prompt": "one two three four five", "completion": "six"},  # prompt fills max_length: no target
    {"prompt": "a", "completion": "b"},
    {"prompt": "one", "completion": "two"},
]


def test_prepare_list_drops_rows_without_targets_with_a_count(tok):
    with pytest.warns(UserWarning, match=r"1 of 3 rows have no target token.*max_length=4.*raise max_length"):
        out = prepare_dataset(ROWS, tok, max_length=4)
    assert len(out) == 2 and all(any(r["loss_mask"]) for r in out)
    assert out[0] == tokenize_row(ROWS[1], tok, "prompt_completion", max_length=4)


def test_prepare_datasets_dataset_matches_the_list_path(tok):
    from datasets import Dataset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        as_list = prepare_dataset(ROWS, tok, max_length=4)
        as_ds = prepare_dataset(Dataset.from_list(ROWS), tok, max_length=4)
    assert as_ds.column_names == ["input_ids", "loss_mask"]
    assert as_ds.to_list() == as_list


def test_prepare_raises_when_every_row_would_be_dropped(tok):
    with pytest.raises(ValueError, match=r"All 1 rows of the SFT dataset have no target token"):
        prepare_dataset(ROWS[:1], tok, max_length=4)


def test_prepare_checks_options_and_rows_before_mapping(tok):
    with pytest.raises(ValueError, match="assistant_only_loss=True needs a chat template"):
        prepare_dataset([{"messages": CHAT}], tok, assistant_only_loss=True)
    with pytest.raises(ValueError, match="Row 1: message 1 of column 'messages'"):
        prepare_dataset([{"messages": CHAT}, {"messages": [CHAT[0], CHAT[0]]}], tok)
    with pytest.raises(ValueError, match="no rows"):
        prepare_dataset([], tok)


def test_prepare_with_formatting_func_and_conversations(tok):
    out = prepare_dataset([{"q": "one", "a": "two"}], tok, formatting_func=lambda r: f"{r['q']} {r['a']}")
    assert out[0]["input_ids"] == tok("one two<|im_end|>")["input_ids"]
    share = [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "hi"}]
    conv = prepare_dataset([{"conversations": share}], tok)
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert conv[0] == tokenize_row({"messages": messages}, tok, "conversational")
