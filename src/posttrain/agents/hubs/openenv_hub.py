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

An MCP environment (the server's action is OpenEnv's ``CallToolAction``: an ``MCPEnvironment``
whose tools are FastMCP tools) is adapted through openenv-core's ``MCPToolClient`` instead:

- Its tools are listed once, when the class is made (a ``list_tools`` action); each becomes a tool
  of the class with the tool's own name, description and JSON input schema.
- A call steps the session with a ``CallToolAction``, so the server's ``step`` runs and its reward
  and ``done`` count as above; it returns the tool's text content (with image content: text and
  image blocks). A tool error reaches the model as the tool's failure.
- ``reset`` returns the reset observation's text, or ``None`` when it has no fields of its own.
"""

from __future__ import annotations

import base64
import functools
import io
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
# The ``type`` discriminators of OpenEnv's MCP actions (a server whose action is one hosts an MCP environment).
MCP_ACTION_TYPES = ("call_tool", "list_tools")


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
        self._client = self._new_client().sync()
        self._rewards: list[float] = []
        self._done = False
        self._connect()

    def _new_client(self) -> Any:
        """The package's asynchronous client for this server (its synchronous wrapper is used)."""
        return _client_module().GenericEnvClient(
            base_url=self._base_url, connect_timeout_s=self._timeout, message_timeout_s=self._message_timeout
        )

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

    def reset(self, **kwargs: Any) -> str | None:
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
        return self._reset_text(result)

    def _reset_text(self, result: Any) -> str | None:
        return self._observation_text(result.observation)

    def _record(self, result: Any) -> None:
        if result.reward is not None:
            self._rewards.append(float(result.reward))
        self._done = bool(result.done)

    def _check_running(self) -> None:
        if self._done:
            raise RuntimeError(
                "the episode is over (the environment reported done); answer without calling more tools."
            )

    def _step(self, name: str, arguments: dict[str, Any]) -> str:
        self._check_running()
        result = self._client.step(dict(arguments))
        self._record(result)
        return self._observation_text(result.observation)

    def get_reward(self) -> float | None:
        """The episode's reward: the last one the server sent (or their sum); ``None`` if none."""
        if not self._rewards:
            return None
        return self._rewards[-1] if self._reduction == "last" else float(sum(self._rewards))


def is_mcp_action(action_schema: dict[str, Any]) -> bool:
    """Whether a server's action schema is one of OpenEnv's MCP actions (``CallToolAction`` /
    ``ListToolsAction``, told by their ``type`` discriminator), i.e. the server hosts an MCP
    environment."""
    kind = ((action_schema.get("properties") or {}).get("type") or {}).get("const")
    return kind in MCP_ACTION_TYPES


def _decode_image(block: dict[str, Any]) -> Any:
    """An MCP image content block (base64 ``data``) as a PIL image."""
    from PIL import Image

    image = Image.open(io.BytesIO(base64.b64decode(block.get("data") or "")))
    image.load()
    return image


def mcp_tool_output(result: Any) -> str | list[dict[str, Any]]:
    """What the model reads of an MCP tool's result (a ``CallToolResult`` as the server sent it).

    Its text content blocks joined by blank lines; when it holds images, a list of posttrain content
    blocks instead (``{"type": "text", ...}`` and ``{"type": "image", "image": <PIL image>}``). Other
    blocks (audio, resources) are given as their JSON. A result without content blocks is its
    ``data`` (text as it is, anything else as JSON).

    Raises:
        RuntimeError: the result is an error (``is_error``); the message is its text.
    """
    if not isinstance(result, dict) or not isinstance(result.get("content"), list):
        data = result.get("data") if isinstance(result, dict) and "data" in result else result
        return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, default=str)
    blocks: list[dict[str, Any]] = []
    for block in result["content"]:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            blocks.append({"type": "text", "text": str(block.get("text") or "")})
        elif kind == "image":
            blocks.append({"type": "image", "image": _decode_image(block)})
        else:
            blocks.append({"type": "text", "text": json.dumps(block, ensure_ascii=False, default=str)})
    text = "\n\n".join(b["text"] for b in blocks if b["type"] == "text")
    if result.get("is_error"):
        raise RuntimeError(text or "the tool reported an error.")
    return blocks if any(b["type"] == "image" for b in blocks) else text


