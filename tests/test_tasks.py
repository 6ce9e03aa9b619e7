"""Tests for the built-in arithmetic task and the <answer> rewards."""

from __future__ import annotations

import pickle
import re
from fractions import Fraction

import pytest

from posttrain.data.tasks import (
    ARITHMETIC_EXAMPLES,
    ARITHMETIC_SYSTEM_PROMPT,
    BUILTIN_TASKS,
    arithmetic_dataset,
    load_task,
)
from posttrain.rewards import answer_accuracy_reward, answer_format_reward
from posttrain.rewards.answer import completion_text, extract_answer, parse_number

QUESTION = re.compile(r"What is (.+)\? Think briefly")


def _evaluate(expression: str) -> int:
    """Independent check of the solutions: Python's own evaluation of the shown expression."""
    assert re.fullmatch(r"[\d\s()+\-*]+", expression)
    return eval(expression)  # noqa: S307 - only digits, spaces, parentheses and + - *


def _question(prompt) -> str:
    text = prompt[-1]["content"] if isinstance(prompt, list) else prompt.rsplit("Question: ", 1)[1]
    return QUESTION.search(text).group(1)


# ---------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------


def test_same_seed_same_dataset_other_seed_other_dataset():
    first = arithmetic_dataset(n=50, seed=3)
    again = arithmetic_dataset(n=50, seed=3)
    other = arithmetic_dataset(n=50, seed=4)
    assert first.to_list() == again.to_list()
    assert first.to_list() != other.to_list()
    assert list(first["solution"]) != list(other["solution"])


def test_global_random_state_is_untouched():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    arithmetic_dataset(n=20, seed=0)
    assert random.random() == expected


def test_columns_and_solutions():
    dataset = arithmetic_dataset(n=200, seed=0)
    assert dataset.column_names == ["prompt", "solution"]
    assert len(dataset) == 200
    operators = set()
    for row in dataset:
        expression = _question(row["prompt"])
        assert row["solution"] == str(_evaluate(expression))
        assert int(row["solution"]) >= 0
        operators.update(ch for ch in expression if ch in "+-*")
        for a, b in re.findall(r"(\d+) \* (\d+)", expression):
            assert int(a) <= 12 and int(b) <= 12
        assert all(0 <= int(v) <= 50 for v in re.findall(r"\d+", expression))
    assert operators == {"+", "-", "*"}
    assert len(set(dataset["solution"])) > 20


def test_conversational_prompt():
    prompt = arithmetic_dataset(n=1, seed=0)[0]["prompt"]
    assert prompt[0] == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    roles = [m["role"] for m in prompt]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]  # two examples
    for message, (expression, _, _) in zip(prompt[1:5:2], ARITHMETIC_EXAMPLES, strict=False):
        assert expression in message["content"]
    assert prompt[2]["content"].endswith(f"<answer>{ARITHMETIC_EXAMPLES[0][2]}</answer>")
    assert "<answer></answer>" in prompt[-1]["content"] and "Think briefly" in prompt[-1]["content"]

    plain = arithmetic_dataset(n=1, seed=0, few_shot=0)[0]["prompt"]
    assert [m["role"] for m in plain] == ["system", "user"]
    assert plain[-1] == prompt[-1]
    bare = arithmetic_dataset(n=1, seed=0, few_shot=0, system_prompt=None)[0]["prompt"]
    assert [m["role"] for m in bare] == ["user"]


def test_standard_prompt_matches_the_conversational_one():
    conversational = arithmetic_dataset(n=5, seed=7)
    standard = arithmetic_dataset(n=5, seed=7, conversational=False)
    assert list(standard["solution"]) == list(conversational["solution"])
    for messages, text in zip(conversational["prompt"], standard["prompt"], strict=True):
        assert isinstance(text, str)
        assert text.startswith(ARITHMETIC_SYSTEM_PROMPT + "\n\n")
        assert text.endswith("\n\nAnswer:")
        assert f"Question: {messages[-1]['content']}" in text
        assert text.count("Question: ") == 3
        assert _question(text) == _question(messages)


def test_harder_level_and_negative_numbers():
    dataset = arithmetic_dataset(
        n=100, seed=1, num_operations=2, min_value=-9, max_value=9, allow_negative=True
    )
    negative = 0
    for row in dataset:
        expression = _question(row["prompt"])
        assert len(re.findall(r" [+\-*] ", expression)) == 2
        assert row["solution"] == str(_evaluate(expression))
        negative += int(row["solution"]) < 0
    assert negative > 0
    assert "(-" in "".join(_question(p) for p in dataset["prompt"])


def test_restricted_operations():
    dataset = arithmetic_dataset(n=30, seed=2, operations=["*"], max_factor=5)
    for row in dataset:
        a, b = map(int, _question(row["prompt"]).split(" * "))
        assert 0 <= a <= 5 and 0 <= b <= 5 and row["solution"] == str(a * b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": -1},
        {"min_value": 5, "max_value": 1},
        {"num_operations": 0},
        {"operations": ["/"]},
        {"operations": []},
        {"few_shot": 99},
        {"min_value": -9, "max_value": -1, "operations": ["+"]},  # never non-negative
    ],
)
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        arithmetic_dataset(**kwargs)


def test_load_task():
    assert BUILTIN_TASKS["arithmetic"] is arithmetic_dataset
    assert load_task("arithmetic", n=4, seed=9).to_list() == arithmetic_dataset(n=4, seed=9).to_list()
    assert len(load_task("Arithmetic", n=2)) == 2
    with pytest.raises(ValueError, match=r"Unknown task 'gsm8k'.*arithmetic"):
        load_task("gsm8k")


