"""GOLD's two tokenisations of a row and the per-sample losses across tokenizers (``distill/gold.py``'s trainer uses them; its module docstring tells how a batch crosses tokenizers)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from posttrain.distill.gold_config import H_KL_THRESHOLD
from posttrain.ops.cross_tokenizer import (
    common_map_from_projection,
    load_projection_matrix,
    matched_tokens,
    merge_group_distributions,
    tempered_log_softmax,
    token_bytes,
)
from posttrain.ops.divergence import HeadInputs
from posttrain.ops.logprobs import completion_head_inputs

if TYPE_CHECKING:
    pass

__all__ = ["TeacherRow", "completion_text"]

Span = tuple[int, int]


# ---- one row's two tokenisations ------------------------------------------------------------------


@dataclass
class TeacherRow:
    """One completion as the teacher reads it, and its alignment with the student's tokens.

    Token indices of the groups are *local*: index 0 is the last prompt token and ``j + 1`` the
    completion's token ``j`` (the rows ``merge_group_distributions`` reads, each predicting the
    next token).

    Attributes:
        prompt_ids: the teacher's prompt tokens (its chat template).
        completion_ids: the teacher's tokens of the completion text (its EOS last if the
            student's completion ended with one).
        student_groups: [G, 2] long local ``(start, end)`` student token ranges.
        teacher_groups: [G, 2] long local ranges on the teacher's side.
        kept: how many of the G groups are valid on both sides (the spans the loss compares).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    student_groups: torch.Tensor
    teacher_groups: torch.Tensor
    kept: int


def completion_text(
    ids: Sequence[int], pieces: Sequence[bytes | None], special: set[int]
) -> tuple[str, list[Span]]:
    """The text of generated tokens and each token's UTF-8 byte span in it.

    Args:
        ids: the tokens, in order.
        pieces: [V] each id's bytes (``token_bytes``); ``None`` or empty: no text.
        special: ids without text (special tokens), given a zero-width span.

    Returns:
        ``(text, offsets)``: the bytes decoded as UTF-8 (invalid bytes replaced), and per token
        ``(start, end)`` into ``text.encode()``. A token whose bytes end inside a character
        reaches to the end of the text the next token's bytes complete, so the two overlap (one
        unit for ``align_spans``), as a fast tokenizer's offsets of a split character do.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    parts: list[str] = []
    offsets: list[Span] = []
    pending: list[int] = []  # tokens whose bytes have not produced a character yet
    at = 0
    for k, idx in enumerate(ids):
        piece = None if idx in special or idx >= len(pieces) else pieces[idx]
        if not piece:
            offsets.append((at, at))
            continue
        out = decoder.decode(piece)
        offsets.append((at, at))
        pending.append(k)
        if out:
            end = at + len(out.encode("utf-8"))
            for p in pending:
                offsets[p] = (offsets[p][0], end)
            parts.append(out)
            at = end
            pending = [k] if decoder.getstate()[0] else []  # its last bytes start the next character
    tail = decoder.decode(b"", final=True)
    if tail:
        end = at + len(tail.encode("utf-8"))
        for p in pending:
            offsets[p] = (offsets[p][0], end)
        parts.append(tail)
    return "".join(parts), offsets


def _positional_groups(n_student: int, n_teacher: int) -> list[tuple[Span, Span]]:
    """The original ULD's pairing: the i-th token of each side, up to the shorter length."""
    return [((i, i + 1), (i, i + 1)) for i in range(min(n_student, n_teacher))]


def _valid(groups: torch.Tensor, token_ids: torch.Tensor, strategy: str, merge: str) -> torch.Tensor:
    """[G] which groups ``merge_group_distributions`` can merge for a sequence (its index rules only).

    The rules depend on the sequence's length and the groups, not on the values: a one-entry
    vocabulary and token 0 everywhere ask them without building [T, V].
    """
    if groups.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    dummy = torch.zeros(len(token_ids), 1)
    zeros = torch.zeros(len(token_ids), dtype=torch.long)
    return merge_group_distributions(dummy, zeros, groups.cpu(), strategy=strategy, merge=merge)[1].cpu()


# ---- the per-sample losses ---------------------------------------------------------------------------


def _logps(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, temperature: float):
    """[n, V] tempered log-probs of one sample's rows: ``x`` hidden states (or logits when no weight)."""
    logits = F.linear(x, weight, bias) if weight is not None else x
    return tempered_log_softmax(logits, temperature)


@dataclass(frozen=True)
class _SampleSides:
    """One sample's two sides: each model's rows ([n, H] or [n, V] logits), head and local tokens."""

    student: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    teacher: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
    student_tokens: torch.Tensor
    teacher_tokens: torch.Tensor
    row: TeacherRow


