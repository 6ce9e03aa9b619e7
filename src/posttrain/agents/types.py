"""Typed records shared by the agent modules: a parsed tool call and the result of running it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Why a call failed; each kind is counted in ``tools/failure_frequency``.
FAILURE_KINDS = ("parse_error", "unknown_tool", "bad_arguments", "exception", "unsupported_type")


@dataclass
class ToolCall:
    """One tool call the model emitted in an assistant turn.

    Attributes:
        name: the function name, or ``None`` when it could not be read.
        arguments: the decoded arguments, or ``None`` when they could not be decoded.
        type: the call type the model named ("function" is the only one that runs).
        raw: the text of the call as the model wrote it (for error messages and logs).
        error: why the call could not be parsed, or ``None`` for a well-formed call.
    """

    name: str | None
    arguments: dict[str, Any] | None
    type: str = "function"
    raw: str = ""
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as a chat-message ``tool_calls`` entry (``{"type", "function": {...}}``)."""
        return {
            "type": self.type,
            "function": {"name": self.name or "", "arguments": dict(self.arguments or {})},
        }


@dataclass
class ToolResult:
    """What running one ``ToolCall`` gave back to the model.

    Attributes:
        name: the tool name the call asked for (may be unknown or ``None``).
        content: the tool's return value as message content: a string, or a list of content
            blocks (``{"type": "text", ...}``, ``{"type": "image", ...}``) for multimodal tools.
        failed: whether the call failed (the content then explains the error to the model).
        failure: one of ``FAILURE_KINDS`` when ``failed``.
        images: images the content blocks carry, in order (for vision-language models).
    """

    name: str | None
    content: str | list[dict[str, Any]]
    failed: bool = False
    failure: str | None = None
    images: list[Any] = field(default_factory=list)
