"""Built-in tasks: small datasets with verifiable answers, for trying GRPO without downloading data.

A task is a function that returns a :class:`datasets.Dataset` with a ``prompt`` column (conversational
or standard format, as TRL trainers accept) and a ``solution`` column that the rewards in
:mod:`posttrain.rewards.answer` check. :func:`load_task` looks one up by name in :data:`BUILTIN_TASKS`.

How hard :func:`arithmetic_dataset` is, measured on 48 problems with the embedded (Q4_1)
SmolLM2-135M-Instruct, correct / well-formatted answers, greedy and sampled at temperature 1:

- defaults: 54 % / 100 % greedy, 42 % / 96 % sampled;
- ``few_shot=0``: 0 % / 0 % either way;
- ``num_operations=2, max_value=10``: 12 % / 100 % greedy, 15 % / 90 % sampled;
- ``num_operations=2`` (operands up to 50): 4 % / 98 % greedy, 2 % / 81 % sampled;
- ``conversational=False`` (raw text, no chat template): 15 % / 23 % greedy, 15 % / 52 % sampled.

So the defaults give GRPO a mix of right and wrong answers within a group; two operations are the
harder level. In the standard (plain-text) format an instruct model tends to run on with a new
"Question:" after its answer, which the format reward penalizes; that format suits base models.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from datasets import Dataset

#: The system message of the arithmetic task (conversational format; in standard format it heads the
#: prompt text).
ARITHMETIC_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves arithmetic problems. Think briefly, then give the final "
    "answer as a number inside <answer></answer>."
)

#: The user message; ``{expression}`` is replaced by the problem.
ARITHMETIC_QUESTION = (
    "What is {expression}? Think briefly, then put only the final number inside <answer></answer>."
)

#: Worked examples ``(expression, reasoning, answer)`` shown before the problem when ``few_shot > 0``.
#: SmolLM2-135M-Instruct ignores the ``<answer>`` instruction alone (0 % of greedy completions use the
#: tag) but follows two examples (about 100 %).
ARITHMETIC_EXAMPLES: tuple[tuple[str, str, str], ...] = (
    ("3 + 4", "3 + 4 = 7.", "7"),
    ("6 * 2", "6 * 2 = 12.", "12"),
    ("15 - 9", "15 - 9 = 6.", "6"),
    ("2 + 3 * 4", "3 * 4 = 12, and 2 + 12 = 14.", "14"),
)

_OPERATIONS = ("+", "-", "*")


def _evaluate(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Evaluate ``operands[0] op operands[1] op ...`` with ``*`` binding tighter than ``+`` and ``-``."""
    total = 0
    sign = 1
    term = operands[0]
    for operator, operand in zip(operators, operands[1:], strict=True):
        if operator == "*":
            term *= operand
        else:
            total += sign * term
            sign = 1 if operator == "+" else -1
            term = operand
    return total + sign * term


def _format_expression(operands: Sequence[int], operators: Sequence[str]) -> str:
    shown = [str(value) if value >= 0 else f"({value})" for value in operands]
    parts = [shown[0]]
    for operator, value in zip(operators, shown[1:], strict=True):
        parts.append(f" {operator} {value}")
    return "".join(parts)


def _arithmetic_prompt(expression: str, conversational: bool, turns: list[dict[str, str]]) -> Any:
    """The prompt for one problem: the shared turns (system message, examples), then the question."""
    messages = [*turns, {"role": "user", "content": ARITHMETIC_QUESTION.format(expression=expression)}]
    if conversational:
        return messages
    # Standard format: the same turns as plain text, ending where the model should continue.
    blocks = []
    for message in messages:
        if message["role"] == "system":
            blocks.append(message["content"])
        elif message["role"] == "user":
            blocks.append(f"Question: {message['content']}")
        else:
            blocks.append(f"Answer: {message['content']}")
    return "\n\n".join(blocks) + "\n\nAnswer:"


