"""Tools the model may call: schemas from Python functions, running a batch of calls, metrics.

A tool is a plain Python function (sync or ``async def``) with type hints and a Google-style
docstring; ``transformers.utils.get_json_schema`` turns it into the JSON schema chat templates
expect. ``run_tool_calls`` runs the calls of one assistant turn for every rollout row at once:
sync tools are called directly, in order, on the calling thread; then every async call of the
whole batch is awaited together in one event loop, so their latencies overlap. The calls of one
turn are *parallel tool calls*: independent by contract, so their relative order is not kept
between sync and async tools. A failing call never raises; it becomes a failed ``ToolResult``
whose content tells the model what went wrong.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from posttrain.agents.types import FAILURE_KINDS, ToolCall, ToolResult

# Content-block types a tool may return in a list (multimodal tool results).
CONTENT_BLOCK_TYPES = ("text", "image")


@dataclass(frozen=True)
class Tool:
    """A function exposed to the model.

    Attributes:
        name: the name the model calls it by (the function's ``__name__``).
        fn: the callable (a function, a bound method of an environment, sync or async).
        schema: the JSON schema of ``get_json_schema``: ``{"type": "function", "function": {...}}``.
        is_async: whether calling ``fn`` gives a coroutine to await.
    """

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool


def _display_name(fn: Callable) -> str:
    """A function's name for error messages: ``Class.method`` for methods."""
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))


def is_async_callable(fn: Callable) -> bool:
    """Whether ``fn`` is an ``async def`` function, bound method or object with ``async __call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(fn, "__call__", None)  # noqa: B004 - looking for an async __call__, not callability
    return call is not None and inspect.iscoroutinefunction(call)


# A function attribute holding a ready schema: tools made from a remote environment's own JSON
# schema (the hub adapters of ``posttrain.agents.hubs``) carry it instead of type hints.
PRESET_SCHEMA_ATTRIBUTE = "__tool_schema__"


def tool_schema(fn: Callable) -> dict[str, Any]:
    """The JSON schema of one tool function.

    A function carrying a ``__tool_schema__`` attribute (a ready ``{"type": "function",
    "function": {...}}`` schema) is described by a copy of it; any other is described from its
    type hints and docstring by ``transformers.utils.get_json_schema``.

    Raises:
        ValueError: the function lacks type hints or a Google-style docstring; the message names
            the function and says how to fix it.
    """
    preset = getattr(fn, PRESET_SCHEMA_ATTRIBUTE, None)
    if preset is not None:
        return copy.deepcopy(preset)
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # DocstringParsingException, TypeHintParsingException, ...
        raise ValueError(
            f"Tool '{_display_name(fn)}' cannot be described to the model: {exc}. A tool needs a type hint "
            "on every argument and a Google-style docstring with a one-line description and an 'Args:' "
            "section describing each argument (see the transformers guide on passing tools)."
        ) from exc


def tools_from_functions(funcs: Sequence[Callable]) -> list[Tool]:
    """Describe functions (or bound methods) as tools.

    Args:
        funcs: the tool functions, sync or ``async def``.

    Returns:
        One ``Tool`` per function, in order.

    Raises:
        TypeError: an entry is not callable.
        ValueError: a function has no usable schema, or two tools share a name.
    """
    tools = []
    for fn in funcs:
        if not callable(fn):
            raise TypeError(f"tools entries must be functions; got {type(fn).__name__} ({fn!r}).")
        schema = tool_schema(fn)
        tools.append(Tool(schema["function"]["name"], fn, schema, is_async_callable(fn)))
    names = [t.name for t in tools]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(
            f"Tool names must be unique, but {duplicates} appear more than once; the model calls tools by "
            "name, so rename the functions."
        )
    return tools


def tool_table(tools: Sequence[Tool]) -> dict[str, Tool]:
    """Tools by name (the lookup table ``run_tool_calls`` takes per row)."""
    return {t.name: t for t in tools}


def combine_tool_tables(*tables: dict[str, Tool]) -> dict[str, Tool]:
    """Merge tool tables (for example the shared ``tools`` and one environment's methods).

    Raises:
        ValueError: the same name is in two tables.
    """
    merged: dict[str, Tool] = {}
    for table in tables:
        clash = sorted(set(merged) & set(table))
        if clash:
            raise ValueError(
                f"Tool names {clash} are defined twice (in `tools` and by the environment, or by two "
                "sources); the model calls tools by name, so rename one of them."
            )
        merged.update(table)
    return merged


# ---------------------------------------------------------------------------------------------
# Turning a tool's return value into message content
# ---------------------------------------------------------------------------------------------


def _is_content_blocks(value: Any) -> bool:
    """Whether ``value`` is a non-empty list of ``{"type": "text" | "image", ...}`` dicts."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(b, dict) and b.get("type") in CONTENT_BLOCK_TYPES for b in value)
    )


