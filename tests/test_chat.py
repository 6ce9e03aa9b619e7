"""The one rendering path (data/chat.py) against apply_chat_template, and the marked family
templates that assistant_only_loss falls back to (agents/templates.py, sft/templates.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import SFTConfig, SFTTrainer
from posttrain.agents import templates
from posttrain.data import chat

STOCK = Path(__file__).parent / "chat_templates"
GEN_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
    {"role": "user", "content": "And 4 + 4?"},
    {"role": "assistant", "content": "<answer>8</answer>"},
]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def stock(name: str) -> str:
    return (STOCK / f"{name}.jinja").read_text()


@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("template", ["chatml", "qwen2_5_instruct", "llama3_1_instruct", "deepseek_v3"])
def test_render_and_tokenize_equal_apply_chat_template(tok, template, generation_prompt):
    tok.chat_template = CHAT_TEMPLATE if template == "chatml" else stock(template)
    messages = CONVERSATION[:-1] if generation_prompt else CONVERSATION
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert chat.render(tok, messages, add_generation_prompt=generation_prompt) == expected
    ids, mask = chat.tokenize(tok, messages, add_generation_prompt=generation_prompt)
    assert ids == list(
        tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)["input_ids"]
    )
    assert mask is None


def test_assistant_mask_equals_apply_chat_templates(tok):
    tok.chat_template = GEN_TEMPLATE
    ids, mask = chat.tokenize(tok, CONVERSATION, assistant_mask=True)
    reference = tok.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    assert ids == list(reference["input_ids"])
    assert mask == list(reference["assistant_masks"])
    assert tok.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        "<answer>5</answer><|im_end|><answer>8</answer><|im_end|>"
    )


def test_a_mask_needs_markers_and_a_template(tok):
    tok.chat_template = CHAT_TEMPLATE
    with pytest.raises(ValueError, match="generation"):
        chat.tokenize(tok, CONVERSATION, assistant_mask=True)
    tok.chat_template = None
    with pytest.raises(ValueError, match="conversational .* no chat template"):
        chat.render(tok, CONVERSATION)


def test_named_templates_are_picked_as_apply_chat_template_picks_them(tok):
    tool = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {}}}
    tok.chat_template = {"default": CHAT_TEMPLATE, "tool_use": "[tools]" + CHAT_TEMPLATE}
    assert not chat.render(tok, CONVERSATION).startswith("[tools]")
    assert chat.render(tok, CONVERSATION, tools=[tool]).startswith("[tools]")
    # a name, or a whole template, through the template kwargs
    assert chat.render(tok, CONVERSATION, variables={"chat_template": "tool_use"}).startswith("[tools]")
    assert chat.render(tok, CONVERSATION, variables={"chat_template": "X{{ messages | length }}"}) == "X5"


def test_render_prompt_continues_a_final_assistant_message(tok):
    tok.chat_template = CHAT_TEMPLATE
    prefilled = [CONVERSATION[1], {"role": "assistant", "content": "<answer>"}]
    assert chat.render_prompt(prefilled, tok).endswith("<|im_start|>assistant\n<answer>")
    assert chat.render_prompt(CONVERSATION[:2], tok).endswith("<|im_start|>assistant\n")
    assert chat.render_prompt("plain text", tok) == "plain text"


# ---- the marked family templates ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name, family",
    [
        ("chatml", "qwen"),
        ("qwen2_5_instruct", "qwen"),
        ("qwen3", "qwen"),
        ("llama3_1_instruct", "llama3"),
        ("deepseek_v3", "deepseek_v3"),
    ],
)
def test_stock_templates_get_the_marked_template_of_their_family(name, family):
    template = CHAT_TEMPLATE if name == "chatml" else stock(name)
    assert not chat.has_generation_markers(template)
    assert templates.chat_family(template) == family
    got_family, marked = templates.marked_template(template)
    assert got_family == family and chat.has_generation_markers(marked)


def test_a_template_of_no_family_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"no marked template for its family.*assistant_only_loss=False"):
        templates.marked_template("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")


def test_marked_qwen_template_masks_the_answer_and_its_turn_end_by_hand(tok):
    """ChatML by hand: each assistant turn is '<|im_start|>assistant\\n' + MARKED(content + '<|im_end|>') + '\\n'."""
    tok.chat_template = templates.training_template("qwen")
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [
        CONVERSATION[1],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "<answer>5</answer>"},
    ]
    ids, mask = chat.tokenize(tok, messages, assistant_mask=True)
    text = tok.decode(ids)
    marked = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
    first = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
    assert marked == first + "<answer>5</answer><|im_end|>"
    assert text == (
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n" + first + "\n"
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<answer>5</answer><|im_end|>\n"
    )


def test_the_marked_templates_still_drive_the_tool_loop():
    for family in templates.FAMILIES:
        marked = templates.training_template(family)
        assert templates.detect_family(marked) == family
        assert templates.is_prefix_preserving(marked, templates._PROBE_TOOLS)


# ---- in SFTTrainer ------------------------------------------------------------------------------


def _chats(n: int = 4) -> Dataset:
    rows = [
        [
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"<answer>{2 * i}</answer>"},
        ]
        for i in range(n)
    ]
    return Dataset.from_dict({"messages": rows})


def test_sft_assistant_only_loss_swaps_in_the_marked_template_with_a_warning(tmp_path):
    tok = build_tiny_tokenizer()
    tok.chat_template = stock("qwen2_5_instruct")
    args = SFTConfig(output_dir=str(tmp_path), assistant_only_loss=True, **CPU_TEST_ARGS)
    with pytest.warns(UserWarning, match="posttrain's marked template of the 'qwen' family"):
        trainer = SFTTrainer(build_tiny_model(tok), args=args, train_dataset=_chats(), processing_class=tok)
    assert trainer.processing_class.chat_template == templates.training_template("qwen")
    row = trainer.train_dataset[0]
    targets = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    assert tok.decode(targets) == "<answer>0</answer><|im_end|>"


def test_chat_template_path_from_a_file_and_from_a_tokenizer_folder(tmp_path):
    tok = build_tiny_tokenizer()
    path = tmp_path / "t.jinja"
    path.write_text(GEN_TEMPLATE)
    args = SFTConfig(output_dir=str(tmp_path / "a"), chat_template_path=str(path), **CPU_TEST_ARGS)
    trainer = SFTTrainer(build_tiny_model(tok), args=args, train_dataset=_chats(), processing_class=tok)
    assert trainer.processing_class.chat_template == GEN_TEMPLATE

    source = build_tiny_tokenizer()
    source.add_tokens(["<|turn_end|>"], special_tokens=True)
    source.eos_token = "<|turn_end|>"
    source.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|turn_end|>{% endfor %}"
    )
    source.save_pretrained(tmp_path / "source")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    before = model.get_input_embeddings().weight.shape[0]
    args = SFTConfig(
        output_dir=str(tmp_path / "b"), chat_template_path=str(tmp_path / "source"), **CPU_TEST_ARGS
    )
    trainer = SFTTrainer(model, args=args, train_dataset=_chats(), processing_class=tok)
    assert tok.eos_token == "<|turn_end|>" and tok.convert_tokens_to_ids("<|turn_end|>") == len(tok) - 1
    assert trainer.model.get_input_embeddings().weight.shape[0] >= len(tok) > before - 1
    assert trainer.model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.decode(trainer.train_dataset[0]["input_ids"]).endswith("<answer>0</answer><|turn_end|>")


def test_chat_template_path_that_is_no_template_names_the_fix(tmp_path):
    tok = build_tiny_tokenizer()
    (tmp_path / "notes.txt").write_text("hello")
    args = SFTConfig(
        output_dir=str(tmp_path), chat_template_path=str(tmp_path / "notes.txt"), **CPU_TEST_ARGS
    )
    with pytest.raises(ValueError, match="not a Jinja template"):
        SFTTrainer(build_tiny_model(tok), args=args, train_dataset=_chats(), processing_class=tok)
