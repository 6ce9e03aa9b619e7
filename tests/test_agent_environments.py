"""Environments: the instance pool (reuse, reset, routing), reset prompts, tools, rewards, checks."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from datasets import Dataset

from posttrain.agents.environments import (
    EnvironmentPool,
    apply_reset_prompt,
    check_environment_dataset,
    environment_rewards,
    environment_tools,
)
from posttrain.agents.tools import run_tool_calls
from posttrain.agents.types import ToolCall


class IncrementEnv:
    """The spec's example environment, counting constructions and resets."""

    inits = 0

    def __init__(self) -> None:
        type(self).inits += 1
        self.resets: list[dict] = []
        self.counter = 0
        self.target = 0

    def reset(self, **kwargs) -> str | None:
        self.resets.append(kwargs)
        self.counter = 0
        self.target = kwargs.get("target", 3)
        return kwargs.get("task")

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


@pytest.fixture(autouse=True)
def _fresh_counts():
    IncrementEnv.inits = 0


class CodingEnv:
    def reset(self, **kwargs) -> str:
        return "Compute fib(5)."

    def get_reward(self) -> float:
        return 0.25

    def run_code(self, code: str) -> str:
        """
        Runs code.

        Args:
            code: The Python source.
        """
        return "5"


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal."

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return 1.0

    def move(self, action: str) -> str:
        """
        Moves.

        Args:
            action: A direction.
        """
        return f"moved {action}"


class NoRewardEnv:
    def reset(self, **kwargs) -> None:
        return None


# ---------------------------------------------------------------------------------------------
# Pool: validation, reuse, reset
# ---------------------------------------------------------------------------------------------


def test_pool_validates_factories_up_front():
    with pytest.raises(TypeError, match="environment_factory must be a class or a callable.*got int"):
        EnvironmentPool(3)
    with pytest.raises(ValueError, match="environment_factory is an empty dict"):
        EnvironmentPool({})
    with pytest.raises(TypeError, match=r"dict keys must be strings.*\[1\]"):
        EnvironmentPool({1: CodingEnv})
    with pytest.raises(TypeError, match="environment_factory is the class .*NoReset, which has no reset"):

        class NoReset:
            pass

        EnvironmentPool(NoReset)
    with pytest.raises(TypeError, match=r"environment_factory\['game'\] is the class .*NoReset2"):

        class NoReset2:
            pass

        EnvironmentPool({"coding": CodingEnv, "game": NoReset2})


def test_factory_function_returning_an_object_without_reset():
    def make() -> object:
        return object()

    pool = EnvironmentPool(make)
    with pytest.raises(TypeError, match="environment_factory .*make returned a object, which has no reset"):
        pool.instances([{}])


def test_instances_are_created_once_per_slot_and_reset_every_step():
    pool = EnvironmentPool(IncrementEnv)
    step1 = [{"prompt": "p", "target": t, "task": None} for t in (1, 2, 3)]
    envs1 = pool.instances(step1)
    envs2 = pool.instances([{"prompt": "q", "target": t} for t in (4, 5, 6)])
    assert IncrementEnv.inits == 3 and len(pool) == 3
    assert all(a is b for a, b in zip(envs1, envs2, strict=True))
    assert envs1[0].resets == [{"target": 1, "task": None}, {"target": 4}]  # no "prompt"
    assert [e.target for e in envs2] == [4, 5, 6]
    assert pool.reset_texts == [None, None, None]


def test_reset_text_and_environment_column_is_not_forwarded():
    pool = EnvironmentPool(IncrementEnv)
    envs = pool.instances([{"environment": "x", "task": "Reach 3.", "target": 3}])
    assert envs[0].resets == [{"task": "Reach 3.", "target": 3}]
    assert pool.reset_texts == ["Reach 3."]


