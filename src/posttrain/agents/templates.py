"""Chat-template families for the multi-turn tool loop.

The tool loop appends text to the token stream the model generated: after an assistant turn
that called tools, it adds the tool results and the next generation prompt, then lets the model
continue. That only works when the chat template is *prefix preserving*: rendering a longer
conversation must not change how the earlier messages render. This module

- recognises a template's tool-call *family* from what it renders (``detect_family``),
- reads the calls out of a generated assistant turn (``parse_tool_calls``),
- checks prefix preservation on probe conversations (``is_prefix_preserving``),
- holds one prefix-preserving training template per family (``training_template``),
- picks the template to train with (``resolve_template``), and
- computes the text to append after a generated turn by rendering (``continuation_text``).

Each family's call parser is in ``agents/call_parsing.py`` and its training template's text in
``agents/training_templates.py``; the family table here joins them.

Families and their syntax:

- ``qwen`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  in the assistant text; results in a user turn as ``<tool_response>\\n...\\n</tool_response>``.
- ``llama3`` (Llama 3.1 / 3.2): the assistant content is ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``; results in an ``ipython`` header turn.
- ``deepseek_v3`` (DeepSeek-V3 / R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME``
  followed by a fenced JSON block; results in ``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.agents.call_parsing import (
    _DS_CALLS_BEGIN,
    _DS_CALLS_END,
    _cut_at_turn_end,
    _parse_deepseek,
    _parse_llama3,
    _parse_qwen,
)
from posttrain.agents.training_templates import _DEEPSEEK_V3_TEMPLATE, _LLAMA3_TEMPLATE, _QWEN_TEMPLATE
from posttrain.agents.types import ToolCall
from posttrain.data.chat import RENDER_ERRORS as _RENDER_ERRORS
from posttrain.data.chat import render_template

FAMILIES = ("qwen", "llama3", "deepseek_v3")

# The text each family's assistant turn ends with (the model's end-of-turn token).
TURN_END = {"qwen": "<|im_end|>", "llama3": "<|eot_id|>", "deepseek_v3": "<｜end▁of▁sentence｜>"}

_FIX = (
    "Pass a processing_class whose chat template renders tool calls (e.g. a Qwen2.5, Qwen3, "
    "Llama-3.1 or DeepSeek-V3 tokenizer), or set tokenizer.chat_template yourself."
)


# ---------------------------------------------------------------------------------------------
# The family table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Family:
    """How one family writes calls and results.

    Attributes:
        parse: splits one assistant turn (end-of-turn text removed) into content and calls.
        turn_ends: end-of-turn texts cut from a generated turn.
        call_region: where the family's calls sit in a render; group 1 is the text to parse.
        result_region: a regex (with ``{result}``) matching a tool result in the family's syntax.
        template: our prefix-preserving training template.
    """

    parse: Callable[[str], tuple[str, list[ToolCall]]]
    turn_ends: tuple[str, ...]
    call_region: re.Pattern[str]
    result_region: str
    template: str


_FAMILY_TABLE = {
    # DeepSeek first: its tokens are the most specific.
    "deepseek_v3": _Family(
        parse=_parse_deepseek,
        turn_ends=("<｜end▁of▁sentence｜>",),
        call_region=re.compile(
            "(" + re.escape(_DS_CALLS_BEGIN) + ".*?" + re.escape(_DS_CALLS_END) + ")", re.DOTALL
        ),
        result_region=r"<｜tool▁output▁begin｜>\s*{result}\s*<｜tool▁output▁end｜>",
        template=_DEEPSEEK_V3_TEMPLATE,
    ),
    "qwen": _Family(
        parse=_parse_qwen,
        turn_ends=("<|im_end|>", "<|endoftext|>"),
        call_region=re.compile(r"(<tool_call>.*?</tool_call>)", re.DOTALL),
        result_region=r"<tool_response>\s*{result}\s*</tool_response>",
        template=_QWEN_TEMPLATE,
    ),
    "llama3": _Family(
        parse=_parse_llama3,
        turn_ends=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"),
        call_region=re.compile(
            r"<\|start_header_id\|>assistant<\|end_header_id\|>\n\n(.*?)(?:<\|eot_id\|>|<\|eom_id\|>)",
            re.DOTALL,
        ),
        result_region=r"<\|start_header_id\|>ipython<\|end_header_id\|>\s*\"?{result}\"?\s*<\|eot_id\|>",
        template=_LLAMA3_TEMPLATE,
    ),
}


def _family(family: str) -> _Family:
    if family not in _FAMILY_TABLE:
        raise ValueError(f"Unknown tool-call family {family!r}; known families: {', '.join(FAMILIES)}.")
    return _FAMILY_TABLE[family]


def parse_tool_calls(family: str, text: str) -> tuple[str, list[ToolCall]]:
    """Split a generated assistant turn into its plain content and its tool calls.

    The end-of-turn text (``<|im_end|>``, ``<|eot_id|>``, ``<｜end▁of▁sentence｜>``, ...) and
    anything after it are dropped. Reasoning up to the last ``</think>`` stays in the content and
    is not searched for calls. A call that cannot be read (bad JSON, no name, arguments that are
    not an object, an unterminated block) comes back with ``error`` set to a one-line reason and
    ``raw`` holding its text; the loop sends the reason to the model.

    Args:
        family: one of ``FAMILIES``.
        text: the decoded assistant turn, as generated.

    Returns:
        ``(content, calls)``, with the calls in the order they were written.

    Raises:
        ValueError: for an unknown family.
    """
    spec = _family(family)
    return spec.parse(_cut_at_turn_end(text, spec.turn_ends))


def training_template(family: str) -> str:
    """Our prefix-preserving chat template for ``family``.

    It renders the system prompt (with the tools listed the family's way), user, assistant (content,
    reasoning kept verbatim, calls in the family's syntax) and tool messages, and the generation
    prompt. Earlier turns never change when messages are appended, one at a time or a turn at a time.

    Raises:
        ValueError: for an unknown family.
    """
    return _family(family).template


# ---------------------------------------------------------------------------------------------
# Probes: detection and prefix preservation
# ---------------------------------------------------------------------------------------------

_PROBE_NAME = "probe_lookup"
_PROBE_ARGUMENTS = {"key": "probe-7"}
_PROBE_RESULT = "probe-result-9"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_NAME,
            "description": "Look a key up in the probe table.",
            "parameters": {
                "type": "object",
                "properties": {"key": {"type": "string", "description": "The key to look up."}},
                "required": ["key"],
            },
        },
    }
]


def _probe_call(key: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": _PROBE_NAME, "arguments": {"key": key}}}


def _assistant(content: str, *keys: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if keys:
        message["tool_calls"] = [_probe_call(key) for key in keys]
    return message


def _tool(content: str) -> dict[str, Any]:
    return {"role": "tool", "name": _PROBE_NAME, "content": content}


_SYSTEM = {"role": "system", "content": "You answer briefly."}
_USER = {"role": "user", "content": "Look the key up, please."}


def _probe_conversations() -> list[list[dict[str, Any]]]:
    """Conversations shaped like the tool loop's: with and without a system message, one or two
    calls per turn, several tool turns, reasoning in the content, and a plain exchange."""
    think = "<think>\nThe table has it.\n</think>\n\n"
    return [
        [_USER, _assistant("", "probe-7"), _tool(_PROBE_RESULT), _assistant("It is probe-result-9.")],
        [
            _SYSTEM,
            _USER,
            _assistant("Let me look.", "probe-7"),
            _tool(_PROBE_RESULT),
            _assistant("", "probe-8"),
            _tool("probe-result-10"),
            _assistant("Done."),
        ],
        [
            _SYSTEM,
            _USER,
            _assistant("", "probe-7", "probe-8"),
            _tool(_PROBE_RESULT),
            _tool("x"),
            _assistant("Both."),
        ],
        [
            _USER,
            _assistant(think + "Checking.", "probe-7"),
            _tool(_PROBE_RESULT),
            _assistant(think + "Found."),
        ],
        [_SYSTEM, _USER, _assistant("Hello.")],
    ]


def _render_probe(chat_template: str, **template_kwargs: Any) -> str | None:
    """The probe exchange (one call, its result) rendered, or ``None`` if the template fails."""
    probe = [_SYSTEM, _USER, _assistant("", "probe-7"), _tool(_PROBE_RESULT)]
    try:
        return render_template(chat_template, probe, _PROBE_TOOLS, **template_kwargs)
    except _RENDER_ERRORS:
        return None


def _renders_probe_call(spec: _Family, rendered: str) -> bool:
    """Whether the family's parser reads the probe call, and its result, back from a render."""
    result = spec.result_region.format(result=re.escape(_PROBE_RESULT))
    if not re.search(result, rendered):
        return False
    for match in spec.call_region.finditer(rendered):
        _, calls = spec.parse(match.group(1))
        if any(c.error is None and c.name == _PROBE_NAME and c.arguments == _PROBE_ARGUMENTS for c in calls):
            return True
    return False


def detect_family(chat_template: str) -> str | None:
    """The tool-call family of a chat template, recognised from what it renders.

    A probe conversation (a system prompt, a user question, an assistant call of a probe tool,
    the tool's result) is rendered; the family is the one whose parser reads the probe call back
    and whose result syntax wraps the probe result. Template wording does not matter.

    Args:
        chat_template: the Jinja chat template.

    Returns:
        One of ``FAMILIES``, or ``None`` when the render shows no call any family can read.
    """
    rendered = _render_probe(chat_template)
    if rendered is None:
        return None
    for name, spec in _FAMILY_TABLE.items():
        if _renders_probe_call(spec, rendered):
            return name
    return None


def renders_tool_calls(chat_template: str) -> bool:
    """Whether rendering an assistant message with ``tool_calls`` leaves a trace of the call."""
    rendered = _render_probe(chat_template)
    return rendered is not None and _PROBE_ARGUMENTS["key"] in rendered


def _boundaries(messages: list[dict[str, Any]]) -> list[tuple[int, bool, int, bool]]:
    """The loop's append points, as ``(k, prompt_k, j, prompt_j)``.

    ``render(messages[:k], add_generation_prompt=prompt_k)`` must be a prefix of
    ``render(messages[:j], add_generation_prompt=prompt_j)``: the generation prompt opens each
    assistant turn, and each run of tool messages is appended, with the next generation prompt,
    after the assistant turn that called them.
    """
    out = []
    for index, message in enumerate(messages):
        if message["role"] == "assistant":
            out.append((index, True, index + 1, False))
        last_of_run = index + 1 == len(messages) or messages[index + 1]["role"] != "tool"
        if message["role"] == "tool" and last_of_run:
            start = index
            while messages[start - 1]["role"] == "tool":
                start -= 1
            out.append((start, False, index + 1, True))
    return out


def _conversation_preserves_prefix(
    chat_template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]], kwargs: dict[str, Any]
) -> bool:
    for k, prompt_k, j, prompt_j in _boundaries(messages):
        before = render_template(chat_template, messages[:k], tools, prompt_k, **kwargs)
        after = render_template(chat_template, messages[:j], tools, prompt_j, **kwargs)
        if not after.startswith(before):
            return False
    return True


