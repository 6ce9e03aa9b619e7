"""Typed, neutral batch containers shared by generation, agents and every trainer.

``Sequences`` (tokens and a loss mask, what SFT trains on), ``Pairs`` (a chosen and a rejected
``Sequences`` sharing their prompts, what preference methods train on), ``PromptRows`` (rows
split into prompt and completion, to score a shared prompt once), ``Rollout``
(prompts and sampled completions with the sampler's log-probs, what online methods score) and
``VisionInputs`` (a vision-language model's per-row image inputs, carried by a ``Rollout``).
No module here imports a trainer family. Shapes: ``N`` rows, ``L`` tokens per row, ``P``
prompt tokens (left padded), ``T`` completion tokens (right padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass
class Sequences:
    """Token rows for teacher-forced training, right padded or packed.

    Attributes:
        input_ids: [N, L] tokens.
        loss_mask: [N, L] 1 on the tokens that are prediction targets (the model is trained to
            predict token ``t`` from the tokens before it); 0 on prompts, padding, and tokens
            other roles wrote.
        attention_mask: [N, L] 1 on real tokens; ``None`` for a packed (padding-free) row,
            whose sequences are told apart by ``position_ids``.
        position_ids: [N, L] positions, restarting at 0 at the start of every packed sequence.
        vision: a vision-language model's image inputs for the rows (SFT with images); the rows
            are then left-padded, so its token-aligned inputs line up with the tokens.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    vision: VisionInputs | None = None

    @property
    def num_targets(self) -> int:
        """How many tokens are prediction targets (the first token of a row never is)."""
        return int(self.loss_mask[:, 1:].sum().item())

    def model_kwargs(self, device: torch.device | str) -> dict[str, torch.Tensor] | None:
        """The image inputs of the model's forward for these rows (``None`` without images)."""
        if self.vision is None:
            return None
        return self.vision.model_kwargs(self.input_ids.shape[1], 0, device)


@dataclass
class Pairs:
    """A preferred and a dispreferred continuation of the same prompts, row by row.

    Attributes:
        chosen: [N, L_c] the preferred rows (prompt + chosen completion).
        rejected: [N, L_r] the dispreferred rows (prompt + rejected completion), same prompts.
    """

    chosen: Sequences
    rejected: Sequences

    @property
    def num_pairs(self) -> int:
        return int(self.chosen.input_ids.shape[0])

    def stacked(self) -> Sequences:
        """The chosen rows then the rejected rows as one batch, for a single forward pass.

        Both sides must have the same width (``data.preference.collate_pairs`` pads them so).
        """
        c, r = self.chosen, self.rejected
        if c.input_ids.shape[1] != r.input_ids.shape[1]:
            raise ValueError(
                f"The chosen rows are {c.input_ids.shape[1]} tokens wide and the rejected ones "
                f"{r.input_ids.shape[1]}; pad both sides to the same width to stack them."
            )

        def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            return None if a is None or b is None else torch.cat([a, b])

        return Sequences(
            torch.cat([c.input_ids, r.input_ids]),
            torch.cat([c.loss_mask, r.loss_mask]),
            cat(c.attention_mask, r.attention_mask),
            cat(c.position_ids, r.position_ids),
        )


