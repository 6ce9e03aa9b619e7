"""Calling reward functions: sync and async, ``None`` for samples they skip, clear errors.

A reward function has the TRL signature ``f(prompts, completions, completion_ids, **kwargs) ->
list[float | None]``; it also receives every dataset column (but ``prompt``) as a keyword
argument, ``trainer_state``, ``log_metric`` and ``log_extra``. ``async def`` functions are
awaited together, so their latencies overlap.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch


class RewardFunctionError(ValueError):
    """A reward function raised or returned something unusable. The message names it."""


def reward_name(func: Any) -> str:
    """The name a reward function's metrics are logged under."""
    name = getattr(func, "__name__", None) or type(func).__name__
    return str(name)


def _call(func: Callable, kwargs: dict[str, Any]) -> Any:
    """Call ``func``; run it to completion if it is a coroutine function."""
    out = func(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_gather_all([out]))[0]
        if isinstance(out, BaseException):
            raise out
    return out


def _row_kwargs(kwargs: dict[str, Any], i: int, n: int) -> dict[str, Any]:
    """The keyword arguments of one sample: every per-sample list cut to row ``i``."""
    return {k: ([v[i]] if isinstance(v, list) and len(v) == n else v) for k, v in kwargs.items()}


def _locate_failure(func: Callable, kwargs: dict[str, Any], n: int) -> int | None:
    """Call ``func`` sample by sample to find the first sample it fails on."""
    for i in range(n):
        try:
            _call(func, _row_kwargs(kwargs, i, n))
        except Exception:
            return i
    return None


def check_output(name: str, values: Any, n: int) -> list[float]:
    """Validate a reward function's return value; ``None`` becomes NaN.

    Raises:
        RewardFunctionError: not a list of ``n`` numbers or ``None``.
    """
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise RewardFunctionError(
            f"Reward function '{name}' returned {type(values).__name__}; it must return a list with one "
            f"float (or None) per completion ({n} here)."
        )
    if len(values) != n:
        raise RewardFunctionError(
            f"Reward function '{name}' returned {len(values)} values for {n} completions; it must return "
            "exactly one reward (or None) per completion, in order."
        )
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            out.append(float(v))
        elif isinstance(v, bool):
            out.append(float(v))
        else:
            raise RewardFunctionError(
                f"Reward function '{name}' returned {v!r} ({type(v).__name__}) for sample {i}; rewards must "
                "be numbers (int or float), or None when the function does not apply to that sample."
            )
    return out


class RewardRunner:
    """Scores completions with a list of reward functions.

    Args:
        funcs: reward callables (sync or ``async def``).
    """

    def __init__(self, funcs: Sequence[Callable]) -> None:
        for f in funcs:
            if not callable(f):
                raise TypeError(
                    f"reward_funcs entries must be callables, reward model names or PreTrainedModels; got "
                    f"{type(f).__name__}."
                )
        self.funcs = list(funcs)
        self.names = [reward_name(f) for f in funcs]

    def score(self, n: int, kwargs: dict[str, Any]) -> torch.Tensor:
        """Call every function on the same keyword arguments.

        Sync functions are called one after the other, outside any event loop (so they may use
        ``asyncio.run`` themselves); the coroutines of ``async def`` functions are then awaited
        together, so their latencies overlap.

        Args:
            n: number of completions.
            kwargs: ``prompts``, ``completions``, ``completion_ids``, the dataset columns and the
                helpers; per-sample values are lists of length ``n``.

        Returns:
            [n, F] float32 rewards, NaN where a function returned ``None``.
        """
        results: list[Any] = []
        for func in self.funcs:
            try:
                results.append(func(**kwargs))
            except Exception as exc:  # reported with the function's name below
                results.append(exc)
        pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if pending:
            awaited = asyncio.run(_gather_all([results[i] for i in pending]))
            for i, value in zip(pending, awaited, strict=True):
                results[i] = value
        columns = []
        for func, name, result in zip(self.funcs, self.names, results, strict=True):
            if isinstance(result, BaseException):
                index = _locate_failure(func, kwargs, n)
                where = f"sample {index}" if index is not None else "the batch (no single sample fails alone)"
                raise RewardFunctionError(
                    f"Reward function '{name}' raised {type(result).__name__}: {result} (on {where}). Fix the "
                    "function, or return None for samples it does not apply to."
                ) from result
            columns.append(check_output(name, result, n))
        return torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(self.funcs))


async def _gather_all(awaitables: list[Any]) -> list[Any]:
    """Await concurrently; an exception is returned in place of its result."""
    return await asyncio.gather(*awaitables, return_exceptions=True)