class OpenEnvMCPEnvironment(OpenEnvEnvironment):
    """Base of the classes ``openenv_environment`` makes for an MCP environment: one session of
    openenv-core's ``MCPToolClient`` per instance; each MCP tool is a tool whose call steps the
    session with a ``CallToolAction`` (so the server's step, its reward and ``done`` apply)."""

    def _new_client(self) -> Any:
        return _mcp_client_class()(
            base_url=self._base_url, connect_timeout_s=self._timeout, message_timeout_s=self._message_timeout
        )

    def _reset_text(self, result: Any) -> str | None:
        # MCPToolClient parses a reset's observation as a bare Observation; its own fields (the
        # environment's text) are in the payload the client kept.
        raw = self._client.async_client.last_observation
        own = (
            {k: v for k, v in raw.items() if k not in OBSERVATION_BASE_FIELDS}
            if isinstance(raw, dict)
            else raw
        )
        return self._observation_text(raw) if own else None

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str | list[dict[str, Any]]:
        self._check_running()
        action = _mcp_types().CallToolAction(tool_name=name, arguments=dict(arguments))
        result = self._client.step(action)
        self._record(result)
        observation = result.observation
        error = getattr(observation, "error", None)
        if error is not None:
            raise RuntimeError(str(getattr(error, "message", error)))
        return mcp_tool_output(getattr(observation, "result", None))


def _mcp_types() -> Any:
    return require("openenv.core.env_server.mcp_types", hub=HUB, extra="openenv")


@functools.cache
def _mcp_client_class() -> type:
    """openenv-core's ``MCPToolClient``, keeping the last observation payload as the server sent it
    (``last_observation``): the client parses a reset's observation without the environment's own
    fields."""

    class Client(_client_module().MCPToolClient):  # type: ignore[misc, name-defined]
        last_observation: Any = None

        def _parse_result(self, payload: dict[str, Any]) -> Any:
            self.last_observation = payload.get("observation")
            return super()._parse_result(payload)

    return Client


def list_mcp_tools(base_url: str, timeout: float, message_timeout: float) -> list[Any]:
    """The MCP tools of the server's environment (``name``, ``description``, ``input_schema``), listed
    through one short session of openenv-core's ``MCPToolClient``.

    Raises:
        ConnectionError: no session within ``timeout``.
        RuntimeError: the server lists no tools (not an MCP environment).
    """
    client = _mcp_client_class()(
        base_url=base_url, connect_timeout_s=timeout, message_timeout_s=message_timeout
    )
    sync = client.sync()
    try:
        try:
            sync.connect()
        except (ConnectionError, OSError, TimeoutError) as exc:
            raise unreachable_error(HUB, base_url, timeout, exc) from exc
        try:
            tools = list(sync.list_tools(use_cache=False))
        except RuntimeError as exc:  # the server refused the list_tools action
            raise _not_mcp_error(base_url, f"it answered a list_tools action with an error ({exc})") from exc
    finally:
        try:
            sync.close()
        except Exception:  # noqa: BLE001 - closing a session that is already gone
            pass
    if not tools:
        raise _not_mcp_error(base_url, "a list_tools action returned no tools")
    return tools


def _not_mcp_error(base_url: str, why: str) -> RuntimeError:
    return RuntimeError(
        f"The OpenEnv server at {base_url} lists no MCP tools: {why}, so there is nothing for the model to call. "
        "Serve an MCPEnvironment with at least one tool, or leave mcp unset (or pass mcp=False) for an "
        "environment whose action model is the tool."
    )


