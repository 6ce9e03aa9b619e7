"""OpenEnv environments (``openenv-core``) as posttrain environments.

An OpenEnv server hosts a Gymnasium-style environment: ``reset`` starts an episode and returns
an observation, ``step(action)`` applies one action and returns an observation with a reward and
a ``done`` flag; the server describes its action model at ``GET /schema``. Each instance of the
class ``openenv_environment`` returns holds one WebSocket session of the package's own client
(``GenericEnvClient``, used through its synchronous wrapper), so the server keeps one
environment per rollout slot.

- ``reset(**row)`` resets the session (the row's columns go to the server's ``reset``, which
  keeps those its signature names, such as ``seed``) and returns the first observation's text.
- The action is one tool: its arguments are the action model's fields (its JSON schema as the
  server gives it, less the ``metadata`` field every OpenEnv action has); its name is the action
  class's name without ``Action``, in snake case (``GuessAction`` -> ``guess``). A call steps the
  environment and returns the observation's text. After ``done`` a call fails, telling the model
  the episode is over.
- ``get_reward()`` is the last reward the server sent in the episode (``reward="sum"``: their
  sum); ``None`` (not scored) when it sent none.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from posttrain.agents.hubs._common import (
    DEFAULT_TIMEOUT,
    check_reachable,
    check_tool_name,
    class_name,
    make_class,
    require,
    tool_method,
    unreachable_error,
)

HUB = "OpenEnv"
# Fields of every OpenEnv action and observation that are not the environment's own.
ACTION_BASE_FIELDS = ("metadata",)
OBSERVATION_BASE_FIELDS = ("done", "reward", "metadata")
REDUCTIONS = ("last", "sum")


def _client_module() -> Any:
    return require("openenv.core", hub=HUB, extra="openenv")


def _get_json(base_url: str, path: str, timeout: float) -> Any:
    """``GET base_url + path`` as JSON.

    Raises:
        ConnectionError: no answer within ``timeout``.
        RuntimeError: an answer that is not an OpenEnv server's.
    """
    url = base_url.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a user-given server URL
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(
            f"{base_url} does not look like an OpenEnv server: GET {path} answered HTTP {exc.code}."
        ) from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise unreachable_error(HUB, base_url, timeout, exc) from exc
    except json.JSONDecodeError as exc:
        raise RuntimeError(
            f"{base_url} does not look like an OpenEnv server: GET {path} is not JSON."
        ) from exc


def default_tool_name(action_schema: dict[str, Any]) -> str:
    """``GuessAction`` -> ``guess``; ``act`` when the schema has no usable title."""
    title = re.sub(r"Action$", "", str(action_schema.get("title") or ""))
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", title).lower()
    snake = re.sub(r"[^a-z0-9_]", "_", snake).strip("_")
    return snake if snake and snake not in ("reset", "get_reward") and not snake[0].isdigit() else "act"


def observation_text(observation: Any) -> str:
    """The text of an observation: its one string field as it is, else its fields as JSON (the
    ``done``/``reward``/``metadata`` fields every OpenEnv observation has left out)."""
    if isinstance(observation, str):
        return observation
    if not isinstance(observation, dict):
        return str(observation)
    own = {k: v for k, v in observation.items() if k not in OBSERVATION_BASE_FIELDS}
    if len(own) == 1 and isinstance(next(iter(own.values())), str):
        return next(iter(own.values()))
    return json.dumps(own, ensure_ascii=False, default=str)


class OpenEnvEnvironment:
    """Base of the classes ``openenv_environment`` makes: one OpenEnv session per instance."""

    _base_url: str = ""
    _timeout: float = DEFAULT_TIMEOUT
    _message_timeout: float = 60.0
    _reduction: str = "last"
    _observation_text: Callable[[Any], str] = staticmethod(observation_text)

    def __init__(self) -> None:
        core = _client_module()
        client = core.GenericEnvClient(
            base_url=self._base_url, connect_timeout_s=self._timeout, message_timeout_s=self._message_timeout
        )
        self._client = client.sync()
        self._rewards: list[float] = []
        self._done = False
        self._connect()

    def _connect(self) -> None:
        try:
            self._client.connect()
        except (ConnectionError, OSError, TimeoutError) as exc:
            raise unreachable_error(HUB, self._base_url, self._timeout, exc) from exc

    def _reconnect(self) -> None:
        try:
            self._client.disconnect()
        except Exception:  # noqa: BLE001 - the old connection is already gone
            pass
        self._connect()

    def reset(self, **kwargs: Any) -> str:
        """Start an episode on the server; the row's columns are offered to its ``reset``."""
        self._rewards, self._done = [], False
        try:
            result = self._client.reset(**kwargs)
        except Exception as exc:  # a dropped session (closed while idle): open a new one, once
            if isinstance(exc, RuntimeError) and str(exc).startswith("Server error"):
                raise  # the server answered: not a connection problem
            self._reconnect()
            result = self._client.reset(**kwargs)
        self._record(result)
        return self._observation_text(result.observation)

    def _record(self, result: Any) -> None:
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        self._done = bool(result.done)

    def _step(self, name: str, arguments: dict[str, Any]) -> str:
        if self._done:
            raise RuntimeError(
                "the episode is over (the environment reported done); answer without calling more tools."
            )
        result = self._client.step(dict(arguments))
        self._record(result)
        return self._observation_text(result.observation)

    def get_reward(self) -> float | None:
        """The episode's reward: the last one the server sent (or their sum); ``None`` if none."""
        if not self._rewards:
            return None
        return self._rewards[-1] if self._reduction == "last" else float(sum(self._rewards))