def _check_arithmetic_arguments(
    n: int, min_value: int, max_value: int, num_operations: int, operations: Sequence[str], few_shot: int
) -> tuple[str, ...]:
    """The operations as a tuple, once every argument of :func:`arithmetic_dataset` is checked."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must not exceed max_value ({max_value})")
    if num_operations < 1:
        raise ValueError(f"num_operations must be >= 1, got {num_operations}")
    operations = tuple(operations)
    unknown = sorted(set(operations) - set(_OPERATIONS))
    if not operations or unknown:
        raise ValueError(f"operations must be a non-empty subset of {_OPERATIONS}, got {operations}")

    if not 0 <= few_shot <= len(ARITHMETIC_EXAMPLES):
        raise ValueError(f"few_shot must be between 0 and {len(ARITHMETIC_EXAMPLES)}, got {few_shot}")
    return operations


def _arithmetic_turns(system_prompt: str | None, few_shot: int) -> list[dict[str, str]]:
    """The turns shared by every prompt: the system message, then ``few_shot`` worked examples."""
    turns: list[dict[str, str]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for expression, reasoning, answer in ARITHMETIC_EXAMPLES[:few_shot]:
        turns.append({"role": "user", "content": ARITHMETIC_QUESTION.format(expression=expression)})
        turns.append({"role": "assistant", "content": f"{reasoning} <answer>{answer}</answer>"})
    return turns


def _draw_problem(
    rng: random.Random,
    operations: tuple[str, ...],
    num_operations: int,
    bounds: tuple[int, int, int],
    allow_negative: bool,
) -> tuple[list[int], list[str], int]:
    """(operands, operators, result) of one problem, operands in ``bounds`` (min, max, max factor)."""
    min_value, max_value, factor_max = bounds
    for _attempt in range(1000):
        operators = [rng.choice(operations) for _ in range(num_operations)]
        operands = []
        for index in range(num_operations + 1):
            in_product = (index > 0 and operators[index - 1] == "*") or (
                index < num_operations and operators[index] == "*"
            )
            operands.append(rng.randint(min_value, factor_max if in_product else max_value))
        result = _evaluate(operands, operators)
        if allow_negative or result >= 0:
            return operands, operators, result
    raise ValueError("could not draw a problem with a non-negative result; set allow_negative=True")


def arithmetic_dataset(
    n: int = 1000,
    seed: int = 0,
    conversational: bool = True,
    min_value: int = 0,
    max_value: int = 50,
    max_factor: int = 12,
    operations: Sequence[str] = _OPERATIONS,
    num_operations: int = 1,
    allow_negative: bool = False,
    few_shot: int = 2,
    system_prompt: str | None = ARITHMETIC_SYSTEM_PROMPT,
) -> Dataset:
    """Small arithmetic problems with exact integer answers, reproducible from ``seed``.

    Each problem is ``a op b`` (or, with ``num_operations=2``, ``a op b op c``, evaluated with the
    usual precedence: ``*`` before ``+`` and ``-``), where each ``op`` is drawn uniformly from
    ``operations`` and each operand uniformly from ``[min_value, max_value]``, except that an operand
    of ``*`` is drawn from ``[min_value, max(min_value, min(max_value, max_factor))]`` so products stay
    small. Unless ``allow_negative``, problems whose result is negative are redrawn. Negative operands
    are shown in parentheses. Draws use ``random.Random(seed)`` only, so the same arguments always give
    the same dataset (problems may repeat).

    The prompt asks the model to think briefly and to put only the final number inside
    ``<answer></answer>``, and by default shows two worked examples first (:data:`ARITHMETIC_EXAMPLES`,
    as earlier user/assistant turns): without them SmolLM2-135M-Instruct never uses the tag. The
    module docstring gives the accuracy measured at each difficulty and format.

    Args:
        n: Number of problems.
        seed: Seed of the private random generator.
        conversational: If True, ``prompt`` is a list of messages: the system message (unless
            ``system_prompt`` is None), ``few_shot`` pairs of user/assistant example turns, then the
            user question. If False, the same turns as one plain string (``Question: ...`` /
            ``Answer: ...`` paragraphs) ending with ``"Answer:"``.
        min_value: Smallest operand.
        max_value: Largest operand.
        max_factor: Largest operand of a multiplication.
        operations: The operators to draw from, a subset of ``("+", "-", "*")``.
        num_operations: Operators per problem, 1 or more.
        allow_negative: Whether a result may be negative.
        few_shot: Number of worked examples shown before the question, 0 to
            ``len(ARITHMETIC_EXAMPLES)``.
        system_prompt: The system message, or None for none.

    Returns:
        A dataset with the columns ``prompt`` and ``solution`` (the exact result as a string, e.g.
        ``"42"`` or ``"-7"``).

    Raises:
        ValueError: On an invalid argument, or if no problem with a non-negative result can be drawn.
    """
    operations = _check_arithmetic_arguments(n, min_value, max_value, num_operations, operations, few_shot)
    turns = _arithmetic_turns(system_prompt, few_shot)
    rng = random.Random(seed)
    bounds = (min_value, max_value, max(min_value, min(max_value, max_factor)))
    problems = [_draw_problem(rng, operations, num_operations, bounds, allow_negative) for _ in range(n)]
    prompts = [_arithmetic_prompt(_format_expression(a, o), conversational, turns) for a, o, _ in problems]
    return Dataset.from_dict({"prompt": prompts, "solution": [str(result) for _, _, result in problems]})


def _worked_answer(prompt: list[dict[str, str]], solution: str) -> str:
    """The assistant's worked answer to an arithmetic prompt, in the style of the examples."""
    question = prompt[-1]["content"]
    expression = question[len("What is ") : question.index("?")]
    return f"{expression} = {solution}. <answer>{solution}</answer>"


