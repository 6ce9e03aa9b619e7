"""One chat-rendering and tokenising path for every trainer.

Every conversation posttrain turns into text goes through this module: GRPO's prompts, the
tool loop's turns and its template probes, SFT's conversations with their assistant masks,
reward models' inputs and the held-out evaluation. It renders the way
``tokenizer.apply_chat_template`` does (transformers' sandboxed Jinja renderer, the tokenizer's
special tokens as template variables, keys whose value is ``None`` dropped, the template picked
from a dict of named templates by ``tokenizer.get_chat_template``), so a conversation renders to
the same text in every trainer.

Two things are added over ``apply_chat_template``:

- templates that concatenate tool-call arguments as text (DeepSeek-V3) cannot take a JSON
  object; when a render fails and some arguments are objects, it is retried with the arguments
  written as JSON strings;
- the assistant mask of a tokenised conversation is read from the ``{% generation %}`` spans by
  character offsets, so a token that straddles the edge of a span counts as assistant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2

Message = dict[str, Any]

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

#: What a template may raise while rendering a conversation it cannot handle.
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, AttributeError, IndexError, KeyError)


def render_template(
    template: str,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    *,
    continue_final_message: bool = False,
    **variables: Any,
) -> str:
    """Render a conversation with one Jinja chat template.

    Args:
        template: the Jinja chat template.
        messages: the conversation.
        tools: tool JSON schemas, or ``None`` (an empty list is passed as ``None``).
        add_generation_prompt: append the text that opens an assistant turn.
        continue_final_message: leave the last message open, for the model to continue it.
        **variables: template variables (``bos_token``, ``enable_thinking``, ...).

    Returns:
        The rendered text.
    """
    return _render_with_spans(
        template, messages, tools, add_generation_prompt, continue_final_message, variables
    )[0]


def _render_with_spans(
    template: str,
    messages: Sequence[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: Mapping[str, Any],
    spans: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The render and, with ``spans``, the character spans of its ``{% generation %}`` blocks."""
    chat = [{key: value for key, value in message.items() if value is not None} for message in messages]
    try:
        return _jinja(template, chat, tools, add_generation_prompt, continue_final_message, variables, spans)
    except RENDER_ERRORS:
        as_strings = _stringify_arguments(chat)
        if as_strings == chat:
            raise
        return _jinja(
            template, as_strings, tools, add_generation_prompt, continue_final_message, variables, spans
        )


def _jinja(
    template: str,
    chat: list[Message],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    variables: Mapping[str, Any],
    spans: bool,
) -> tuple[str, list[tuple[int, int]]]:
    """One call of transformers' Jinja renderer (sandboxed, ``trim_blocks``, ``tojson``, ...)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(
        conversations=[chat],
        tools=list(tools) if tools else None,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        return_assistant_tokens_mask=spans,
        **dict(variables),
    )
    return rendered[0], [tuple(span) for span in (indices[0] if spans and indices else [])]


def _stringify_arguments(chat: list[Message]) -> list[Message]:
    """A copy of ``chat`` whose tool-call arguments are JSON strings."""
    out = []
    for message in chat:
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [_stringify_call(call) for call in message["tool_calls"]]}
        out.append(message)
    return out


def _stringify_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": json.dumps(function.get("arguments") or {})}}


# ---------------------------------------------------------------------------------------------
# With a tokenizer
# ---------------------------------------------------------------------------------------------


def special_tokens(tokenizer: Any) -> dict[str, str]:
    """The template variables ``apply_chat_template`` passes too (``bos_token``, ``eos_token``, ...)."""
    return {k: v for k, v in getattr(tokenizer, "special_tokens_map", {}).items() if isinstance(v, str)}


def template_of(
    tokenizer: Any, template: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None
) -> str:
    """The Jinja template to render with: ``template`` when given, else the tokenizer's own.

    A tokenizer with several named templates gives the one ``apply_chat_template`` would use
    (``tool_use`` when there are tools and it has one, else ``default``); ``template`` may also
    name one of them.

    Raises:
        ValueError: when there is no template to render with.
    """
    own = getattr(tokenizer, "chat_template", None)
    if template is not None and not (isinstance(own, Mapping) and template in own):
        return template
    if own is None:
        raise ValueError(
            "The dataset is conversational (chat messages) but the tokenizer has no chat template. Set "
            "tokenizer.chat_template (or the config's chat_template_path), or use plain-text prompts."
        )
    if isinstance(own, Mapping):
        if template is not None:
            return own[template]
        if tools and "tool_use" in own:
            return own["tool_use"]
        if "default" in own:
            return own["default"]
        raise ValueError(
            f"The tokenizer has several chat templates ({sorted(own)}) and none named 'default'. Pass "
            "chat_template_kwargs={'chat_template': NAME} to pick one."
        )
    return own


def _variables(tokenizer: Any, variables: Mapping[str, Any] | None) -> tuple[str | None, dict[str, Any]]:
    """Split the caller's template kwargs into a template override and the template variables."""
    merged = {**special_tokens(tokenizer), **dict(variables or {})}
    return merged.pop("chat_template", None), merged


