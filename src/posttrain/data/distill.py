"""Datasets of the distillation trainers: prompts, and (for GKD's off-policy steps) completions.

The reference's GKD reads ``messages`` rows (the last message is the completion, the ones before
it the prompt). Here a ``messages`` row becomes ``prompt`` / ``completion`` columns, so the
shared sampler reads the prompt as for every online trainer; ``prompt`` / ``completion`` rows
(standard or conversational) are taken as they are. ``dataset_rollout`` tokenises a batch of
such rows into a ``Rollout`` the way the sampler would have produced it: the prompt rendered
for generation and left-padded, the completion after it, right-padded, every token SFT's
tokenisation gives it (a chat template's tokens after the EOS included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from posttrain.core.batch import TOKEN_ALIGNED_INPUTS, Rollout, VisionInputs
from posttrain.data import sft, vision
from posttrain.data.preference_vision import encode_completions
from posttrain.generation.base import Samples, build_rollout
from posttrain.ops.padding import left_pad

__all__ = [
    "PRIVILEGED_COLUMN",
    "as_prompt_completion",
    "check_privileged_column",
    "context_text",
    "fill_prompt",
    "dataset_rollout",
    "has_completions",
    "teacher_prompt",
]

Row = dict[str, Any]


def as_prompt_completion(dataset: Any, completion_optional: bool = False) -> Any:
    """A ``messages`` dataset as ``prompt`` (all but the last message) and ``completion`` (the last).

    Other datasets are returned as they are. With ``completion_optional`` (IW-OPD), a conversation
    that does not end with the assistant's message is a prompt alone (``completion`` None).

    Raises:
        ValueError: a conversation whose last message is not the assistant's, where one is needed.
    """
    if dataset is None:
        return None
    columns = list(getattr(dataset, "column_names", None) or [])
    column = next((c for c in sft.MESSAGE_COLUMNS if c in columns), None)
    if column is None or "prompt" in columns:
        return dataset

    def split(row: Row, index: int) -> Row:
        messages = sft.to_messages(row[column], column, index)
        if completion_optional and messages and messages[-1].get("role") != "assistant":
            return {"prompt": messages, "completion": None}
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError(
                f"{sft.row_label(index)}: the last message of '{column}' is "
                f"{messages[-1].get('role') if messages else 'missing'!r}; GKD trains on the last message as the "
                "completion, so it must be the assistant's. Drop such rows, or give 'prompt' and 'completion' "
                "columns."
            )
        return {"prompt": messages[:-1], "completion": messages[-1:]}

    return dataset.map(split, with_indices=True, remove_columns=[column])


def has_completions(dataset: Any) -> bool:
    """Whether the rows carry a ``completion`` (after ``as_prompt_completion``)."""
    return dataset is not None and "completion" in list(getattr(dataset, "column_names", None) or [])


def dataset_rollout(
    rows: Sequence[Row],
    tokenizer: Any,
    eos_token_ids: list[int],
    max_length: int | None,
    chat_template_kwargs: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    through_end: bool = True,
    max_prompt_length: int | None = None,
    processor: Any = None,
) -> Rollout:
    """The rows' own completions as a ``Rollout``, tokenised as the sampler tokenises prompts.

    ``through_end`` (the default) keeps every token SFT's tokenisation gives the completion, the
    chat template's tokens after the EOS included (ChatML's newline after ``<|im_end|>``), as the
    reference and posttrain's SFT train on them; ``False`` ends each row at its first EOS (GOLD,
    whose cross-tokenizer alignment ends both sides at their EOS).

    A dataset completion is bounded by ``max_length`` only, as the reference bounds it, not by
    ``max_completion_length``, which budgets sampled completions. Which tokens a row longer than
    ``max_length`` keeps follows the reference's collators:

    * without ``max_prompt_length`` (GKD, GOLD: the reference's ChatML collator) the row keeps
      its last ``max_length`` tokens: the prompt loses its start first; a completion that alone
      fills ``max_length`` keeps its last ``max_length - 1`` tokens after the prompt's last one;
    * with ``max_prompt_length`` (IW-OPD) the prompt keeps its last ``max_prompt_length`` tokens
      and the completion fills the rest of ``max_length``, losing its end (it then counts as
      truncated, without EOS); a prompt that alone fills ``max_length`` keeps its last
      ``max_length - 1`` tokens.

    A row with images (``image`` / ``images``, with a vision-language model's ``processor``) is
    encoded by the processor, its prompt's placeholders expanded (``preference_vision.encode_completions``),
    and the rollout carries its image inputs (``Rollout.vision``); a bound that would cut its image
    tokens is an error.

    Raises:
        ValueError: a row without a completion, or a bound that cuts a prompt's image tokens.
    """
    prompts, completions, images = [], [], []
    for i, row in enumerate(rows):
        if row.get("completion") is None:
            raise ValueError(
                f"Row {i} of this batch has no 'completion'; GKD's off-policy steps (lmbda < 1 and seq_kd=False) "
                "train on the dataset's completions. Give every row a completion (or 'messages' ending with the "
                "assistant's), or set lmbda=1.0 or seq_kd=True."
            )
        prompt, completion, inputs = _encode_row(row, i, tokenizer, processor, chat_template_kwargs)
        kept, completion = _bounded(prompt, completion, max_length, max_prompt_length)
        if inputs:
            inputs = _kept_images(inputs, prompt, len(kept), processor, tokenizer, i, max_length)
        prompts.append(kept)
        completions.append(completion)
        images.append(inputs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
    prompt_ids, prompt_mask = left_pad(prompts, pad)
    samples = Samples.from_lists(completions, pad, device)
    rollout = build_rollout(
        prompt_ids.to(device), prompt_mask.to(device), samples, eos_token_ids, pad, through_end=through_end
    )
    return replace(rollout, vision=VisionInputs(images)) if any(images) else rollout


def _encode_row(
    row: Row, index: int, tokenizer: Any, processor: Any, chat_template_kwargs: dict[str, Any] | None
) -> tuple[list[int], list[int], dict[str, torch.Tensor]]:
    """A dataset row's prompt and completion tokens (and, with images, their inputs), unbounded."""
    if processor is not None and vision.row_images(row):
        prompt, completions, inputs = encode_completions(
            row, processor, ("completion",), chat_template_kwargs=chat_template_kwargs, index=index
        )
        return prompt, completions["completion"], inputs
    out = sft.tokenize_row(
        {"prompt": row["prompt"], "completion": row["completion"]},
        tokenizer,
        "prompt_completion",
        max_length=None,
        completion_only_loss=True,
        chat_template_kwargs=chat_template_kwargs,
        index=index,
    )
    ids, mask = out["input_ids"], out["loss_mask"]
    start = mask.index(1) if 1 in mask else len(ids)
    return ids[:start], ids[start:], {}


def _kept_images(
    inputs: dict[str, torch.Tensor],
    prompt: list[int],
    kept: int,
    processor: Any,
    tokenizer: Any,
    index: int,
    max_length: int | None,
) -> dict[str, torch.Tensor]:
    """A row's image inputs for the last ``kept`` tokens of its prompt; a cut through its images refused."""
    if kept == len(prompt):
        return inputs
    image_id = vision.image_token_id(processor, tokenizer)
    if image_id is not None and image_id in prompt[: len(prompt) - kept]:
        raise ValueError(
            f"Row {index} of this batch: its prompt takes {len(prompt)} tokens with its images, and max_length="
            f"{max_length} keeps its last {kept}, which would cut its image tokens. Raise max_length (or set it to "
            "None), or use smaller images."
        )
    return {k: v[-kept:] if k in TOKEN_ALIGNED_INPUTS else v for k, v in inputs.items()}


def _bounded(
    prompt: list[int], completion: list[int], max_length: int | None, max_prompt_length: int | None
) -> tuple[list[int], list[int]]:
    """A dataset row's prompt and completion within ``max_length`` (``dataset_rollout``'s rules)."""
    if max_prompt_length is not None:  # IW-OPD: the prompt in its budget, the completion cut at the end
        prompt = prompt[-max_prompt_length:]
        if max_length is not None:
            prompt = prompt[max(0, len(prompt) - (max_length - 1)) :]
            completion = completion[: max_length - len(prompt)]
        return prompt, completion
    if max_length is None or len(prompt) + len(completion) <= max_length:
        return prompt, completion
    if len(completion) >= max_length:  # the row's last tokens, one of the prompt's kept
        return prompt[-1:], completion[len(completion) - (max_length - 1) :]
    return prompt[len(prompt) + len(completion) - max_length :], completion


PRIVILEGED_COLUMN = "privileged_context"


def check_privileged_column(dataset: Any, name: str) -> None:
    """Self-distillation rows need a ``privileged_context`` column (what the teacher reads).

    A streamed dataset whose columns are not known before it is read (``column_names`` None, e.g.
    an ``IterableDataset`` from a generator or after ``map``) passes; each row is then checked as
    it is drawn.

    Raises:
        ValueError: the column is missing.
    """
    if dataset is None or getattr(dataset, "column_names", None) is None:
        return
    columns = list(dataset.column_names)
    if PRIVILEGED_COLUMN not in columns:
        raise ValueError(
            f"The {name} has no '{PRIVILEGED_COLUMN}' column (its columns: {columns}); self-distillation's teacher "
            f"reads each prompt with its privileged context (a worked solution, feedback, a hint). Add the column, "
            "e.g. dataset.add_column('privileged_context', [...])."
        )


def teacher_prompt(prompt: Any, context: Any, template: str, index: int | str) -> Any:
    """SDFT's teacher prompt: ``template`` filled with the prompt and the privileged context.

    A conversational prompt keeps its messages; its last user message's content is the one filled
    in. A context given as messages is their contents, one per line.

    Raises:
        ValueError: the row has no context, or a conversational prompt has no user message.
    """
    if context is None or (isinstance(context, str) and not context):
        raise ValueError(
            f"Row {index} has an empty '{PRIVILEGED_COLUMN}'; the teacher needs one for every row. Fill it, or drop "
            "the row."
        )
    text = context_text(context)
    return fill_prompt(prompt, lambda p: template.format(prompt=p, privileged_context=text), index)


def context_text(context: Any) -> str:
    """A privileged context as text: a string as it is, messages as their contents, one per line."""
    if isinstance(context, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in context)
    return str(context)


def fill_prompt(prompt: Any, fill: Any, index: int | str) -> Any:
    """``fill(text)`` of a standard prompt, or the messages with the last user message's content filled
    (a content of blocks: its text blocks' text filled as one block after its other blocks, images).

    Raises:
        ValueError: a conversational prompt without a user message.
    """
    if isinstance(prompt, str):
        return fill(prompt)
    messages = [dict(m) for m in prompt]
    last_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if last_user is None:
        raise ValueError(
            f"Row {index}: the conversational prompt has no user message to add the teacher's context to."
        )
    content = messages[last_user]["content"]
    if isinstance(content, list):  # content blocks (images): their text filled, the other blocks kept
        texts = [b.get("text") or "" for b in content if isinstance(b, dict) and b.get("type") == "text"]
        others = [b for b in content if not (isinstance(b, dict) and b.get("type") == "text")]
        messages[last_user]["content"] = [*others, {"type": "text", "text": fill("".join(texts))}]
    else:
        messages[last_user]["content"] = fill(content)
    return messages
