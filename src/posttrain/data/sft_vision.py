"""Supervised fine-tuning rows with images, for vision-language models.

A row is a conversation (``messages``) or a ``prompt`` and its ``completion`` (plain strings or
chat messages), with its images in an ``image`` column (one PIL image) or an ``images`` column
(a list). Each image goes where the row places it (an ``{"type": "image"}`` block, or the
processor's image token in plain text); a conversation without blocks gets one per image at the
start of its first user message (``vision.place_images``). The model's processor renders and
tokenises the row with its images, expanding each placeholder into the image's tokens.

Rows are encoded when a batch is collated, not beforehand: their image tensors are large, and a
dataset keeps its images as they are. A batch is left-padded (``Sequences.vision``), so the
processor's token-aligned inputs line up with the tokens as the sampler's do
(``core.batch.VisionInputs``).

Targets: every token of a conversation, or the completion's tokens of a prompt-completion row
(``completion_only_loss``, on by default for them), never an image's placeholder tokens.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.core.batch import Sequences, VisionInputs
from posttrain.data import chat, vision
from posttrain.data.sft_tokenize import common_prefix_length, with_eos
from posttrain.ops.online_logps import position_ids_from_mask
from posttrain.ops.padding import left_pad

#: The columns a row with images is read from (kept when the trainer drops unused columns).
VISION_SFT_COLUMNS = ("messages", "prompt", "completion", *vision.IMAGE_COLUMNS)


def check_vision_options(fmt: str, args: Any, name: str, first_row: Mapping[str, Any] | None = None) -> None:
    """Refuse what rows with images cannot do, before the model loads.

    Args:
        fmt: the dataset's format (``sft.detect_format``).
        args: the ``SFTConfig`` (``packing``, ``eval_packing``, ``padding_free``, ``assistant_only_loss``).
        name: the dataset's name, for the message.
        first_row: the dataset's first row (plain-text prompts have no assistant turns to mask).

    Raises:
        ValueError: a language-modelling ``text`` dataset, packing or padding-free batches,
            ``assistant_only_loss`` on plain-text prompt-completion rows.
    """
    packing = args.packing or bool(args.eval_packing)
    padding_free, assistant_only_loss = args.padding_free, args.assistant_only_loss
    if fmt not in ("conversational", "prompt_completion"):
        raise ValueError(
            f"{name} has images and is a {fmt!r} dataset; SFT with images reads a 'messages' conversation or a "
            "'prompt' and 'completion' per row (the processor places each image where its row puts it)."
        )
    if packing or padding_free:
        raise ValueError(
            f"{name} has images: packing and padding_free join rows into one sequence, which a vision-language "
            "model's image inputs cannot follow. Set packing=False (and eval_packing) and padding_free=False."
        )
    if assistant_only_loss and first_row is not None and isinstance(first_row.get("prompt"), str):
        raise ValueError(
            f"assistant_only_loss=True needs chat messages, but {name} has plain-text prompts and completions. Use "
            "'messages' (or prompt/completion message lists), or set assistant_only_loss=False (the completion "
            "alone is the target by default)."
        )


def check_assistant_markers(processor: Any) -> None:
    """``assistant_only_loss`` with images reads the assistant's spans from the processor's chat
    template (it renders the image blocks), which must mark them.

    Raises:
        ValueError: the processor's template has no ``{% generation %}`` markers.
    """
    template = getattr(processor, "chat_template", None)
    if not chat.has_generation_markers(template):
        raise ValueError(
            "assistant_only_loss=True with images needs the processor's chat template (it renders the image blocks) "
            "to wrap assistant turns in {% generation %} ... {% endgeneration %}, and it has no such markers. Give "
            "SFTConfig(chat_template_path=...) a marked copy of it, or set assistant_only_loss=False."
        )


def encode_row(
    row: Mapping[str, Any],
    processor: Any,
    completion_only_loss: bool | None,
    max_length: int | None,
    truncation_mode: str,
    eos_token: str | None = None,
    assistant_only_loss: bool = False,
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """One row's tokens, target mask and image inputs.

    Args:
        row: a ``messages`` row, or a ``prompt`` + ``completion`` row, with its images.
        processor: the model's processor (its ``tokenizer``, chat template and image processor).
        completion_only_loss: for prompt-completion rows, train on the completion only (``None``: yes).
        max_length: the most tokens a row keeps (``None``: all).
        truncation_mode: ``"keep_start"`` or ``"keep_end"``.
        eos_token: appended to a plain-text completion (default: the tokenizer's).
        assistant_only_loss: targets only the assistant's tokens (the chat template's
            ``{% generation %}`` spans), found on the text without the images and carried over to
            the processor's tokens (:func:`_carried_mask`).

    Returns:
        ``(input_ids, loss_mask, image_inputs)``: ``loss_mask[t]`` is 1 when token ``t`` is a
        target (never token 0, never an image token).

    Raises:
        ValueError: the row's images do not match its placeholders, or truncation would cut an image.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    images = vision.row_images(row)
    variables = _template_variables(processor)
    text, prompt_text, conversation = _rendered(row, processor, tokenizer, images, variables, eos_token)
    special = prompt_text is not None and isinstance(row.get("prompt"), str)
    ids, inputs = vision.encode_row_text(processor, tokenizer, text, images, special)
    targets = [1] * len(ids)
    if assistant_only_loss and conversation is not None:
        text_ids, assistant = chat.tokenize(tokenizer, conversation, variables=variables, assistant_mask=True)
        targets = _carried_mask(text_ids, assistant or [], ids)
    if prompt_text is not None and completion_only_loss is not False:
        prompt_ids, _ = vision.encode_row_text(processor, tokenizer, prompt_text, images, special)
        start = common_prefix_length(ids, prompt_ids)
        targets[:start] = [0] * start
    image_id = vision.image_token_id(processor, tokenizer)
    mask = [0] + [int(t and token != image_id) for t, token in zip(targets[1:], ids[1:], strict=True)]
    return _truncated(ids, mask, inputs, max_length, truncation_mode, image_id)


