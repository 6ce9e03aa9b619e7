"""The reward functions of a subcommand: built-in names or dotted import paths.

``--reward_funcs`` takes built-in reward names (``answer_accuracy_reward``, ...) and dotted
import paths to the user's own functions (``my_pkg.rewards.my_reward`` or
``my_pkg.rewards:my_reward``); :func:`resolve_reward_funcs` turns them into callables, followed
by a reward model's name or path. Bad input raises :class:`CLIError`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from posttrain.cli.options import CLIError

#: Reward functions used when ``--reward_funcs`` is not given and there is no reward model.
DEFAULT_REWARD_FUNCS: tuple[str, ...] = ("answer_accuracy_reward", "answer_format_reward")

#: Built-in rewards that need the math-verify package.
_MATH_REWARDS = frozenset({"accuracy_reward", "reasoning_accuracy_reward"})


def resolve_reward_funcs(names: list[str] | None, reward_model: str | None = None) -> list[Any]:
    """Reward callables for ``names``, then the reward model's name or path (the trainer loads it).

    Args:
        names: built-in reward names or dotted import paths; ``None``: the
            ``DEFAULT_REWARD_FUNCS``, or none when a reward model is given.
        reward_model: a sequence-classification reward model's hub id or folder, or ``None``.

    Returns:
        The reward functions followed by ``reward_model``, as the trainers' ``reward_funcs``.

    Raises:
        CLIError: an unknown name, a path that cannot be imported or is not callable, a
            built-in reward whose package is missing, or no reward at all.
    """
    if names is None:
        names = [] if reward_model else list(DEFAULT_REWARD_FUNCS)
    registry = _reward_registry()
    funcs: list[Any] = [_resolve_reward(name, registry) for name in names]
    if reward_model:
        funcs.append(reward_model)
    if not funcs:
        raise CLIError("no reward: give --reward_funcs, --reward_model_name_or_path, or both.")
    return funcs


def _reward_registry() -> dict[str, Any]:
    """Built-in reward name -> function."""
    from posttrain import rewards

    return {
        "answer_accuracy_reward": rewards.answer_accuracy_reward,
        "answer_format_reward": rewards.answer_format_reward,
        "accuracy_reward": rewards.accuracy_reward,
        "reasoning_accuracy_reward": rewards.reasoning_accuracy_reward,
        "think_format_reward": rewards.think_format_reward,
    }


def _import_reward(path: str) -> Callable[..., Any]:
    """The callable at ``pkg.mod.func`` or ``pkg.mod:func`` (attributes may be nested after ``:``)."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise CLIError(
            f"reward function {path!r} is not a valid import path; write it as my_pkg.rewards.my_reward "
            "or my_pkg.rewards:my_reward."
        )
    # The console script does not put the working directory on sys.path, `python -m` does:
    # make a module next to the user importable either way (last, so it shadows nothing).
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise CLIError(f"cannot import reward function {path!r}: {exc}.") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CLIError(
                f"cannot import reward function {path!r}: module {module_name!r} has no attribute {attr!r}."
            ) from None
    if not callable(obj):
        raise CLIError(f"reward function {path!r} is a {type(obj).__name__}, not a callable.")
    return obj


def _resolve_reward(name: str, registry: dict[str, Any]) -> Callable[..., Any]:
    """The built-in reward ``name``, or the callable at the dotted import path ``name``."""
    if name in registry:
        if name in _MATH_REWARDS and importlib.util.find_spec("math_verify") is None:
            raise CLIError(
                f"reward function {name!r} needs the math-verify package; install it with "
                "pip install 'posttrain[math]'."
            )
        return registry[name]
    if "." in name or ":" in name:
        return _import_reward(name)
    raise CLIError(
        f"unknown reward function {name!r}: it is not a built-in reward ({', '.join(sorted(registry))}) "
        "nor a dotted import path such as my_pkg.rewards.my_reward or my_pkg.rewards:my_reward."
    )
