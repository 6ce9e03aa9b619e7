"""OpenReward / ORS environments (``openreward``) as posttrain environments.

An ORS server (the Open Reward Standard: HTTP plus server-sent events) serves an environment's
splits of tasks, its tools (name, description, JSON schema) and sessions: a session is one
episode of one task, whose prompt the server writes and whose tool calls return a reward and a
``finished`` flag with their output. The adapter uses the package's own synchronous client
(``openreward.EnvironmentsAPI``), one per class, shared by its instances.

- ``reset(task_index=None)`` closes the instance's previous session, opens one on task
  ``task_index`` of the split (a dataset column; ``openreward_tasks`` makes such a dataset), and
  returns the session's prompt. Without a ``task_index`` the episodes go through the split's tasks
  in order.
- Each ORS tool is a tool of the class, described by the server's JSON schema; a call returns the
  text of the output's blocks. After ``finished`` a call fails, telling the model the episode is
  over.
- ``get_reward()`` is the last reward the tools returned in the episode, ``None`` (not scored)
  when none returned one: the outcome reward of TRL's OpenReward integration. It also closes the
  episode's session.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

from posttrain.agents.hubs._common import (
    DEFAULT_TIMEOUT,
    check_reachable,
    check_tool_name,
    class_name,
    make_class,
    require,
    text_of,
    tool_method,
)

HUB = "OpenReward"
# Where the SDK reads the platform key (the catalog needs it; a local server usually does not).
API_KEY_ENV = "OPENREWARD_API_KEY"


def _sdk() -> Any:
    return require("openreward", hub=HUB, extra="openreward")


def _connect(environment: str, url: str | None, variant: str | None, api_key: str | None, timeout: float):
    """The SDK's environments API and environment handle, after checking the server answers.

    ``url`` given: a single-host ORS server (sessions and the task list at the same address).
    ``url`` ``None``: the OpenReward platform, as the SDK's ``OpenReward`` client finds it.
    """
    sdk = _sdk()
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
    if url is not None:
        check_reachable(url, timeout, HUB)
        api = sdk.EnvironmentsAPI(base_url=url, api_key=key, api_base_url=url)
    else:
        client = sdk.OpenReward(api_key=key or None)
        check_reachable(client.session_base_url, timeout, HUB)
        api = client.environments
    return api, api.get(environment, variant=variant, base_url=url)


def _prompt_text(blocks: Any) -> str:
    """The text of a session's prompt blocks.

    Raises:
        NotImplementedError: an image block (an environment's ``reset`` returns text, so an image
            in the task's prompt has no way to the model; a dataset row can carry it instead).
    """
    for block in blocks or []:
        if getattr(block, "type", None) == "image":
            raise NotImplementedError(
                "The OpenReward task's prompt holds an image, but an environment's reset() returns text only, "
                "so the image cannot reach the model. Put the image in the dataset row instead (an `image` column "
                "and an image block in its prompt), which tool-calling episodes of a vision-language model read."
            )
    return text_of(list(blocks or []))


class _Episodes:
    """One ORS session per episode: ``reset`` opens it, the tools call it, ``reward`` is the last
    reward a tool returned (``None`` while none has). No reward source of its own."""

    _api: Any = None
    _env: Any = None
    _split: str = "train"
    _num_tasks: int = 0
    _secrets: Mapping[str, Any] | None = None
    _counter: Any = None

    def __init__(self) -> None:
        self._session: Any = None
        self._rewards: list[float] = []
        self._finished = False

    @property
    def reward(self) -> float | None:
        """The last reward a tool returned in the episode (the outcome), ``None`` when none did."""
        return self._rewards[-1] if self._rewards else None

    @property
    def rewards(self) -> list[float]:
        """Every reward the tools returned in the episode, in call order."""
        return list(self._rewards)

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - the episode is over either way
                pass

    def reset(self, task_index: int | None = None, **kwargs: Any) -> str:
        """Open a session on task ``task_index`` of the split (the next task when ``None``)."""
        self._close()
        self._rewards, self._finished = [], False
        if task_index is None:
            task_index = next(type(self)._counter) % max(self._num_tasks, 1)
        session = self._env.session(split=self._split, index=int(task_index), secrets=self._secrets)
        session.__enter__()
        self._session = session
        return _prompt_text(session.get_prompt())

    def _call(self, name: str, arguments: dict[str, Any]) -> str:
        if self._session is None:
            raise RuntimeError("no episode is running: reset() opens one.")
        if self._finished:
            raise RuntimeError(
                "the episode is over (the environment said finished); answer without calling tools."
            )
        output = self._session.call_tool(name, dict(arguments))
        if output.reward is not None:
            self._rewards.append(float(output.reward))
        self._finished = bool(output.finished)
        return text_of(list(output.blocks or []))


class OpenRewardEnvironment(_Episodes):
    """Base of the classes ``openreward_environment`` makes: the episode's outcome is its reward."""

    def get_reward(self) -> float | None:
        """The last reward a tool returned in the episode; ``None`` when none did. The episode is
        scored once it is over, so its session closes here (freeing the server's resources now
        rather than at the next ``reset``)."""
        self._close()
        return self.reward


class OpenRewardSpecEnvironment(_Episodes):
    """Base of the classes ``OpenRewardSpec.environment_factory`` makes: as the reference's, the
    episode is scored by a reward function reading ``environments`` (``OpenRewardSpec.reward_funcs``),
    so the class is no reward source of its own."""


def openreward_environment(
    environment: str,
    *,
    url: str | None = None,
    split: str = "train",
    variant: str | None = None,
    name: str | None = None,
    api_key: str | None = None,
    secrets: Mapping[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> type:
    """An environment class for ``environment_factory`` backed by an ORS environment.

    Reads the environment's tools and the size of ``split`` now, so a server that does not
    answer fails here, before any trainer is built.

    Args:
        environment: the environment's name on the server (``"echoenvironment"``), or a catalog
            name (``"Eigent/SETA"``) with ``url=None``.
        url: a self-hosted ORS server (``"http://127.0.0.1:8000"``); ``None`` for the OpenReward
            platform (the SDK reads ``OPENREWARD_API_KEY``).
        split: the split whose tasks the episodes run.
        variant: the environment variant, where the server has several.
        name: the class name, which names the reward column; default the environment's name.
        api_key: the key for the platform (default ``OPENREWARD_API_KEY``).
        secrets: secrets the environment's sessions need.
        timeout: seconds to wait for a connection.

    Raises:
        ImportError: ``openreward`` is not installed (``pip install "posttrain[openreward]"``).
        ConnectionError: the server does not answer within ``timeout``; names host, port, timeout.
        ValueError: a tool name posttrain cannot expose.
    """
    api, env = _connect(environment, url, variant, api_key, timeout)
    return _episode_class(
        name or class_name(env.name, "OpenRewardEnvironment"),
        OpenRewardEnvironment,
        api,
        env,
        split,
        secrets,
        env.list_tools(format="openai"),
    )


def _episode_class(
    name: str,
    base: type,
    api: Any,
    env: Any,
    split: str,
    secrets: Mapping[str, Any] | None,
    specs: list[Mapping[str, Any]],
) -> type:
    """The environment class: ``base`` with one method per tool of ``specs`` (OpenAI format)."""
    tools: dict[str, Any] = {}
    for spec in specs:
        tool_name = spec.get("name")
        check_tool_name(tool_name, HUB, tools)
        tools[tool_name] = tool_method(
            tool_name, spec.get("description") or tool_name, spec.get("parameters"), _Episodes._call
        )
    namespace = {
        "_api": api,
        "_env": env,
        "_split": split,
        "_num_tasks": int(env.num_tasks(split)),
        "_secrets": dict(secrets) if secrets else None,
        "_counter": itertools.count(),
        **tools,
    }
    return make_class(name, base, namespace)


def openreward_tasks(
    environment: str,
    *,
    url: str | None = None,
    split: str = "train",
    num_tasks: int | None = None,
    variant: str | None = None,
    api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Any:
    """A ``train_dataset`` of the split's tasks: a ``task_index`` column, one row per task.

    Each row's ``task_index`` reaches ``reset``, so a GRPO group shares its task; the prompt is
    the one the server writes for the session, so there is no ``prompt`` column.

    Args:
        num_tasks: the first this many tasks (default all).
        environment, url, split, variant, api_key, timeout: as in ``openreward_environment``.

    Raises:
        ImportError, ConnectionError: as ``openreward_environment``.
        ValueError: ``num_tasks`` < 1.
    """
    from datasets import Dataset

    if num_tasks is not None and num_tasks < 1:
        raise ValueError(
            f"num_tasks={num_tasks!r} is invalid: it must be a positive integer or None (all tasks)."
        )
    _, env = _connect(environment, url, variant, api_key, timeout)
    available = int(env.num_tasks(split))
    count = available if num_tasks is None else min(num_tasks, available)
    return Dataset.from_dict({"task_index": list(range(count))})


def outcome_reward(environments: list[Any], **kwargs: Any) -> list[float | None]:
    """``OpenRewardSpec.reward_funcs``: each episode's last reward (its outcome), ``None`` for an
    episode no tool scored (not a scored zero). The episodes are over when they are scored, so
    their sessions close here."""
    rewards = []
    for env in environments:
        rewards.append(env.reward)
        close = getattr(env, "_close", None)
        if callable(close):
            close()
    return rewards


class OpenRewardSpec:
    """The reference's one-object wiring of an ORS environment into ``GRPOTrainer``.

    ``OpenRewardSpec(target, num_tasks=...)`` gives three things for the trainer's arguments of
    the same names: ``train_dataset`` (one row per task: an empty user message, to which the
    session's prompt is appended, the ``task_index`` that ``reset`` opens, and the task's own
    fields as columns), ``environment_factory`` (a class, one ORS session per episode) and
    ``reward_funcs`` (the episode's last reward, ``outcome_reward``, logged as
    ``rewards/outcome_reward/mean``). ``openreward_environment`` and ``openreward_tasks`` are
    posttrain's own, finer-grained API over the same adapter.

    Args:
        target: a server URL (it contains ``://``: ``"http://127.0.0.1:8000"``) or an OpenReward
            catalog name (``"Eigent/SETA"``, the SDK reads ``OPENREWARD_API_KEY``).
        num_tasks: train on the split's first this many tasks (default all); not with ``indices``.
        split: the split whose tasks the episodes run.
        indices: train on exactly these tasks of the split; not with ``num_tasks``.
        api_key: the platform key (default ``OPENREWARD_API_KEY``); a catalog target forwards it to
            the sessions as the ``api_key`` secret unless ``secrets`` is given.
        secrets: secrets the environment's sessions need.
        env_name: the environment's name on a server; default the server's first environment.
        include_metadata: add each task's fields as dataset columns (reward functions read them).
        discover_task_tools: list the tools of a session on a task (task-specific tools included)
            rather than the environment's shared tools only.
        task_tools_discovery_index: the task whose session lists the tools (default: each of
            ``indices``, merged by name, or task 0).
        variant: the environment variant, where the server has several.
        timeout: seconds to wait for a connection.

    Raises:
        ValueError: both ``num_tasks`` and ``indices``, ``num_tasks`` < 1, an index outside the
            split, or a task-tool discovery index outside it.
        ImportError, ConnectionError: as ``openreward_environment`` (when a property is first read).
    """

    def __init__(
        self,
        target: str,
        *,
        num_tasks: int | None = None,
        split: str = "train",
        indices: list[int] | None = None,
        api_key: str | None = None,
        secrets: Mapping[str, str] | None = None,
        env_name: str | None = None,
        include_metadata: bool = True,
        discover_task_tools: bool = True,
        task_tools_discovery_index: int | None = None,
        variant: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if num_tasks is not None and indices is not None:
            raise ValueError(
                "OpenRewardSpec got both num_tasks and indices; give num_tasks (the first tasks) or indices "
                "(exactly those tasks), not both."
            )
        if num_tasks is not None and (not isinstance(num_tasks, int) or num_tasks < 1):
            raise ValueError(
                f"num_tasks={num_tasks!r} is invalid: it must be a positive integer or None (all tasks)."
            )
        if indices is not None and (not indices or any(not isinstance(i, int) or i < 0 for i in indices)):
            raise ValueError(
                f"indices={indices!r} is invalid: give a non-empty list of task indices (integers >= 0)."
            )
        self.target = target
        self.is_url = "://" in target
        self.num_tasks, self.split, self.indices = (
            num_tasks,
            split,
            None if indices is None else list(indices),
        )
        self.api_key, self.env_name, self.variant, self.timeout = api_key, env_name, variant, timeout
        self.include_metadata = include_metadata
        self.discover_task_tools = discover_task_tools
        self.task_tools_discovery_index = task_tools_discovery_index
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        if secrets is not None or self.is_url:
            self.secrets = dict(secrets) if secrets else None
        else:  # the catalog's environments conventionally read the platform key as a secret
            self.secrets = {"api_key": key} if key else None
        self._handles: tuple[Any, Any] | None = None
        self._dataset: Any = None
        self._factory: type | None = None

    def _connected(self) -> tuple[Any, Any]:
        """The SDK's environments API and the environment handle (connected once)."""
        if self._handles is None:
            if self.is_url:
                name = self.env_name or _first_environment(self.target, self.timeout)
                self._handles = _connect(name, self.target, self.variant, self.api_key, self.timeout)
            else:
                self._handles = _connect(self.target, None, self.variant, self.api_key, self.timeout)
        return self._handles

    def _task_indices(self, available: int) -> list[int]:
        if self.indices is not None:
            outside = [i for i in self.indices if i >= available]
            if outside:
                raise ValueError(
                    f"indices {outside} are outside split {self.split!r}, which has {available} task(s) "
                    f"(0 to {available - 1})."
                )
            return list(self.indices)
        return list(range(available if self.num_tasks is None else min(self.num_tasks, available)))

    @property
    def train_dataset(self) -> Any:
        """One row per task: ``prompt`` (an empty user message), ``task_index`` and the task's fields."""
        if self._dataset is None:
            from datasets import Dataset

            _, env = self._connected()
            indices = self._task_indices(int(env.num_tasks(self.split)))
            columns: dict[str, list[Any]] = {
                "prompt": [[{"role": "user", "content": ""}] for _ in indices],
                "task_index": indices,
            }
            if self.include_metadata and indices:
                specs = [_task_spec(env.get_task(self.split, i)) for i in indices]
                for key in sorted({k for spec in specs for k in spec} - set(columns)):
                    columns[key] = [spec.get(key) for spec in specs]
            self._dataset = Dataset.from_dict(columns)
        return self._dataset

    @property
    def environment_factory(self) -> type:
        """The environment class for ``environment_factory``: one ORS session per episode."""
        if self._factory is None:
            api, env = self._connected()
            self._factory = _episode_class(
                class_name(env.name, "OpenRewardEnvironment"),
                OpenRewardSpecEnvironment,
                api,
                env,
                self.split,
                self.secrets,
                self._tool_specs(env),
            )
        return self._factory

    @property
    def reward_funcs(self) -> Any:
        """``outcome_reward``: each episode's last reward, ``None`` when no tool scored it."""
        return outcome_reward

    def _tool_specs(self, env: Any) -> list[Mapping[str, Any]]:
        """The tools an episode may call: a session's on the probe tasks (merged by name), or the
        environment's shared tools."""
        shared = list(env.list_tools(format="openai"))
        if not self.discover_task_tools:
            return shared
        available = int(env.num_tasks(self.split))
        if self.task_tools_discovery_index is not None:
            probes = [self.task_tools_discovery_index]
        else:
            probes = sorted(set(self.indices)) if self.indices is not None else [0]
        outside = [i for i in probes if not 0 <= i < available]
        if outside:
            raise ValueError(
                f"task_tools_discovery_index / indices {outside} are outside split {self.split!r}, which has "
                f"{available} task(s); give an index below {available}, or discover_task_tools=False."
            )
        merged: dict[str, Mapping[str, Any]] = {}
        for index in probes:
            with env.session(split=self.split, index=index, secrets=self.secrets) as session:
                for spec in session.list_tools(format="openai"):
                    merged.setdefault(spec.get("name"), spec)
        return list(merged.values())


def _task_spec(task: Any) -> dict[str, Any]:
    """A task's own fields (the SDK's ``Task.task_spec``, or a dict as it is)."""
    spec = task if isinstance(task, Mapping) else getattr(task, "task_spec", None)
    return dict(spec) if isinstance(spec, Mapping) else {}


def _first_environment(url: str, timeout: float) -> str:
    """The name of the first environment a single-host ORS server lists (``GET /list_environments``)."""
    import json
    import urllib.request

    check_reachable(url, timeout, HUB)
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/list_environments", timeout=timeout) as response:
            names = json.loads(response.read())
    except Exception as exc:  # noqa: BLE001 - any failure here means: name it yourself
        raise ConnectionError(
            f"The ORS server at {url} did not list its environments ({type(exc).__name__}: {exc}); pass "
            "env_name= with the environment's name on the server."
        ) from exc
    if not names:
        raise ValueError(f"The ORS server at {url} serves no environment.")
    return str(names[0])
