"""Environments: stateful objects whose public methods are the model's tools.

An environment class has two reserved methods. ``reset(**kwargs)`` (required) starts an
episode; it receives the row's dataset columns (all but ``prompt`` and ``environment``) and
returns ``None`` or a string that becomes (or is appended to) the prompt. ``get_reward()``
(optional, sync or ``async def``) scores the episode from the environment's own state. Every
other public method defined by the class is a tool.

``EnvironmentPool`` keeps one instance per rollout slot and per environment name, created on
first use and reused across steps, so an expensive ``__init__`` is paid once; ``reset`` starts
each new episode. With a dict ``environment_factory`` the row's ``environment`` column picks
the environment.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from posttrain.agents.tools import Tool, is_async_callable, run_awaitables, tool_schema

# Methods of an environment class that are never exposed as tools.
RESERVED_METHODS = ("reset", "get_reward")
# The row columns the trainer consumes; they are not forwarded to ``reset``.
ROUTING_COLUMN = "environment"
PROMPT_COLUMN = "prompt"

Factory = Callable[[], object]


def _factory_label(factory: Any) -> str:
    """A factory's name for messages."""
    return str(getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory))


def _check_factory(factory: Any, name: str | None = None) -> None:
    """Raise when ``factory`` cannot make environments.

    Raises:
        TypeError: not callable, or a class without a callable ``reset``.
    """
    where = f"environment_factory[{name!r}]" if name is not None else "environment_factory"
    if not callable(factory):
        raise TypeError(
            f"{where} must be a class or a callable returning an environment; got {type(factory).__name__} "
            f"({factory!r})."
        )
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise TypeError(
            f"{where} is the class {factory.__qualname__}, which has no reset() method; an environment "
            "class needs `def reset(self, **kwargs) -> str | None` to start each episode."
        )