def format_tool_output(value: Any) -> tuple[str | list[dict[str, Any]], list[Any]]:
    """Message content (and images) for a tool's return value.

    A string stays as it is; ``None`` becomes ``""`` (a tool with nothing to say, like a command
    without output, gives an empty message rather than the word "None"); a list of content
    blocks (dicts whose ``"type"`` is ``"text"`` or ``"image"``) stays a list, and the value
    under each image block's ``"image"`` key is collected; other dicts and lists become JSON
    text (``str()`` when they hold values JSON cannot encode); anything else becomes ``str()``.

    Returns:
        ``(content, images)``.
    """
    if isinstance(value, str):
        return value, []
    if value is None:
        return "", []
    if _is_content_blocks(value):
        blocks = [dict(b) for b in value]
        images = [b["image"] for b in blocks if b["type"] == "image" and "image" in b]
        return blocks, images
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False), []
        except (TypeError, ValueError):
            return str(value), []
    return str(value), []


# ---------------------------------------------------------------------------------------------
# Running calls
# ---------------------------------------------------------------------------------------------


def _failure(call: ToolCall, kind: str, message: str) -> ToolResult:
    """A failed result; ``message`` is what the model reads."""
    assert kind in FAILURE_KINDS, kind
    return ToolResult(name=call.name, content=message, failed=True, failure=kind)


def _exception_result(call: ToolCall, exc: BaseException) -> ToolResult:
    """The result of a tool that raised: the exception's type and text."""
    text = str(exc)
    detail = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return _failure(call, "exception", f"Error: tool '{call.name}' raised {detail}")


def _success(call: ToolCall, value: Any) -> ToolResult:
    """The result of a tool that returned ``value``."""
    content, images = format_tool_output(value)
    return ToolResult(name=call.name, content=content, images=images)


def _signature_text(tool: Tool) -> str:
    """``name(a, b)``: the tool's parameters for an error message."""
    try:
        params = ", ".join(inspect.signature(tool.fn).parameters)
    except (TypeError, ValueError):
        params = "..."
    return f"{tool.name}({params})"


def _check_call(call: ToolCall, table: dict[str, Tool]) -> ToolResult | tuple[Tool, dict[str, Any]]:
    """Either the failed result of a call that cannot run, or its tool and arguments."""
    if call.error is not None:
        return _failure(call, "parse_error", f"Error: the tool call could not be parsed: {call.error}")
    if call.type != "function":
        return _failure(
            call, "unsupported_type", f"Error: unsupported tool call type '{call.type}'; only 'function' is."
        )
    tool = table.get(call.name) if call.name is not None else None
    if tool is None:
        available = ", ".join(sorted(table)) or "none"
        return _failure(
            call, "unknown_tool", f"Error: unknown tool '{call.name}'. Available tools: {available}."
        )
    arguments = {} if call.arguments is None else call.arguments
    problem = _binding_problem(tool, arguments)
    if problem is not None:
        message = f"Error: bad arguments for tool '{tool.name}': {problem}. Expected {_signature_text(tool)}."
        return _failure(call, "bad_arguments", message)
    return tool, arguments


def _binding_problem(tool: Tool, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's signature, or ``None`` when they do."""
    if not isinstance(arguments, dict):
        return f"arguments must be an object of named arguments, got {type(arguments).__name__}"
    try:
        signature = inspect.signature(tool.fn)
    except (TypeError, ValueError):
        return None  # a builtin without a signature: let the call decide
    try:
        signature.bind(**arguments)
    except TypeError as exc:
        return _describe_mismatch(signature, arguments) or str(exc)
    return None


def _describe_mismatch(signature: inspect.Signature, arguments: dict[str, Any]) -> str | None:
    """Every unexpected and missing argument name (``bind`` only reports the first problem)."""
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    by_name = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unexpected = [] if takes_any else [k for k in arguments if k not in by_name]
    missing = [n for n in by_name if params[n].default is inspect.Parameter.empty and n not in arguments]
    parts = []
    if unexpected:
        parts.append(f"unexpected argument(s) {', '.join(map(repr, unexpected))}")
    if missing:
        parts.append(f"missing required argument(s) {', '.join(map(repr, missing))}")
    return "; ".join(parts) or None


def _start_call(call: ToolCall, table: dict[str, Tool]) -> ToolResult | Awaitable[Any]:
    """Run a call that needs no awaiting; return its result, or the awaitable still to await."""
    checked = _check_call(call, table)
    if isinstance(checked, ToolResult):
        return checked
    tool, arguments = checked
    try:
        out = tool.fn(**arguments)
    except Exception as exc:
        return _exception_result(call, exc)
    if inspect.isawaitable(out):
        return out
    return _success(call, out)


async def _await_all(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await everything together; an exception is returned in place of its value."""
    return await asyncio.gather(*awaitables, return_exceptions=True)


def run_awaitables(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Await coroutines together in one fresh event loop and return their values in order.

    Works from any thread: when the calling thread already runs an event loop (a notebook, an
    async server), the new loop runs in a worker thread and this call blocks until it ends.

    Returns:
        One entry per awaitable: its value, or the exception it raised.
    """
    if not awaitables:
        return []
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_await_all(awaitables))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="posttrain-tools") as pool:
        return pool.submit(asyncio.run, _await_all(awaitables)).result()


