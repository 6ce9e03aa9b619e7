"""Reward functions with the TRL signature ``f(completions, **columns) -> list[float | None]``."""

from posttrain.rewards.answer import answer_accuracy_reward, answer_format_reward

__all__ = ["answer_accuracy_reward", "answer_format_reward"]