def test_reset_receives_only_named_columns_without_var_kwargs():
    class Strict:
        def reset(self, target: int) -> None:
            self.target = target

    env = EnvironmentPool(Strict).instances([{"prompt": "p", "target": 7, "extra": 1}])[0]
    assert env.target == 7
    with pytest.raises(RuntimeError, match=r"Strict.reset\(\) raised on row 0: TypeError: .*target"):
        EnvironmentPool(Strict).instances([{"prompt": "p"}])


def test_reset_errors_name_the_class_and_row():
    class Broken:
        def reset(self, **kwargs) -> None:
            if kwargs["n"] == 1:
                raise ValueError("bad seed")

    with pytest.raises(RuntimeError, match=r"Broken.reset\(\) raised on row 1: ValueError: bad seed"):
        EnvironmentPool(Broken).instances([{"n": 0}, {"n": 1}])

    class Numeric:
        def reset(self, **kwargs) -> int:
            return 5

    with pytest.raises(
        TypeError, match=r"Numeric.reset\(\) returned int on row 0; it must return None or a str"
    ):
        EnvironmentPool(Numeric).instances([{}])


def test_async_resets_run_together():
    state = {"arrived": 0}

    class Slow:
        async def reset(self, **kwargs) -> str:
            state["arrived"] += 1
            deadline = time.monotonic() + 3
            while state["arrived"] < 3:
                assert time.monotonic() < deadline, "resets ran one after the other"
                await asyncio.sleep(0.005)
            return "go"

    pool = EnvironmentPool(Slow)
    pool.instances([{}] * 3)
    assert pool.reset_texts == ["go"] * 3


# ---------------------------------------------------------------------------------------------
# Routing with a dict factory
# ---------------------------------------------------------------------------------------------


def test_routing_picks_the_environment_and_reuses_per_slot_and_name():
    pool = EnvironmentPool({"coding": CodingEnv, "game": GameEnv})
    first = pool.instances([{"environment": "coding"}, {"environment": "game"}])
    assert [type(e) for e in first] == [CodingEnv, GameEnv]
    assert pool.reset_texts == ["Compute fib(5).", "Reach the goal."]
    second = pool.instances([{"environment": "game"}, {"environment": "game"}])
    third = pool.instances([{"environment": "coding"}, {"environment": "game"}])
    assert second[1] is first[1] and third[0] is first[0] and third[1] is first[1]
    assert second[0] is not first[1] and len(pool) == 3  # (0, coding), (1, game), (0, game)


def test_routing_errors():
    pool = EnvironmentPool({"coding": CodingEnv, "game": GameEnv})
    with pytest.raises(
        ValueError,
        match=r"environment_factory is a dict of 2 environments; each row needs an 'environment' column naming "
        r"one of \['coding', 'game'\]. Row 1 has none.",
    ):
        pool.instances([{"environment": "game"}, {"prompt": "x"}])
    with pytest.raises(ValueError, match=r"Row 0 has environment='chess'.*\['coding', 'game'\]"):
        pool.instances([{"environment": "chess"}])


# ---------------------------------------------------------------------------------------------
# Reset prompts
# ---------------------------------------------------------------------------------------------


def test_apply_reset_prompt_cases():
    assert apply_reset_prompt(None, "Task.") == [{"role": "user", "content": "Task."}]
    assert apply_reset_prompt("Solve:", "2+2") == "Solve:\n\n2+2"
    assert apply_reset_prompt("", "2+2") == "2+2"
    assert apply_reset_prompt("Solve:", None) == "Solve:"
    with pytest.raises(
        ValueError, match="The row has no 'prompt' and the environment's reset\\(\\) returned None"
    ):
        apply_reset_prompt(None, None)


