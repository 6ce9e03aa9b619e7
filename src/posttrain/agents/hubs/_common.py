"""What the hub adapters share: the optional client package, the reachability check, tools made
from a remote environment's JSON schemas, and the class each adapter returns.

Nothing here imports torch or a hub package at import time, so ``posttrain.agents.hubs`` loads
without them; each adapter asks for its package with ``require`` when it is used.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import keyword
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

# The distribution each extra of posttrain installs.
EXTRA_PACKAGES = {"openenv": "openenv-core", "openreward": "openreward", "harbor": "harbor"}
# Port of a URL that names none, by scheme.
DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
# Seconds to wait for a TCP connection to a hub's server before calling it unreachable.
DEFAULT_TIMEOUT = 10.0


def require(module: str, *, hub: str, extra: str, note: str = "") -> ModuleType:
    """Import a hub's client package, or say which extra of posttrain installs it.

    Args:
        module: the module to import (``"openenv.core"``, ``"openreward"``, ``"harbor"``).
        hub: the hub's name for the message.
        extra: the extra of posttrain that installs the package.
        note: more to say after the install command (a Python version it needs).

    Raises:
        ImportError: the package is not installed; the message names ``pip install "posttrain[extra]"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"The {hub} environment adapter needs the '{EXTRA_PACKAGES[extra]}' package, which is not "
            f'installed ({exc}); install it with `pip install "posttrain[{extra}]"`{note}.'
        ) from exc


def host_port(url: str) -> tuple[str, int]:
    """The host and port a server URL names (the scheme's default port when it names none).

    Raises:
        ValueError: ``url`` names no host.
    """
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if not parts.hostname:
        raise ValueError(f"{url!r} is not a server URL; give one like 'http://127.0.0.1:8000'.")
    return parts.hostname, parts.port or DEFAULT_PORTS.get(parts.scheme, 80)


def unreachable_error(hub: str, url: str, timeout: float, cause: BaseException) -> ConnectionError:
    """The error of a hub server that does not answer: it names the host, the port and the timeout."""
    host, port = host_port(url)
    return ConnectionError(
        f"The {hub} server at {url} is unreachable: no connection to host {host}, port {port} within the "
        f"timeout of {timeout:g} s ({type(cause).__name__}: {cause}). Start the server or correct the URL "
        "(a slow server needs a larger timeout=)."
    )


def check_reachable(url: str, timeout: float, hub: str) -> None:
    """Open (and close) a TCP connection to the server of ``url``.

    Raises:
        ConnectionError: no connection within ``timeout`` seconds; the message names the host,
            the port and the timeout.
    """
    host, port = host_port(url)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        raise unreachable_error(hub, url, timeout, exc) from exc


def check_tool_name(name: Any, hub: str, taken: Mapping[str, Any]) -> None:
    """Refuse a remote tool name posttrain cannot expose as a method.

    Raises:
        ValueError: not a non-empty string, starts with ``_`` (not a tool in posttrain), is a
            reserved method (``reset``, ``get_reward``) or a name already used.
    """
    from posttrain.agents.environments import RESERVED_METHODS

    if not isinstance(name, str) or not name or name.startswith("_") or name in RESERVED_METHODS:
        raise ValueError(
            f"The {hub} environment has a tool named {name!r}, which posttrain cannot expose: a tool name must "
            f"be a non-empty string that does not start with '_' and is not one of {list(RESERVED_METHODS)}."
        )
    if name in taken:
        raise ValueError(f"The {hub} environment names two tools {name!r}; tool names must be unique.")


def _signature(properties: Mapping[str, Any], required: set[str]) -> inspect.Signature:
    """``(self, *, a, b=None)`` from a JSON schema's properties, so that posttrain's argument check
    names missing and unexpected arguments; ``(self, **arguments)`` when a name is not a Python
    identifier."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if all(p.isidentifier() and not keyword.iskeyword(p) and p != "self" for p in properties):
        ordered = sorted(properties, key=lambda p: p not in required)  # required ones first
        params += [
            inspect.Parameter(
                p, inspect.Parameter.KEYWORD_ONLY, default=inspect.Parameter.empty if p in required else None
            )
            for p in ordered
        ]
    else:
        params.append(inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def tool_method(
    name: str,
    description: str,
    parameters: Mapping[str, Any] | None,
    call: Callable[[Any, str, dict[str, Any]], Any],
) -> Callable[..., Any]:
    """A method exposing one remote tool, described by the remote JSON schema as it is.

    Calling it runs ``call(self, name, arguments)`` with only the arguments the model gave. The
    method carries the schema in ``__tool_schema__`` (read by ``posttrain.agents.tools.tool_schema``)
    and a signature built from it, so a call with a missing or unknown argument fails as
    ``bad_arguments`` before reaching the server.

    Args:
        name: the tool's name.
        description: what the model reads about it.
        parameters: the JSON schema of its arguments (an ``object`` schema); ``None`` for none.
        call: what a call does.
    """
    description = inspect.cleandoc(description)
    schema = dict(parameters or {"type": "object", "properties": {}})
    schema.setdefault("type", "object")
    properties = dict(schema.get("properties") or {})

    def method(self: Any, **arguments: Any) -> Any:
        return call(self, name, arguments)

    method.__name__ = name
    method.__qualname__ = name
    method.__doc__ = description
    method.__signature__ = _signature(properties, set(schema.get("required") or []))  # type: ignore[attr-defined]
    method.__tool_schema__ = {  # type: ignore[attr-defined]
        "type": "function",
        "function": {"name": name, "description": description, "parameters": schema},
    }
    return method


def make_class(name: str, base: type, namespace: Mapping[str, Any]) -> type:
    """The environment class an adapter returns: ``base`` plus the tools and settings of one
    remote environment. Its name is the reward column (``rewards/{name}/mean``).

    Raises:
        ValueError: ``name`` is empty or not a string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}: an environment class needs a non-empty name (its reward column).")
    return type(name, (base,), {"__module__": base.__module__, "__qualname__": name, **namespace})


def class_name(text: str, fallback: str) -> str:
    """A readable class name from a remote environment's name: non-identifier characters become ``_``."""
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in str(text or "")).strip("_")
    if not cleaned:
        return fallback
    return cleaned if not cleaned[0].isdigit() else f"_{cleaned}"


def text_of(value: Any) -> str:
    """The text of a tool result or prompt: strings as they are, text blocks joined by blank lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return "\n\n".join(text_of(v) for v in value)
    text = getattr(value, "text", None)
    if isinstance(text, str):
        return text
    if isinstance(value, Mapping) and isinstance(value.get("text"), str):
        return value["text"]
    return str(value)


class LoopThread:
    """An event loop running on its own daemon thread, for async clients bound to one loop.

    ``run(coro)`` blocks until the coroutine, run on that loop, is done; it works from a plain
    thread and from inside another running loop alike.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
