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
import warnings
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


FAULT_POLICIES = ("raise", "skip")


class RewardRunner:
    """Scores completions with a list of reward functions.

    Faults of a reward function (it raises, returns NaN or inf, or, for ``async def`` ones, takes
    longer than ``timeout`` seconds) follow ``fault_policy``: ``"raise"`` stops with an error
    naming the function and the sample; ``"skip"`` leaves the faulty rewards out (as if the
    function had returned ``None`` for those samples) and counts them in ``faults``.

    Args:
        funcs: reward callables (sync or ``async def``).
        fault_policy: ``"raise"`` or ``"skip"``.
        timeout: seconds an ``async def`` function may take per call (``None``: no limit). A
            sync function cannot be interrupted safely and is not timed.
    """

    def __init__(
        self, funcs: Sequence[Callable], fault_policy: str = "raise", timeout: float | None = None
    ) -> None:
        if fault_policy not in FAULT_POLICIES:
            raise ValueError(f"reward_fault_policy={fault_policy!r} is not one of {FAULT_POLICIES}.")
        self.fault_policy = fault_policy
        self.timeout = timeout
        self.faults: dict[str, int] = {}
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
        if not self.funcs:  # every reward comes from elsewhere (environments)
            return torch.zeros((n, 0), dtype=torch.float32)
        results: list[Any] = []
        for func in self.funcs:
            try:
                results.append(func(**kwargs))
            except Exception as exc:  # reported with the function's name below
                results.append(exc)
        pending = [i for i, r in enumerate(results) if inspect.isawaitable(r)]
        if pending:
            awaited = asyncio.run(_gather_all([results[i] for i in pending], self.timeout))
            for i, value in zip(pending, awaited, strict=True):
                results[i] = value
        columns = [
            self._column(func, name, result, kwargs, n)
            for func, name, result in zip(self.funcs, self.names, results, strict=True)
        ]
        return torch.tensor(columns, dtype=torch.float32).T.reshape(n, len(self.funcs))

    def _column(self, func: Callable, name: str, result: Any, kwargs: dict[str, Any], n: int) -> list[float]:
        """One function's rewards, with its faults handled by the policy."""
        if isinstance(result, BaseException):
            if self.fault_policy == "skip":
                self.faults[name] = self.faults.get(name, 0) + n
                return [math.nan] * n
            if isinstance(result, asyncio.TimeoutError):
                raise RewardFunctionError(
                    f"Reward function '{name}' did not finish within reward_timeout={self.timeout} s. Make it "
                    "faster, raise reward_timeout, or set reward_fault_policy='skip' to leave such calls out."
                ) from result
            index = _locate_failure(func, kwargs, n)
            where = f"sample {index}" if index is not None else "the batch (no single sample fails alone)"
            raise RewardFunctionError(
                f"Reward function '{name}' raised {type(result).__name__}: {result} (on {where}). Fix the "
                "function, return None for samples it does not apply to, or set reward_fault_policy='skip'."
            ) from result
        values = check_output(name, result, n)
        bad = [i for i, v in enumerate(values) if math.isinf(v) or (math.isnan(v) and result[i] is not None)]
        if bad:
            if self.fault_policy == "raise":
                raise RewardFunctionError(
                    f"Reward function '{name}' returned {result[bad[0]]!r} for sample {bad[0]}; rewards must be "
                    "finite. Return None for samples a function cannot score, or set reward_fault_policy='skip'."
                )
            self.faults[name] = self.faults.get(name, 0) + len(bad)
            for i in bad:
                values[i] = math.nan
        return values

    def pop_faults(self) -> dict[str, int]:
        """Faults skipped per function since the last call."""
        faults, self.faults = self.faults, {}
        return faults


async def _gather_all(awaitables: list[Any], timeout: float | None = None) -> list[Any]:
    """Await concurrently, each within ``timeout`` seconds; an exception replaces a failed result."""
    if timeout is not None:
        awaitables = [asyncio.wait_for(a, timeout) for a in awaitables]
    return await asyncio.gather(*awaitables, return_exceptions=True)


def weighted_sum(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum the reward functions with their weights, skipping missing (NaN) entries.

    ``r_i = sum_f w_f * R[i, f]`` over the functions that scored sample ``i``. A sample that no
    function scored gets 0 and a warning, since it cannot carry a learning signal.

    Args:
        rewards: [N, F] rewards, NaN where a function returned ``None``.
        weights: [F] weight of each function.

    Returns:
        [N] combined rewards.
    """
    all_missing = torch.isnan(rewards).all(dim=1)  # [N]
    if all_missing.any():
        idx = all_missing.nonzero().flatten().tolist()
        warnings.warn(
            f"All reward functions returned None for samples {idx[:10]}; their reward is set to 0. "
            "Make sure at least one reward function applies to every sample.",
            stacklevel=2,
        )
    return torch.nansum(rewards * weights.unsqueeze(0), dim=1)  # [N]