def is_prefix_preserving(
    chat_template: str, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
) -> bool:
    """Whether appending turns never changes how earlier messages render.

    On several probe conversations (with and without a system message, one or two calls per
    turn, several tool turns, reasoning in the content) every append point of the tool loop is
    checked: the render with the generation prompt is a prefix of the render with the assistant
    message, and the render ending with an assistant turn is a prefix of the render with the tool
    results and the next generation prompt. A probe the template refuses to render (Llama 3.1
    refuses two calls in one turn) is skipped; if it refuses every probe, the answer is ``False``.

    Args:
        chat_template: the Jinja chat template.
        tools: the tool schemas to render with (a probe tool when ``None``).
        **template_kwargs: extra template variables (``enable_thinking``, ...).

    Returns:
        ``True`` when every append point of every renderable probe preserves the prefix.
    """
    schemas = tools or _PROBE_TOOLS
    checked = 0
    for messages in _probe_conversations():
        try:
            if not _conversation_preserves_prefix(chat_template, messages, schemas, template_kwargs):
                return False
        except _RENDER_ERRORS:
            continue
        checked += 1
    return checked > 0


def renders_every_probe(
    chat_template: str, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any
) -> bool:
    """Whether the template renders every probe conversation (stock Llama 3.1 refuses two calls in
    one turn, which would stop the tool loop the first time the model makes two)."""
    schemas = tools or _PROBE_TOOLS
    for messages in _probe_conversations():
        try:
            render_template(chat_template, messages, schemas, False, **template_kwargs)
        except _RENDER_ERRORS:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Choosing the template, and the loop's continuation text
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template the tool loop trains with.

    Attributes:
        family: the tool-call family (one of ``FAMILIES``), which selects the parser.
        template: the Jinja template to render with.
        substituted: ``True`` when the model's own template was replaced by our training template
            (the trainer warns).
    """

    family: str
    template: str
    substituted: bool


def resolve_template(
    chat_template: str | None, tools: list[dict[str, Any]], **template_kwargs: Any
) -> TemplateChoice:
    """Pick the chat template for tool training.

    A template of a known family that is prefix preserving and renders every probe conversation
    is kept; a known family that is not (stock Qwen3 and DeepSeek-V3, which rewrite earlier
    turns, and stock Llama 3.1, which refuses two calls in one turn) is replaced by our training
    template.

    Args:
        chat_template: the processing class's chat template, or ``None``.
        tools: the tool schemas the loop will render with.
        **template_kwargs: extra template variables (``enable_thinking``, ...).

    Returns:
        The ``TemplateChoice``.

    Raises:
        ValueError: when there is no template, when it renders no tool calls, or when it renders
            them in a syntax no known family reads (there would be no parser for the model's calls).
    """
    if not chat_template:
        raise ValueError(
            f"The processing class has no chat template, so tool calls cannot be rendered. {_FIX}"
        )
    family = detect_family(chat_template)
    if family is None:
        if not renders_tool_calls(chat_template):
            raise ValueError(
                "The chat template does not render tool calls: an assistant message with `tool_calls` "
                f"leaves no trace in its output, so the model would never see its own calls. {_FIX}"
            )
        raise ValueError(
            "The chat template renders tool calls in a syntax posttrain cannot parse (known families: "
            f"{', '.join(FAMILIES)}), so the model's calls could not be read. {_FIX}"
        )
    if is_prefix_preserving(chat_template, tools, **template_kwargs) and renders_every_probe(
        chat_template, tools, **template_kwargs
    ):
        return TemplateChoice(family=family, template=chat_template, substituted=False)
    return TemplateChoice(family=family, template=training_template(family), substituted=True)


# The turn layout of each family's plain chat (no tools): what wraps an assistant answer.
_CHAT_LAYOUT = {
    "deepseek_v3": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
    "qwen": ("<|im_start|>assistant\n", "<|im_end|>"),
    "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
}
_PROBE_ANSWER = "probe-answer-5"


def chat_family(chat_template: str) -> str | None:
    """The family of a chat template, also for templates that render no tool calls.

    The tool-call family (``detect_family``) when the template renders calls; else the family
    whose assistant-turn layout wraps the answer of a plain probe exchange (so a ChatML template
    without tools, such as SmolLM2's, is ``qwen``). A template that renders tool calls in a
    syntax no family reads has no family: substituting ours would change how its calls read.

    Returns:
        One of ``FAMILIES``, or ``None``.
    """
    family = detect_family(chat_template)
    if family is not None:
        return family
    if renders_tool_calls(chat_template):
        return None
    try:
        rendered = render_template(chat_template, [_USER, {"role": "assistant", "content": _PROBE_ANSWER}])
    except _RENDER_ERRORS:
        return None
    for name, (opening, closing) in _CHAT_LAYOUT.items():
        if opening + _PROBE_ANSWER + closing in rendered:
            return name
    return None


def marked_template(chat_template: str | None) -> tuple[str, str]:
    """A chat template with ``{% generation %}`` markers, for training on assistant tokens only.

    A template of a known family (``chat_family``) is replaced by our training template of that
    family, which marks each assistant turn from its first token after the turn header through
    its end-of-turn token (reasoning and tool calls included). It is prefix preserving and
    renders system, user, assistant and tool messages; a family's stock default system prompt
    (one the template adds when the conversation has none) is not rendered.

    Args:
        chat_template: the template without markers.

    Returns:
        ``(family, template)``.

    Raises:
        ValueError: when there is no template or it belongs to no known family.
    """
    family = chat_family(chat_template) if chat_template else None
    if family is None:
        raise ValueError(
            "assistant_only_loss=True needs a chat template that wraps assistant turns in {% generation %} ... "
            "{% endgeneration %}. This tokenizer's template has no such markers, and posttrain has no marked "
            f"template for its family (known: {', '.join(FAMILIES)}: ChatML/Qwen, Llama 3, DeepSeek-V3). Set a "
            "template with generation markers (tokenizer.chat_template = ..., or SFTConfig.chat_template_path), "
            "or set assistant_only_loss=False."
        )
    return family, training_template(family)


def continuation_text(
    template: str,
    messages: list[dict[str, Any]],
    new_messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    eos_text: str,
    **template_kwargs: Any,
) -> str:
    """The text to append after a generated assistant turn so the stream matches the template.

    ``messages`` ends with the assistant turn the model just generated, whose text ended with
    ``eos_text``. The answer is what the template writes after that end-of-turn text (e.g. a
    newline), then ``new_messages`` (the tool results), then the generation prompt: the render of
    ``messages + new_messages`` with the generation prompt, minus the render of ``messages`` up to
    the turn's ``eos_text``. It is computed by rendering, with no per-family text.

    Args:
        template: the (prefix-preserving) chat template.
        messages: the conversation so far, ending with the generated assistant message.
        new_messages: the messages to append (usually the tool results of that turn).
        tools: the tool schemas, or ``None``.
        eos_text: the end-of-turn text the generated turn ended with.
        **template_kwargs: extra template variables (``enable_thinking``, ...).

    Returns:
        The text to tokenize and append.

    Raises:
        ValueError: when ``messages`` does not end with an assistant message, when the renders are
            not prefixes of each other (the template is not prefix preserving), or when the
            rendered assistant turn does not contain ``eos_text``.
    """
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("continuation_text needs `messages` to end with the generated assistant message.")
    if not eos_text:
        raise ValueError("continuation_text needs the end-of-turn text the assistant turn ended with.")
    prompt = _render_or_raise(template, messages[:-1], tools, True, template_kwargs)
    before = _render_or_raise(template, messages, tools, False, template_kwargs)
    after = _render_or_raise(template, messages + new_messages, tools, True, template_kwargs)
    if not before.startswith(prompt) or not after.startswith(before):
        raise ValueError(
            "The chat template is not prefix preserving: appending messages changed how earlier ones "
            "render. Use resolve_template(...) to get a prefix-preserving template."
        )
    end = before.rfind(eos_text, len(prompt))
    if end < 0:
        raise ValueError(f"The rendered assistant turn does not contain the end-of-turn text {eos_text!r}.")
    return before[end + len(eos_text) :] + after[len(before) :]


def _render_or_raise(
    template: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    kwargs: dict[str, Any],
) -> str:
    try:
        return render_template(template, messages, tools, add_generation_prompt, **kwargs)
    except _RENDER_ERRORS as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"The chat template could not render the conversation: {first_line}") from exc
