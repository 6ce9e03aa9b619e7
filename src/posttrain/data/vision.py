"""Prompts with images for vision-language models: the dataset columns, checks and encoding.

A row of a multimodal prompt dataset has a ``prompt`` and its images in an ``image`` column
(one PIL image) or an ``images`` column (a list of them). A conversational prompt marks where
each image goes with an ``{"type": "image"}`` content block; a plain-text prompt writes the
processor's image token (``processor.image_token``) there. A conversational prompt whose
contents are all plain strings (no blocks) gets one image block per image at the start of its
first user message, as the reference places them (``place_images``). The model's processor renders and
tokenises a row with its images: it expands each placeholder into the image's tokens and
returns the pixel values and the model's other image inputs (``core.batch.VisionInputs``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.core.batch import TOKEN_ALIGNED_INPUTS, VisionInputs
from posttrain.data import chat

#: The dataset columns that hold a row's images: one image, or a list of images.
IMAGE_COLUMNS = ("image", "images")


def image_column(column_names: Sequence[str] | None) -> str | None:
    """The dataset's image column (``"image"`` or ``"images"``), or ``None``."""
    return next((c for c in IMAGE_COLUMNS if column_names is not None and c in column_names), None)


def row_images(row: Mapping[str, Any]) -> list[Any]:
    """A dataset row's images as a list (empty when it has none)."""
    if row.get("images") is not None:
        images = row["images"]
        return list(images) if isinstance(images, (list, tuple)) else [images]
    if row.get("image") is not None:
        return [row["image"]]
    return []


def image_processor_of(processing_class: Any) -> Any:
    """The processing class's image processor, or ``None`` for a plain tokenizer."""
    return getattr(processing_class, "image_processor", None)


def placeholder_count(prompt: Any, image_token: str | None) -> int:
    """How many images a prompt places: ``{"type": "image"}`` blocks, or image tokens in text."""
    if isinstance(prompt, str):
        return prompt.count(image_token) if image_token else 0
    count = 0
    for message in prompt:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(
                1 for block in content if isinstance(block, Mapping) and block.get("type") == "image"
            )
    return count


def place_images(prompt: Any, images: Sequence[Any]) -> Any:
    """A conversational prompt without content blocks, given images, with one ``{"type": "image"}``
    block per image at the start of its first user message (its text after them), as the
    reference places a dataset row's images; any other prompt as it is.

    A prompt that already has a list of blocks in some message says where its images go itself
    (``check_row_images`` then counts them), and a plain-text prompt writes the image token.
    """
    if not images or isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return prompt
    messages = list(prompt)
    if any(not isinstance(m, Mapping) or isinstance(m.get("content"), list) for m in messages):
        return prompt
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is None:
        return prompt
    message = messages[first_user]
    blocks: list[dict[str, Any]] = [{"type": "image"} for _ in images]
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    messages[first_user] = {**message, "content": blocks}
    return messages


def check_row_images(prompt: Any, images: Sequence[Any], row: int | str, image_token: str | None) -> None:
    """Raise a clear ``ValueError`` when a row's images do not match the placeholders of its prompt.

    Args:
        prompt: the row's prompt (text or messages).
        images: the row's images.
        row: the row's index (or a description), named in the message.
        image_token: the processor's image placeholder in plain text.
    """
    places = placeholder_count(prompt, image_token)
    if places == len(images):
        return
    where = (
        f"image token {image_token!r}s in its text"
        if isinstance(prompt, str)
        else "{'type': 'image'} content blocks in its messages"
    )
    raise ValueError(
        f"Row {row} of the dataset has {len(images)} image(s) but its prompt has {places} {where}. Each image "
        "needs one placeholder where it goes: add one {'type': 'image'} block per image to the user message "
        "(e.g. [{'type': 'image'}, {'type': 'text', 'text': ...}]), or give the row as many images as placeholders."
    )


def with_images(prompt: Any, images: Sequence[Any]) -> Any:
    """A conversational prompt whose ``{"type": "image"}`` blocks carry their images (``"image"``), in
    order (what the completions log saves); a plain-text prompt, or a row without images, as it is."""
    if not images or isinstance(prompt, str):
        return prompt
    remaining = list(images)

    def fill(block: Any) -> Any:
        is_image = isinstance(block, Mapping) and block.get("type") == "image"
        return {**block, "image": remaining.pop(0)} if is_image and remaining else block

    return [
        {**m, "content": [fill(b) for b in m["content"]]} if isinstance(m.get("content"), list) else m
        for m in prompt
    ]


def as_blocks(prompt: Any) -> Any:
    """A conversational prompt with each plain-string content as one ``{"type": "text"}`` block, as
    the reference hands a row with images to ``rollout_func``; a plain-text prompt as it is."""
    if isinstance(prompt, str):
        return prompt
    return [
        {**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str) else m
        for m in prompt
    ]


def image_token_of(processing_class: Any) -> str | None:
    """The processor's image placeholder in plain text (``image_token``), or ``None``."""
    token = getattr(processing_class, "image_token", None)
    return token if isinstance(token, str) else None


