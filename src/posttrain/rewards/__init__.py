"""Reward functions with the TRL signature ``f(completions, **columns) -> list[float | None]``."""

from posttrain.rewards.answer import answer_accuracy_reward, answer_format_reward
from posttrain.rewards.library import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)

__all__ = [
    "accuracy_reward",
    "answer_accuracy_reward",
    "answer_format_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "think_format_reward",
]
