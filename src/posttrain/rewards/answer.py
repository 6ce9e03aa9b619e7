"""Rewards for answers written as ``<answer>NUMBER</answer>``, as the built-in arithmetic task asks.

Both functions follow the TRL reward signature: they take the batch of completions plus the dataset
columns as keyword arguments and return one float (or None) per completion. A completion is either a
string (standard format) or a list of message dicts (conversational format); in the latter case the
text is the content of the last assistant message with non-empty content, else of the last message.
They are module-level functions, so they pickle, and each one's ``__name__`` is its metric name.

How a number is read (the same rule for an answer and for a solution): surrounding whitespace, one
trailing period and a leading ``+`` are ignored; ``-`` and the Unicode minus ``−`` mark a negative
number; commas are accepted only as thousands separators (``1,234``, not ``1,23``); a decimal part is
allowed (``12.0`` equals ``12``); the value is then compared exactly, as a fraction. Anything else (words,
units, expressions, ``1e3``, ``3/4``) is not a number.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")


def parse_number(text: Any) -> Fraction | None:
    """Read a number written in plain decimal notation.

    Args:
        text: The text (or an int, float or Fraction, returned as an exact fraction).

    Returns:
        The exact value, or None if ``text`` is not a number under the rule in the module docstring.
    """
    if isinstance(text, bool) or text is None:
        return None
    if isinstance(text, (int, Fraction)):
        return Fraction(text)
    if isinstance(text, float):
        return Fraction(text) if text == text and abs(text) != float("inf") else None
    if not isinstance(text, str):
        return None
    candidate = text.strip().replace("\u2212", "-")
    if candidate.endswith("."):
        candidate = candidate[:-1].rstrip()
    if not _NUMBER.fullmatch(candidate):
        return None
    return Fraction(candidate.replace(",", "").lstrip("+"))


def completion_text(completion: Any) -> str:
    """The text of one completion, in either format.

    Args:
        completion: A string, or a list of message dicts (``{"role": ..., "content": ...}``) whose
            content is a string or a list of parts (``{"type": "text", "text": ...}``).

    Returns:
        The string itself; for messages, the content of the last assistant message with non-empty
        content, else of the last message; an empty string if there is nothing.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    messages = [m for m in completion or [] if isinstance(m, dict)]
    texts = [(m.get("role"), _content_text(m.get("content"))) for m in messages]
    for role, text in reversed(texts):
        if role == "assistant" and text:
            return text
    return texts[-1][1] if texts else ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):  # multimodal parts
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    return str(content)


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` block, or None if there is none."""
    matches = ANSWER_PATTERN.findall(text)
    return matches[-1] if matches else None


def answer_accuracy_reward(
    completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any
) -> list[float | None]:
    """Whether the last ``<answer>`` block holds the right number.

    Rule, per completion ``c`` with solution ``s``::

        reward = None  if s is not a number
                 1.0   if c has an <answer>...</answer> block and number(last block) == number(s)
                 0.0   otherwise (no block, a block that is not a number, or a different number)

    Numbers are compared exactly after the normalization described in the module docstring, so
    ``<answer> 1,200. </answer>`` matches ``"1200"`` and ``<answer>12.0</answer>`` matches ``"12"``.

    Args:
        completions: The generated completions (strings, or lists of message dicts).
        solution: The reference answers, one per completion (the dataset's ``solution`` column).
        **kwargs: The other dataset columns and trainer state; ignored.

    Returns:
        One reward per completion; None where the solution cannot be parsed, which TRL-style trainers
        treat as "this reward does not apply" rather than as a wrong answer.

    Raises:
        ValueError: If ``completions`` and ``solution`` differ in length.
    """
    if len(completions) != len(solution):
        raise ValueError(f"got {len(completions)} completions but {len(solution)} solutions")
    rewards: list[float | None] = []
    for completion, reference in zip(completions, solution, strict=True):
        expected = parse_number(reference)
        if expected is None:
            rewards.append(None)
            continue
        answer = extract_answer(completion_text(completion))
        rewards.append(1.0 if answer is not None and parse_number(answer) == expected else 0.0)
    return rewards


def answer_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Whether the completion gives exactly one answer, as a number inside ``<answer></answer>``.

    Rule, per completion ``c`` (a strict 0/1 reward, not graded)::

        reward = 1.0  if c contains exactly one "<answer>" tag, exactly one "</answer>" tag, in that
                      order, and the text between them is a number
                 0.0  otherwise

    Text before and after the block (the brief reasoning) is allowed. The solution is not used, so this
    reward works on any dataset.

    Args:
        completions: The generated completions (strings, or lists of message dicts).
        **kwargs: The dataset columns and trainer state; ignored.

    Returns:
        One reward (0.0 or 1.0) per completion.
    """
    rewards: list[float] = []
    for completion in completions:
        text = completion_text(completion)
        ok = text.count("<answer>") == 1 and text.count("</answer>") == 1
        if ok:
            answer = extract_answer(text)
            ok = answer is not None and parse_number(answer) is not None
        rewards.append(1.0 if ok else 0.0)
    return rewards


__all__ = [
    "answer_accuracy_reward",
    "answer_format_reward",
    "completion_text",
    "extract_answer",
    "parse_number",
]
