"""Chat-template families for the tool loop: detection, parsing, prefix preservation, the
template choice and the continuation text.

The fixtures in ``tests/chat_templates/`` are copies of the published chat templates of
Qwen2.5-Instruct, Qwen3, Llama-3.1-Instruct and DeepSeek-V3 (model data used as inputs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CHAT_TEMPLATE

from posttrain.agents.templates import (
    FAMILIES,
    TURN_END,
    continuation_text,
    detect_family,
    is_prefix_preserving,
    parse_tool_calls,
    renders_every_probe,
    resolve_template,
    training_template,
)
from posttrain.data.chat import render_template

FIXTURES = Path(__file__).parent / "chat_templates"

STOCK = {
    "qwen2_5_instruct": "qwen",
    "qwen3": "qwen",
    "llama3_1_instruct": "llama3",
    "deepseek_v3": "deepseek_v3",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "multiply",
            "description": "Multiplies two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def stock(name: str) -> str:
    return (FIXTURES / f"{name}.jinja").read_text()


def call(name: str, arguments: dict, call_type: str = "function") -> dict:
    return {"type": call_type, "function": {"name": name, "arguments": arguments}}


def fields(calls) -> list[tuple]:
    return [(c.name, c.arguments, c.type, c.error) for c in calls]


# ---------------------------------------------------------------------------------------------
# detect_family
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, family", sorted(STOCK.items()))
def test_detects_the_family_of_each_published_template(name, family):
    assert detect_family(stock(name)) == family


# Edits to wording that a fine-tuned model's template might carry; detection reads the render,
# not the template text, so the family is still found.
EDITS = {
    "qwen2_5_instruct": [
        ("You are Qwen, created by Alibaba Cloud. You are a helpful assistant.", "You are a math tutor."),
        ("You may call one or more functions to assist with the user query.", "Use the tools below."),
    ],
    "qwen3": [("# Tools\\n\\n", "## Available tools\\n\\n")],
    "llama3_1_instruct": [
        ("Cutting Knowledge Date: December 2023", "Knowledge cutoff: 2024"),
        ("Given the following functions, please respond", "Using these functions, respond"),
    ],
    "deepseek_v3": [("'\\n\\n' + message['content']", "'\\n' + message['content']")],
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_detection_survives_edited_wording(name):
    template = stock(name)
    for old, new in EDITS[name]:
        assert old in template, f"fixture {name} lost the text the edit targets: {old!r}"
        template = template.replace(old, new)
    assert template != stock(name)
    assert detect_family(template) == STOCK[name]


@pytest.mark.parametrize("family", FAMILIES)
def test_training_templates_are_detected_as_their_family(family):
    assert detect_family(training_template(family)) == family


def test_template_without_tool_calls_has_no_family():
    """The tiny ChatML template of the test tokenizer drops ``tool_calls`` entirely."""
    assert detect_family(CHAT_TEMPLATE) is None


# Renders calls in a syntax none of the families reads (Mistral-style).
MISTRAL_LIKE = (
    "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | map(attribute='function') "
    "| list | tojson }}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}[INST]{{ m.content }}[/INST]{% endif %}{% endfor %}"
)


def test_unknown_call_syntax_has_no_family():
    rendered = render_template(
        MISTRAL_LIKE, [{"role": "assistant", "content": "", "tool_calls": [call("f", {"x": 1})]}]
    )
    assert '"name": "f"' in rendered  # it does render the call...
    assert detect_family(MISTRAL_LIKE) is None  # ...but in no known family's syntax


def test_qwen_call_syntax_without_tool_response_is_not_qwen():
    """A template that writes <tool_call> blocks but drops tool results is not recognised."""
    template = stock("qwen2_5_instruct").replace(
        "{{- message.content }}\n        {{- '\\n</tool_response>' }}", ""
    )
    assert template != stock("qwen2_5_instruct")
    assert detect_family(template) is None


# ---------------------------------------------------------------------------------------------
# parse_tool_calls
# ---------------------------------------------------------------------------------------------

QWEN_ONE = 'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>'
LLAMA_ONE = '{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eot_id|>'
DS_ONE = (
    "Let me compute.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n"
    '```json\n{"a": 3, "b": 4}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'
)
MULTIPLY_34 = [("multiply", {"a": 3, "b": 4}, "function", None)]


@pytest.mark.parametrize(
    "family, text, content",
    [
        ("qwen", QWEN_ONE, "Let me compute."),
        ("llama3", LLAMA_ONE, ""),
        ("deepseek_v3", DS_ONE, "Let me compute."),
    ],
)
def test_parses_a_single_call_and_strips_the_turn_end(family, text, content):
    got_content, calls = parse_tool_calls(family, text)
    assert got_content == content
    assert fields(calls) == MULTIPLY_34
    assert calls[0].raw and "multiply" in calls[0].raw


def test_llama_call_after_python_tag_keeps_the_text_before_as_content():
    content, calls = parse_tool_calls(
        "llama3", 'Sure.<|python_tag|>{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eom_id|>'
    )
    assert content == "Sure."
    assert fields(calls) == MULTIPLY_34


@pytest.mark.parametrize(
    "family, text",
    [
        (
            "qwen",
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>',
        ),
        (
            "llama3",
            '{"name": "multiply", "parameters": {"a": 3, "b": 4}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
        ),
        (
            "llama3",
            '<|python_tag|>[{"name": "multiply", "parameters": {"a": 3, "b": 4}}, {"name": "add", "parameters": {"a": 1, "b": 2}}]',
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n"
            '{"a": 3, "b": 4}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
            '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        ),
    ],
)
def test_parses_several_calls_in_order(family, text):
    content, calls = parse_tool_calls(family, text)
    assert content == ""
    assert fields(calls) == [
        ("multiply", {"a": 3, "b": 4}, "function", None),
        ("add", {"a": 1, "b": 2}, "function", None),
    ]


@pytest.mark.parametrize(
    "family, text, reason, name",
    [
        (
            "qwen",
            '<tool_call>\n{"name": "multiply", "arguments": {"a": 3,}}\n</tool_call>',
            "not valid JSON",
            "multiply",
        ),
        ("qwen", '<tool_call>\n{"arguments": {"a": 3}}\n</tool_call>', 'no "name"', None),
        (
            "qwen",
            '<tool_call>\n{"name": "multiply", "arguments": [3, 4]}\n</tool_call>',
            "must be a JSON object",
            "multiply",
        ),
        (
            "qwen",
            'ok <tool_call>\n{"name": "multiply", "arguments": {"a": 3',
            "unterminated <tool_call>",
            "multiply",
        ),
        ("llama3", '{"name": "multiply", "parameters": {"a": 3,}}', "not valid JSON", "multiply"),
        ("llama3", '<|python_tag|>{"name": "multiply", "parameters": {"a": 3', "not valid JSON", "multiply"),
        ("llama3", '{"parameters": {"a": 3}}', 'no "name"', None),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{a: 3}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
            "not valid JSON",
            "multiply",
        ),
        (
            "deepseek_v3",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>multiply\n```json\n{"a": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            "no <｜tool▁sep｜>",
            None,
        ),
        (
            "deepseek_v3",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\n```json\n{"a": 3}\n```<｜tool▁call▁end｜>',
            "no function name",
            None,
        ),
        (
            "deepseek_v3",
            '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{"a": 3}',
            "unterminated",
            None,
        ),
    ],
)
def test_malformed_calls_carry_a_one_line_error_and_the_raw_text(family, text, reason, name):
    _, calls = parse_tool_calls(family, text)
    assert len(calls) == 1
    bad = calls[0]
    assert bad.error is not None and reason in bad.error
    assert "\n" not in bad.error
    assert bad.arguments is None
    assert bad.name == name
    assert bad.raw and bad.raw in text


def test_a_malformed_call_does_not_hide_the_good_one_beside_it():
    text = (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
        "<tool_call>\n{not json}\n</tool_call><|im_end|>"
    )
    _, calls = parse_tool_calls("qwen", text)
    assert [c.error is None for c in calls] == [True, False]
    assert calls[1].raw == "<tool_call>\n{not json}\n</tool_call>"


@pytest.mark.parametrize(
    "family, text",
    [
        ("qwen", '<tool_call>\n{"name": "multiply", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>'),
        ("llama3", '{"name": "multiply", "parameters": "{\\"a\\": 3, \\"b\\": 4}"}'),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n"
            '"{\\"a\\": 3, \\"b\\": 4}"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        ),
    ],
)
def test_arguments_given_as_a_json_string_are_decoded(family, text):
    _, calls = parse_tool_calls(family, text)
    assert fields(calls) == MULTIPLY_34


def test_string_arguments_that_are_not_json_are_an_error():
    _, calls = parse_tool_calls("qwen", '<tool_call>\n{"name": "multiply", "arguments": "a=3"}\n</tool_call>')
    assert calls[0].name == "multiply" and "not valid JSON" in calls[0].error


@pytest.mark.parametrize(
    "family, text, expected",
    [
        (
            "qwen",
            '<tool_call>\n{"name": "run", "arguments": {"code": "1+1"}, "type": "code"}\n</tool_call>',
            ("run", {"code": "1+1"}, "code", None),
        ),
        (
            "llama3",
            '<|python_tag|>brave_search.call(query="weather in Lisbon")<|eom_id|>',
            ("brave_search", {"query": "weather in Lisbon"}, "builtin", None),
        ),
        (
            "llama3",
            "<|python_tag|>print(6 * 7)<|eom_id|>",
            ("code_interpreter", {"code": "print(6 * 7)"}, "code_interpreter", None),
        ),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>retrieval<｜tool▁sep｜>search\n```json\n"
            '{"q": "grpo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
            ("search", {"q": "grpo"}, "retrieval", None),
        ),
    ],
)
def test_a_call_that_is_not_a_function_keeps_its_type(family, text, expected):
    _, calls = parse_tool_calls(family, text)
    assert fields(calls) == [expected]


@pytest.mark.parametrize(
    "family, text, content",
    [
        ("qwen", "The answer is 12.<|im_end|>", "The answer is 12."),
        ("llama3", "The answer is 12.<|eot_id|>", "The answer is 12."),
        ("llama3", '{"answer": 12}<|eot_id|>', '{"answer": 12}'),  # JSON that is not a call is content
        ("deepseek_v3", "The answer is 12.<｜end▁of▁sentence｜>", "The answer is 12."),
    ],
)
def test_plain_answers_have_no_calls(family, text, content):
    assert parse_tool_calls(family, text) == (content, [])


def test_calls_written_inside_the_reasoning_are_not_calls():
    text = (
        '<think>\nI could write <tool_call>{"name": "multiply", "arguments": {}}</tool_call>.\n</think>\n\n'
        "It is 12.<|im_end|>"
    )
    content, calls = parse_tool_calls("qwen", text)
    assert calls == []
    assert content == text.removesuffix("<|im_end|>")


def test_text_after_the_turn_end_is_dropped():
    content, calls = parse_tool_calls("qwen", "Hi.<|im_end|>\n<tool_call>\n{}\n</tool_call>")
    assert (content, calls) == ("Hi.", [])


def test_unknown_family_is_rejected():
    with pytest.raises(ValueError, match="known families"):
        parse_tool_calls("mistral", "x")
    with pytest.raises(ValueError, match="known families"):
        training_template("mistral")


# ---------------------------------------------------------------------------------------------
# is_prefix_preserving
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [("qwen2_5_instruct", True), ("llama3_1_instruct", True), ("qwen3", False), ("deepseek_v3", False)],
)
def test_prefix_preservation_of_the_published_templates(name, expected):
    assert is_prefix_preserving(stock(name), TOOLS) is expected
    assert is_prefix_preserving(stock(name)) is expected


def test_qwen3_rewrites_the_last_assistant_turn_once_it_is_no_longer_last():
    """Why Qwen3 fails: the last assistant turn gets an empty think block that disappears later."""
    template = stock("qwen3")
    conversation = [
        {"role": "user", "content": "3 times 4?"},
        {"role": "assistant", "content": "", "tool_calls": [call("multiply", {"a": 3, "b": 4})]},
    ]
    first = render_template(template, conversation, TOOLS)
    later = render_template(template, conversation + [{"role": "tool", "content": "12"}], TOOLS, True)
    opened_with_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>"
    assert opened_with_think in first
    assert opened_with_think not in later and "<|im_start|>assistant\n<tool_call>" in later
    assert not later.startswith(first)


def test_deepseek_v3_breaks_on_a_second_tool_turn():
    template = stock("deepseek_v3")
    conversation = [
        {"role": "user", "content": "3 times 4 times 5?"},
        {"role": "assistant", "content": "", "tool_calls": [call("multiply", {"a": 3, "b": 4})]},
        {"role": "tool", "content": "12"},
    ]
    second = {"role": "assistant", "content": "", "tool_calls": [call("multiply", {"a": 12, "b": 5})]}
    prompt = render_template(template, conversation, TOOLS, True)
    assert not render_template(template, conversation + [second], TOOLS).startswith(prompt)


def test_a_template_that_refuses_every_probe_is_not_prefix_preserving():
    assert is_prefix_preserving("{{ raise_exception('no') }}") is False


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_training_templates_are_prefix_preserving(family, kwargs):
    assert is_prefix_preserving(training_template(family), TOOLS, **kwargs)


def _loop_conversation(system: bool) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}] if system else []
    return messages + [
        {"role": "user", "content": "Compute 3*4 and 5*6."},
        {
            "role": "assistant",
            "content": "<think>\nTwo products.\n</think>\n\nComputing.",
            "tool_calls": [call("multiply", {"a": 3, "b": 4}), call("multiply", {"a": 5, "b": 6})],
        },
        {"role": "tool", "name": "multiply", "content": "12"},
        {"role": "tool", "name": "multiply", "content": "30"},
        {"role": "assistant", "content": "", "tool_calls": [call("multiply", {"a": 12, "b": 30})]},
        {"role": "tool", "name": "multiply", "content": "360"},
        {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n12, 30 and 360."},
    ]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("system", [True, False])
def test_training_templates_keep_every_message_prefix_even_between_tool_messages(family, system):
    """Stronger than the loop needs: each single appended message (the second tool result of a
    turn included) leaves the earlier render untouched."""
    template = training_template(family)
    messages = _loop_conversation(system)
    renders = [render_template(template, messages[:k], TOOLS) for k in range(1, len(messages) + 1)]
    for shorter, longer in zip(renders, renders[1:], strict=False):
        assert longer.startswith(shorter)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            assert renders[k].startswith(render_template(template, messages[:k], TOOLS, True))


@pytest.mark.parametrize("family", FAMILIES)
def test_training_templates_keep_reasoning_of_earlier_turns(family):
    template = training_template(family)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Bye!"},
    ]
    assert "<think>\nGreet back.\n</think>\n\nHello!" in render_template(template, messages)
    with_field = [messages[0], {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]
    with_field += messages[2:]
    assert "Greet back." in render_template(template, with_field)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_templates_list_the_tools_in_the_system_prompt(family):
    template = training_template(family)
    rendered = render_template(
        template, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], TOOLS
    )
    head = rendered.split("Hi")[0]
    assert "Multiplies two integers." in head and "Be brief." in head
    assert "Multiplies" not in render_template(template, [{"role": "user", "content": "Hi"}])


# ---------------------------------------------------------------------------------------------
# Round trip: our templates render calls that the parser reads back
# ---------------------------------------------------------------------------------------------

ROUND_TRIP_CALLS = [
    call("multiply", {"a": 3, "b": 4}),
    call("search", {"query": 'grpo "loss"', "filters": {"year": [2024, 2025]}, "exact": True}),
]


def _generated_text(template: str, prompt: list[dict], assistant: dict, **kwargs) -> str:
    """What the model generated for ``assistant``: its render minus the generation prompt."""
    before = render_template(template, prompt, TOOLS, True, **kwargs)
    after = render_template(template, prompt + [assistant], TOOLS, **kwargs)
    assert after.startswith(before)
    return after[len(before) :]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("content", ["", "Let me compute.", "<think>\nTwo tools.\n</think>\n\nOn it."])
def test_training_template_calls_parse_back_identically(family, content):
    template = training_template(family)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"}]
    assistant = {"role": "assistant", "content": content, "tool_calls": ROUND_TRIP_CALLS}
    got_content, calls = parse_tool_calls(family, _generated_text(template, prompt, assistant))
    assert got_content == content
    assert [c.as_message_call() for c in calls] == ROUND_TRIP_CALLS
    assert all(c.error is None for c in calls)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_template_round_trips_a_non_function_call(family):
    template = training_template(family)
    odd = call("run", {"code": "1+1"}, call_type="code")
    assistant = {"role": "assistant", "content": "", "tool_calls": [odd]}
    _, calls = parse_tool_calls(
        family, _generated_text(template, [{"role": "user", "content": "Go"}], assistant)
    )
    assert [c.as_message_call() for c in calls] == [odd]


@pytest.mark.parametrize("name", ["qwen2_5_instruct", "llama3_1_instruct"])
def test_published_template_calls_parse_back(name):
    template = stock(name)
    assistant = {"role": "assistant", "content": "", "tool_calls": [ROUND_TRIP_CALLS[1]]}
    _, calls = parse_tool_calls(
        STOCK[name], _generated_text(template, [{"role": "user", "content": "Go"}], assistant)
    )
    assert [c.as_message_call() for c in calls] == [ROUND_TRIP_CALLS[1]]


# ---------------------------------------------------------------------------------------------
# resolve_template
# ---------------------------------------------------------------------------------------------


def test_resolve_keeps_a_prefix_preserving_template():
    choice = resolve_template(stock("qwen2_5_instruct"), TOOLS)
    assert (choice.family, choice.template, choice.substituted) == ("qwen", stock("qwen2_5_instruct"), False)


def test_llama_template_refusing_two_calls_is_replaced():
    # prefix preserving for single calls, but it raises on two calls in one turn, which would stop
    # the loop mid-training the first time the model makes two
    assert is_prefix_preserving(stock("llama3_1_instruct"), TOOLS)
    assert not renders_every_probe(stock("llama3_1_instruct"), TOOLS)
    choice = resolve_template(stock("llama3_1_instruct"), TOOLS)
    assert (choice.family, choice.template, choice.substituted) == (
        "llama3",
        training_template("llama3"),
        True,
    )


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_resolve_substitutes_our_template_for_a_known_family(name):
    choice = resolve_template(stock(name), TOOLS)
    assert choice.family == STOCK[name]
    assert choice.template == training_template(STOCK[name])
    assert choice.substituted is True


@pytest.mark.parametrize(
    "template, message",
    [
        (None, "no chat template"),
        ("", "no chat template"),
        (CHAT_TEMPLATE, "does not render tool calls"),
        (MISTRAL_LIKE, "cannot parse"),
    ],
)
def test_resolve_rejects_templates_the_loop_cannot_use(template, message):
    with pytest.raises(ValueError, match=message) as info:
        resolve_template(template, TOOLS)
    assert "processing_class" in str(info.value) and "tokenizer.chat_template" in str(info.value)


# ---------------------------------------------------------------------------------------------
# continuation_text
# ---------------------------------------------------------------------------------------------

# One exchange per family, written by hand: what the model generates for a call of
# multiply(3, 4), and the text expected after it (the tool result and the next prompt).
HAND_WRITTEN = {
    "qwen": (
        'Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call><|im_end|>',
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ),
    "llama3": (
        'Let me compute.<|python_tag|>{"name": "multiply", "parameters": {"a": 3, "b": 4}}<|eot_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\n12<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "deepseek_v3": (
        "Let me compute.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n"
        '{"a": 3, "b": 4}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>12<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
    ),
}

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3 times 4?"}]
RESULT = [{"role": "tool", "name": "multiply", "content": "12"}]


def _loop_messages(family: str) -> list[dict]:
    """The prompt plus the assistant message the loop builds from the hand-written generation."""
    content, calls = parse_tool_calls(family, HAND_WRITTEN[family][0])
    assistant = {"role": "assistant", "content": content, "tool_calls": [c.as_message_call() for c in calls]}
    return PROMPT + [assistant]


@pytest.mark.parametrize("family", FAMILIES)
def test_continuation_matches_the_hand_written_text_and_completes_the_stream(family):
    template = training_template(family)
    generated, expected = HAND_WRITTEN[family]
    messages = _loop_messages(family)
    text = continuation_text(template, messages, RESULT, TOOLS, TURN_END[family])
    assert text == expected
    stream = render_template(template, PROMPT, TOOLS, True) + generated + text
    assert stream == render_template(template, messages + RESULT, TOOLS, True)


@pytest.mark.parametrize("name", ["qwen2_5_instruct", "llama3_1_instruct"])
def test_continuation_with_a_kept_published_template(name):
    family = STOCK[name]
    text = continuation_text(stock(name), _loop_messages(family), RESULT, TOOLS, TURN_END[family])
    expected = HAND_WRITTEN[family][1]
    if family == "llama3":  # Llama 3.1's template JSON-encodes string tool results
        expected = expected.replace("\n\n12<|eot_id|>", '\n\n"12"<|eot_id|>')
    assert text == expected


def test_continuation_with_two_results_and_thinking_disabled():
    template = training_template("qwen")
    messages = PROMPT + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [call("multiply", {"a": 3, "b": 4}), call("multiply", {"a": 5, "b": 6})],
        }
    ]
    results = [{"role": "tool", "content": "12"}, {"role": "tool", "content": "30"}]
    text = continuation_text(template, messages, results, TOOLS, "<|im_end|>", enable_thinking=False)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n12\n</tool_response>\n<tool_response>\n30\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_continuation_refuses_a_template_that_is_not_prefix_preserving():
    with pytest.raises(ValueError, match="not prefix preserving"):
        continuation_text(stock("qwen3"), _loop_messages("qwen"), RESULT, TOOLS, "<|im_end|>")


def test_continuation_checks_its_inputs():
    template = training_template("qwen")
    with pytest.raises(ValueError, match="end-of-turn text '<\\|eot_id\\|>'"):
        continuation_text(template, _loop_messages("qwen"), RESULT, TOOLS, "<|eot_id|>")
    with pytest.raises(ValueError, match="end with the generated assistant"):
        continuation_text(template, PROMPT, RESULT, TOOLS, "<|im_end|>")
    with pytest.raises(ValueError, match="could not render"):
        continuation_text(
            "{{ raise_exception('boom') }}", _loop_messages("qwen"), RESULT, TOOLS, "<|im_end|>"
        )