def _check_factories(factory: Any) -> None:
    """Validate a single factory or a dict of named factories."""
    if not isinstance(factory, Mapping):
        _check_factory(factory)
        return
    if not factory:
        raise ValueError("environment_factory is an empty dict; give at least one {name: factory} entry.")
    bad_keys = [k for k in factory if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(
            f"environment_factory dict keys must be strings (the names the 'environment' column uses); got "
            f"{bad_keys!r}."
        )
    for name, f in factory.items():
        _check_factory(f, name)


def routing_error(names: Sequence[str], detail: str) -> ValueError:
    """The error of a row that does not say which environment it belongs to."""
    return ValueError(
        f"environment_factory is a dict of {len(names)} environments; each row needs an "
        f"'{ROUTING_COLUMN}' column naming one of {sorted(names)}. {detail}"
    )


class EnvironmentPool:
    """Environment instances for the rollout rows, reused across steps.

    Args:
        factory: a class (or callable) making one environment, or a dict from environment names
            to such factories; rows then pick one through their ``environment`` column.

    Attributes:
        reset_texts: per row of the last ``instances`` call, what ``reset`` returned.

    Raises:
        TypeError: a factory is not callable, a dict key is not a string, or a class has no
            ``reset``.
        ValueError: the dict is empty.
    """

    def __init__(self, factory: Factory | Mapping[str, Factory]) -> None:
        _check_factories(factory)
        self.factory = factory
        self.is_multi = isinstance(factory, Mapping)
        self.names: list[str] = list(factory) if self.is_multi else []
        self._cache: dict[tuple[int, str | None], object] = {}
        self.reset_texts: list[str | None] = []

    def route(self, row: Mapping[str, Any], index: int = 0) -> str | None:
        """The environment name of a row (``None`` for a single factory).

        Raises:
            ValueError: a dict factory and the row has no ``environment`` or an unknown one.
        """
        if not self.is_multi:
            return None
        if ROUTING_COLUMN not in row or row[ROUTING_COLUMN] is None:
            raise routing_error(self.names, f"Row {index} has none.")
        name = row[ROUTING_COLUMN]
        if name not in self.factory:
            raise ValueError(
                f"Row {index} has environment={name!r}, which is not one of the environment_factory names "
                f"{sorted(self.names)}."
            )
        return name

    def _instance(self, slot: int, name: str | None) -> object:
        """The environment of a slot, created on first use."""
        key = (slot, name)
        if key not in self._cache:
            factory = self.factory[name] if name is not None else self.factory
            env = factory()
            if not callable(getattr(env, "reset", None)):
                raise TypeError(
                    f"environment_factory {_factory_label(factory)} returned a {type(env).__name__}, which has "
                    "no reset() method; an environment needs `def reset(self, **kwargs) -> str | None`."
                )
            self._cache[key] = env
        return self._cache[key]

    def instances(self, rows: Sequence[Mapping[str, Any]]) -> list[object]:
        """One environment per row, reset for a new episode.

        Row ``i`` gets the instance of slot ``i`` for its environment (created on first use,
        then reused), and ``reset`` is called with the row's columns except ``prompt`` and
        ``environment``. What each ``reset`` returned is kept in ``reset_texts``.

        Raises:
            ValueError: a row cannot be routed (dict factory).
            TypeError: ``reset`` returned something other than ``None`` or a string.
            RuntimeError: ``reset`` raised; the message names the class and the row.
        """
        names = [self.route(row, i) for i, row in enumerate(rows)]
        envs = [self._instance(i, name) for i, name in enumerate(names)]
        self.reset_texts = reset_all(envs, [reset_kwargs(row) for row in rows])
        return envs

    def prototypes(self) -> list[object]:
        """One environment per dict entry (or the single one): slot 0's instance, created now and
        reused by the first rollout row. Its class and tools stand for the entry's."""
        names: list[str | None] = list(self.names) if self.is_multi else [None]
        return [self._instance(0, name) for name in names]

    def __len__(self) -> int:
        """How many instances exist (slots x environments used so far)."""
        return len(self._cache)


def reset_kwargs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``reset`` receives: every column but ``prompt`` and ``environment``."""
    return {k: v for k, v in row.items() if k not in (PROMPT_COLUMN, ROUTING_COLUMN)}


def _accepted_kwargs(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` cut to the parameters ``fn`` names, unless it takes ``**kwargs``."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in named}


def _hook_error(env: object, hook: str, row: int, exc: BaseException) -> RuntimeError:
    """The error of an environment hook that raised."""
    return RuntimeError(f"{type(env).__name__}.{hook}() raised on row {row}: {type(exc).__name__}: {exc}")


def _call_hooks(
    envs: Sequence[object], hook: str, kwargs: Sequence[dict[str, Any]], rows: Sequence[int] | None = None
) -> list[Any]:
    """Call ``env.<hook>(**kw)`` on each; await the async ones together.

    Args:
        envs: the environments.
        hook: the method name.
        kwargs: per environment, its keyword arguments.
        rows: per environment, its row index for error messages (default: its position).

    Raises:
        RuntimeError: a hook raised; the message names the class, the hook and the row.
    """
    rows = list(range(len(envs))) if rows is None else rows
    values: list[Any] = []
    pending: list[int] = []
    for i, (env, kw) in enumerate(zip(envs, kwargs, strict=True)):
        try:
            out = getattr(env, hook)(**kw)
        except Exception as exc:
            raise _hook_error(env, hook, rows[i], exc) from exc
        if inspect.isawaitable(out):
            pending.append(i)
        values.append(out)
    for i, value in zip(pending, run_awaitables([values[i] for i in pending]), strict=True):
        if isinstance(value, BaseException):
            raise _hook_error(envs[i], hook, rows[i], value) from value
        values[i] = value
    return values


def reset_all(envs: Sequence[object], kwargs: Sequence[dict[str, Any]]) -> list[str | None]:
    """Reset every environment (``async def reset`` ones together) and check what they return.

    ``reset`` receives only the columns it names unless it takes ``**kwargs``.

    Raises:
        RuntimeError: a ``reset`` raised.
        TypeError: a ``reset`` returned something other than ``None`` or a string.
    """
    accepted = [_accepted_kwargs(env.reset, kw) for env, kw in zip(envs, kwargs, strict=True)]
    texts = _call_hooks(envs, "reset", accepted)
    for i, (env, text) in enumerate(zip(envs, texts, strict=True)):
        if text is not None and not isinstance(text, str):
            raise TypeError(
                f"{type(env).__name__}.reset() returned {type(text).__name__} on row {i}; it must return None "
                "or a string (the prompt, or text appended to the row's prompt)."
            )
    return texts


def apply_reset_prompt(
    prompt: str | list[dict[str, Any]] | None, text: str | None
) -> str | list[dict[str, Any]]:
    """The prompt of an episode: the row's prompt combined with what ``reset`` returned.

    - ``text`` is ``None``: the prompt unchanged.
    - ``prompt`` is ``None`` (the environment owns the data): one user message with ``text``.
    - a conversational prompt: ``text`` appended to the last user message (after a blank line;
      as a new text block when that content is a list of blocks), or a new user message when
      there is none. The row's messages are copied, never changed.
    - a standard (string) prompt: ``prompt + "\\n\\n" + text``.

    Raises:
        ValueError: neither the row nor ``reset`` gives a prompt.
    """
    if text is None:
        if prompt is None:
            raise ValueError(
                "The row has no 'prompt' and the environment's reset() returned None; return the task "
                "text from reset(), or give the dataset a 'prompt' column."
            )
        return prompt
    if prompt is None:
        return [{"role": "user", "content": text}]
    if isinstance(prompt, str):
        return f"{prompt}\n\n{text}" if prompt else text
    return _append_to_last_user(list(prompt), text)


def _append_to_last_user(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``messages`` (a copy) with ``text`` added to the last user message."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "user":
            message = dict(messages[i])
            content = message.get("content")
            if isinstance(content, list):
                message["content"] = [*content, {"type": "text", "text": text}]
            else:
                message["content"] = f"{content}\n\n{text}" if content else text
            messages[i] = message
            return messages
    return [*messages, {"role": "user", "content": text}]


# ---------------------------------------------------------------------------------------------
# Tools and rewards of environments
# ---------------------------------------------------------------------------------------------


def _tool_method_names(cls: type) -> list[str]:
    """Public methods ``cls`` (or a base) defines, but the reserved ones; definition order."""
    names: list[str] = []
    seen: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, attr in vars(klass).items():
            if name in seen:
                continue
            seen.add(name)
            if name.startswith("_") or name in RESERVED_METHODS:
                continue
            if inspect.isfunction(getattr(attr, "__func__", attr)):  # def, @staticmethod, @classmethod
                names.append(name)
    return names


@functools.lru_cache(maxsize=256)
def _class_tool_schemas(cls: type) -> tuple[tuple[str, dict[str, Any]], ...]:
    """The schema of each tool method of a class (computed once per class)."""
    return tuple((name, tool_schema(getattr(cls, name))) for name in _tool_method_names(cls))


def environment_tools(env: object) -> dict[str, Tool]:
    """The environment's public methods as tools, bound to ``env``.

    Exposed: functions defined with ``def`` in the class (or its bases; plain, ``@staticmethod``
    or ``@classmethod``) whose names do not start with ``_``, except ``reset`` and
    ``get_reward``. Properties, other class attributes (even callable ones, like
    ``helper = staticmethod(len)``) and attributes set on the instance are not tools. The schemas describe the bound methods (no ``self``).

    Raises:
        ValueError: a method lacks type hints or a Google-style docstring.
    """
    tools: dict[str, Tool] = {}
    for name, schema in _class_tool_schemas(type(env)):
        bound = getattr(env, name)
        tools[name] = Tool(name, bound, schema, is_async_callable(bound))
    return tools


def _reward_value(env: object, row: int, value: Any) -> float:
    """One ``get_reward`` result as a float (``None`` -> NaN).

    Raises:
        TypeError: not a number.
    """
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"{type(env).__name__}.get_reward() returned {value!r} ({type(value).__name__}) on row {row}; it must "
        "return a float (or None when it does not score the episode)."
    )


def reward_column_names(classes: Sequence[type]) -> list[str]:
    """Column names for environment classes: the class name, module-qualified if two share it."""
    short = [c.__name__ for c in classes]
    return [
        f"{c.__module__}.{c.__qualname__}" if short.count(c.__name__) > 1 else c.__name__ for c in classes
    ]


def environment_rewards(
    envs: Sequence[object], classes: Sequence[type] | None = None
) -> tuple[list[str], torch.Tensor]:
    """Call ``get_reward`` on every environment that has it.

    Each distinct class defining ``get_reward`` is one reward column named after the class, in
    first-seen order (or the order of ``classes`` when given, so that columns stay the same
    from batch to batch); a row's reward goes in its class's column, the other columns are NaN
    for it (so with a dict factory every environment is its own reward function, and rows of
    other environments count as "not scored"). Async ``get_reward`` calls run together.

    Args:
        envs: one environment per row.
        classes: the fixed column classes; every row's class that defines ``get_reward`` must
            be among them.

    Returns:
        ``(names, rewards)``: the column names and an [n, k] float32 tensor.

    Raises:
        RuntimeError: a ``get_reward`` raised (the message names the class and the row).
        TypeError: a ``get_reward`` returned something other than a number or ``None``.
    """
    scored = [i for i, env in enumerate(envs) if callable(getattr(env, "get_reward", None))]
    if classes is None:
        classes = list(dict.fromkeys(type(envs[i]) for i in scored))
    unknown = {type(envs[i]).__name__ for i in scored if type(envs[i]) not in classes}
    if unknown:
        raise TypeError(
            f"Environments of class {sorted(unknown)} appeared after training started; an environment factory "
            "must always return instances of the same class."
        )
    rewards = torch.full((len(envs), len(classes)), math.nan, dtype=torch.float32)  # [n, k]
    values = _call_hooks([envs[i] for i in scored], "get_reward", [{} for _ in scored], scored)
    for i, value in zip(scored, values, strict=True):
        rewards[i, classes.index(type(envs[i]))] = _reward_value(envs[i], i, value)
    return reward_column_names(classes), rewards


# ---------------------------------------------------------------------------------------------
# Up-front checks
# ---------------------------------------------------------------------------------------------


def _dataset_columns(dataset: Any) -> list[str] | None:
    """The column names of a dataset, a list of row dicts, or ``None`` when unknown."""
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, dict):  # a DatasetDict: the columns of its first split
        columns = next(iter(columns.values()), None)
    if columns is not None:
        return list(columns)
    if isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], Mapping):
        return list(dataset[0])
    return None


def _environment_values(dataset: Any) -> set[Any] | None:
    """The distinct ``environment`` values of a map-style dataset or list (``None``: a stream)."""
    if hasattr(dataset, "unique") and hasattr(dataset, "__len__"):
        return set(dataset.unique(ROUTING_COLUMN))
    if isinstance(dataset, Sequence):
        return {row.get(ROUTING_COLUMN) for row in dataset}
    return None


def check_environment_dataset(
    factory: Factory | Mapping[str, Factory], train_dataset: Any | None, max_steps: int | None
) -> None:
    """Check, before training, that the environments can get their episodes.

    Raises:
        ValueError: no dataset and no positive ``max_steps``; a dict factory and no dataset to
            route its rows; or a dict factory and a dataset without an ``environment`` column, or
            with names the dict does not have.
    """
    _check_factories(factory)
    if train_dataset is None:
        if isinstance(factory, Mapping):
            raise routing_error(
                list(factory),
                "Without a train_dataset no row says which environment it belongs to: pass a train_dataset "
                f"with an '{ROUTING_COLUMN}' column, or a single environment class.",
            )
        if max_steps is None or max_steps <= 0:
            raise ValueError(
                "environment_factory without train_dataset: the environment owns the data, so set max_steps "
                f"(a positive number of training steps); got max_steps={max_steps!r}."
            )
        return
    if not isinstance(factory, Mapping):
        return
    names = list(factory)
    columns = _dataset_columns(train_dataset)
    if columns is not None and ROUTING_COLUMN not in columns:
        raise routing_error(names, f"The train_dataset has columns {columns}.")
    values = _environment_values(train_dataset) if columns is not None else None
    unknown = sorted(map(repr, (values or set()) - set(names)))
    if unknown:
        raise ValueError(
            f"The train_dataset's '{ROUTING_COLUMN}' column has values {', '.join(unknown)} that are not "
            f"environment_factory names {sorted(names)}."
        )