def test_apply_reset_prompt_appends_to_the_last_user_message_without_mutating():
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "First."},
        {"role": "assistant", "content": "Ok."},
        {"role": "user", "content": "Second."},
    ]
    snapshot = [dict(m) for m in prompt]
    out = apply_reset_prompt(prompt, "Target: 3.")
    assert out[3] == {"role": "user", "content": "Second.\n\nTarget: 3."}
    assert out[:3] == prompt[:3] and prompt == snapshot
    blocks = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Look."}]}]
    out = apply_reset_prompt(blocks, "Count.")
    assert out[0]["content"][-1] == {"type": "text", "text": "Count."} and len(blocks[0]["content"]) == 2
    system_only = [{"role": "system", "content": "S"}]
    assert (
        apply_reset_prompt(system_only, "T")[-1] == {"role": "user", "content": "T"} and len(system_only) == 1
    )


# ---------------------------------------------------------------------------------------------
# Environment tools
# ---------------------------------------------------------------------------------------------


class Base:
    def reset(self, **kwargs) -> None:
        self.log: list[str] = []

    def look(self) -> str:
        """
        Looks around.
        """
        return "a room"


class RichEnv(Base):
    limit = 3
    helper = staticmethod(len)  # a builtin, not defined as a function here

    def __init__(self) -> None:
        self.callback = lambda: None  # instance attribute, not a tool

    def get_reward(self) -> float:
        return 0.0

    def _private(self) -> None:
        pass

    @property
    def state(self) -> str:
        return "s"

    @staticmethod
    def shout(text: str) -> str:
        """
        Shouts.

        Args:
            text: What to shout.
        """
        return text + "!"

    def say(self, text: str) -> str:
        """
        Says something.

        Args:
            text: What to say.
        """
        self.log.append(text)
        return text.upper()

    async def wait(self, seconds: float) -> str:
        """
        Waits.

        Args:
            seconds: How long.
        """
        await asyncio.sleep(0)
        return f"waited {seconds}"


def test_environment_tools_are_the_public_methods_bound_to_the_instance():
    env = RichEnv()
    tools = environment_tools(env)
    assert list(tools) == ["shout", "say", "wait", "look"]  # class order, then the base's
    assert tools["wait"].is_async and not tools["say"].is_async
    params = tools["say"].schema["function"]["parameters"]
    assert list(params["properties"]) == ["text"] and params["required"] == ["text"]
    env.reset()
    results = run_tool_calls(
        [
            [
                ToolCall("say", {"text": "hi"}),
                ToolCall("wait", {"seconds": 1}),
                ToolCall("shout", {"text": "a"}),
            ]
        ],
        [tools],
    )[0]
    assert [r.content for r in results] == ["HI", "waited 1", "a!"] and env.log == ["hi"]
    for hidden in ("reset", "get_reward", "_private", "state", "limit", "helper", "callback"):
        assert hidden not in tools


def test_environment_tools_of_two_instances_touch_their_own_state():
    envs = EnvironmentPool(IncrementEnv).instances([{}, {}])
    calls = [[ToolCall("increment", {"step": 2})], [ToolCall("increment", {"step": 5})]]
    results = run_tool_calls(calls, [environment_tools(e) for e in envs])
    assert [r[0].content for r in results] == ["2", "5"] and [e.counter for e in envs] == [2, 5]


def test_environment_method_without_docstring_is_rejected_naming_it():
    class Sloppy:
        def reset(self, **kwargs) -> None:
            pass

        def act(self, x: int) -> int:
            return x

    with pytest.raises(ValueError, match=r"Tool '.*Sloppy.act' cannot be described.*no docstring"):
        environment_tools(Sloppy())


# ---------------------------------------------------------------------------------------------
# Environment rewards
# ---------------------------------------------------------------------------------------------


def test_rewards_of_a_single_environment():
    envs = EnvironmentPool(IncrementEnv).instances([{"target": 2}, {"target": 3}])
    envs[0].increment(2)
    names, rewards = environment_rewards(envs)
    assert names == ["IncrementEnv"]
    assert rewards.dtype == torch.float32 and rewards.tolist() == [[1.0], [0.0]]


