"""Images in agent episodes: a vision-language model's prompt images and the images tools return.

An episode with images keeps them in order (the prompt's, then each tool result's) with the
processor's tensors of each part, and the token-aligned inputs (Qwen-VL's ``mm_token_type_ids``,
Gemma 3's ``token_type_ids``) over every token it holds: the processor's values over the parts it
encoded, 0 over the tokens the model sampled and the text the tokenizer encoded. From these the
loop builds the ``VisionInputs`` of each generation call (the whole episode so far is the
prompt) and of the finished rollout (prompt and completion apart), so the model sees every image
of the episode when it samples its next turn and when its completion is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.batch import TOKEN_ALIGNED_INPUTS, VisionInputs, merge_image_parts
from posttrain.data import vision


@dataclass
class EpisodeImages:
    """One episode's images and the processor's inputs for them.

    Attributes:
        images: every image of the episode, in the order its placeholders appear.
        parts: the processor's image tensors of each encoded part with images, in order.
        prompt: token-aligned inputs over the prompt tokens ([prompt tokens] each).
        completion: token-aligned inputs over the completion tokens so far, as lists.
        completion_length: how many completion tokens the episode holds.
    """

    images: list[Any] = field(default_factory=list)
    parts: list[dict[str, torch.Tensor]] = field(default_factory=list)
    prompt: dict[str, torch.Tensor] = field(default_factory=dict)
    completion: dict[str, list[int]] = field(default_factory=dict)
    completion_length: int = 0

    @property
    def has_images(self) -> bool:
        return bool(self.images)

    def set_prompt(self, inputs: dict[str, torch.Tensor], images: Sequence[Any]) -> None:
        """The prompt's processor outputs (``data.vision.encode_text``) and its images."""
        self.prompt = {k: v for k, v in inputs.items() if k in TOKEN_ALIGNED_INPUTS}
        self._add_images(inputs, images)

    def extend(
        self, length: int, inputs: dict[str, torch.Tensor] | None = None, images: Sequence[Any] = ()
    ) -> None:
        """``length`` completion tokens more: sampled or tokenised (``inputs`` None: 0 for them) or
        encoded by the processor with ``images`` (its outputs over those tokens)."""
        inputs = inputs or {}
        for name in inputs:
            if name in TOKEN_ALIGNED_INPUTS and name not in self.completion:
                self.completion[name] = [0] * self.completion_length
        for name, values in self.completion.items():
            values += inputs[name].reshape(-1)[:length].tolist() if name in inputs else [0] * length
        self.completion_length += length
        self._add_images(inputs, images)

    def _add_images(self, inputs: dict[str, torch.Tensor], images: Sequence[Any]) -> None:
        if images:
            self.images += list(images)
            self.parts.append({k: v for k, v in inputs.items() if k not in TOKEN_ALIGNED_INPUTS})

    def prompt_row(self) -> dict[str, torch.Tensor]:
        """The episode's ``VisionInputs`` row: every image's tensors, the prompt's token-aligned inputs."""
        return {**merge_image_parts(self.parts), **self.prompt} if self.parts else dict(self.prompt)

    def completion_row(self) -> dict[str, torch.Tensor]:
        """The token-aligned inputs over the completion tokens (a ``VisionInputs.completions`` row)."""
        return {
            name: torch.tensor(values, dtype=self._dtype(name)) for name, values in self.completion.items()
        }

    def generation_row(self, prompt_length: int) -> dict[str, torch.Tensor]:
        """The row for sampling the next turn, whose prompt is the whole episode so far."""
        row = {**merge_image_parts(self.parts)} if self.parts else {}
        for name in dict.fromkeys([*self.prompt, *self.completion]):
            before = self.prompt.get(name, torch.zeros(prompt_length, dtype=self._dtype(name))).reshape(-1)
            after = torch.tensor(self.completion.get(name, [0] * self.completion_length), dtype=before.dtype)
            row[name] = torch.cat([before, after])
        return row

    def _dtype(self, name: str) -> torch.dtype:
        return self.prompt[name].dtype if name in self.prompt else torch.long


def batch_inputs(episodes: Sequence[EpisodeImages], prompt_lengths: Sequence[int]) -> VisionInputs:
    """The ``VisionInputs`` of a generation call over these episodes (each one's tokens so far)."""
    return VisionInputs([e.generation_row(n) for e, n in zip(episodes, prompt_lengths, strict=True)])


def rollout_inputs(episodes: Sequence[EpisodeImages]) -> VisionInputs:
    """The ``VisionInputs`` of the finished rollout: prompt rows and completion rows."""
    return VisionInputs([e.prompt_row() for e in episodes], [e.completion_row() for e in episodes])


def encode_with_processor(
    processor: Any, text: str, images: Sequence[Any], what: str
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Tokenise rendered episode text with its images, after checking it places each of them.

    Args:
        processor: the model's processor.
        text: the rendered text (a prompt, or a tool turn's continuation).
        images: its images, in order.
        what: the text's origin for the message ("the prompt of row 2", "tool 'screenshot'").

    Raises:
        ValueError: the text holds another number of the processor's image placeholders.
    """
    token = vision.image_token_of(processor)
    places = text.count(token) if token else 0
    if places != len(images):
        raise ValueError(
            f"{what[0].upper()}{what[1:]} has {len(images)} image(s), but the tool loop's chat template rendered "
            f"{places} image placeholder(s) {token!r} for it, so the processor cannot place them. The template "
            "must write the model's image placeholder for each {'type': 'image'} content block (posttrain's qwen "
            "template writes Qwen-VL's '<|vision_start|><|image_pad|><|vision_end|>'); set a template that does "
            "as the processor's (and tokenizer's) chat_template."
        )
    return vision.encode_text(processor, text, images)