def _merged_side(
    side: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tokens: torch.Tensor,
    groups: torch.Tensor,
    temperature: float,
    how: tuple[str, str],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One side's merged log-distribution per group and which groups are valid: ([G, V], [G])."""
    strategy, merge = how
    return merge_group_distributions(
        _logps(*side, temperature), tokens, groups, strategy=strategy, merge=merge
    )


def _merged_pair(
    sides: _SampleSides, s_x: torch.Tensor, temps: tuple[float, float], how: tuple[str, str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The groups valid on both sides, merged: ``(student [G, Vs] with gradient, teacher [G, Vt])``.

    Args:
        sides: the sample.
        s_x: the student's rows (the checkpointed input).
        temps: the student's and the teacher's temperatures.
        how: ``(strategy, merge)`` of ``merge_group_distributions``.
    """
    _, s_w, s_b = sides.student
    s_merged, s_valid = _merged_side(
        (s_x, s_w, s_b), sides.student_tokens, sides.row.student_groups, temps[0], how
    )
    with torch.no_grad():
        t_merged, t_valid = _merged_side(
            sides.teacher, sides.teacher_tokens, sides.row.teacher_groups, temps[1], how
        )
    keep = s_valid & t_valid.to(s_valid.device)
    return s_merged[keep], t_merged[keep].to(s_merged.dtype)


def _p_kl_rows(s_logps: torch.Tensor, t_top: torch.Tensor, projection_t: torch.Tensor) -> torch.Tensor:
    """P-KL (X-Token Eq. 4) on given teacher tokens K: ``sum_K p_t (log p_t - log (p_s W)_K)`` per row.

    ``xtoken_p_kl``'s formula with K chosen by the caller (the micro-batch's top-k, while the rows
    arrive one sample at a time).

    Args:
        s_logps: [N, Vs] the student's log-probs (merged rows).
        t_top: [N, k] the teacher's log-probs at K (detached).
        projection_t: [k, Vs] sparse ``W[:, K]`` transposed.

    Returns:
        [N] the per-row KD term (may be negative: not renormalised over K).
    """
    with torch.autocast(s_logps.device.type, enabled=False):  # no low-precision sparse product
        q = torch.sparse.mm(projection_t, s_logps.float().exp().t()).t()  # [N, k] = p_s W[:, K]
        log_q = q.clamp_min(torch.finfo(q.dtype).tiny).log()
        t = t_top.float()
        return (t.exp() * (t - log_q)).sum(dim=-1)


class _Pair:
    """What the cross-tokenizer losses need of the two tokenizers, built once per trainer.

    Attributes:
        tokenizer: the teacher's tokenizer.
        pieces: [Vs] the bytes of each student token id.
        special: the student's special token ids (no text).
        eos: the teacher's EOS id, or ``None``.
        common: [Vs] the teacher token common with each student token (-1: none), for the hybrid
            ULD (identical text) or H-KL (top-1 projection weight >= 0.6); ``None`` otherwise.
        projection: [Vs, Vt] sparse X-Token matrix, or ``None``.
    """

    def __init__(self, student_tokenizer: Any, tokenizer: Any, sizes: tuple[int, int], args: Any) -> None:
        vs, vt = sizes
        for name, tok in (("student", student_tokenizer), ("teacher", tokenizer)):
            if not getattr(tok, "is_fast", False):
                raise ValueError(
                    f"The {name}'s tokenizer ({type(tok).__name__}) is a slow tokenizer; aligning the two "
                    "tokenisations needs byte offsets, which only fast tokenizers report. Load it with "
                    "AutoTokenizer.from_pretrained(..., use_fast=True)."
                )
        if len(tokenizer) > vt:
            raise ValueError(
                f"The teacher's tokenizer has {len(tokenizer)} tokens but the teacher's model only {vt} logits; "
                "pass the teacher's own tokenizer (teacher_processing_class or teacher_tokenizer_name_or_path)."
            )
        self.tokenizer = tokenizer
        self.pieces = token_bytes(student_tokenizer, vs)
        self.special = set(student_tokenizer.all_special_ids)
        self.eos = tokenizer.eos_token_id
        self.projection = None
        self.common = None
        if args.xtoken_loss_type is not None:
            self.projection = load_projection_matrix(args.xtoken_projection_matrix_path, vs, vt)
            if args.xtoken_loss_type == "h_kl":
                self.common = common_map_from_projection(self.projection, H_KL_THRESHOLD)
        elif args.uld_use_hybrid_loss:
            self.common = matched_tokens(student_tokenizer, tokenizer, vs, vt)


def _head_inputs(model: torch.nn.Module, ids: tuple[torch.Tensor, ...], pad: int) -> tuple[HeadInputs, Any]:
    """One model's side with one more position per row: [B, T + 1, ...], row ``j`` predicting token ``j``.

    The extra (masked) column makes position ``T_i`` of each row the output at its last token, the
    row that predicts past the completion (the loss's unshifted rows need it).
    """
    prompt_ids, prompt_mask, completion_ids, completion_mask = ids
    column = completion_ids.new_full((completion_ids.shape[0], 1), pad)
    return completion_head_inputs(
        model,
        prompt_ids,
        prompt_mask,
        torch.cat([completion_ids, column], dim=1),
        torch.cat([completion_mask, torch.zeros_like(column, dtype=completion_mask.dtype)], dim=1),
    )


def _pad_rows(rows: list[list[int]], pad: int, left: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Token lists as ``(ids [N, W], mask [N, W])``, padded on the left or the right."""
    width = max(max((len(r) for r in rows), default=0), 1)
    ids = [([pad] * (width - len(r)) + r) if left else (r + [pad] * (width - len(r))) for r in rows]
    mask = [
        ([0] * (width - len(r)) + [1] * len(r)) if left else ([1] * len(r) + [0] * (width - len(r)))
        for r in rows
    ]
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device)