def arithmetic_sft_dataset(n: int = 2000, seed: int = 1, few_shot: int = 0, **kwargs: Any) -> Dataset:
    """Worked answers to arithmetic problems, for supervised fine-tuning (prompt-completion).

    The prompts are those of :func:`arithmetic_dataset` (its system message), drawn with their
    own ``seed`` and, by default, without worked examples: the fine-tuning itself teaches the
    answer format, which the embedded model never uses unprompted (0 % of its greedy answers
    without examples), and short rows keep a CPU step short. Each completion is the assistant
    turn ``"<expression> = <result>. <answer><result></answer>"``. Problems that also occur in
    :func:`arithmetic_heldout` are left out, so an SFT run never sees the evaluation problems.

    Args:
        n: Number of problems before the held-out ones are removed.
        seed: Seed of the private random generator.
        few_shot: Worked examples in each prompt (as in :func:`arithmetic_dataset`).
        **kwargs: Passed to :func:`arithmetic_dataset` (conversational only).

    Returns:
        A dataset with the columns ``prompt``, ``completion`` and ``solution``.
    """
    data = arithmetic_dataset(n=n, seed=seed, conversational=True, few_shot=few_shot, **kwargs)
    data = without_problems(data, arithmetic_heldout())
    return data.map(
        lambda row: {
            "completion": [{"role": "assistant", "content": _worked_answer(row["prompt"], row["solution"])}]
        }
    )


