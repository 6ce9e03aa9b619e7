"""RewardRunner: how reward functions are called, validated and named."""

from __future__ import annotations

import asyncio
import functools
import math
import time

import pytest
import torch

from posttrain.rewards.runner import RewardFunctionError, RewardRunner, check_output, reward_name

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["c0", "c1", "c2", "c3"]
IDS = [[1], [2, 3], [4], [5, 6, 7]]

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


def make_kwargs(**extra):
    return {
        "prompts": PROMPTS,
        "completions": COMPLETIONS,
        "completion_ids": IDS,
        "answer": ["a0", "a1", "a2", "a3"],
        "trainer_state": None,
        **extra,
    }


def length_reward(prompts, completions, completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def test_sync_function_gets_every_keyword_argument():
    seen = {}

    def record(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [0.0] * len(prompts)

    log_metric = object()
    kwargs = make_kwargs(log_metric=log_metric)
    RewardRunner([record]).score(4, kwargs)
    assert seen["prompts"] == PROMPTS
    assert seen["completions"] == COMPLETIONS
    assert seen["completion_ids"] == IDS
    assert seen["answer"] == ["a0", "a1", "a2", "a3"]
    assert seen["trainer_state"] is None
    assert seen["log_metric"] is log_metric
    assert set(seen) == set(kwargs)


def test_scores_shape_dtype_and_column_order():
    def const(prompts, completions, completion_ids, **kwargs):
        return [0.5, -1, 2, 3.25]

    runner = RewardRunner([length_reward, const])
    out = runner.score(4, make_kwargs())
    assert out.shape == (4, 2) and out.dtype == torch.float32
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, 2.0, 1.0, 3.0]))
    torch.testing.assert_close(out[:, 1], torch.tensor([0.5, -1.0, 2.0, 3.25]))
    assert runner.names == ["length_reward", "const"]


def test_async_functions_run_concurrently():
    """Each function waits until the other one has started: run one after the other, neither finishes."""
    started: set[str] = set()

    async def meet(name: str) -> None:
        started.add(name)
        deadline = time.monotonic() + 5
        while len(started) < 2:
            assert time.monotonic() < deadline, f"{name} ran alone: the async rewards ran one after the other"
            await asyncio.sleep(0.005)

    async def slow_a(completions, **kwargs):
        await meet("a")
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await meet("b")
        return [2.0] * len(completions)

    runner = RewardRunner([slow_a, slow_b])
    out = runner.score(4, make_kwargs())
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0]] * 4))


def test_sync_and_async_mixed():
    async def async_len(completion_ids, **kwargs):
        await asyncio.sleep(0)
        return [len(i) for i in completion_ids]

    out = RewardRunner([length_reward, async_len]).score(4, make_kwargs())
    torch.testing.assert_close(out[:, 0], out[:, 1])


def test_none_becomes_nan():
    def partial_reward(completions, **kwargs):
        return [1.0, None, 2.0, None]

    out = RewardRunner([partial_reward]).score(4, make_kwargs())
    assert out[0, 0] == 1.0 and out[2, 0] == 2.0
    assert math.isnan(out[1, 0]) and math.isnan(out[3, 0])


def test_bools_and_ints_accepted():
    def mixed(completions, **kwargs):
        return [True, False, 3, 0]

    out = RewardRunner([mixed]).score(4, make_kwargs())
    torch.testing.assert_close(out[:, 0], torch.tensor([1.0, 0.0, 3.0, 0.0]))


def test_tensor_and_tuple_returns_accepted():
    assert check_output("f", torch.tensor([1.0, 2.0]), 2) == [1.0, 2.0]
    assert check_output("f", (1, None), 2)[0] == 1.0


def test_wrong_count_names_the_function():
    def too_few(completions, **kwargs):
        return [1.0, 2.0]

    with pytest.raises(RewardFunctionError, match=r"'too_few' returned 2 values for 4 completions"):
        RewardRunner([too_few]).score(4, make_kwargs())


def test_string_value_names_function_and_sample():
    def stringly(completions, **kwargs):
        return [1.0, "0.5", 2.0, 3.0]

    with pytest.raises(RewardFunctionError, match=r"'stringly' returned '0.5' \(str\) for sample 1"):
        RewardRunner([stringly]).score(4, make_kwargs())


