"""The chat template SFT trains with: ``chat_template_path``, and the markers ``assistant_only_loss`` needs.

Both run once, before the dataset is tokenised, and change the tokenizer the trainer holds (so
the saved tokenizer renders conversations the way the model was trained on them).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from posttrain.agents import templates
from posttrain.data import chat
from posttrain.models import peft as peft_utils

TEMPLATE_SUFFIXES = (".jinja", ".j2")


def apply_chat_template_path(path: str, tokenizer: Any, model: Any) -> list[str]:
    """Give ``tokenizer`` the chat template found at ``path``.

    ``path`` is a Jinja file (``.jinja`` / ``.j2``), or a tokenizer (local folder or hub id)
    whose template is taken. From a tokenizer, its special tokens that the template writes and
    this tokenizer lacks are added (the model's embeddings grow to match) and its EOS token
    becomes this tokenizer's EOS (the turn end the template writes), as a model trained on that
    template must learn to stop with it.

    Args:
        path: the template file, or the tokenizer to take it from.
        tokenizer: the tokenizer to change.
        model: the policy (resized when tokens are added).

    Returns:
        The tokens added.

    Raises:
        ValueError: an unreadable path, a source without a template, or new tokens for a PEFT
            model (whose embeddings the adapter cannot grow).
    """
    if os.path.isfile(path):
        if not path.endswith(TEMPLATE_SUFFIXES):
            raise ValueError(
                f"chat_template_path={path!r} is a file but not a Jinja template; give a '.jinja' (or '.j2') file, "
                "or a tokenizer folder or hub id whose chat template to use."
            )
        with open(path, encoding="utf-8") as handle:
            tokenizer.chat_template = handle.read()
        return []
    source = _load_source(path)
    template = getattr(source, "chat_template", None)
    if not template:
        raise ValueError(
            f"The tokenizer at chat_template_path={path!r} has no chat template. Point it at a tokenizer with one, "
            "or at a '.jinja' file."
        )
    texts = template.values() if isinstance(template, dict) else [template]
    needed = [
        t for t in source.get_added_vocab() if any(t in text for text in texts) or t == source.eos_token
    ]
    missing = [t for t in needed if t not in tokenizer.get_vocab()]
    if missing and peft_utils.is_peft_model(model):
        raise ValueError(
            f"The chat template of {path!r} writes tokens this tokenizer lacks ({missing}); adding them grows the "
            "embeddings, which a PEFT adapter cannot train. Add the tokens and resize the base model before "
            "wrapping it (model.resize_token_embeddings), or use a template written with the existing tokens."
        )
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
        model.resize_token_embeddings(len(tokenizer))
    tokenizer.chat_template = template
    if source.eos_token and source.eos_token != tokenizer.eos_token:
        tokenizer.eos_token = source.eos_token
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.eos_token_id = tokenizer.eos_token_id
    return missing


def _load_source(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"chat_template_path={path!r} is neither a '.jinja' file nor a tokenizer that could be loaded ({exc}). "
            "Give a template file, a local tokenizer folder, or a hub id."
        ) from exc


def ensure_generation_markers(tokenizer: Any, template_override: str | None = None) -> str | None:
    """Make the tokenizer's template mark assistant turns, for ``assistant_only_loss``.

    A template with ``{% generation %}`` markers is kept. One without, of a known family
    (ChatML/Qwen, Llama 3, DeepSeek-V3), is replaced by posttrain's marked template of that
    family, with a warning; the reference raises here instead.

    Args:
        tokenizer: the tokenizer whose template is checked (and replaced).
        template_override: a template the rows render with instead (``chat_template`` in the
            template kwargs), which is then the one checked.

    Returns:
        The family substituted, or ``None`` when the template was kept.

    Raises:
        ValueError: no template, or one of no known family.
    """
    current = template_override or getattr(tokenizer, "chat_template", None)
    if chat.has_generation_markers(current):
        return None
    if isinstance(current, dict):
        current = current.get("default")
    family, marked = templates.marked_template(current)
    warnings.warn(
        "assistant_only_loss=True needs a chat template with {% generation %} markers, and this tokenizer's has "
        f"none. Training with posttrain's marked template of the {family!r} family instead (the saved tokenizer "
        "keeps it). It renders the same turns; a default system prompt the stock template adds is not rendered. "
        "To keep your own template, add {% generation %} ... {% endgeneration %} around its assistant turns.",
        stacklevel=3,
    )
    tokenizer.chat_template = marked
    return family
