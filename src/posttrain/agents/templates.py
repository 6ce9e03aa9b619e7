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

Families and their syntax:

- ``qwen`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  in the assistant text; results in a user turn as ``<tool_response>\\n...\\n</tool_response>``.
- ``llama3`` (Llama 3.1 / 3.2): the assistant content is ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``; results in an ``ipython`` header turn.
- ``deepseek_v3`` (DeepSeek-V3 / R1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME``
  followed by a fenced JSON block; results in ``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


_THINK_END = "</think>"

# ---------------------------------------------------------------------------------------------
# Parsing helpers shared by the families
# ---------------------------------------------------------------------------------------------


def _failed(raw: str, reason: str, name: str | None = None, call_type: str = "function") -> ToolCall:
    """A call that could not be read; ``reason`` is a one-line explanation for the model."""
    return ToolCall(name=name, arguments=None, type=call_type, raw=raw, error=reason)


def _guess_name(text: str) -> str | None:
    """The ``"name"`` value of a broken JSON call, when it can still be seen."""
    match = re.search(r'"name"\s*:\s*"([^"\\]+)"', text)
    return match.group(1) if match else None


def _json_kind(value: Any) -> str:
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), "a number")


def _one_line(exc: json.JSONDecodeError) -> str:
    return f"{exc.msg} at line {exc.lineno} column {exc.colno}"


def _decode_arguments(value: Any) -> tuple[dict[str, Any] | None, str | None]:
    """Arguments as a dict (JSON text is decoded; missing means none), or an error reason."""
    if value is None:
        return {}, None
    if isinstance(value, str):
        if not value.strip():
            return {}, None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return None, f"tool call arguments are not valid JSON: {_one_line(exc)}"
        if isinstance(value, str):  # encoded twice: a JSON string holding the JSON object
            return _decode_arguments(value)
    if not isinstance(value, dict):
        return None, f"tool call arguments must be a JSON object, got {_json_kind(value)}"
    return value, None


def _call_from_object(obj: Any, raw: str) -> ToolCall:
    """A ``ToolCall`` from a decoded ``{"name", "arguments"|"parameters", "type"?}`` object."""
    if not isinstance(obj, dict):
        return _failed(raw, f"a tool call must be a JSON object, got {_json_kind(obj)}")
    if isinstance(obj.get("function"), dict):  # OpenAI style {"type": ..., "function": {...}}
        obj = {"type": obj.get("type", "function"), **obj["function"]}
    call_type = obj.get("type", "function")
    call_type = call_type if isinstance(call_type, str) and call_type else "function"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return _failed(raw, 'tool call has no "name"', call_type=call_type)
    arguments, error = _decode_arguments(obj.get("arguments", obj.get("parameters")))
    return ToolCall(name=name, arguments=arguments, type=call_type, raw=raw, error=error)


def _call_from_json_text(text: str, raw: str) -> ToolCall:
    """A ``ToolCall`` from the JSON text of one call."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return _failed(raw, f"tool call is not valid JSON: {_one_line(exc)}", name=_guess_name(text))
    return _call_from_object(obj, raw)


def _split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: text up to the last ``</think>`` is reasoning and holds no calls."""
    cut = text.rfind(_THINK_END)
    if cut < 0:
        return "", text
    cut += len(_THINK_END)
    return text[:cut], text[cut:]


def _cut_at_turn_end(text: str, ends: tuple[str, ...]) -> str:
    """``text`` up to the first end-of-turn marker (nothing after it belongs to the turn)."""
    positions = [text.find(end) for end in ends if end in text]
    return text[: min(positions)] if positions else text


# ---------------------------------------------------------------------------------------------
# qwen
# ---------------------------------------------------------------------------------------------

_QWEN_OPEN, _QWEN_CLOSE = "<tool_call>", "</tool_call>"
_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _parse_qwen(text: str) -> tuple[str, list[ToolCall]]:
    """Split a Qwen/Hermes turn: every ``<tool_call>...</tool_call>`` block is one call."""
    reasoning, body = _split_reasoning(text)
    calls: list[ToolCall] = []
    pieces: list[str] = []
    position = 0
    for match in _QWEN_CALL.finditer(body):
        pieces.append(body[position : match.start()])
        calls.append(_call_from_json_text(match.group(1), match.group(0)))
        position = match.end()
    tail = body[position:]
    opened = tail.find(_QWEN_OPEN)
    if opened >= 0:
        broken = tail[opened:]
        reason = f"unterminated {_QWEN_OPEN} (no closing {_QWEN_CLOSE})"
        calls.append(_failed(broken, reason, name=_guess_name(broken)))
        tail = tail[:opened]
    pieces.append(tail)
    return (reasoning + "".join(pieces)).strip(), calls


# ---------------------------------------------------------------------------------------------
# llama3
# ---------------------------------------------------------------------------------------------

_PYTHON_TAG = "<|python_tag|>"
_BUILTIN_CALL = re.compile(r"([A-Za-z_]\w*)\.call\((.*)\)", re.DOTALL)
_CALL_KEYS = ("name", "parameters", "arguments", "function")


def _json_values(text: str) -> list[tuple[Any, str]]:
    """Consecutive JSON values separated by whitespace, ``;`` or ``,``: ``[(value, source)]``.

    Raises:
        json.JSONDecodeError: when a value cannot be decoded.
    """
    decoder = json.JSONDecoder()
    values: list[tuple[Any, str]] = []
    position = 0
    while True:
        while position < len(text) and text[position] in " \t\r\n;,":
            position += 1
        if position >= len(text):
            return values
        value, end = decoder.raw_decode(text, position)
        if isinstance(value, list):
            values.extend((item, json.dumps(item)) for item in value)
        else:
            values.append((value, text[position:end]))
        position = end


def _llama_json_calls(payload: str, forced: bool) -> list[ToolCall] | None:
    """Calls from JSON objects, or ``None`` when (not ``forced``) the JSON is not a call."""
    try:
        values = _json_values(payload)
    except json.JSONDecodeError as exc:
        if forced or '"name"' in payload:
            reason = f"tool call is not valid JSON: {_one_line(exc)}"
            return [_failed(payload, reason, name=_guess_name(payload))]
        return None
    looks_like_calls = values and all(
        isinstance(value, dict) and any(key in value for key in _CALL_KEYS) for value, _ in values
    )
    if not looks_like_calls:
        return [_failed(payload, "no tool call after <|python_tag|>")] if forced else None
    return [_call_from_object(value, raw) for value, raw in values]


def _builtin_call(name: str, arguments: str, raw: str) -> ToolCall:
    """A Llama built-in tool call ``name.call(key="value", ...)`` (type ``"builtin"``)."""
    try:
        node = ast.parse(f"f({arguments})", mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
            raise ValueError("only keyword arguments are allowed")
        values = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    except (SyntaxError, ValueError) as exc:
        reason = f"built-in call {name}.call(...) has unreadable arguments: {str(exc).splitlines()[0]}"
        return _failed(raw, reason, name=name, call_type="builtin")
    return ToolCall(name=name, arguments=values, type="builtin", raw=raw)


def _llama_tagged_calls(payload: str) -> list[ToolCall]:
    """The calls after ``<|python_tag|>``: JSON calls, a built-in call, or code to run."""
    payload = payload.replace(_PYTHON_TAG, "").strip()
    if not payload:
        return [_failed("", "empty tool call after <|python_tag|>")]
    if payload.startswith(("{", "[")):
        return _llama_json_calls(payload, forced=True) or []
    builtin = _BUILTIN_CALL.fullmatch(payload)
    if builtin:
        return [_builtin_call(builtin.group(1), builtin.group(2), payload)]
    return [
        ToolCall(name="code_interpreter", arguments={"code": payload}, type="code_interpreter", raw=payload)
    ]


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Split a Llama 3.x turn: JSON call objects as the content, or anything after the python tag."""
    reasoning, body = _split_reasoning(text)
    if _PYTHON_TAG in body:
        content, payload = body.split(_PYTHON_TAG, 1)
        return (reasoning + content).strip(), _llama_tagged_calls(payload)
    stripped = body.strip()
    if stripped.startswith(("{", "[")):
        calls = _llama_json_calls(stripped, forced=False)
        if calls is not None:
            return reasoning.strip(), calls
    return (reasoning + body).strip(), []


# ---------------------------------------------------------------------------------------------
# deepseek_v3
# ---------------------------------------------------------------------------------------------

_DS_CALLS_BEGIN, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL_BEGIN, _DS_CALL_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_CALL = re.compile(re.escape(_DS_CALL_BEGIN) + r"(.*?)(?:" + re.escape(_DS_CALL_END) + r"|\Z)", re.DOTALL)
_FENCE = re.compile(r"\s*```[A-Za-z]*[ \t]*\n?(.*?)\s*```\s*", re.DOTALL)


def _deepseek_call(match: re.Match[str]) -> ToolCall:
    """One ``<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME\\n```json ...```<｜tool▁call▁end｜>``."""
    raw, inner = match.group(0), match.group(1)
    if not raw.endswith(_DS_CALL_END):
        return _failed(raw, f"unterminated tool call (no {_DS_CALL_END})")
    if _DS_SEP not in inner:
        return _failed(raw, f"tool call has no {_DS_SEP} between its type and its name")
    call_type, rest = inner.split(_DS_SEP, 1)
    call_type = call_type.strip() or "function"
    name, _, arguments_text = rest.partition("\n")
    if not name.strip():
        return _failed(raw, f"tool call has no function name after {_DS_SEP}", call_type=call_type)
    fenced = _FENCE.fullmatch(arguments_text)
    arguments, error = _decode_arguments(fenced.group(1) if fenced else arguments_text)
    return ToolCall(name=name.strip(), arguments=arguments, type=call_type, raw=raw, error=error)


def _parse_deepseek(text: str) -> tuple[str, list[ToolCall]]:
    """Split a DeepSeek-V3 turn: the content, then one block of calls."""
    reasoning, body = _split_reasoning(text)
    start = body.find(_DS_CALLS_BEGIN)
    if start < 0:
        start = body.find(_DS_CALL_BEGIN)
    if start < 0:
        return (reasoning + body).strip(), []
    content, region = body[:start], body[start:].removeprefix(_DS_CALLS_BEGIN)
    region, _, trailing = region.partition(_DS_CALLS_END)
    calls = [_deepseek_call(match) for match in _DS_CALL.finditer(region)]
    if not calls:
        calls = [_failed(region, f"tool-call block holds no {_DS_CALL_BEGIN}")]
    return (reasoning + content + trailing).strip(), calls


# ---------------------------------------------------------------------------------------------
# Training templates (prefix preserving; reasoning is never stripped)
# ---------------------------------------------------------------------------------------------

# Shared by the three templates: the text of a message's content (a string or content blocks).
_TEXT_OF = r"""
{%- macro text_of(content, image_text='') -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for block in content -%}
            {%- if block is mapping and block.type == 'text' -%}
                {{- block.text -}}
            {%- elif block is mapping and (block.type == 'image' or 'image' in block) -%}
                {{- image_text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro arguments_of(function) -%}
    {%- if function.arguments is string -%}
        {{- function.arguments -}}
    {%- else -%}
        {{- (function.arguments if function.arguments is defined else {}) | tojson -}}
    {%- endif -%}
{%- endmacro -%}
"""

# A run of tool messages stays open until the next message (or the generation prompt) closes it,
# so appending one more tool message never changes what was rendered before.
_QWEN_TEMPLATE = (
    _TEXT_OF
    + r"""
{%- set image_text = '<|vision_start|><|image_pad|><|vision_end|>' -%}
{%- set ns = namespace(prev='') -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {{- text_of(messages[0].content, image_text) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments '
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n'
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content, image_text) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role != 'tool' and ns.prev == 'tool' -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content, image_text) -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- elif enable_thinking is defined and enable_thinking is false -%}
            {{- '<think>\n\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set function = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + (function.name | tojson) + ', "arguments": ' -}}
            {{- arguments_of(function) -}}
            {%- if call.type is defined and call.type != 'function' -%}
                {{- ', "type": ' + (call.type | tojson) -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>' -}}
        {%- endgeneration -%}
        {{- '\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if ns.prev != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content, image_text) + '\n</tool_response>' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content, image_text) + '<|im_end|>\n' -}}
    {%- endif -%}
    {%- set ns.prev = message.role -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.prev == 'tool' -%}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""
)

# Tools go in the system prompt (Llama's ``tools_in_user_message=False`` layout); several calls in
# one turn are written as JSON objects separated by "; ".
_LLAMA3_TEMPLATE = (
    _TEXT_OF
    + r"""
{{- bos_token -}}
{%- set has_system = messages and messages[0].role == 'system' -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools -%}
    {{- 'Environment: ipython\n' -}}
{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: ' -}}
{{- (date_string if date_string is defined else '26 Jul 2024') + '\n\n' -}}
{%- if tools -%}
    {{- 'You have access to the following functions. To call a function, please respond with JSON '
        'for a function call. Respond in the format {"name": function name, "parameters": '
        'dictionary of argument name and its value}. Do not use variables.\n\n' -}}
    {%- for tool in tools -%}
        {{- (tool | tojson(indent=4)) + '\n\n' -}}
    {%- endfor -%}
{%- endif -%}
{%- if has_system -%}
    {{- text_of(messages[0].content) | trim -}}
{%- endif -%}
{{- '<|eot_id|>' -}}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content) -%}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- if content -%}
                {{- content + '<|python_tag|>' -}}
            {%- endif -%}
            {%- for call in message.tool_calls -%}
                {%- set function = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '; ' -}}
                {%- endif -%}
                {{- '{"name": ' + (function.name | tojson) + ', "parameters": ' + arguments_of(function) -}}
                {%- if call.type is defined and call.type != 'function' -%}
                    {{- ', "type": ' + (call.type | tojson) -}}
                {%- endif -%}
                {{- '}' -}}
            {%- endfor -%}
        {%- else -%}
            {{- content -}}
        {%- endif -%}
        {{- '<|eot_id|>' -}}
        {%- endgeneration -%}
    {%- elif message.role == 'tool' or message.role == 'ipython' -%}
        {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' -}}
        {%- if message.content is mapping -%}
            {{- message.content | tojson -}}
        {%- else -%}
            {{- text_of(message.content) -}}
        {%- endif -%}
        {{- '<|eot_id|>' -}}
    {%- else -%}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
        {{- (text_of(message.content) | trim) + '<|eot_id|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
"""
)

# After tool outputs the assistant continues without a new <｜Assistant｜> tag, as in DeepSeek's
# own templates; the outputs block is closed by whatever comes next.
_DEEPSEEK_V3_TEMPLATE = (
    _TEXT_OF
    + r"""
{{- bos_token -}}
{%- set ns = namespace(prev='') -%}
{%- set has_system = messages and messages[0].role == 'system' -%}
{%- if has_system -%}
    {{- text_of(messages[0].content) -}}
{%- endif -%}
{%- if tools -%}
    {%- if has_system -%}
        {{- '\n\n' -}}
    {%- endif -%}
    {{- '## Tools\nYou can call the following functions.' -}}
    {%- for tool in tools -%}
        {%- set function = tool.function if tool.function is defined else tool -%}
        {{- '\n\n### ' + function.name + '\nDescription: ' + (function.description or '') -}}
        {{- '\nParameters: ' + ((function.parameters or {}) | tojson) -}}
    {%- endfor -%}
    {{- '\n\nTo call functions, answer with one block of calls, one call per line:\n'
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>FUNCTION_NAME\n```json\n'
        'ARGUMENTS_AS_JSON\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role != 'tool' and ns.prev == 'tool' -%}
        {{- '<｜tool▁outputs▁end｜>' -}}
    {%- endif -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' -%}
        {{- '<｜User｜>' + text_of(message.content) -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content) -%}
        {%- if ns.prev != 'tool' -%}
            {{- '<｜Assistant｜>' -}}
        {%- endif -%}
        {%- generation -%}
        {%- if message.reasoning_content is string and message.reasoning_content
              and not content.lstrip().startswith('<think>') -%}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {{- '<｜tool▁calls▁begin｜>' -}}
            {%- for call in message.tool_calls -%}
                {%- set function = call.function if call.function is defined else call -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<｜tool▁call▁begin｜>' + (call.type if call.type is defined else 'function') -}}
                {{- '<｜tool▁sep｜>' + function.name + '\n```json\n' + arguments_of(function) -}}
                {{- '\n```<｜tool▁call▁end｜>' -}}
            {%- endfor -%}
            {{- '<｜tool▁calls▁end｜>' -}}
        {%- endif -%}
        {{- '<｜end▁of▁sentence｜>' -}}
        {%- endgeneration -%}
    {%- elif message.role == 'tool' -%}
        {%- if ns.prev == 'tool' -%}
            {{- '\n' -}}
        {%- else -%}
            {{- '<｜tool▁outputs▁begin｜>' -}}
        {%- endif -%}
        {{- '<｜tool▁output▁begin｜>' + text_of(message.content) + '<｜tool▁output▁end｜>' -}}
    {%- else -%}
        {{- text_of(message.content) -}}
    {%- endif -%}
    {%- set ns.prev = message.role -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {%- if ns.prev == 'tool' -%}
        {{- '<｜tool▁outputs▁end｜>' -}}
    {%- else -%}
        {{- '<｜Assistant｜>' -}}
    {%- endif -%}
{%- endif -%}
"""
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
