"""SDPO's reprompts: which completions get a teacher prompt, and what it says (pure).

A group's completions are the ``num_generations`` samples of one prompt. Every completion is
reprompted with the first completion of its group that reached ``success_reward_threshold``
(``solution_template``) and/or the environment's feedback on its row (``feedback_template``),
composed by ``reprompt_template``; a successful completion too, from a successful sibling.
``dont_reprompt_on_self_success`` (on by default) keeps a completion from being its own
demonstration, as in the reference and the paper's code; off, the first success of the group may
be the row itself. A completion with neither a demonstration nor feedback gets no reprompt: it
adds 0 to the distillation term but still counts in its mean (the reference's reduction).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["RepromptSettings", "Reprompts", "plan_reprompts", "strip_thinking"]

_THINKING = re.compile(r"<think>.*?</think>\s*", flags=re.DOTALL)


def strip_thinking(text: str) -> str:
    """The text without its ``<think>...</think>`` spans."""
    return _THINKING.sub("", text)


@dataclass(frozen=True)
class RepromptSettings:
    """The ``SDPOConfig`` fields that decide the reprompts (see its docstring)."""

    group: int
    success_reward_threshold: float = 1.0
    use_successful_as_teacher: bool = True
    dont_reprompt_on_self_success: bool = True
    include_environment_feedback: bool = False
    environment_feedback_only_without_solution: bool = False
    remove_thinking_from_demonstration: bool = False
    reprompt_template: str = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
    solution_template: str = "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
    feedback_template: str = (
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"
    )


@dataclass
class Reprompts:
    """What ``plan_reprompts`` decides for every row.

    Attributes:
        fills: per row, how its prompt text becomes the reprompt (``str -> str``), or ``None``.
        stats: the reference's ``self_distillation/*`` fractions: ``success_group_fraction``
            (groups with a success), ``success_sample_fraction`` (rows shown a successful
            sibling's answer), ``feedback_available_fraction`` (rows with feedback, used or not),
            ``feedback_used_fraction`` and ``reprompt_sample_fraction``.
    """

    fills: list[Any]
    stats: dict[str, float] = field(default_factory=dict)


def plan_reprompts(
    rewards: torch.Tensor, completions: list[str], feedback: list[str | None], s: RepromptSettings
) -> Reprompts:
    """Decide each row's reprompt from every row's reward, completion and feedback.

    Args:
        rewards: [N] each completion's (weighted) reward, NaN where unscored; rows are in groups
            of ``s.group`` consecutive completions of one prompt.
        completions: the N completions' texts.
        feedback: the N rows' environment feedback (``None``: none).
        s: the settings.

    Returns:
        ``Reprompts`` over the N rows.
    """
    n = rewards.shape[0]
    success = (rewards >= s.success_reward_threshold).tolist()  # NaN compares False
    fills: list[Any] = []
    counts = {"with_solution": 0, "feedback_available": 0, "feedback_used": 0, "reprompted": 0}
    for i in range(n):
        start = i // s.group * s.group
        own = not s.dont_reprompt_on_self_success  # may the row demonstrate to itself?
        sibling = next((j for j in range(start, start + s.group) if (own or j != i) and success[j]), None)
        solution = ""
        if s.use_successful_as_teacher and sibling is not None:
            demo = completions[sibling]
            demo = strip_thinking(demo) if s.remove_thinking_from_demonstration else demo
            solution = s.solution_template.format(successful_previous_attempt=demo)
            counts["with_solution"] += 1
        counts["feedback_available"] += bool(feedback[i] and feedback[i].strip())  # used or not
        raw = feedback[i] if s.include_environment_feedback else None
        use_feedback = bool(raw) and not (s.environment_feedback_only_without_solution and solution)
        text = s.feedback_template.format(feedback_raw=raw) if use_feedback else ""
        if not (solution or text):
            fills.append(None)
            continue
        counts["feedback_used"] += use_feedback
        counts["reprompted"] += 1
        fills.append(_filler(s.reprompt_template, solution, text))
    groups = max(n // s.group, 1)
    grouped = torch.tensor(success, dtype=torch.float32).view(groups, -1) if n else torch.zeros(1, 1)
    stats = {
        "success_group_fraction": grouped.amax(dim=1).mean().item(),
        "success_sample_fraction": counts["with_solution"] / max(n, 1),
        "feedback_available_fraction": counts["feedback_available"] / max(n, 1),
        "feedback_used_fraction": counts["feedback_used"] / max(n, 1),
        "reprompt_sample_fraction": counts["reprompted"] / max(n, 1),
    }
    return Reprompts(fills=fills, stats=stats)


def _filler(template: str, solution: str, feedback: str) -> Any:
    return lambda prompt: template.format(prompt=prompt, solution=solution, feedback=feedback)