def _mcp_namespace(base_url: str, timeout: float, message_timeout: float) -> dict[str, Any]:
    """One tool method per MCP tool, each described by the tool's own JSON schema.

    Raises:
        ValueError: a tool name posttrain cannot expose (``reset``, ``get_reward``, ``_...``) or twice.
    """
    namespace: dict[str, Any] = {}
    for tool in list_mcp_tools(base_url, timeout, message_timeout):
        name = tool.name
        check_tool_name(name, f"{HUB} MCP", namespace)
        description = tool.description or f"The {name} tool of the environment."
        namespace[name] = tool_method(name, description, tool.input_schema, OpenEnvMCPEnvironment._call_tool)
    return namespace


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
    mcp: bool | None = None,
) -> type:
    """An environment class for ``environment_factory`` backed by an OpenEnv server.

    Reads the server's action schema (``GET /schema``) and name (``GET /metadata``) now, and for
    an MCP environment its tools (a ``list_tools`` action), so a server that does not answer fails
    here, before any trainer is built.

    An MCP environment (its action is OpenEnv's ``CallToolAction``) gives the class one tool per
    MCP tool, with the tool's name, description and JSON input schema as ``list_tools`` reports
    them; a call steps the session with a ``CallToolAction`` through openenv-core's
    ``MCPToolClient`` and returns the tool's text (or text and image blocks), and the reward is
    the one the server's step reports. Any other environment gives one tool, its action.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"`` (``ws://`` works too).
        name: the class name, which names the reward column (``rewards/{name}/mean``); default
            the name the server reports (``GET /metadata``).
        tool_name: the name of the action tool; default the action class's name without
            ``Action`` in snake case (``act`` when it has none).
        tool_description: what the model reads about the tool; default the action's docstring.
        reward: ``"last"`` (the last reward of the episode) or ``"sum"`` (their sum).
        observation_to_text: turns an observation (a dict of its fields) into what the model
            reads; default its one string field, else JSON. For an MCP environment it applies to
            the reset's observation (a reset observation with no fields of its own gives ``None``).
        timeout: seconds to wait for a connection (and for the schema).
        message_timeout: seconds to wait for the answer to a reset or a step.
        mcp: whether the server hosts an MCP environment; ``None`` (default) tells it from the
            action schema (OpenEnv's ``CallToolAction``); ``True`` for a server whose action class
            is the bare ``Action``; ``False`` treats even an MCP server's action as the one tool.

    Raises:
        ImportError: ``openenv-core`` is not installed (``pip install "posttrain[openenv]"``).
        ConnectionError: the server does not answer within ``timeout``; names host, port, timeout.
        RuntimeError: the URL answers but not as an OpenEnv server, or an MCP server lists no tools.
        ValueError: ``reward`` is neither ``"last"`` nor ``"sum"``, a tool name is unusable, or
            ``tool_name``/``tool_description`` is given for an MCP environment.
    """
    _client_module()
    if reward not in REDUCTIONS:
        raise ValueError(f"reward={reward!r} is invalid: it must be one of {list(REDUCTIONS)}.")
    check_reachable(base_url, timeout, HUB)
    action = (_get_json(base_url, "/schema", timeout) or {}).get("action") or {}
    metadata = _get_json(base_url, "/metadata", timeout) or {}
    env_name = str(metadata.get("name") or "")
    settings = _class_settings(base_url, timeout, message_timeout, reward, observation_to_text)
    if is_mcp_action(action) if mcp is None else mcp:
        return _mcp_class(settings, name, env_name, tool_name, tool_description)
    return _action_class(settings, name, env_name, action, tool_name, tool_description)


def _class_settings(
    base_url: str,
    timeout: float,
    message_timeout: float,
    reward: str,
    observation_to_text: Callable[[Any], str] | None,
) -> dict[str, Any]:
    """The class attributes every OpenEnv environment class carries: server, timeouts, reduction."""
    settings: dict[str, Any] = {
        "_base_url": base_url,
        "_timeout": float(timeout),
        "_message_timeout": float(message_timeout),
        "_reduction": reward,
    }
    if observation_to_text is not None:
        settings["_observation_text"] = staticmethod(observation_to_text)
    return settings


def _mcp_class(
    settings: dict[str, Any],
    name: str | None,
    env_name: str,
    tool_name: str | None,
    tool_description: str | None,
) -> type:
    """The ``OpenEnvMCPEnvironment`` subclass with one tool method per MCP tool the server lists."""
    base_url = settings["_base_url"]
    given = [
        k for k, v in (("tool_name", tool_name), ("tool_description", tool_description)) if v is not None
    ]
    if given:
        raise ValueError(
            f"{' and '.join(given)} name and describe the one action tool of an action-model environment; "
            f"the OpenEnv server at {base_url} hosts an MCP environment, whose tools keep the names and "
            "descriptions its list_tools gives. Leave them out (or pass mcp=False to make its action the tool)."
        )
    tools = _mcp_namespace(base_url, settings["_timeout"], settings["_message_timeout"])
    namespace = {**settings, **tools}
    return make_class(name or class_name(env_name, "OpenEnvEnvironment"), OpenEnvMCPEnvironment, namespace)


def _action_parameters(action: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of the action tool: the action's schema without OpenEnv's base fields."""
    parameters = {
        **{k: v for k, v in action.items() if k not in ("title", "description")},
        "properties": {
            k: v for k, v in (action.get("properties") or {}).items() if k not in ACTION_BASE_FIELDS
        },
    }
    parameters["required"] = [r for r in action.get("required") or [] if r not in ACTION_BASE_FIELDS]
    parameters.pop("additionalProperties", None)
    return parameters


def _action_class(
    settings: dict[str, Any],
    name: str | None,
    env_name: str,
    action: dict[str, Any],
    tool_name: str | None,
    tool_description: str | None,
) -> type:
    """The ``OpenEnvEnvironment`` subclass whose one tool is the server's action."""
    parameters = _action_parameters(action)
    tool = tool_name or default_tool_name(action)
    description = (
        tool_description
        or action.get("description")
        or f"Take one action in the {env_name or HUB} environment."
    )
    check_tool_name(tool, HUB, {})
    namespace = {**settings, tool: tool_method(tool, description, parameters, OpenEnvEnvironment._step)}
    return make_class(name or class_name(env_name, "OpenEnvEnvironment"), OpenEnvEnvironment, namespace)
