"""Log-probabilities and entropy of completion tokens (online methods) and of whole rows (SFT).

The model is run on ``[prompt | completion]``; log-probs are taken of
``softmax(logits / temperature)``, the distribution the sampler drew from. Two paths compute them:

- chunked (the default where ``chunked.supports_chunked`` holds): the final hidden states of the
  completion positions are projected onto the vocabulary a chunk of token rows at a time, and
  recomputed in backward, so no ``[B, T, V]`` logits exist (``ops/chunked.py``);
- naive (any other model, or ``chunk_size=None``): the model's own logits of the completion
  positions (``logits_to_keep``), log-softmaxed one row at a time so at most one row's float32
  copy of ``[T, V]`` exists besides the logits themselves.

This module scores teacher-forced rows for the offline trainers (``score_rows``,
``score_completions`` -> ``RowScores``, ``unpack_scores``). The completion log-probs of the online
methods are in ``ops/online_logps.py`` and the next-token statistics of whole rows in
``ops/sequence_stats.py``; their public names are imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from posttrain.ops import chunked
from posttrain.ops.online_logps import (  # noqa: F401  (re-exported)
    PolicyOutput,
    completion_head_inputs,
    completion_logps,
    position_ids_from_mask,
    rows_and_hidden,
    sampler_topk,
    sampler_topk_truncated,
)
from posttrain.ops.sequence_stats import (  # noqa: F401  (re-exported)
    SequenceStats,
    _stats_from_hidden,
    entropy_from_logits,
    right_padding_only,
    selective_log_softmax,
    sequence_token_stats,
    top_log_softmax,
)


@dataclass
class RowScores:
    """What scoring teacher-forced rows gives the offline preference trainers (DPO, KTO, ORPO, CPO).

    Attributes:
        logps: [N] the summed log-probs of each row's target tokens (``loss_mask``).
        lengths: [N] each row's number of target tokens.
        token_logps: [N, L - 1] per-token log-probs (position ``t`` scores token ``t + 1``).
        mask: [N, L - 1] 1 on the target tokens, in ``token_logps``' dtype.
        stats: the ``SequenceStats`` the scores came from (entropy, top, head summaries, aux loss).
    """

    logps: torch.Tensor
    lengths: torch.Tensor
    token_logps: torch.Tensor
    mask: torch.Tensor
    stats: SequenceStats


def score_rows(
    model: torch.nn.Module,
    rows: Any,
    *,
    with_metrics: bool = False,
    with_log_sq_norm: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
) -> RowScores:
    """Score right-padded rows (a ``core.batch.Sequences``) under ``model``: summed target log-probs.

    Args:
        model: the policy or a reference.
        rows: ``Sequences`` with ``input_ids``, ``loss_mask`` and a 2-D ``attention_mask`` (and,
            for a vision-language model, left-padded with their ``vision`` inputs).
        with_metrics: also entropy, top log-prob and mean logit per position (no gradient).
        with_log_sq_norm: also ``log sum_v p_v^2`` per position (WPO).
        chunk_size: as in ``sequence_token_stats``.
    """
    positions = rows.position_ids
    if positions is None:
        positions = (rows.attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    images = rows.model_kwargs(rows.input_ids.device) if getattr(rows, "vision", None) is not None else None
    stats = sequence_token_stats(
        model,
        rows.input_ids,
        rows.attention_mask,
        positions,
        with_entropy=with_metrics,
        with_top=with_metrics,
        chunk_size=chunk_size,
        with_logit_mean=with_metrics,
        with_log_sq_norm=with_log_sq_norm,
        target_mask=rows.loss_mask[:, 1:],
        model_inputs=images,
    )
    mask = rows.loss_mask[:, 1:].to(stats.logps.dtype)  # [N, L - 1]
    return RowScores((stats.logps * mask).sum(dim=1), mask.sum(dim=1), stats.logps, mask, stats)


def score_completions(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    with_metrics: bool = False,
    with_log_sq_norm: bool = False,
    chunk_size: int | None = chunked.DEFAULT_CHUNK_SIZE,
    model_inputs: dict[str, torch.Tensor] | None = None,
) -> RowScores:
    """Score completions after their prompts, each distinct prompt run through the model once.

    The preference trainers' rows share prompts in pairs (a chosen and a rejected completion of
    each); where ``ops/shared_prefix.py`` supports the model, the prompt's forward, backward and
    recomputation happen once per pair instead of twice. Elsewhere the ``[prompt | completion]``
    rows are scored whole. The scores are in the completions' layout: ``token_logps[:, t]`` is
    completion token ``t``'s log-prob and ``mask`` is ``completion_mask``. The LM head runs on the
    completion tokens only (every field is 0 on the completions' padding).

    Args:
        model: the policy or a reference.
        prompt_ids: [N, P] left-padded prompts; prompt_mask: [N, P].
        completion_ids: [N, T] right-padded completions; completion_mask: [N, T] 1 on targets.
        with_metrics: also entropy, top log-prob and mean logit per position (no gradient).
        with_log_sq_norm: also ``log sum_v p_v^2`` per position (WPO).
        chunk_size: as in ``sequence_token_stats``; ``None`` forces full logits (whole rows).
        model_inputs: a vision-language model's image inputs for the ``[prompt | completion]``
            rows (``VisionInputs.model_kwargs``); the rows are then scored whole (a prompt's
            images are read with it).
    """
    rows = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    inputs, found = rows_and_hidden(model, *rows, model_inputs, True, chunk_size is not None)
    if found is not None:
        out, predicting = found
        stats = _stats_from_hidden(
            model, out, predicting, completion_ids, chunk_size, with_metrics, with_metrics, with_metrics,
            with_log_sq_norm, completion_mask,
        )  # fmt: skip
    else:
        stats = _whole_row_stats(
            model, inputs, prompt_ids.shape[1], completion_mask, with_metrics, with_log_sq_norm, chunk_size,
            model_inputs,
        )  # fmt: skip
    mask = completion_mask.to(stats.logps.dtype)
    return RowScores((stats.logps * mask).sum(dim=1), mask.sum(dim=1), stats.logps, mask, stats)


def _whole_row_stats(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    prompt_width: int,
    completion_mask: torch.Tensor,
    with_metrics: bool,
    with_log_sq_norm: bool,
    chunk_size: int | None,
    model_inputs: dict[str, torch.Tensor] | None,
) -> SequenceStats:
    """``score_completions``' statistics from the ``[prompt | completion]`` rows scored whole (the
    model's own logits where the chunked path does not apply), in the completions' layout."""
    start = prompt_width - 1  # position P - 1 predicts completion token 0
    targets = torch.zeros_like(inputs["input_ids"][:, 1:])  # [N, P + T - 1]: the head runs on these
    targets[:, start:] = completion_mask
    whole = sequence_token_stats(
        model, inputs["input_ids"], inputs["attention_mask"], position_ids_from_mask(inputs["attention_mask"]),
        with_entropy=with_metrics, with_top=with_metrics, chunk_size=chunk_size,
        with_logit_mean=with_metrics, with_log_sq_norm=with_log_sq_norm, target_mask=targets,
        model_inputs=model_inputs,
    )  # fmt: skip

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return t[:, start:] if t is not None else None

    return SequenceStats(
        whole.logps[:, start:], cut(whole.entropy), cut(whole.top), whole.aux_loss,
        cut(whole.logit_mean), cut(whole.log_sq_norm),
    )  # fmt: skip


def unpack_scores(scores: RowScores, lengths: torch.Tensor) -> RowScores:
    """Per-sequence ``RowScores`` of sequences packed end to end in one row.

    Args:
        scores: the scores of a packed batch ``[1, S]`` (``score_rows`` on a row whose
            ``position_ids`` restart at every sequence): per-token fields are ``[1, S - 1]``.
        lengths: [K] the tokens of each packed sequence, in order (their sum is at most ``S``;
            what follows is padding).

    Returns:
        ``RowScores`` with ``[K]`` sums and ``[K, max(lengths) - 1]`` per-token fields, laid out as
        if each sequence were its own right-padded row (position ``t`` scores token ``t + 1``).
        Gradients flow back to the packed log-probs.
    """
    if scores.token_logps.shape[0] != 1:
        raise ValueError(f"unpack_scores takes one packed row, got {scores.token_logps.shape[0]} rows.")
    device = scores.token_logps.device
    lengths = lengths.to(device=device, dtype=torch.long)
    starts = torch.cumsum(lengths, dim=0) - lengths  # [K]
    width = max(int(lengths.max()) - 1, 1)
    offsets = torch.arange(width, device=device)
    inside = offsets[None, :] < (lengths[:, None] - 1)  # [K, W]: positions scoring a token of the sequence
    index = torch.where(inside, starts[:, None] + offsets[None, :], 0)  # [K, W] into the packed positions

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return t[0][index] if t is not None else None

    mask = take(scores.mask) * inside.to(scores.mask.dtype)
    token_logps = take(scores.token_logps)
    s = scores.stats
    stats = SequenceStats(
        take(s.logps), take(s.entropy), take(s.top), s.aux_loss, take(s.logit_mean), take(s.log_sq_norm)
    )
    return RowScores((token_logps * mask).sum(dim=1), mask.sum(dim=1), token_logps, mask, stats)
