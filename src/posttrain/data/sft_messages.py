"""SFT's chat messages: a ``messages`` (or ShareGPT ``conversations``) column read as role/content
dicts, and checked before a chat template renders them.

``to_messages`` converts a row's value (ShareGPT speakers become roles), ``check_messages``
checks the roles and their order; ``row_label`` is how every data error names its row. The
preference, reward and distillation data paths use them too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MESSAGE_COLUMNS = ("messages", "conversations")

#: ShareGPT speaker names (``from``) and the chat role each becomes.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
}

#: Which roles may come right before each role (``None`` = first message).
_ALLOWED_BEFORE = {
    "system": (None,),
    "developer": (None,),
    "user": (None, "system", "developer", "assistant"),
    "assistant": ("user", "tool"),
    "tool": ("assistant", "tool"),
}

Message = dict[str, Any]
Row = Mapping[str, Any]


def row_label(index: int | None) -> str:
    """How messages name a row: ``"Row 3"``, or ``"A row"`` when its index is unknown."""
    return "A row" if index is None else f"Row {index}"


def to_messages(value: Any, column: str, index: int | None) -> list[Message]:
    """Return a column's chat messages as ``{"role", "content", ...}`` dicts.

    ShareGPT messages (``{"from", "value"}``) are converted; other keys (``tool_calls``, ...) kept.

    Raises:
        ValueError: the value is not a list of dicts, or a ShareGPT speaker is unknown.
    """
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ValueError(
            f"{row_label(index)}: column '{column}' holds {type(value).__name__}, not a list of messages. Use a list "
            "of {'role': ..., 'content': ...} dicts."
        )
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{row_label(index)}: message {i} of column '{column}' is a {type(message).__name__}, not a dict. Use "
                "{'role': ..., 'content': ...} dicts."
            )
        messages.append(
            _from_sharegpt(dict(message), column, index, i) if "from" in message else dict(message)
        )
    return messages


def _from_sharegpt(message: Message, column: str, index: int | None, position: int) -> Message:
    """Convert one ShareGPT message to a role/content one."""
    speaker = message.pop("from")
    if speaker not in SHAREGPT_ROLES:
        raise ValueError(
            f"{row_label(index)}: message {position} of column '{column}' comes from {speaker!r}, which is not a known "
            f"ShareGPT speaker ({sorted(SHAREGPT_ROLES)}). Rename it, or convert the rows to role/content."
        )
    message["role"] = SHAREGPT_ROLES[speaker]
    message["content"] = message.pop("value", message.get("content"))
    return message


def check_messages(messages: Sequence[Message], column: str, index: int | None) -> None:
    """Check that a conversation has roles in a trainable order.

    Rules: a system (or developer) message only first; then a user message; user and assistant
    alternate; ``tool`` messages only after an assistant message with ``tool_calls`` (or after
    another tool message), and an assistant message after them.

    Raises:
        ValueError: an empty conversation, a message without a role or without content, or roles
            out of order; the message names the row, the column and the message's position.
    """
    if not messages:
        raise ValueError(
            f"{row_label(index)}: column '{column}' is an empty conversation. Drop the row, e.g. "
            f"dataset.filter(lambda r: len(r['{column}']) > 0)."
        )
    previous: Message | None = None
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ALLOWED_BEFORE:
            raise ValueError(
                f"{row_label(index)}: message {i} of column '{column}' has role {role!r}; expected one of "
                f"{sorted(_ALLOWED_BEFORE)}. Give every message a 'role' (ShareGPT rows use 'from')."
            )
        if message.get("content") is None and not message.get("tool_calls"):
            raise ValueError(
                f"{row_label(index)}: message {i} ('{role}') of column '{column}' has no 'content' (the key is "
                "missing or None; only an assistant message with 'tool_calls' may go without). Give it a 'content' "
                "(text, or a list of content blocks), or drop the row."
            )
        _check_order(role, previous, column, index, i)
        previous = message


def _check_order(role: str, previous: Message | None, column: str, index: int | None, i: int) -> None:
    """Raise when ``role`` may not follow ``previous``."""
    before = None if previous is None else previous.get("role")
    allowed = _ALLOWED_BEFORE[role]
    ok = before in allowed
    if role == "tool" and before == "assistant":
        ok = bool(previous.get("tool_calls"))
    if ok:
        return
    after = "at the start" if before is None else f"after a '{before}' message"
    hint = {
        "system": "a system message may only come first",
        "developer": "a developer message may only come first",
        "user": "a user message follows the system message or an assistant reply",
        "assistant": "an assistant message answers a user message or tool results",
        "tool": "a tool message answers an assistant message that has 'tool_calls'",
    }[role]
    raise ValueError(
        f"{row_label(index)}: message {i} of column '{column}' is a '{role}' message {after}; {hint}. Fix the order "
        "of the conversation, or drop the row."
    )
