"""The multi-turn tool loop inside GRPOTrainer, driven by a scripted generator (no model sampling)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_tokenizer
from datasets import Dataset
from helpers import TurnScriptedGenerator, make_config, make_trainer

QWEN25 = (Path(__file__).parent / "chat_templates" / "qwen2_5_instruct.jinja").read_text()


def long_context_model(tok):
    """The tiny model with room for the Qwen2.5 tool prompt (about 700 tokens with the tiny BPE)."""
    from conftest import build_tiny_model

    model = build_tiny_model(tok)
    model.config.max_position_embeddings = 4096
    return model


def agent_trainer(tmp_path, tok, reward, dataset, **kwargs):
    """A trainer on the long-context tiny model: 2 prompts x 2 completions, 120 tokens."""
    config = {
        "per_device_train_batch_size": 4,
        "num_generations": 2,
        "max_steps": 1,
        "max_completion_length": 120,
    }
    config.update(kwargs.pop("config", {}))
    return make_trainer(
        tok, reward, make_config(tmp_path, **config), dataset=dataset, model=long_context_model(tok), **kwargs
    )


def qwen_tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = QWEN25
    return tok


class IncrementEnv:
    """The spec's example environment, reading its target from the dataset."""

    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# One script per task: a valid call, wrong arguments, an unknown tool, no call at all.
SCRIPTS = {
    "task 0": [call("increment", '{"step": 2}'), "Done."],
    "task 1": [call("increment", '{"amount": 2}'), "I give up."],
    "task 2": [call("decrement", '{"step": 1}'), "Done."],
    "task 3": ["The answer is 3."],
}


def task_dataset():
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"task {k}: reach 2"}] for k in range(4)],
            "target": [2, 2, 2, 2],
        }
    )


def scripted_trainer(tmp_path, tok, seen, **overrides):
    def env_state(completions, environments, **kwargs):
        seen.append([(env.counter, env.target) for env in environments])
        seen.append(completions)
        return [0.0] * len(completions)

    values = {
        "per_device_train_batch_size": 8,
        "num_generations": 2,
        "max_steps": 1,
        "max_completion_length": 200,
    }
    values.update(overrides)
    trainer = make_trainer(
        tok,
        env_state,
        make_config(tmp_path, **values),
        dataset=task_dataset(),
        model=long_context_model(tok),
        environment_factory=IncrementEnv,
    )
    trainer.generator = TurnScriptedGenerator(tok, SCRIPTS)
    return trainer


def test_tool_metrics_and_environment_states(tmp_path):
    tok = qwen_tokenizer()
    seen: list = []
    trainer = scripted_trainer(tmp_path, tok, seen)
    trainer.train()
    logs = next(entry for entry in trainer.state.log_history if "tools/call_frequency" in entry)
    # 8 completions: tasks 0-2 call once each (two rows per task), task 3 never -> 6 calls;
    # the wrong-argument and unknown-tool calls fail -> 4 of 6.
    assert logs["tools/call_frequency"] == pytest.approx(6 / 8)
    assert logs["tools/failure_frequency"] == pytest.approx(4 / 6)
    # only the valid call moved a counter; get_reward scores it under the class name
    assert logs["rewards/IncrementEnv/mean"] == pytest.approx(2 / 8)
    states, completions = seen[0], seen[1]

    def called(messages):
        calls = messages[0].get("tool_calls", [])
        return (calls[0]["function"]["name"], messages[1]["content"][:5]) if calls else None

    counters = {}
    for (counter, target), messages in zip(states, completions, strict=True):
        assert target == 2
        counters.setdefault(called(messages), []).append(counter)
    # the valid call moved its counters to 2; wrong arguments, unknown tool and no call left them at 0
    assert counters == {
        ("increment", "2"): [2, 2],
        ("increment", "Error"): [0, 0],
        ("decrement", "Error"): [0, 0],
        None: [0, 0],
    }
    # the completion messages: assistant call, tool result, assistant answer
    valid = next(
        m
        for m in completions
        if m[0].get("tool_calls", [{}])[0].get("function", {}).get("name") == "increment"
        and m[1]["content"] == "2"
    )
    assert [m["role"] for m in valid] == ["assistant", "tool", "assistant"]
    assert valid[0]["tool_calls"][0]["function"]["arguments"] == {"step": 2}
    assert valid[2]["content"] == "Done."
    unknown = next(
        m
        for m in completions
        if m[0].get("tool_calls", [{}])[0].get("function", {}).get("name") == "decrement"
    )
    assert "increment" in unknown[1]["content"]  # the error lists the available tools
    no_call = next(m for m in completions if m[0]["content"] == "The answer is 3.")
    assert len(no_call) == 1