def run_tool_calls(
    calls: Sequence[Sequence[ToolCall]], tools: Sequence[dict[str, Tool]]
) -> list[list[ToolResult]]:
    """Run the tool calls of one turn for every rollout row.

    Args:
        calls: per row, the calls its last assistant message made (possibly none).
        tools: per row, its tool table (rows of different environments expose different tools).

    Returns:
        Per row, one ``ToolResult`` per call, in call order. Never raises for a bad call or a
        failing tool: see ``FAILURE_KINDS`` for how each failure is reported.
    """
    if len(calls) != len(tools):
        raise ValueError(f"run_tool_calls got {len(calls)} rows of calls but {len(tools)} tool tables.")
    results: list[list[Any]] = []
    pending: list[tuple[int, int, ToolCall]] = []
    for r, (row_calls, table) in enumerate(zip(calls, tools, strict=True)):
        row = []
        for c, call in enumerate(row_calls):
            started = _start_call(call, table)
            if not isinstance(started, ToolResult):
                pending.append((r, c, call))
            row.append(started)
        results.append(row)
    values = run_awaitables([results[r][c] for r, c, _ in pending])
    for (r, c, call), value in zip(pending, values, strict=True):
        failed = isinstance(value, BaseException)
        results[r][c] = _exception_result(call, value) if failed else _success(call, value)
    return results


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


@dataclass
class ToolStats:
    """Tool-call counts of a generation batch, summable across processes.

    The logged metrics follow TRL's definitions: ``tools/call_frequency`` is the number of tool
    calls divided by the number of completions (calls of all turns count, so a completion can
    contribute more than one); ``tools/failure_frequency`` is failed calls divided by calls, and
    0.0 when no tool was called. A call that could not be parsed counts as a call and a failure.

    Attributes:
        completions: completions (rollout rows) counted.
        calls: tool calls they made, over all turns.
        failures: calls that failed.
        by_kind: failures per kind, keyed by ``FAILURE_KINDS``.
    """

    completions: int = 0
    calls: int = 0
    failures: int = 0
    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAILURE_KINDS, 0))

    @classmethod
    def from_results(cls, results: Sequence[Sequence[ToolResult]]) -> ToolStats:
        """Count the results of a batch: one inner list per completion, all its turns together."""
        stats = cls(completions=len(results))
        for row in results:
            for result in row:
                stats.calls += 1
                if result.failed:
                    stats.failures += 1
                    kind = result.failure if result.failure in stats.by_kind else "exception"
                    stats.by_kind[kind] += 1
        return stats

    def to_counts(self) -> list[int]:
        """``[completions, calls, failures, *by_kind]``: a vector to sum across processes."""
        return [self.completions, self.calls, self.failures, *(self.by_kind[k] for k in FAILURE_KINDS)]

    @classmethod
    def from_counts(cls, counts: Sequence[float]) -> ToolStats:
        """The inverse of ``to_counts`` (accepts the floats of a reduced tensor)."""
        values = [int(round(float(v))) for v in counts]
        if len(values) != 3 + len(FAILURE_KINDS):
            raise ValueError(f"Expected {3 + len(FAILURE_KINDS)} counts, got {len(values)}.")
        return cls(values[0], values[1], values[2], dict(zip(FAILURE_KINDS, values[3:], strict=True)))

    def __add__(self, other: ToolStats) -> ToolStats:
        """Counts of both batches together."""
        return ToolStats.from_counts(
            [a + b for a, b in zip(self.to_counts(), other.to_counts(), strict=True)]
        )

    def metrics(self) -> dict[str, float]:
        """``tools/call_frequency`` and ``tools/failure_frequency`` as plain floats."""
        return {
            "tools/call_frequency": self.calls / self.completions if self.completions else 0.0,
            "tools/failure_frequency": self.failures / self.calls if self.calls else 0.0,
        }


def tool_metrics(results: Sequence[Sequence[ToolResult]]) -> dict[str, float]:
    """The tool metrics of one process's batch (see ``ToolStats`` for the definitions)."""
    return ToolStats.from_results(results).metrics()