def arithmetic_distill_dataset(n: int = 1000, seed: int = 0, few_shot: int = 2, **kwargs: Any) -> Dataset:
    """Arithmetic prompts with their worked answers as privileged context, for self-distillation.

    The prompts are those of :func:`arithmetic_dataset` (conversational; ``kwargs`` draw them);
    each row's ``privileged_context`` is the worked answer of its problem, the completion of
    :func:`arithmetic_sft_dataset` (``"<expression> = <result>. <answer><result></answer>"``):
    ``SDFTTrainer``'s teacher reads it after the prompt, the student samples without it. Problems
    that also occur in a held-out set are left out: the offline commands' (``arithmetic_heldout()``)
    and the online commands' (``arithmetic_heldout(distinct=True, **kwargs)``, drawn like these
    prompts; its first 100 draws when the options allow fewer different problems).

    Args:
        n: Number of problems before the held-out ones are removed.
        seed: Seed of the private random generator.
        few_shot: Worked examples in each prompt (as in :func:`arithmetic_dataset`).
        **kwargs: Passed to :func:`arithmetic_dataset` (conversational only).

    Returns:
        A dataset with the columns ``prompt``, ``privileged_context`` and ``solution`` (so the
        answer rewards can be logged).
    """
    data = arithmetic_dataset(n=n, seed=seed, conversational=True, few_shot=few_shot, **kwargs)
    data = without_problems(data, arithmetic_heldout())
    try:
        drawn_alike = arithmetic_heldout(distinct=True, **kwargs)
    except ValueError:  # too few different problems for 100: the first 100 draws
        drawn_alike = arithmetic_heldout(**kwargs)
    data = without_problems(data, drawn_alike)
    return data.map(lambda row: {"privileged_context": _worked_answer(row["prompt"], row["solution"])})


def arithmetic_preference_dataset(n: int = 2000, seed: int = 2, few_shot: int = 0, **kwargs: Any) -> Dataset:
    """Preference pairs on arithmetic problems, for DPO and the other preference trainers.

    The prompts are those of :func:`arithmetic_sft_dataset` (its own ``seed``, the held-out
    problems left out). ``chosen`` is the worked answer with the right result in the answer tag;
    ``rejected`` alternates between the same worked answer with a wrong result in the tag (the
    right result off by 1 to 9, drawn from the seed) and the right result without the tag, so
    the pairs teach both correctness and the format.

    Args:
        n: Number of problems before the held-out ones are removed.
        seed: Seed of the problems and of the wrong results.
        few_shot: Worked examples in each prompt (as in :func:`arithmetic_dataset`).
        **kwargs: Passed to :func:`arithmetic_dataset` (conversational only).

    Returns:
        A dataset with the columns ``prompt``, ``chosen``, ``rejected`` and ``solution``
        (conversational: each answer is a one-message assistant list).
    """
    data = arithmetic_sft_dataset(n=n, seed=seed, few_shot=few_shot, **kwargs).remove_columns("completion")
    rng = random.Random(seed)

    def pair(row: dict[str, Any], index: int) -> dict[str, Any]:
        solution = row["solution"]
        chosen = _worked_answer(row["prompt"], solution)
        expression = chosen[: chosen.index(" = ")]
        if index % 2 == 0:
            wrong = str(int(solution) + rng.choice([-1, 1]) * rng.randint(1, 9))
            rejected = f"{expression} = {wrong}. <answer>{wrong}</answer>"
        else:
            rejected = f"{expression} = {solution}."
        return {
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
        }

    return data.map(pair, with_indices=True)


#: The seed and size of the held-out evaluation problems (disjoint from every training seed's use).
HELDOUT_SEED, HELDOUT_SIZE = 20261201, 100