@dataclass
class PromptRows:
    """Rows split at the end of their prompts: the layout that runs a shared prompt once.

    Attributes:
        prompt_ids: [N, P] prompts, left padded (rows may repeat a prompt: a pair's two sides).
        prompt_mask: [N, P] 1 on real prompt tokens.
        completion_ids: [N, T] completions, right padded.
        completion_mask: [N, T] 1 on the completion tokens that are targets.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor

    def to(self, device: torch.device | str) -> PromptRows:
        return PromptRows(*(t.to(device) for t in (self.prompt_ids, self.prompt_mask, self.completion_ids,
                                                   self.completion_mask)))  # fmt: skip


#: Processor outputs with one value per prompt token (aligned with ``input_ids``): they are padded
#: with the prompts and continued with 0 over the completion tokens. Every other processor output
#: (pixel values, grid sizes, image sizes, pixel masks) is per image and concatenated over rows.
TOKEN_ALIGNED_INPUTS = ("mm_token_type_ids", "token_type_ids")


@dataclass
class VisionInputs:
    """A vision-language model's inputs besides the tokens, kept per row of a batch.

    The processor of each row is run on that row alone, so a row's tensors describe its own
    images (Qwen2-VL: ``pixel_values`` [patches, D] and ``image_grid_thw`` [images, 3]; Idefics3 /
    SmolVLM: ``pixel_values`` [1, images, C, H, W] and ``pixel_attention_mask``; LLaVA-NeXT:
    ``pixel_values`` [images, crops, C, H, W] and ``image_sizes``; Gemma 3: ``pixel_values``
    [images, C, H, W]), and a micro-batch concatenates the tensors of its own rows
    (``model_kwargs``). A row without images has an empty dict.

    Attributes:
        rows: one dict per row: image tensors as the processor returned them for that row (or
            several processor calls' tensors joined by ``merge_image_parts``: an agent episode's
            prompt and tool results), and the ``TOKEN_ALIGNED_INPUTS`` as 1-D tensors over the
            row's real prompt tokens.
        completions: per row, the ``TOKEN_ALIGNED_INPUTS`` over the row's completion tokens, from
            its first (the image tokens of tool results inserted into an agent episode); empty
            (the default): 0 over every completion.
    """

    rows: list[dict[str, torch.Tensor]]
    completions: list[dict[str, torch.Tensor]] = field(default_factory=list)

    def select(self, index: slice | Sequence[int]) -> VisionInputs:
        """The inputs of the given rows, in that order."""
        if isinstance(index, slice):
            return VisionInputs(self.rows[index], self.completions[index])
        picked = [self.rows[i] for i in index]
        return VisionInputs(picked, [self.completions[i] for i in index] if self.completions else [])

    @staticmethod
    def gather(rows: Sequence[tuple[VisionInputs | None, int]]) -> VisionInputs:
        """Rows taken from several batches: ``(inputs, row)`` pairs, ``None`` for a text-only batch."""
        picked = [v.rows[i] if v is not None else {} for v, i in rows]
        completions = [v.completions[i] if v is not None and v.completions else {} for v, i in rows]
        return VisionInputs(picked, completions if any(completions) else [])

    @property
    def has_images(self) -> bool:
        """Whether any row has image tensors."""
        return any(k not in TOKEN_ALIGNED_INPUTS for row in self.rows for k in row)

    def model_kwargs(
        self, prompt_width: int, completion_width: int, device: torch.device | str
    ) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward (or ``generate``) for these rows.

        Args:
            prompt_width: P, the width of the left-padded prompts the rows sit in.
            completion_width: T, the completion tokens after the prompts (0 for generation).
            device: where the tensors go.

        Returns:
            Token-aligned inputs as [N, P + T] (0 on padding, and on completions unless
            ``completions`` has their values); the image tensors of every row concatenated on
            their first dimension, the others zero-padded to the largest row's (as a processor
            pads a batch: padding images are all zero).
        """
        names = dict.fromkeys(k for row in [*self.rows, *self.completions] for k in row)
        out: dict[str, torch.Tensor] = {}
        for name in names:
            if name in TOKEN_ALIGNED_INPUTS:
                out[name] = _token_aligned(self.rows, self.completions, name, prompt_width, completion_width)
            else:
                out[name] = _concat_padded([row[name] for row in self.rows if name in row])
        return {k: v.to(device) for k, v in out.items()}