def test_tool_results_are_masked_and_not_counted(tmp_path):
    tok = qwen_tokenizer()
    trainer = scripted_trainer(tmp_path, tok, [])
    trainer.args.max_steps = 1
    batch = [dict(row) for row in task_dataset()][:1] * 2
    rollout, rewards = trainer._sample(batch, "train")
    # task 0 twice: call -> tool result -> "Done."
    row = rollout.completion_ids[0][rollout.completion_mask[0].bool()].tolist()
    model = rollout.tool_mask[0][rollout.completion_mask[0].bool()].tolist()
    sampled = tok.decode([t for t, m in zip(row, model, strict=True) if m], skip_special_tokens=False)
    inserted = tok.decode([t for t, m in zip(row, model, strict=True) if not m], skip_special_tokens=False)
    assert sampled == call("increment", '{"step": 2}') + "<|im_end|>" + "Done.<|im_end|>"
    assert "<tool_response>\n2\n</tool_response>" in inserted
    assert inserted.endswith("<|im_start|>assistant\n")
    expected_model_tokens = (
        len(tok(call("increment", '{"step": 2}'))["input_ids"]) + len(tok("Done.")["input_ids"]) + 2
    )
    assert rollout.generated_lengths.tolist() == [expected_model_tokens] * 2
    assert rollout.completion_lengths[0] > expected_model_tokens
    loss_mask = trainer._loss_mask(rollout)
    assert torch.equal(loss_mask, rollout.completion_mask * rollout.tool_mask)
    # the second turn's input is the whole history, the tool result included
    assert "<tool_response>\n2\n</tool_response>" in trainer.generator.inputs[-1]
    assert rewards.shape == (2, 2)  # the reward function and IncrementEnv
    assert rewards[:, 1].tolist() == [1.0, 1.0]


def test_max_tool_calling_iterations_stops_the_loop(tmp_path):
    tok = qwen_tokenizer()
    trainer = scripted_trainer(tmp_path, tok, [], max_tool_calling_iterations=1)
    trainer.generator = TurnScriptedGenerator(
        tok, {"task": [call("increment", '{"step": 1}'), call("increment", '{"step": 1}'), "Done."]}
    )
    batch = [dict(row) for row in task_dataset()][:2]
    seen: list = []
    trainer.rewards.funcs[0] = lambda completions, environments, **kwargs: (
        seen.append([env.counter for env in environments]) or [0.0] * len(completions)
    )
    rollout, rewards = trainer._sample(batch, "train")
    assert rollout.is_terminated.tolist() == [True, True]
    assert seen == [[1, 1]]  # the second call was not run


def test_completion_budget_cuts_the_episode(tmp_path):
    tok = qwen_tokenizer()
    trainer = scripted_trainer(tmp_path, tok, [], max_completion_length=30)
    batch = [dict(row) for row in task_dataset()][:1] * 2
    rollout, _ = trainer._sample(batch, "train")
    assert rollout.completion_lengths.tolist() == [30, 30]
    assert rollout.is_terminated.tolist() == [False, False]


def test_tools_without_environment(tmp_path):
    tok = qwen_tokenizer()
    calls = []

    async def multiply(a: int, b: int) -> int:
        """Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product.
        """
        calls.append((a, b))
        return a * b

    def reward(completions, **kwargs):
        return [float(m[-1]["content"] == "6") for m in completions]

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"task {k}"}] for k in range(2)]})
    trainer = agent_trainer(tmp_path, tok, reward, dataset, tools=[multiply])
    trainer.generator = TurnScriptedGenerator(tok, {"task": [call("multiply", '{"a": 2, "b": 3}'), "6"]})
    rollout, rewards = trainer._sample([dict(r) for r in dataset] * 2, "train")
    assert calls == [(2, 3)] * 4
    assert rewards[:, 0].tolist() == [1.0] * 4


def test_multi_environment_routing(tmp_path):
    tok = qwen_tokenizer()

    class DoubleEnv(IncrementEnv):
        def double(self) -> int:
            """Double the counter.

            Returns:
                The updated counter value.
            """
            self.counter *= 2
            return self.counter

    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"task {k}"}] for k in range(2)],
            "target": [1, 2],
            "environment": ["inc", "dbl"],
        }
    )
    trainer = agent_trainer(
        tmp_path, tok, None, dataset, environment_factory={"inc": IncrementEnv, "dbl": DoubleEnv}
    )
    trainer.generator = TurnScriptedGenerator(
        tok, {"task 0": [call("increment", '{"step": 1}'), "ok"], "task 1": [call("double", "{}"), "ok"]}
    )
    rows = [dict(r) for r in dataset]
    batch = [rows[0], rows[0], rows[1], rows[1]]
    rollout, rewards = trainer._sample(batch, "train")
    # "inc" rows only see increment, so they succeed; "dbl" rows see double (and increment, inherited)
    assert trainer._reward_names == ["IncrementEnv", "DoubleEnv"]
    assert rewards[:2, 0].tolist() == [1.0, 1.0] and torch.isnan(rewards[:2, 1]).all()
    assert torch.isnan(rewards[2:, 0]).all() and rewards[2:, 1].tolist() == [0.0, 0.0]
    inc_prompt = next(t for t in trainer.generator.inputs if "task 0" in t)
    assert '"name": "double"' not in inc_prompt


