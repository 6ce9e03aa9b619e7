"""Tool schemas, running batches of tool calls (every failure kind, async concurrency), metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from PIL import Image

from posttrain.agents.tools import (
    Tool,
    ToolStats,
    combine_tool_tables,
    format_tool_output,
    run_awaitables,
    run_tool_calls,
    tool_metrics,
    tool_table,
    tools_from_functions,
)
from posttrain.agents.types import FAILURE_KINDS, ToolCall, ToolResult


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product.
    """
    return a * b


async def async_add(a: int, b: int = 1) -> int:
    """
    Adds two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a + b


def divide(a: float, b: float) -> float:
    """
    Divides a by b.

    Args:
        a: The numerator.
        b: The denominator.
    """
    return a / b


def call(name: str | None, **arguments: object) -> ToolCall:
    """A well-formed function call."""
    return ToolCall(name=name, arguments=dict(arguments))


def table(*funcs) -> dict[str, Tool]:
    """A tool table from functions."""
    return tool_table(tools_from_functions(list(funcs)))


def run_one(c: ToolCall, tools: dict[str, Tool]) -> ToolResult:
    """Run one call on one row."""
    return run_tool_calls([[c]], [tools])[0][0]


# ---------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------


def test_schema_of_sync_and_async_functions():
    mul, add = tools_from_functions([multiply, async_add])
    assert (mul.name, mul.is_async, mul.fn) == ("multiply", False, multiply)
    assert (add.name, add.is_async) == ("async_add", True)
    fn = mul.schema["function"]
    assert mul.schema["type"] == "function"
    assert fn["description"] == "Multiplies two integers."
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first integer."}
    assert fn["parameters"]["required"] == ["a", "b"]
    assert add.schema["function"]["parameters"]["required"] == ["a"]  # b has a default


def test_bound_method_schema_has_no_self_and_calls_the_instance():
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def bump(self, step: int) -> int:
            """
            Adds to the counter.

            Args:
                step: How much to add.
            """
            self.n += step
            return self.n

    counter = Counter()
    (tool,) = tools_from_functions([counter.bump])
    params = tool.schema["function"]["parameters"]
    assert list(params["properties"]) == ["step"] and params["required"] == ["step"]
    result = run_one(call("bump", step=3), {tool.name: tool})
    assert (result.content, counter.n) == ("3", 3)


def test_function_without_docstring_is_rejected_with_its_name_and_the_fix():
    def no_doc(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"Tool '.*no_doc' cannot be described.*no docstring.*Google-style"):
        tools_from_functions([no_doc])


def test_function_without_type_hints_is_rejected_naming_the_argument():
    def untyped(x):
        """
        Does a thing.

        Args:
            x: A value.
        """
        return x

    with pytest.raises(ValueError, match=r"untyped.*Argument x is missing a type hint.*type hint on every"):
        tools_from_functions([untyped])


def test_argument_without_description_is_rejected():
    def half_doc(x: int, y: int) -> int:
        """
        Does a thing.

        Args:
            x: A value.
        """
        return x

    with pytest.raises(ValueError, match=r"half_doc.*no description for the argument 'y'"):
        tools_from_functions([half_doc])


def test_duplicate_names_and_non_callables_are_rejected():
    with pytest.raises(ValueError, match=r"\['multiply'\] appear more than once"):
        tools_from_functions([multiply, divide, multiply])
    with pytest.raises(TypeError, match="tools entries must be functions; got str"):
        tools_from_functions(["multiply"])


def test_combine_tool_tables_rejects_clashing_names():
    shared, own = table(multiply), table(divide)
    assert list(combine_tool_tables(shared, own)) == ["multiply", "divide"]
    with pytest.raises(ValueError, match=r"Tool names \['multiply'\] are defined twice"):
        combine_tool_tables(shared, table(multiply))


# ---------------------------------------------------------------------------------------------
# Failure kinds
# ---------------------------------------------------------------------------------------------


def test_success_is_not_a_failure():
    result = run_one(call("multiply", a=3, b=4), table(multiply))
    assert result == ToolResult(name="multiply", content="12", failed=False, failure=None, images=[])


def test_parse_error():
    bad = ToolCall(name=None, arguments=None, raw="<tool_call>{oops", error="invalid JSON at char 1")
    result = run_one(bad, table(multiply))
    assert (result.failed, result.failure) == (True, "parse_error")
    assert result.content == "Error: the tool call could not be parsed: invalid JSON at char 1"


def test_unsupported_type():
    result = run_one(
        ToolCall(name="multiply", arguments={"a": 1, "b": 2}, type="code_interpreter"), table(multiply)
    )
    assert result.failure == "unsupported_type"
    assert "unsupported tool call type 'code_interpreter'" in result.content


def test_unknown_tool_lists_the_available_tools():
    result = run_one(call("add", a=1), table(multiply, divide))
    assert result.failure == "unknown_tool"
    assert result.content == "Error: unknown tool 'add'. Available tools: divide, multiply."
    assert "Available tools: none." in run_one(call("add"), {}).content


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({"a": 3}, "missing required argument(s) 'b'. "),
        ({"a": 3, "c": 4}, "unexpected argument(s) 'c'; missing required argument(s) 'b'. "),
        ({"a": 3, "b": 4, "c": 5, "d": 6}, "unexpected argument(s) 'c', 'd'. "),
    ],
)
def test_bad_arguments_name_the_problem_and_the_signature(arguments, problem):
    result = run_one(ToolCall(name="multiply", arguments=arguments), table(multiply))
    assert result.failure == "bad_arguments"
    assert result.content.startswith("Error: bad arguments for tool 'multiply': ")
    assert problem in result.content and "Expected multiply(a, b)." in result.content


def test_bad_arguments_for_an_async_tool_and_non_object_arguments():
    result = run_one(call("async_add", x=1), table(async_add))
    assert result.failure == "bad_arguments" and "'a'" in result.content
    result = run_one(ToolCall(name="multiply", arguments=[1, 2]), table(multiply))  # type: ignore[arg-type]
    assert result.failure == "bad_arguments" and "got list" in result.content


def test_exception_of_a_sync_and_an_async_tool():
    async def explode() -> str:
        """
        Always fails.
        """
        raise KeyError("missing")

    results = run_tool_calls([[call("divide", a=1, b=0), call("explode")]], [table(divide, explode)])[0]
    assert [r.failure for r in results] == ["exception", "exception"]
    assert results[0].content == "Error: tool 'divide' raised ZeroDivisionError: division by zero"
    assert results[1].content == "Error: tool 'explode' raised KeyError: 'missing'"


def test_every_failure_kind_is_covered_by_the_tests_above():
    assert set(FAILURE_KINDS) == {
        "parse_error",
        "unknown_tool",
        "bad_arguments",
        "exception",
        "unsupported_type",
    }


def test_rows_use_their_own_tool_tables_and_keep_call_order():
    calls = [[call("multiply", a=2, b=5), call("divide", a=1, b=4)], [], [call("multiply", a=1, b=1)]]
    results = run_tool_calls(calls, [table(multiply, divide), table(multiply), table(divide)])
    assert [[r.content for r in row] for row in results] == [["10", "0.25"], [], [results[2][0].content]]
    assert results[2][0].failure == "unknown_tool" and "Available tools: divide." in results[2][0].content
    with pytest.raises(ValueError, match="2 rows of calls but 1 tool tables"):
        run_tool_calls([[], []], [{}])


# ---------------------------------------------------------------------------------------------
# Async concurrency
# ---------------------------------------------------------------------------------------------


def make_rendezvous(expected: int, timeout: float = 3.0):
    """Two async tools that each wait until ``expected`` calls have started: serial runs time out."""
    state = {"arrived": 0}

    async def wait_all() -> None:
        state["arrived"] += 1
        deadline = time.monotonic() + timeout
        while state["arrived"] < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {state['arrived']} of {expected} calls started")
            await asyncio.sleep(0.005)

    async def ping(tag: str) -> str:
        """
        Waits for everyone.

        Args:
            tag: A label.
        """
        await wait_all()
        return f"ping {tag}"

    async def pong(tag: str) -> str:
        """
        Waits for everyone too.

        Args:
            tag: A label.
        """
        await wait_all()
        return f"pong {tag}"

    return table(ping, pong)


def test_all_async_calls_of_all_rows_run_at_once():
    tools = make_rendezvous(expected=8)
    calls = [[call("ping", tag=str(r)), call("pong", tag=str(r))] for r in range(4)]
    results = run_tool_calls(calls, [tools] * 4)
    assert not any(r.failed for row in results for r in row), results
    assert [[r.content for r in row] for row in results][3] == ["ping 3", "pong 3"]


def test_async_latencies_overlap():
    async def slow(x: int) -> int:
        """
        Sleeps a bit.

        Args:
            x: A value.
        """
        await asyncio.sleep(0.2)
        return x

    tools = table(slow)
    start = time.perf_counter()
    results = run_tool_calls([[call("slow", x=r), call("slow", x=-r)] for r in range(4)], [tools] * 4)
    elapsed = time.perf_counter() - start
    assert [r.content for r in results[1]] == ["1", "-1"]
    assert elapsed < 0.8, f"8 calls of 0.2 s took {elapsed:.2f} s; serial would take 1.6 s"


def test_works_inside_a_running_event_loop():
    tools = make_rendezvous(expected=4)

    async def caller() -> list[list[ToolResult]]:
        return run_tool_calls([[call("ping", tag="a"), call("pong", tag="b")]] * 2, [tools] * 2)

    results = asyncio.run(caller())
    assert [r.content for r in results[0]] == ["ping a", "pong b"]
    assert not any(r.failed for row in results for r in row)


def test_run_awaitables_returns_exceptions_in_place():
    async def ok() -> int:
        return 1

    async def bad() -> int:
        raise ValueError("no")

    out = run_awaitables([ok(), bad()])
    assert out[0] == 1 and isinstance(out[1], ValueError)
    assert run_awaitables([]) == []


# ---------------------------------------------------------------------------------------------
# Results as message content
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "content"),
    [
        ("text", "text"),
        (None, ""),
        ({"a": 1, "b": [True, None]}, '{"a": 1, "b": [true, null]}'),
        ([1, "é"], '[1, "é"]'),
        (12, "12"),
        (0.5, "0.5"),
        ({"when": object}, "{'when': <class 'object'>}"),
        ([{"type": "video"}], '[{"type": "video"}]'),
    ],
)
def test_format_tool_output(value, content):
    assert format_tool_output(value) == (content, [])


def test_content_blocks_stay_a_list_and_images_are_collected():
    image = Image.new("RGB", (4, 4))

    def screenshot() -> list:
        """
        Takes a screenshot.
        """
        return [{"type": "image", "image": image}, {"type": "text", "text": "Here it is."}]

    result = run_one(call("screenshot"), table(screenshot))
    assert result.content == [{"type": "image", "image": image}, {"type": "text", "text": "Here it is."}]
    assert result.images == [image] and result.images[0] is image and not result.failed


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def test_metrics_follow_trl_definitions():
    """TRL's tool test: 3 completions, 2 calls (one fails), no call in the third: 2/3 and 1/2."""
    results = run_tool_calls(
        [[call("multiply", a=3, b=4)], [call("multiply", a=3, c=4)], []], [table(multiply)] * 3
    )
    stats = ToolStats.from_results(results)
    assert (stats.completions, stats.calls, stats.failures) == (3, 2, 1)
    assert stats.by_kind["bad_arguments"] == 1
    assert tool_metrics(results) == pytest.approx(
        {"tools/call_frequency": 2 / 3, "tools/failure_frequency": 0.5}
    )


def test_failure_frequency_is_zero_without_calls_and_counts_sum_across_processes():
    assert tool_metrics([[], []]) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    assert tool_metrics([]) == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    a = ToolStats.from_results(
        [[ToolResult("x", "1"), ToolResult("y", "e", failed=True, failure="unknown_tool")]]
    )
    b = ToolStats.from_results([[], [ToolResult(None, "e", failed=True, failure="parse_error")]])
    total = ToolStats.from_counts([float(x + y) for x, y in zip(a.to_counts(), b.to_counts(), strict=True)])
    assert total == a + b
    assert (total.completions, total.calls, total.failures) == (3, 3, 2)
    assert total.by_kind == {**dict.fromkeys(FAILURE_KINDS, 0), "unknown_tool": 1, "parse_error": 1}
    assert total.metrics() == pytest.approx({"tools/call_frequency": 1.0, "tools/failure_frequency": 2 / 3})
    with pytest.raises(ValueError, match="Expected 8 counts"):
        ToolStats.from_counts([1, 2])
