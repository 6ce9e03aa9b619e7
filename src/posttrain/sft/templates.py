"""The chat template SFT trains with: the markers ``assistant_only_loss`` needs (``chat_template_path``
is ``models.loading.apply_chat_template_path``, shared with reward models).

Both run once, before the dataset is tokenised, and change the tokenizer the trainer holds (so
the saved tokenizer renders conversations the way the model was trained on them).
"""

from __future__ import annotations

import warnings
from typing import Any

from posttrain.agents import templates
from posttrain.data import chat


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