def test_rewards_of_a_dict_factory_are_one_column_per_class_with_nan_elsewhere():
    envs = EnvironmentPool({"coding": CodingEnv, "game": GameEnv, "plain": NoRewardEnv}).instances(
        [{"environment": n} for n in ("game", "plain", "coding", "game")]
    )
    names, rewards = environment_rewards(envs)
    assert names == ["GameEnv", "CodingEnv"]  # first seen order; NoRewardEnv has no column
    expected = [[1.0, math.nan], [math.nan, math.nan], [math.nan, 0.25], [1.0, math.nan]]
    torch.testing.assert_close(rewards, torch.tensor(expected), equal_nan=True)


def test_async_get_rewards_run_together():
    state = {"arrived": 0}

    class Judge:
        def reset(self, **kwargs) -> None:
            pass

        async def get_reward(self) -> float:
            state["arrived"] += 1
            deadline = time.monotonic() + 3
            while state["arrived"] < 4:
                if time.monotonic() > deadline:
                    raise TimeoutError("get_reward calls ran one after the other")
                await asyncio.sleep(0.005)
            return 0.5

    names, rewards = environment_rewards([Judge() for _ in range(4)])
    assert names == ["Judge"] and rewards.flatten().tolist() == [0.5] * 4


def test_reward_errors_name_the_class():
    class Faulty:
        def get_reward(self) -> float:
            raise ZeroDivisionError("no moves")

    with pytest.raises(
        RuntimeError, match=r"Faulty.get_reward\(\) raised on row 1: ZeroDivisionError: no moves"
    ):
        environment_rewards([NoRewardEnv(), Faulty()])

    class AsyncFaulty:
        async def get_reward(self) -> float:
            raise KeyError("k")

    with pytest.raises(RuntimeError, match=r"AsyncFaulty.get_reward\(\) raised on row 0: KeyError"):
        environment_rewards([AsyncFaulty()])

    class Wordy:
        def get_reward(self) -> str:
            return "good"

    with pytest.raises(TypeError, match=r"Wordy.get_reward\(\) returned 'good' \(str\) on row 0"):
        environment_rewards([Wordy()])


def test_reward_none_is_nan_and_no_environments_give_no_columns():
    class Abstains:
        def get_reward(self) -> None:
            return None

    names, rewards = environment_rewards([Abstains()])
    assert names == ["Abstains"] and math.isnan(rewards.item())
    names, rewards = environment_rewards([])
    assert names == [] and rewards.shape == (0, 0)


# ---------------------------------------------------------------------------------------------
# Up-front checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_steps", [None, -1, 0])
def test_environment_without_dataset_needs_max_steps(max_steps):
    with pytest.raises(
        ValueError, match="environment_factory without train_dataset: the environment owns the data"
    ):
        check_environment_dataset(IncrementEnv, None, max_steps)


def test_check_environment_dataset_accepts_good_setups():
    check_environment_dataset(IncrementEnv, None, 10)
    check_environment_dataset(IncrementEnv, Dataset.from_dict({"prompt": ["a"], "target": [1]}), -1)
    routed = Dataset.from_dict({"environment": ["coding", "game"] * 3})
    check_environment_dataset({"coding": CodingEnv, "game": GameEnv}, routed, -1)
    check_environment_dataset({"coding": CodingEnv}, [{"environment": "coding"}], -1)


def test_check_environment_dataset_rejects_unroutable_datasets():
    factory = {"coding": CodingEnv, "game": GameEnv}
    with pytest.raises(
        ValueError, match=r"each row needs an 'environment' column naming one of \['coding', 'game'\]"
    ):
        check_environment_dataset(factory, Dataset.from_dict({"prompt": ["a"]}), -1)
    with pytest.raises(ValueError, match=r"has values 'chess' that are not environment_factory names"):
        check_environment_dataset(factory, Dataset.from_dict({"environment": ["game", "chess"]}), -1)
    with pytest.raises(ValueError, match="values None"):
        check_environment_dataset(factory, [{"environment": "game"}, {"environment": None}], -1)