def arithmetic_heldout(
    n: int = HELDOUT_SIZE, few_shot: int = 0, distinct: bool = False, **kwargs: Any
) -> Dataset:
    """A fixed set of held-out arithmetic problems to measure accuracy before and after training.

    Drawn with :data:`HELDOUT_SEED` like :func:`arithmetic_dataset` (conversational): by default
    one operation on numbers up to 50, the system message and ``few_shot`` worked examples (none,
    as in the SFT task); ``kwargs`` change the drawing (``max_value=20, system_prompt=None``) so
    that the problems look like a run's training prompts. The SFT and preference tasks leave the
    default problems out of their training rows; :func:`without_problems` does it for others.

    Args:
        n: Number of problems.
        few_shot: Worked examples before each problem.
        distinct: If True, ``n`` different problems (the first ``n`` different ones of the seed's
            draws); if False, the first ``n`` draws, which may repeat a problem (the offline
            commands' measured figures use this set).
        **kwargs: Passed to :func:`arithmetic_dataset` (``max_value``, ``system_prompt``, ...).

    Returns:
        A dataset with the columns ``prompt`` and ``solution``.

    Raises:
        ValueError: With ``distinct``, if the drawing options allow fewer than ``n`` different
            problems.
    """
    draws = n
    while True:
        data = arithmetic_dataset(
            n=draws, seed=HELDOUT_SEED, conversational=True, few_shot=few_shot, **kwargs
        )
        if not distinct:
            return data
        first = _first_occurrences([arithmetic_question(p) for p in data["prompt"]])
        if len(first) >= n:
            return data.select(first[:n])
        if draws >= 64 * n:
            raise ValueError(
                f"only {len(first)} different problems in {draws} draws of the held-out set, fewer than "
                f"the {n} it needs; allow more problems (a larger max_value, more operations)"
            )
        draws *= 2


def _first_occurrences(keys: Sequence[str]) -> list[int]:
    """The index of the first occurrence of each different key, in order."""
    seen: set[str] = set()
    first = []
    for index, key in enumerate(keys):
        if key not in seen:
            seen.add(key)
            first.append(index)
    return first


def arithmetic_question(prompt: Any) -> str:
    """The question of an arithmetic prompt, without the worked examples and system message.

    Conversational: the last message's text. Standard: the text after the last ``Question: ``,
    up to the ``Answer:`` paragraph that follows.
    """
    if isinstance(prompt, str):
        question = prompt[prompt.rindex("Question: ") + len("Question: ") :]
        return question.split("\n\nAnswer:", 1)[0]
    return prompt[-1]["content"]


def without_problems(data: Dataset, problems: Dataset) -> Dataset:
    """The rows of ``data`` whose question is none of the questions of ``problems`` (order kept).

    Leaves held-out problems out of a task's training rows. The questions are compared as
    :func:`arithmetic_question` reads them, so worked examples and system messages may differ.
    """
    excluded = {arithmetic_question(p) for p in problems["prompt"]}
    keep = [i for i, p in enumerate(data["prompt"]) if arithmetic_question(p) not in excluded]
    return data.select(keep)


#: The built-in tasks by name; each value returns a :class:`datasets.Dataset`.
BUILTIN_TASKS: dict[str, Callable[..., Dataset]] = {
    "arithmetic": arithmetic_dataset,
    "arithmetic_sft": arithmetic_sft_dataset,
    "arithmetic_preference": arithmetic_preference_dataset,
    "arithmetic_distill": arithmetic_distill_dataset,
}


def load_task(name: str, **kwargs: Any) -> Dataset:
    """Build a built-in task's dataset.

    Args:
        name: A key of :data:`BUILTIN_TASKS` (case-insensitive), e.g. ``"arithmetic"``.
        **kwargs: Passed to the task function, e.g. ``n=200, seed=1``.

    Returns:
        The dataset.

    Raises:
        ValueError: If ``name`` is not a built-in task; the message lists the known names.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in BUILTIN_TASKS:
        known = ", ".join(sorted(BUILTIN_TASKS))
        raise ValueError(f"Unknown task {name!r}; the built-in tasks are: {known}")
    return BUILTIN_TASKS[key](**kwargs)


__all__ = [
    "ARITHMETIC_QUESTION",
    "ARITHMETIC_SYSTEM_PROMPT",
    "BUILTIN_TASKS",
    "arithmetic_dataset",
    "arithmetic_distill_dataset",
    "arithmetic_heldout",
    "arithmetic_preference_dataset",
    "arithmetic_question",
    "arithmetic_sft_dataset",
    "load_task",
    "without_problems",
]
