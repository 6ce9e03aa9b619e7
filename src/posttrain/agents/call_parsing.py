"""Reading tool calls out of a generated assistant turn: one parser per chat-template family.

Each parser takes the turn with its end-of-turn text removed and returns ``(content, calls)``;
a call that cannot be read comes back with ``error`` set (``_failed``). ``agents/templates.py``
holds the family table that names each family's parser, and ``parse_tool_calls``.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from posttrain.agents.types import ToolCall

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