def render(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render a conversation with the tokenizer's chat template, as ``apply_chat_template`` does.

    Args:
        tokenizer: the tokenizer whose template and special tokens are used.
        messages: the conversation.
        tools: tool JSON schemas, or ``None``.
        add_generation_prompt: append the text that opens an assistant turn.
        continue_final_message: leave the last message open, for the model to continue it.
        variables: extra template variables (``enable_thinking``, ...); a ``chat_template`` key
            renders with that template (or named template) instead of the tokenizer's.

    Returns:
        The rendered text.
    """
    override, kwargs = _variables(tokenizer, variables)
    template = template_of(tokenizer, override, tools)
    return render_template(
        template,
        messages,
        tools,
        add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )


def tokenize(
    tokenizer: Any,
    messages: Sequence[Message],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    variables: Mapping[str, Any] | None = None,
    assistant_mask: bool = False,
) -> tuple[list[int], list[int] | None]:
    """Render and tokenise a conversation; with ``assistant_mask``, 1 on the assistant's tokens.

    The text is tokenised without adding special tokens (the template writes them), as
    ``apply_chat_template`` does. The assistant tokens are those overlapping a
    ``{% generation %}`` span of the template.

    Args:
        tokenizer: a fast tokenizer (offsets are needed for the mask).
        messages, tools, add_generation_prompt, variables: as in ``render``.
        assistant_mask: also return the assistant mask.

    Returns:
        ``(input_ids, mask)``, ``mask`` ``None`` unless asked for.

    Raises:
        ValueError: no template to render with, or a mask asked of a template without
            ``{% generation %}`` markers.
    """
    override, kwargs = _variables(tokenizer, variables)
    template = template_of(tokenizer, override, tools)
    if assistant_mask and not has_generation_markers(template):
        raise ValueError(
            "An assistant mask needs a chat template that wraps assistant turns in {% generation %} ... "
            "{% endgeneration %}; this one has no such markers."
        )
    text, spans = _render_with_spans(
        template, messages, tools, add_generation_prompt, False, kwargs, assistant_mask
    )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=assistant_mask)
    ids = list(encoded["input_ids"])
    if not assistant_mask:
        return ids, None
    mask = [int(any(s < end and e > start for start, end in spans)) for s, e in encoded["offset_mapping"]]
    return ids, mask


def has_generation_markers(template: str | Mapping[str, str] | None) -> bool:
    """Whether a chat template (or any of a dict of named templates) has ``{% generation %}``."""
    if isinstance(template, Mapping):
        return any(has_generation_markers(t) for t in template.values())
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def render_prompt(
    prompt: str | Sequence[Message], tokenizer: Any, variables: Mapping[str, Any] | None = None
) -> str:
    """Turn one prompt into the text the model continues.

    A conversation is rendered with the generation prompt appended or, when its last message
    is from the assistant, with that message left open for the model to continue. A plain-text
    prompt is used as it is.

    Args:
        prompt: a string, or a list of chat messages.
        tokenizer: the policy's tokenizer.
        variables: extra template variables (``chat_template_kwargs``).

    Returns:
        The text to tokenise.
    """
    if isinstance(prompt, str):
        return prompt
    continue_final = prompt[-1].get("role") == "assistant"
    return render(
        tokenizer,
        list(prompt),
        add_generation_prompt=not continue_final,
        continue_final_message=continue_final,
        variables=variables,
    )