def openenv_environment(
    base_url: str,
    *,
    name: str | None = None,
    tool_name: str | None = None,
    tool_description: str | None = None,
    reward: str = "last",
    observation_to_text: Callable[[Any], str] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    message_timeout: float = 60.0,
) -> type:
    """An environment class for ``environment_factory`` backed by an OpenEnv server.

    Reads the server's action schema (``GET /schema``) and name (``GET /metadata``) now, so a
    server that does not answer fails here, before any trainer is built.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"`` (``ws://`` works too).
        name: the class name, which names the reward column (``rewards/{name}/mean``); default
            the name the server reports (``GET /metadata``).
        tool_name: the name of the action tool; default the action class's name without
            ``Action`` in snake case (``act`` when it has none).
        tool_description: what the model reads about the tool; default the action's docstring.
        reward: ``"last"`` (the last reward of the episode) or ``"sum"`` (their sum).
        observation_to_text: turns an observation (a dict of its fields) into what the model
            reads; default its one string field, else JSON.
        timeout: seconds to wait for a connection (and for the schema).
        message_timeout: seconds to wait for the answer to a reset or a step.

    Raises:
        ImportError: ``openenv-core`` is not installed (``pip install "posttrain[openenv]"``).
        ConnectionError: the server does not answer within ``timeout``; names host, port, timeout.
        RuntimeError: the URL answers but not as an OpenEnv server.
        ValueError: ``reward`` is neither ``"last"`` nor ``"sum"``, or the tool name is unusable.
    """
    _client_module()
    if reward not in REDUCTIONS:
        raise ValueError(f"reward={reward!r} is invalid: it must be one of {list(REDUCTIONS)}.")
    check_reachable(base_url, timeout, HUB)
    action = (_get_json(base_url, "/schema", timeout) or {}).get("action") or {}
    metadata = _get_json(base_url, "/metadata", timeout) or {}
    parameters = {
        **{k: v for k, v in action.items() if k not in ("title", "description")},
        "properties": {
            k: v for k, v in (action.get("properties") or {}).items() if k not in ACTION_BASE_FIELDS
        },
    }
    parameters["required"] = [r for r in action.get("required") or [] if r not in ACTION_BASE_FIELDS]
    parameters.pop("additionalProperties", None)
    tool = tool_name or default_tool_name(action)
    env_name = str(metadata.get("name") or "")
    description = (
        tool_description
        or action.get("description")
        or f"Take one action in the {env_name or HUB} environment."
    )
    check_tool_name(tool, HUB, {})
    namespace: dict[str, Any] = {
        "_base_url": base_url,
        "_timeout": float(timeout),
        "_message_timeout": float(message_timeout),
        "_reduction": reward,
        tool: tool_method(tool, description, parameters, OpenEnvEnvironment._step),
    }
    if observation_to_text is not None:
        namespace["_observation_text"] = staticmethod(observation_to_text)
    return make_class(name or class_name(env_name, "OpenEnvEnvironment"), OpenEnvEnvironment, namespace)
