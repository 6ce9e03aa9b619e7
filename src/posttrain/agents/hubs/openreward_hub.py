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


class OpenRewardEnvironment:
    """Base of the classes ``openreward_environment`` makes: one ORS session per episode."""

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

    def get_reward(self) -> float | None:
        """The last reward a tool returned in the episode; ``None`` when none did. The episode is
        scored once it is over, so its session closes here (freeing the server's resources now
        rather than at the next ``reset``)."""
        self._close()
        return self._rewards[-1] if self._rewards else None


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
    num_tasks = int(env.num_tasks(split))
    tools: dict[str, Any] = {}
    for spec in env.list_tools(format="openai"):
        tool_name = spec.get("name")
        check_tool_name(tool_name, HUB, tools)
        tools[tool_name] = tool_method(
            tool_name,
            spec.get("description") or tool_name,
            spec.get("parameters"),
            OpenRewardEnvironment._call,
        )
    namespace = {
        "_api": api,
        "_env": env,
        "_split": split,
        "_num_tasks": num_tasks,
        "_secrets": dict(secrets) if secrets else None,
        "_counter": itertools.count(),
        **tools,
    }
    return make_class(name or class_name(env.name, "OpenRewardEnvironment"), OpenRewardEnvironment, namespace)


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
