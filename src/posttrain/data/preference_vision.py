"""Preference pairs with images, for vision-language models (DPO).

A row is a preference pair (``data/preference.py``: explicit or implicit prompt, standard or
conversational) with its images in an ``image`` column (one PIL image) or an ``images`` column
(a list). The images belong to the prompt: a conversational prompt places them with
``{"type": "image"}`` blocks (or gets one block per image at the start of its first user
message, ``vision.place_images``); a plain-text prompt writes the processor's image token. The
completions are text.

Rows are encoded when a batch is collated (a dataset keeps its images; pixel values are not
stored). Each row costs one processor call, on its prompt with its images: that call expands
each placeholder into the image's tokens and returns the image inputs. The completions are
split off as the text path splits them (``preference_tokenize``: the tokens each tokenised side
adds after the tokenised prompt), on the tokenizer's encoding of the unexpanded text, and put
after the expanded prompt; so ``prompt_ids + chosen_ids`` is what the processor gives for the
prompt with the chosen completion, and the processor's image work is not done three times.

Truncation (``max_length``) keeps the start, as in the text path: each side keeps its first
``max_length`` tokens and the prompt is never cut. A prompt that alone fills ``max_length``
(its images' tokens count) is an error naming the row, raised when its batch is collated, since
the row's length is only known once its images are processed.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from posttrain.core.batch import TOKEN_ALIGNED_INPUTS, Sequences, VisionInputs
from posttrain.data import chat, unpaired, vision
from posttrain.data.preference_tokenize import (
    COMPLETION_COLUMNS,
    REF_COLUMNS,
    extract_prompt,
    pair_kind,
)
from posttrain.data.sft import (
    check_messages,
    common_prefix_length,
    row_label,
    row_template_kwargs,
    row_tools,
    to_messages,
    with_eos,
)
from posttrain.data.unpaired import KL_COLUMN, UnpairedBatch
from posttrain.ops.online_logps import position_ids_from_mask
from posttrain.ops.padding import left_pad

#: The columns a pair with images is read from (kept when the trainer drops unused columns).
VISION_PAIR_COLUMNS = (
    "prompt",
    *COMPLETION_COLUMNS,
    *vision.IMAGE_COLUMNS,
    *REF_COLUMNS,
    "tools",
    "chat_template_kwargs",
)
#: The columns an unpaired example (KTO) with images is read from.
VISION_EXAMPLE_COLUMNS = (
    *unpaired.UNPAIRED_COLUMNS,
    *vision.IMAGE_COLUMNS,
    *unpaired.TEMPLATE_COLUMNS,
    KL_COLUMN,
    *unpaired.REF_COLUMNS,
)


def check_vision_pair_options(args: Any, name: str) -> None:
    """Refuse what pairs with images cannot do, before the model loads.

    Args:
        args: the trainer's config (``truncation_mode``, ``max_length``, ``padding_free``).
        name: the dataset's name, for the message.

    Raises:
        ValueError: ``truncation_mode="keep_end"`` with a ``max_length`` (it cuts the prompt's
            start, where the images are), or ``padding_free`` (one packed row per batch, which
            a vision-language model's image inputs cannot follow).
    """
    if getattr(args, "truncation_mode", "keep_start") == "keep_end" and args.max_length is not None:
        raise ValueError(
            f"{name} has images: truncation_mode='keep_end' cuts the start of the prompt, where its images are. "
            "Use truncation_mode='keep_start' (the default; the prompt is never cut), or max_length=None."
        )
    if getattr(args, "padding_free", False):
        raise ValueError(
            f"{name} has images: padding_free joins a batch's sequences into one row, which a vision-language "
            "model's image inputs cannot follow. Set padding_free=False."
        )


def encode_pair(
    row: Mapping[str, Any],
    processor: Any,
    *,
    max_length: int | None,
    eos_token: str | None = None,
    tools: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One pair's tokens (the prompt's images expanded) and its image inputs.

    Args:
        row: a preference row (``prompt`` / ``chosen`` / ``rejected``, or implicit) with its images.
        processor: the model's processor (tokenizer, chat template, image processor).
        max_length: the most tokens of prompt + completion per side (``None``: all).
        eos_token: appended to standard completions (default: the tokenizer's).
        tools: tool schemas for the chat template; a row's ``tools`` column wins.
        chat_template_kwargs: template variables; a row's ``chat_template_kwargs`` merge over them.
        index: the row's position, named in error messages.

    Returns:
        ``({"prompt_ids", "chosen_ids", "rejected_ids"}, image_inputs)``, the first dict also
        carrying the row's reference log-probs when it has them: what ``preference.collate_pairs``
        and ``collate_pair_prompts`` take.

    Raises:
        ValueError: the images do not match the prompt's placeholders, a completion holds an
            image token, a side adds no tokens, or the prompt alone fills ``max_length``.
    """
    row = extract_prompt(row, index)
    pair_kind(row, index)  # both sides text, or both messages
    prompt_ids, completions, inputs = encode_completions(
        row, processor, COMPLETION_COLUMNS, eos_token=eos_token, tools=tools,
        chat_template_kwargs=chat_template_kwargs, index=index,
    )  # fmt: skip
    out: dict[str, Any] = {"prompt_ids": prompt_ids}
    out.update({f"{column}_ids": ids for column, ids in completions.items()})
    out.update({c: row[c] for c in REF_COLUMNS if c in row})
    return _truncated(out, max_length, index), inputs


def encode_completions(
    row: Mapping[str, Any],
    processor: Any,
    columns: Sequence[str],
    *,
    eos_token: str | None = None,
    tools: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int | None = None,
) -> tuple[list[int], dict[str, list[int]], dict[str, torch.Tensor]]:
    """A row's prompt tokens (its images expanded), each completion column's tokens after it, and
    the image inputs (no truncation).

    Args:
        row: a row with a ``prompt`` (text or messages), the ``columns`` and its images.
        processor: the model's processor (tokenizer, chat template, image processor).
        columns: the completion columns (``chosen`` and ``rejected``; KTO's ``completion``).
        eos_token, tools, chat_template_kwargs, index: as in :func:`encode_pair`.

    Returns:
        ``(prompt_ids, {column: completion_ids}, image_inputs)``: ``prompt_ids`` followed by a
        column's ids is the processor's encoding of the prompt with that completion.

    Raises:
        ValueError: the images do not match the prompt's placeholders, a completion holds an
            image token or adds no tokens.
    """
    tokenizer = getattr(processor, "tokenizer", processor)
    images = vision.row_images(row)
    prompt_text, side_texts, special = _texts(
        row, processor, tokenizer, images, columns, eos_token, tools, chat_template_kwargs, index
    )
    prompt_ids, inputs = vision.encode_row_text(processor, tokenizer, prompt_text, images, special)
    text_prompt = list(tokenizer(prompt_text, add_special_tokens=special)["input_ids"])
    sides = [list(tokenizer(text, add_special_tokens=special)["input_ids"]) for text in side_texts]
    start = min(common_prefix_length(text_prompt, ids) for ids in sides)
    prompt_ids, inputs = _cut_prompt(prompt_ids, inputs, text_prompt, start, index)
    image_id = vision.image_token_id(processor, tokenizer)
    completions: dict[str, list[int]] = {}
    for column, ids in zip(columns, sides, strict=True):
        completion = ids[start:]
        if not completion:
            raise ValueError(
                f"{row_label(index)}: the '{column}' completion adds no tokens after the prompt. Check that the chat "
                "template renders assistant messages, or drop the row."
            )
        if image_id is not None and image_id in completion:
            raise ValueError(
                f"{row_label(index)}: the '{column}' completion holds the image token; a row's images belong to its "
                "prompt. Put the image placeholders in the prompt."
            )
        completions[column] = completion
    return prompt_ids, completions, inputs


def _texts(
    row: Mapping[str, Any],
    processor: Any,
    tokenizer: Any,
    images: list[Any],
    columns: Sequence[str],
    eos_token: str | None,
    tools: Any,
    chat_template_kwargs: Mapping[str, Any] | None,
    index: int | None,
) -> tuple[str, list[str], bool]:
    """The prompt's text and each side's (prompt + completion), and whether the tokenizer adds
    its special tokens (plain text: yes; a rendered conversation holds them already)."""
    token = vision.image_token_of(processor)
    if isinstance(row["prompt"], str):
        prompt = row["prompt"]
        vision.check_row_images(prompt, images, index if index is not None else "of the batch", token)
        eos = eos_token if eos_token is not None else tokenizer.eos_token
        return prompt, [prompt + with_eos(row[c], eos) for c in columns], True
    variables = row_template_kwargs(row, chat_template_kwargs)
    template = getattr(processor, "chat_template", None)
    if isinstance(template, str) and "chat_template" not in variables:
        variables["chat_template"] = template  # the processor's template knows the image blocks
    row_tools_ = row_tools(row, tools)
    prompt = vision.place_images(to_messages(row["prompt"], "prompt", index), images)
    vision.check_row_images(prompt, images, index if index is not None else "of the batch", token)
    sides = []
    for column in columns:
        messages = [*prompt, *to_messages(row[column], column, index)]
        check_messages(messages, f"prompt + {column}", index)
        sides.append(chat.render(tokenizer, messages, tools=row_tools_, variables=variables))
    head = chat.render(tokenizer, prompt, tools=row_tools_, add_generation_prompt=True, variables=variables)
    return head, sides, False


def _cut_prompt(
    prompt_ids: list[int],
    inputs: dict[str, torch.Tensor],
    text_prompt: list[int],
    start: int,
    index: int | None,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """The expanded prompt without the text tokens that the sides tokenise otherwise (a merge
    across the prompt's end, as in ``preference_tokenize``), or as it is."""
    if start == 0:
        raise ValueError(
            f"{row_label(index)}: the prompt tokenises to no tokens (or none that the completions' tokens keep), so the "
            "first completion token has nothing to be scored from. Give the row a non-empty prompt."
        )
    drop = len(text_prompt) - start
    if drop == 0:
        return prompt_ids, inputs
    if prompt_ids[-drop:] != text_prompt[-drop:]:
        raise ValueError(
            f"{row_label(index)}: the tokenised prompt is not a prefix of the tokenised prompt + completion, and the "
            "tokens where they part are next to an image. End the prompt's text after its images on a token "
            "boundary (e.g. without a trailing space)."
        )
    warnings.warn(
        f"{row_label(index)}: the tokenised prompt is not a prefix of the tokenised prompt + completion (they part at "
        f"token {start} of {len(text_prompt)}); the pair's prompt loses its last {drop} tokens and the completions "
        "start there. End prompts on a token boundary (e.g. without a trailing space).",
        stacklevel=4,
    )
    kept = len(prompt_ids) - drop
    cut = {k: v[:kept] if k in TOKEN_ALIGNED_INPUTS else v for k, v in inputs.items()}
    return prompt_ids[:kept], cut


def _truncated(pair: dict[str, Any], max_length: int | None, index: int | None) -> dict[str, Any]:
    """Each side cut to its first ``max_length`` tokens; the prompt (and its images) never cut."""
    if max_length is None:
        return pair
    room = max_length - len(pair["prompt_ids"])
    if room <= 0:
        raise ValueError(
            f"{row_label(index)}: its prompt takes {len(pair['prompt_ids'])} tokens with its images, so max_length="
            f"{max_length} leaves no completion token. Raise max_length (or set it to None), use smaller images, or "
            "drop the row."
        )
    return {**pair, "chosen_ids": pair["chosen_ids"][:room], "rejected_ids": pair["rejected_ids"][:room]}


def encode_example(
    row: Mapping[str, Any],
    processor: Any,
    *,
    max_length: int | None,
    eos_token: str | None = None,
    tools: Any = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    index: int | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One unpaired example's tokens (KTO: ``prompt``, ``completion``, ``label``) and image inputs.

    Args:
        row: the example with its images (and its precomputed columns, carried through).
        processor, max_length, eos_token, tools, chat_template_kwargs, index: as in :func:`encode_pair`.

    Returns:
        ``({"prompt_ids", "completion_ids", "label", ...}, image_inputs)``; the completion cut to
        fit ``max_length``, the prompt never.

    Raises:
        ValueError: a malformed example, images that do not match the placeholders, or a prompt
            that alone fills ``max_length``.
    """
    unpaired.check_example(row, index)
    prompt_ids, completions, inputs = encode_completions(
        row, processor, ("completion",), eos_token=eos_token, tools=tools,
        chat_template_kwargs=chat_template_kwargs, index=index,
    )  # fmt: skip
    example = {
        "prompt_ids": prompt_ids,
        "completion_ids": completions["completion"],
        "label": bool(row["label"]),
    }
    example.update({c: row[c] for c in (KL_COLUMN, *unpaired.REF_COLUMNS) if row.get(c) is not None})
    pair = _truncated(
        {**example, "chosen_ids": example["completion_ids"], "rejected_ids": []}, max_length, index
    )
    example["completion_ids"] = pair["chosen_ids"]
    return example, inputs


def collate_examples(
    encoded: Sequence[tuple[dict[str, Any], dict[str, torch.Tensor]]],
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
    *,
    with_kl: bool = True,
    max_length: int | None = None,
) -> UnpairedBatch:
    """Encoded examples (:func:`encode_example`) as a left-padded ``UnpairedBatch`` with their images.

    The KL pairs are ``unpaired.collate_unpaired``'s (row ``i``'s prompt, and with it its images,
    with row ``i - 1``'s completion tokens, or the row's ``kl_completion_ids``); examples and KL
    pairs share one width, left-padded so the image inputs line up with the tokens
    (``Sequences.model_kwargs``).
    """
    examples = [e for e, _ in encoded]
    images = [inputs for _, inputs in encoded]
    items = [(e["prompt_ids"], e["completion_ids"]) for e in examples]
    if with_kl:
        for i, e in enumerate(examples):
            partner = e.get(KL_COLUMN)
            completion = list(partner if partner is not None else examples[i - 1]["completion_ids"])
            if max_length is not None:
                completion = completion[: max(max_length - len(e["prompt_ids"]), 1)]
            items.append((e["prompt_ids"], completion))
    ids, attention = left_pad([p + c for p, c in items], pad_token_id, pad_to_multiple_of)
    mask, _ = left_pad([[0] * len(p) + [1] * len(c) for p, c in items], 0, pad_to_multiple_of)
    positions = position_ids_from_mask(attention)
    n = len(examples)
    # each row's token-aligned inputs over its whole row (0 on the completion), so that they sit
    # on its tokens in the left-padded batch
    rows = [_over_row(images[i % n], len(c)) for i, (_, c) in enumerate(items)]

    def part(span: slice) -> Sequences:
        return Sequences(
            ids[span], mask[span], attention[span], positions[span], vision=VisionInputs(rows[span])
        )

    labels = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
    ref, ref_kl = unpaired.collate_ref_logps(examples, with_kl)
    return UnpairedBatch(part(slice(0, n)), labels, part(slice(n, None)) if with_kl else None, ref, ref_kl)


def _over_row(inputs: dict[str, torch.Tensor], completion_length: int) -> dict[str, torch.Tensor]:
    """A prompt's image inputs with its token-aligned ones extended by 0 over ``completion_length`` tokens."""
    return {
        k: torch.cat([v, v.new_zeros(completion_length)]) if k in TOKEN_ALIGNED_INPUTS else v
        for k, v in inputs.items()
    }