# ---------------------------------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------------------------------


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    ("completion", "solution", "expected"),
    [
        ("7 + 5 = 12. <answer>12</answer>", "12", 1.0),
        ("7 + 5 = 13. <answer>13</answer>", "12", 0.0),
        ("7 + 5 = 12.", "12", 0.0),  # no tag
        ("<answer>12", "12", 0.0),  # unclosed tag
        ("<answer>3</answer> no wait <answer>12</answer>", "12", 1.0),  # the last one counts
        ("<answer>12</answer> no wait <answer>3</answer>", "12", 0.0),
        ("<answer> 12 </answer>", "12", 1.0),
        ("<answer>\n12\n</answer>", "12", 1.0),
        ("<answer>12.</answer>", "12", 1.0),
        ("<answer>12.0</answer>", "12", 1.0),
        ("<answer>12</answer>", "12.00", 1.0),
        ("<answer>+12</answer>", "12", 1.0),
        ("<answer>1,200</answer>", "1200", 1.0),
        ("<answer>1,20</answer>", "120", 0.0),  # not a thousands separator
        ("<answer>0.5</answer>", "0.50", 1.0),
        ("<answer>.5</answer>", "0.5", 1.0),
        ("<answer>0.51</answer>", "0.5", 0.0),
        ("<answer>-7</answer>", "-7", 1.0),
        ("<answer>\u22127</answer>", "-7", 1.0),  # Unicode minus
        ("<answer>7</answer>", "-7", 0.0),
        ("<answer>twelve</answer>", "12", 0.0),
        ("<answer>12 apples</answer>", "12", 0.0),
        ("<answer>3*4</answer>", "12", 0.0),
        ("<answer></answer>", "0", 0.0),
        ("<answer>12</answer>", 12, 1.0),  # a numeric solution column
    ],
)
def test_accuracy_cases(completion, solution, expected):
    assert answer_accuracy_reward([completion], [solution]) == [expected]
    assert answer_accuracy_reward([_assistant(completion)], solution=[solution]) == [expected]


@pytest.mark.parametrize("solution", ["n/a", "", "twelve", None, "1e3", float("nan")])
def test_accuracy_is_none_when_the_solution_is_not_a_number(solution):
    assert answer_accuracy_reward(["<answer>12</answer>"], [solution]) == [None]


def test_accuracy_batch_and_extra_columns():
    completions = ["<answer>4</answer>", "<answer>5</answer>", "4", "<answer>4</answer>"]
    rewards = answer_accuracy_reward(
        completions, solution=["4", "4", "4", "?"], prompts=["p"] * 4, trainer_state=None
    )
    assert rewards == [1.0, 0.0, 0.0, None]
    with pytest.raises(ValueError, match="2 completions but 1 solutions"):
        answer_accuracy_reward(["a", "b"], ["1"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("3 + 4 = 7. <answer>7</answer>", 1.0),
        ("<answer> -1,234.5. </answer>", 1.0),
        ("<answer>7</answer> and more text", 1.0),
        ("3 + 4 = 7.", 0.0),  # missing
        ("<answer>7</answer><answer>7</answer>", 0.0),  # two blocks
        ("<answer>7</answer> </answer>", 0.0),  # a stray closing tag
        ("</answer>7<answer>", 0.0),  # wrong order
        ("<answer>seven</answer>", 0.0),  # not a number
        ("<answer>7", 0.0),
        ("", 0.0),
    ],
)
def test_format_cases(completion, expected):
    assert answer_format_reward([completion]) == [expected]
    assert answer_format_reward([_assistant(completion)], solution=["7"]) == [expected]


def test_conversational_completions():
    multi = [
        {"role": "assistant", "content": "<answer>1</answer>"},
        {"role": "tool", "content": "<answer>2</answer>"},
        {"role": "assistant", "content": "<answer>3</answer>"},
        {"role": "assistant", "content": ""},
    ]
    assert completion_text(multi) == "<answer>3</answer>"
    assert answer_accuracy_reward([multi], ["3"]) == [1.0]
    parts = [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "<answer>"}, {"type": "text", "text": "8</answer>"}],
        }
    ]
    assert answer_accuracy_reward([parts], ["8"]) == [1.0]
    assert completion_text({"role": "assistant", "content": "x"}) == "x"
    assert completion_text([{"role": "user", "content": "only a user turn"}]) == "only a user turn"
    assert completion_text([]) == ""
    assert answer_format_reward([[]]) == [0.0]


def test_helpers():
    assert parse_number(" 1,234,567.50. ") == Fraction(123456750, 100)
    assert parse_number("-0") == 0
    assert parse_number("1,2345") is None
    assert parse_number("12..") is None
    assert parse_number(True) is None
    assert parse_number(2.5) == Fraction(5, 2)
    assert extract_answer("a <answer>1</answer> b <answer>2</answer>") == "2"
    assert extract_answer("nothing") is None


def test_rewards_are_picklable_and_named():
    for function, name in [
        (answer_accuracy_reward, "answer_accuracy_reward"),
        (answer_format_reward, "answer_format_reward"),
    ]:
        assert function.__name__ == name
        assert pickle.loads(pickle.dumps(function)) is function


def test_rewards_on_the_dataset_solutions():
    solutions = list(arithmetic_dataset(n=10, seed=5)["solution"])
    right = [f"... <answer>{s}</answer>" for s in solutions]
    wrong = [f"... <answer>{int(s) + 1}</answer>" for s in solutions]
    assert answer_accuracy_reward(right, solutions) == [1.0] * 10
    assert answer_accuracy_reward(wrong, solutions) == [0.0] * 10
    assert answer_format_reward(right) == [1.0] * 10