def test_environment_owns_the_data(tmp_path):
    tok = qwen_tokenizer()

    class SelfSampling(IncrementEnv):
        def reset(self, **kwargs) -> str:
            self.counter, self.target = 0, 3
            return "task 9: increment the counter to 3."

    trainer = trainer_without_dataset(tmp_path, tok, SelfSampling)
    trainer.generator = TurnScriptedGenerator(tok, {"task 9": [call("increment", '{"step": 3}'), "ok"]})
    trainer.train()
    logs = next(e for e in trainer.state.log_history if "rewards/SelfSampling/mean" in e)
    assert logs["rewards/SelfSampling/mean"] == 1.0


def trainer_without_dataset(tmp_path, tok, env):
    from posttrain import GRPOTrainer

    return GRPOTrainer(
        model=long_context_model(tok),
        args=make_config(
            tmp_path, per_device_train_batch_size=4, num_generations=2, max_steps=1, max_completion_length=120
        ),
        processing_class=tok,
        environment_factory=env,
    )


@pytest.mark.parametrize(
    "dataset, factory, message",
    [
        (
            Dataset.from_dict({"prompt": ["task 0", "task 1"], "target": [1, 2]}),
            {"inc": IncrementEnv},
            "'environment' column",
        ),
        (
            Dataset.from_dict({"prompt": ["task 0", "task 1"], "environment": ["inc", "nope"]}),
            {"inc": IncrementEnv},
            "nope",
        ),
    ],
    ids=["missing-column", "unknown-name"],
)
def test_routing_errors_before_training(tmp_path, dataset, factory, message):
    tok = qwen_tokenizer()
    with pytest.raises(ValueError, match=message):
        make_trainer(
            tok,
            None,
            make_config(tmp_path, per_device_train_batch_size=4, num_generations=2),
            dataset=dataset,
            environment_factory=factory,
        )


def test_template_without_tool_calls_is_refused(tmp_path):
    tok = build_tiny_tokenizer()  # plain ChatML template: tool calls leave no trace

    def noop(x: int) -> int:
        """Return x.

        Args:
            x: a number.

        Returns:
            x.
        """
        return x

    with pytest.raises(ValueError, match="does not render tool calls"):
        make_trainer(
            tok, lambda completions, **k: [0.0] * len(completions), make_config(tmp_path), tools=[noop]
        )


def test_no_reward_at_all_is_refused(tmp_path):
    tok = qwen_tokenizer()

    class NoReward:
        def reset(self, **kwargs) -> None:
            pass

    with pytest.raises(ValueError, match="needs a reward"):
        make_trainer(
            tok,
            None,
            make_config(tmp_path, per_device_train_batch_size=4, num_generations=2),
            dataset=task_dataset(),
            environment_factory=NoReward,
        )


def test_rollout_func_with_tools_is_refused(tmp_path):
    tok = qwen_tokenizer()
    with pytest.raises(ValueError, match="rollout_func replaces generation"):
        make_trainer(
            tok,
            None,
            make_config(tmp_path, per_device_train_batch_size=4, num_generations=2),
            dataset=task_dataset(),
            environment_factory=IncrementEnv,
            rollout_func=lambda prompts, trainer: {},
        )


def test_prompt_longer_than_the_model_is_refused(tmp_path):
    tok = qwen_tokenizer()
    trainer = make_trainer(  # the tiny model's 256 positions cannot hold the ~700-token tool prompt
        tok,
        None,
        make_config(tmp_path, per_device_train_batch_size=4, num_generations=2),
        dataset=task_dataset(),
        environment_factory=IncrementEnv,
    )
    trainer.generator = TurnScriptedGenerator(tok, SCRIPTS)
    with pytest.raises(
        ValueError, match=r"renders to \d+ tokens \(tool schemas included\), but the model's maximum"
    ):
        trainer._sample([dict(r) for r in task_dataset()][:2], "train")


class FlakyEnv(IncrementEnv):
    """get_reward fails on the episodes of task 1."""

    def reset(self, target, **kwargs) -> None:
        super().reset(target)
        self.flaky = False

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        return super().increment(step)

    def get_reward(self) -> float:
        if self.counter == 0:
            raise ConnectionError("scorer unreachable")
        return 1.0


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_failing_get_reward_follows_the_fault_policy(tmp_path, policy):
    tok = qwen_tokenizer()
    trainer = agent_trainer(
        tmp_path,
        tok,
        None,
        task_dataset(),
        environment_factory=FlakyEnv,
        config={"max_completion_length": 200, "reward_fault_policy": policy},
    )
    trainer.generator = TurnScriptedGenerator(tok, SCRIPTS)
    rows = [dict(r) for r in task_dataset()]
    batch = [rows[0], rows[0], rows[1], rows[1]]  # task 1's wrong arguments leave the counter at 0
    if policy == "raise":
        with pytest.raises(RuntimeError, match=r"FlakyEnv.get_reward\(\) raised on row 2: ConnectionError"):
            trainer._sample(batch, "train")
        return
    _, rewards = trainer._sample(batch, "train")
    assert rewards[:2, 0].tolist() == [1.0, 1.0] and torch.isnan(rewards[2:, 0]).all()
    assert trainer.rewards.pop_faults() == {"FlakyEnv": 2}
