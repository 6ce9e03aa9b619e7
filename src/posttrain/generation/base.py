"""The generation protocol shared by every backend.

A backend turns a batch of tokenised prompts into sampled completions. Everything after that
(EOS masking, the ``Rollout`` container) is shared and lives here, so backends stay small and
tests can plug in a scripted generator.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.core.batch import Rollout
from posttrain.ops.padding import right_pad


@dataclass
class Samples:
    """Raw backend output.

    Termination and length come from the source of the tokens, never from padding: a source
    that right-pads rows of different lengths (a list per row from ``rollout_func``, continuous
    batching, a scripted generator) must give ``lengths``, because its padding token may be the
    EOS token, and a row cut at the length limit would then read as one that ended with EOS.

    Attributes:
        completion_ids: [N, T] sampled tokens; anything after the first EOS is ignored.
        logps: [N, T] the sampler's log-probs of those tokens, if it reports them.
        lengths: [N] how many tokens of each row the source produced; the rest is padding.
            ``None``: every row runs to its first EOS or, without one, to the full width (the
            convention of ``model.generate``, which samples until every row has ended).
    """

    completion_ids: torch.Tensor
    logps: torch.Tensor | None = None
    lengths: torch.Tensor | None = None

    @classmethod
    def from_lists(
        cls,
        rows: Sequence[Sequence[int]],
        pad_token_id: int,
        device: torch.device | str = "cpu",
        logps: Sequence[Sequence[float]] | None = None,
    ) -> Samples:
        """Right-pad token lists into ``Samples``, keeping each row's own length.

        Args:
            rows: the tokens of each completion, as the source produced them.
            pad_token_id: fills the columns past a row's end.
            device: where the tensors go.
            logps: the sampler's log-prob of each token, same lengths as ``rows``.
        """
        ids = right_pad([list(r) for r in rows], pad_token_id, torch.long)
        values = None if logps is None else right_pad([list(r) for r in logps], 0.0, torch.float32).to(device)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        return cls(completion_ids=ids.to(device), logps=values, lengths=lengths.to(device))


@dataclass
class EnginePrompts:
    """A batch's rows with images for an engine that runs the model's processor itself (vLLM).

    Attributes:
        ids: each row's prompt tokens with one placeholder per image, as the chat template writes
            it (``vision.placeholder_ids``); the engine expands each into its image's tokens.
        images: each row's images (PIL images; none for a text row).
    """

    ids: list[list[int]]
    images: list[list[Any]]

    def requests(self) -> list[dict[str, Any]]:
        """vLLM's prompt of each row: its tokens, and its images as ``multi_modal_data``."""
        return [
            {"prompt_token_ids": ids, **({"multi_modal_data": {"image": list(images)}} if images else {})}
            for ids, images in zip(self.ids, self.images, strict=True)
        ]


def check_expansion(expanded: Sequence[Sequence[int]], trainer: Sequence[Sequence[int]], engine: str) -> None:
    """Check that an engine expanded each row's image placeholders into the tokens the trainer's
    processor gives (the prompt the trainer scores the completion after).

    Raises:
        ValueError: a row differs; names the row, both lengths and the likely cause.
    """
    for i, (theirs, ours) in enumerate(zip(expanded, trainer, strict=True)):
        if list(theirs) != list(ours):
            raise ValueError(
                f"{engine} expanded row {i}'s prompt with images into {len(theirs)} tokens where the trainer's "
                f"processor gives {len(ours)} (or other tokens): the engine's processor, loaded from the model's "
                "folder, differs from processing_class (image sizes, min_pixels/max_pixels, patch or merge size). "
                "Save the trainer's processor to that folder (processor.save_pretrained) or pass the folder's "
                "processor as processing_class."
            )


@runtime_checkable
class Generator(Protocol):
    """Samples one completion per row of a left-padded prompt batch."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> Samples:
        """Args: prompt_ids [N, P], prompt_mask [N, P]. Returns one completion per row."""
        ...


def check_takes_images(
    generator: Generator, takes: tuple[str, ...] = ("model_inputs", "engine_prompts")
) -> None:
    """Refuse a generator whose ``generate`` takes neither ``model_inputs`` (a vision-language
    model's image inputs) nor ``engine_prompts`` (``EnginePrompts``: the images for an engine that
    runs the processor itself, which says so with ``runs_processor = True``): sampling without
    them would ignore the images. ``takes``: the keywords that count (an agent's episodes pass
    ``model_inputs`` alone).

    Raises:
        NotImplementedError: naming the generator and the backend that takes images.
    """
    params = inspect.signature(generator.generate).parameters
    if "engine_prompts" in takes and getattr(generator, "runs_processor", False):
        return
    if set(takes) & set(params) or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise NotImplementedError(
        f"{type(generator).__name__} does not take image inputs; vision-language models sample with the "
        "transformers backend or vLLM (use_transformers_continuous_batching=False)."
    )


def mask_after_eos(
    completion_ids: torch.Tensor,
    eos_token_ids: list[int],
    lengths: torch.Tensor | None = None,
    through_end: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask every token after the first EOS, and every padding column past a row's length.

    Args:
        completion_ids: [N, T] sampled tokens.
        eos_token_ids: ids that end a completion.
        lengths: [N] tokens the source produced per row (``Samples.lengths``); ``None``: all ``T``.
        through_end: keep every token up to each row's length, EOS or not: a dataset's completion
            as the chat template writes it (``<|im_end|>`` then ``"\n"``), which SFT trains on too.

    Returns:
        ``mask`` [N, T] (1 up to and including the first EOS within the row's length; with
        ``through_end``, up to the length) and ``is_terminated`` [N] (an EOS within that length).
    """
    T = completion_ids.shape[1]
    positions = torch.arange(T, device=completion_ids.device).unsqueeze(0)  # [1, T]
    if lengths is None:
        lengths = torch.full((completion_ids.shape[0],), T, dtype=torch.long, device=completion_ids.device)
    produced = positions < lengths.to(completion_ids.device).unsqueeze(1)  # [N, T]
    eos = torch.tensor(eos_token_ids, device=completion_ids.device)
    is_eos = torch.isin(completion_ids, eos) & produced  # [N, T]
    is_terminated = is_eos.any(dim=1)
    if through_end:
        return produced.long(), is_terminated
    first_eos = torch.where(is_terminated, is_eos.int().argmax(dim=1), torch.full_like(lengths, T))
    mask = ((positions <= first_eos.unsqueeze(1)) & produced).long()
    return mask, is_terminated


def build_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    samples: Samples,
    eos_token_ids: list[int],
    pad_token_id: int,
    through_end: bool = False,
) -> Rollout:
    """Assemble a ``Rollout``: mask after EOS (or, ``through_end``, after each row's length: a
    dataset completion, :func:`mask_after_eos`), replace masked tokens by padding."""
    completion_ids, logps = samples.completion_ids, samples.logps
    if completion_ids.shape[1] == 0:  # nothing sampled: one padding column that counts for nothing
        n = completion_ids.shape[0]
        completion_ids = torch.full((n, 1), pad_token_id, dtype=torch.long, device=prompt_ids.device)
        mask = torch.zeros_like(completion_ids)
        terminated = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
        logps = torch.zeros((n, 1), device=prompt_ids.device) if logps is not None else None
    else:
        mask, terminated = mask_after_eos(completion_ids, eos_token_ids, samples.lengths, through_end)
    completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad_token_id))
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=mask,
        is_terminated=terminated,
        sampler_logps=logps,
    )