@pytest.mark.parametrize("value", [1.0, "1.0", {"a": 1}, None])
def test_non_list_return_names_the_function(value):
    def not_a_list(completions, **kwargs):
        return value

    with pytest.raises(RewardFunctionError, match="'not_a_list' returned"):
        RewardRunner([not_a_list]).score(4, make_kwargs())


def test_error_is_a_value_error():
    assert issubclass(RewardFunctionError, ValueError)


def test_function_raising_on_one_sample_is_located_and_chained():
    def picky(completions, **kwargs):
        out = []
        for c in completions:
            if c == "c2":
                raise KeyError("no answer for c2")
            out.append(1.0)
        return out

    with pytest.raises(RewardFunctionError) as info:
        RewardRunner([length_reward, picky]).score(4, make_kwargs())
    message = str(info.value)
    assert "'picky'" in message and "KeyError" in message
    assert "sample 2" in message
    assert isinstance(info.value.__cause__, KeyError)


def test_async_function_raising_on_one_sample_is_located():
    async def picky_async(completions, **kwargs):
        if "c2" in completions:
            raise ZeroDivisionError("boom")
        return [0.0] * len(completions)

    with pytest.raises(RewardFunctionError, match="sample 2") as info:
        RewardRunner([picky_async]).score(4, make_kwargs())
    assert "'picky_async'" in str(info.value)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_per_sample_call_cuts_every_per_sample_list():
    """When locating a failure, each sample sees one-element lists of every per-sample column."""
    calls = []

    def fails_in_batch(prompts, completions, completion_ids, answer, **kwargs):
        calls.append((prompts, completions, completion_ids, answer))
        if len(completions) > 1:
            raise RuntimeError("only works one at a time")
        return [0.0]

    with pytest.raises(RewardFunctionError, match="no single sample fails alone"):
        RewardRunner([fails_in_batch]).score(4, make_kwargs())
    assert calls[1:] == [([f"p{i}"], [f"c{i}"], [IDS[i]], [f"a{i}"]) for i in range(4)]


def test_sync_function_may_use_asyncio_run():
    """A TRL-style *sync* reward function that wraps an async client with asyncio.run works on
    its own, so it should work when the runner calls it."""

    async def fetch(c):
        await asyncio.sleep(0)
        return float(len(c))

    def run_sync(c):
        coro = fetch(c)
        try:
            return asyncio.run(coro)
        finally:
            coro.close()  # no "never awaited" warning when asyncio.run refuses to start

    def wraps_async(completions, **kwargs):
        return [run_sync(c) for c in completions]

    assert wraps_async(["ab"]) == [2.0]  # fine outside an event loop
    out = RewardRunner([wraps_async]).score(4, make_kwargs())
    torch.testing.assert_close(out[:, 0], torch.full((4,), 2.0))


def test_non_callable_rejected():
    with pytest.raises(TypeError, match="callables"):
        RewardRunner(["some/reward-model"])


# ---- names -----------------------------------------------------------------------------------


class Scorer:
    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)


async def async_scorer(completions, **kwargs):
    return [1.0] * len(completions)


def test_reward_name_of_functions():
    assert reward_name(length_reward) == "length_reward"
    assert reward_name(async_scorer) == "async_scorer"
    assert reward_name(lambda completions, **kw: completions) == "<lambda>"


def test_reward_name_of_callable_object_is_its_class():
    assert reward_name(Scorer()) == "Scorer"


def test_reward_name_uses_explicit_name_attribute():
    scorer = Scorer()
    scorer.__name__ = "custom"
    assert reward_name(scorer) == "custom"


def test_reward_name_of_partial_falls_back_to_type_name():
    """functools.partial has no __name__: the name falls back to the type, "partial"."""
    p = functools.partial(length_reward, prompts=PROMPTS)
    assert reward_name(p) == "partial"


def test_callable_object_and_partial_are_scored():
    runner = RewardRunner([Scorer(), functools.partial(length_reward)])
    assert runner.names == ["Scorer", "partial"]
    out = runner.score(4, make_kwargs())
    torch.testing.assert_close(out, torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 1.0], [1.0, 3.0]]))