def encode_with_images(
    processor: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    images: Sequence[Sequence[Any]],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[list[list[int]], VisionInputs]:
    """Render and tokenise prompts with their images, one row at a time, with the processor.

    A row without images is tokenised by the tokenizer alone. Conversational prompts render
    with the processor's chat template when it has one (it knows the image blocks), else the
    tokenizer's.

    Args:
        processor: the model's processor (a ``ProcessorMixin`` with an image processor).
        tokenizer: its text tokenizer.
        prompts: standard or conversational prompts.
        images: each row's images (PIL images), as many as the row's placeholders.
        chat_template_kwargs: extra chat template variables.

    Returns:
        Each row's prompt tokens (placeholders expanded) and the rows' ``VisionInputs``.

    Raises:
        ValueError: a row's images do not match its placeholders (``check_row_images``).
    """
    ids: list[list[int]] = []
    rows: list[dict[str, torch.Tensor]] = []
    token = image_token_of(processor)
    for i, (prompt, row_images_) in enumerate(zip(prompts, images, strict=True)):
        check_row_images(prompt, row_images_, f"{i} of this batch", token)
        text = _render(processor, tokenizer, prompt, chat_template_kwargs)
        special = isinstance(prompt, str)
        if not row_images_:
            ids.append(tokenizer(text, add_special_tokens=special)["input_ids"])
            rows.append({})
            continue
        row_ids, row = encode_text(processor, text, row_images_, add_special_tokens=special)
        ids.append(row_ids)
        rows.append(row)
    return ids, VisionInputs(rows)


def placeholder_ids(
    processor: Any,
    tokenizer: Any,
    prompts: Sequence[Any],
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Each prompt rendered as ``encode_with_images`` renders it and tokenised by the tokenizer
    alone: one placeholder per image, as the chat template writes it. An inference engine that
    runs the model's processor itself (vLLM) takes these with the images and expands them."""
    return [
        list(tokenizer(_render(processor, tokenizer, p, chat_template_kwargs), add_special_tokens=isinstance(p, str))[
            "input_ids"
        ])
        for p in prompts
    ]  # fmt: skip


def _render(
    processor: Any, tokenizer: Any, prompt: Any, chat_template_kwargs: Mapping[str, Any] | None
) -> str:
    """A prompt's text: a conversation rendered with the processor's chat template when it has one
    (it knows the image blocks), else the tokenizer's; a plain-text prompt as it is."""
    if isinstance(prompt, str):
        return chat.render_prompt(prompt, tokenizer, None)
    variables = dict(chat_template_kwargs or {})
    template = getattr(processor, "chat_template", None)
    if isinstance(template, str) and "chat_template" not in variables:
        variables["chat_template"] = template
    return chat.render_prompt(prompt, tokenizer, variables)


def follow_prompt(
    row: Mapping[str, torch.Tensor],
    encoded: Sequence[int],
    ids: Sequence[int],
    image_token_id: int | None,
    where: str,
) -> dict[str, torch.Tensor]:
    """A row's image inputs, encoded by the processor with the tokens ``encoded``, for the same
    images under the prompt tokens ``ids`` that a ``rollout_func`` returned.

    The image tensors stay; the ``TOKEN_ALIGNED_INPUTS`` are rebuilt over ``ids`` (each token's
    value as over ``encoded``: e.g. 1 on Qwen-VL's image tokens, 0 on text), so they sit on the
    rollout's own image tokens whatever text surrounds them.

    Raises:
        ValueError: ``ids`` hold another number of image tokens than the images take.
    """
    if image_token_id is not None and list(ids).count(image_token_id) != list(encoded).count(image_token_id):
        raise ValueError(
            f"rollout_func's prompt_ids for {where} hold {list(ids).count(image_token_id)} image tokens, but its "
            f"images take {list(encoded).count(image_token_id)}: encode the prompt with its images through the "
            "model's processor (processor(text=..., images=...)), which expands each image placeholder."
        )
    out = {k: v for k, v in row.items() if k not in TOKEN_ALIGNED_INPUTS}
    for name in TOKEN_ALIGNED_INPUTS:
        if name in row:
            values = dict(zip(encoded, row[name].tolist(), strict=True))
            out[name] = torch.tensor([values.get(t, 0) for t in ids], dtype=row[name].dtype)
    return out


def encode_text(
    processor: Any, text: str, images: Sequence[Any], add_special_tokens: bool = False
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Tokenise rendered text with its images: each placeholder expands into its image's tokens.

    Args:
        processor: the model's processor.
        text: rendered text holding one image placeholder per image, in order.
        images: the images (PIL images).
        add_special_tokens: whether the tokenizer adds its special tokens (a plain-text prompt).

    Returns:
        The tokens and the processor's other outputs for them (image tensors, and the
        ``TOKEN_ALIGNED_INPUTS`` as 1-D tensors over the tokens).
    """
    out = processor(
        text=[text], images=list(images), add_special_tokens=add_special_tokens, return_tensors="pt"
    )
    return out["input_ids"][0].tolist(), _row_inputs(out)


def encode_row_text(
    processor: Any, tokenizer: Any, text: str, images: Sequence[Any], add_special_tokens: bool
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """``encode_text`` for a row with images; the tokenizer alone (no image inputs) for one without."""
    if not images:
        return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]), {}
    return encode_text(processor, text, images, add_special_tokens=add_special_tokens)


def image_token_id(processor: Any, tokenizer: Any) -> int | None:
    """The id of the processor's image placeholder token (``image_token``, else ``image_token_id``), or ``None``."""
    token = image_token_of(processor)
    if token is None:
        return getattr(processor, "image_token_id", None)
    return tokenizer.convert_tokens_to_ids(token)


def _row_inputs(out: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A one-row processor output without its tokens: image tensors, and token-aligned ones as 1-D."""
    row: dict[str, torch.Tensor] = {}
    for name, value in out.items():
        if name in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        row[name] = value[0] if name in TOKEN_ALIGNED_INPUTS else value
    return row