def _rendered(
    row: Mapping[str, Any],
    processor: Any,
    tokenizer: Any,
    images: list[Any],
    variables: dict[str, Any],
    eos_token: str | None,
) -> tuple[str, str | None, list[Any] | None]:
    """A row's text, its prompt's text (``None`` for a conversation) and its chat messages (``None``
    for plain text), its images placed and checked against their placeholders."""
    token = vision.image_token_of(processor)
    if "messages" in row and row.get("messages") is not None:
        conversation = vision.place_images(list(row["messages"]), images)
        vision.check_row_images(conversation, images, "of the batch", token)
        return chat.render(tokenizer, conversation, variables=variables), None, conversation
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, str):
        vision.check_row_images(prompt, images, "of the batch", token)
        return prompt + with_eos(completion, eos_token or tokenizer.eos_token), prompt, None
    prompt = vision.place_images(list(prompt), images)
    vision.check_row_images(prompt, images, "of the batch", token)
    conversation = [*prompt, *completion]
    text = chat.render(tokenizer, conversation, variables=variables)
    return text, chat.render_prompt(prompt, tokenizer, variables), conversation


def collate(
    rows: Sequence[tuple[list[int], list[int], dict[str, torch.Tensor]]], pad_token_id: int
) -> Sequences:
    """Encoded rows (:func:`encode_row`) as one left-padded batch with their image inputs."""
    input_ids, attention_mask = left_pad([ids for ids, _, _ in rows], pad_token_id)
    loss_mask, _ = left_pad([mask for _, mask, _ in rows], 0)
    return Sequences(
        input_ids=input_ids,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        vision=VisionInputs([inputs for _, _, inputs in rows]),
    )


def _carried_mask(text_ids: list[int], mask: list[int], ids: list[int]) -> list[int]:
    """``mask`` over ``text_ids`` (the conversation tokenised without its images) carried over to
    ``ids`` (the processor's tokens, each image placeholder expanded): the tokens the two share, in
    order (``difflib``'s matching blocks), keep their value; the images' tokens, and any text the
    expansion tokenised otherwise next to them, get 0.

    Raises:
        ValueError: a masked token (an assistant's) has no counterpart in ``ids``.
    """
    out = [0] * len(ids)
    matcher = difflib.SequenceMatcher(None, text_ids, ids, autojunk=False)
    carried = 0
    for a, b, size in matcher.get_matching_blocks():
        for k in range(size):
            out[b + k] = mask[a + k]
            carried += mask[a + k]
    if carried != sum(mask):
        raise ValueError(
            f"{sum(mask) - carried} of the assistant's {sum(mask)} tokens could not be found among the tokens the "
            "processor gives the row with its images. Put images in user messages only, or set "
            "assistant_only_loss=False."
        )
    return out


def _template_variables(processor: Any) -> dict[str, Any]:
    """Render with the processor's chat template (it knows the image blocks) when it has one."""
    template = getattr(processor, "chat_template", None)
    return {"chat_template": template} if isinstance(template, str) else {}


def _truncated(
    ids: list[int],
    mask: list[int],
    inputs: dict[str, torch.Tensor],
    max_length: int | None,
    mode: str,
    image_id: int | None,
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """Cut a row to ``max_length`` tokens, refusing a cut through its images."""
    if max_length is None or len(ids) <= max_length:
        return ids, mask, inputs
    keep = slice(0, max_length) if mode == "keep_start" else slice(len(ids) - max_length, len(ids))
    if image_id is not None and ids[keep].count(image_id) != ids.count(image_id):
        raise ValueError(
            f"a row with images has {len(ids)} tokens; max_length={max_length} would cut its image tokens. Raise "
            "max_length (or set it to None), or use smaller images."
        )
    aligned = {k: v[keep] if k in vision.TOKEN_ALIGNED_INPUTS else v for k, v in inputs.items()}
    mask = mask[keep]
    return ids[keep], [0, *mask[1:]], aligned