def merge_image_parts(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One row's image tensors from several processor calls on it, images in call order.

    Each image input is concatenated on its first dimension, the others zero-padded, as
    ``VisionInputs.model_kwargs`` joins rows (SmolVLM's [1, images, ...] parts become [parts,
    images, ...]: the model drops the all-zero padding images and fills the placeholders in
    order). Token-aligned inputs are left out: they follow the tokens, not the images.
    """
    names = dict.fromkeys(k for part in parts for k in part if k not in TOKEN_ALIGNED_INPUTS)
    return {name: _concat_padded([part[name] for part in parts if name in part]) for name in names}


def _token_aligned(
    rows: list[dict[str, torch.Tensor]],
    completions: list[dict[str, torch.Tensor]],
    name: str,
    width: int,
    extra: int,
) -> torch.Tensor:
    """[N, width + extra]: each row's values right-aligned in the prompt columns, its completion's
    values (if any) from the first completion column, 0 elsewhere."""
    dtype = next(part[name].dtype for part in [*rows, *completions] if name in part)
    out = torch.zeros(len(rows), width + extra, dtype=dtype)
    for i, row in enumerate(rows):
        if name in row:
            values = row[name].reshape(-1)[-width:]
            out[i, width - values.shape[0] : width] = values
        if extra and completions and name in completions[i]:
            values = completions[i][name].reshape(-1)[:extra]
            out[i, width : width + values.shape[0]] = values
    return out


def _concat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate on dim 0, zero-padding every other dimension to the largest part's size."""
    shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    padded = []
    for p in parts:
        pad: list[int] = []
        for d in reversed(range(1, p.dim())):
            pad += [0, shape[d - 1] - p.shape[d]]
        padded.append(torch.nn.functional.pad(p, pad) if any(pad) else p)
    return torch.cat(padded, dim=0)


@dataclass
class Rollout:
    """What the generator produced for a batch of prompts.

    Attributes:
        prompt_ids: [N, P] prompt tokens, left padded.
        prompt_mask: [N, P] 1 on real prompt tokens.
        completion_ids: [N, T] sampled tokens, right padded.
        completion_mask: [N, T] 1 up to and including the first EOS, 0 after it.
        is_terminated: [N] whether the completion ended with EOS (False: cut at the length limit).
        sampler_logps: [N, T] log-probabilities the sampler assigned, when it reports them.
        tool_mask: [N, T] in agent rollouts, 1 on the tokens the model sampled and 0 on those the
            tool loop inserted (tool results, template text); ``None`` when every completion
            token was sampled.
        vision: a vision-language model's image inputs of each row, or ``None`` (text only).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    is_terminated: torch.Tensor
    sampler_logps: torch.Tensor | None = None
    tool_mask: torch.Tensor | None = None
    vision: VisionInputs | None = None

    def vision_kwargs(self) -> dict[str, torch.Tensor] | None:
        """The model's image inputs for scoring ``[prompt | completion]`` rows, or ``None``."""
        if self.vision is None:
            return None
        P, T = self.prompt_ids.shape[1], self.completion_ids.shape[1]
        return self.vision.model_kwargs(P, T, self.prompt_ids.device)

    @property
    def completion_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens (EOS included), inserted tool tokens included."""
        return self.completion_mask.sum(dim=1)

    @property
    def model_token_mask(self) -> torch.Tensor:
        """[N, T] 1 on the completion tokens the model sampled (tool results excluded)."""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask * self.tool_mask

    @property
    def generated_lengths(self) -> torch.Tensor:
        """[N] number of completion tokens the model sampled (what ``completions/*`` count)."""
        return self.model_token_mask.sum(dim=1)

    def rows(self, rows: slice) -> Rollout:
        """The given rows, without the prompt columns that are padding in all of them and the
        completion columns past their longest completion."""
        keep_p = int(self.prompt_mask[rows].sum(dim=1).max().item())
        keep_t = max(int(self.completion_mask[rows].sum(dim=1).max().item()), 1)
        start_p = self.prompt_ids.shape[1] - keep_p
        return Rollout(
            prompt_ids=self.prompt_ids[rows, start_p:],
            prompt_mask=self.prompt_mask[rows, start_p:],
            completion_ids=self.completion_ids[rows, :keep_t],
            completion_mask=self.completion_mask[rows, :keep_t],
            is_terminated=self.is_terminated[rows],
            sampler_logps=self.sampler_logps[rows, :keep_t] if self.sampler_logps is not None else None,
            tool_mask=self.tool_mask[rows, :keep_t] if self.tool_mask is not None else None,
            vision=self.vision.select(rows) if self.vision is not None else None,
        )
