"""Aligning two tokenisations of one text by UTF-8 byte offsets (cross-tokenizer distillation).

A student and a teacher with different tokenizers cut the same completion text at different
places: ``"café au lait"`` may be ``caf|é| a|u| lait`` for one and ``ca|f\\xc3|\\xa9| au| la|it`` for
the other. Their next-token distributions can only be compared where both have read the same
text, so ``align_spans`` groups the two token sequences into spans of identical bytes: each
``AlignedGroup`` is a run of student tokens and a run of teacher tokens that start and end at the
same byte (above: ``café``, `` au``, `` lait``; a 2:3, a 2:1 and a 1:2 group). The GOLD trainer's
ULD loss (``ops/cross_tokenizer.py``) merges the distributions within each group and compares the
groups.

Choices where the facts leave room:

- **Bytes, not characters.** Offsets are UTF-8 byte offsets, so that a byte-level BPE token holding
  half of a multi-byte character (``\\xc3`` of ``é``) has a place. ``byte_offsets`` converts a
  fast tokenizer's character offsets; such half-character tokens come back with the whole
  character's span (the tokenizer reports the character for both halves).
- **Straddling tokens merge.** Consecutive tokens of one side whose spans overlap or repeat (the
  two halves of a split character) form one indivisible unit: no group boundary falls inside a
  character. Group boundaries are the byte positions where a unit of each side ends: a group
  closes as soon as both sides' current units end at the same byte. Only ends are compared, so a
  tokenizer whose offsets leave out a leading space (some SentencePiece offsets do) still aligns.
- **Zero-width tokens are skipped.** A token with an empty span (``start >= end``: a BOS or EOS the
  tokenizer adds, not found in the text) has no text to align and no counterpart on the other side:
  it opens no group. It is reported in ``student_skipped`` / ``teacher_skipped`` when it falls
  between groups; one that falls between two tokens of one group lies inside the group's index
  range. ``student_skip`` / ``teacher_skip`` treat chosen tokens the same way (GOLD's
  ``uld_skip_student_eos`` / ``uld_skip_teacher_eos``).
- **A ragged end joins the last group.** When one side's units run out before the two ends meet
  (the two offset lists do not end at the same byte), the remaining units of both sides join the
  last group rather than being dropped silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

__all__ = [
    "AlignedGroup",
    "SpanAlignment",
    "TokenizedText",
    "align_spans",
    "byte_offsets",
    "char_to_byte_offsets",
]

Span = tuple[int, int]


@dataclass(frozen=True)
class AlignedGroup:
    """One span of identical text: a run of student tokens and a run of teacher tokens.

    Attributes:
        student: ``(start, end)`` student token indices, end exclusive.
        teacher: ``(start, end)`` teacher token indices, end exclusive.
        span: ``(start, end)`` the bytes of the text the group covers, end exclusive.
    """

    student: Span
    teacher: Span
    span: Span

    @property
    def is_one_to_one(self) -> bool:
        """Whether the group is one student token against one teacher token."""
        return self.student[1] - self.student[0] == 1 and self.teacher[1] - self.teacher[0] == 1


@dataclass(frozen=True)
class SpanAlignment:
    """The aligned groups of two tokenisations of one text, in text order.

    Attributes:
        groups: the groups, in order; their token ranges are disjoint and increasing.
        student_skipped: student token indices in no group (zero-width or skipped tokens).
        teacher_skipped: teacher token indices in no group.
    """

    groups: tuple[AlignedGroup, ...]
    student_skipped: tuple[int, ...] = ()
    teacher_skipped: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.groups)

    def student_ranges(self) -> torch.Tensor:
        """[G, 2] long: each group's ``(start, end)`` student token indices."""
        return torch.tensor([g.student for g in self.groups], dtype=torch.long).reshape(-1, 2)

    def teacher_ranges(self) -> torch.Tensor:
        """[G, 2] long: each group's ``(start, end)`` teacher token indices."""
        return torch.tensor([g.teacher for g in self.groups], dtype=torch.long).reshape(-1, 2)

    def shifted(self, student: int = 0, teacher: int = 0) -> SpanAlignment:
        """The same alignment with token indices moved by ``student`` / ``teacher`` positions.

        A completion aligned on its own is indexed from 0; shift by each side's prompt length to
        index the full (prompt + completion) sequences whose logits the loss reads.
        """

        def move(span: Span, by: int) -> Span:
            return (span[0] + by, span[1] + by)

        groups = tuple(
            replace(g, student=move(g.student, student), teacher=move(g.teacher, teacher))
            for g in self.groups
        )
        return SpanAlignment(
            groups,
            tuple(i + student for i in self.student_skipped),
            tuple(i + teacher for i in self.teacher_skipped),
        )

    def drop_last(self) -> SpanAlignment:
        """The alignment without its last group (GOLD skips the completion's last token)."""
        return SpanAlignment(self.groups[:-1], self.student_skipped, self.teacher_skipped)


@dataclass(frozen=True)
class _Unit:
    """Consecutive tokens of one side that no group boundary may separate."""

    first: int  # first token index
    last: int  # last token index (inclusive)
    start: int  # first byte
    end: int  # one past the last byte


def _units(offsets: Sequence[Span], skip: Iterable[int]) -> list[_Unit]:
    """Group one side's tokens into units: tokens whose byte spans overlap share a unit.

    Zero-width tokens and those in ``skip`` open no unit (they have no text of their own).
    """
    skip = set(skip)
    units: list[_Unit] = []
    for k, (start, end) in enumerate(offsets):
        if start >= end or k in skip:
            continue
        if units and start < units[-1].end:  # overlaps the previous unit: a split character
            prev = units[-1]
            units[-1] = _Unit(prev.first, k, min(prev.start, start), max(prev.end, end))
        else:
            units.append(_Unit(k, k, start, end))
    return units


def _match_units(s_units: list[_Unit], t_units: list[_Unit]) -> list[tuple[int, int, int, int]]:
    """Pair runs of units of the two sides that end at the same byte.

    Returns ``(first student unit, last student unit, first teacher unit, last teacher unit)`` per
    group, inclusive.
    """
    pairs: list[tuple[int, int, int, int]] = []
    i = j = 0
    n, m = len(s_units), len(t_units)
    while i < n and j < m:
        gi, gj = i, j
        while s_units[i].end != t_units[j].end:
            if s_units[i].end < t_units[j].end and i + 1 < n:
                i += 1
            elif t_units[j].end < s_units[i].end and j + 1 < m:
                j += 1
            else:  # one side ran out before the ends met: the rest is one group
                i, j = n - 1, m - 1
                break
        pairs.append((gi, i, gj, j))
        i, j = i + 1, j + 1
    if pairs and (i < n or j < m):  # a ragged end: the leftover units join the last group
        gi, _, gj, _ = pairs[-1]
        pairs[-1] = (gi, n - 1, gj, m - 1)
    return pairs


def _outside(count: int, ranges: Iterable[Span]) -> tuple[int, ...]:
    """The indices in ``range(count)`` that lie in none of ``ranges`` (end exclusive)."""
    inside = set()
    for start, end in ranges:
        inside.update(range(start, end))
    return tuple(k for k in range(count) if k not in inside)


def align_spans(
    student_offsets: Sequence[Span],
    teacher_offsets: Sequence[Span],
    *,
    student_skip: Iterable[int] = (),
    teacher_skip: Iterable[int] = (),
) -> SpanAlignment:
    """Group two tokenisations of one text into runs that cover exactly the same bytes.

    Args:
        student_offsets: per student token, its ``(start, end)`` byte offsets in the text (end
            exclusive), in token order; ``byte_offsets`` makes them from a fast tokenizer.
        teacher_offsets: the same for the teacher's tokens of the same text.
        student_skip: student token indices to leave out of every group (e.g. EOS).
        teacher_skip: teacher token indices to leave out of every group.

    Returns:
        A ``SpanAlignment``: the groups in text order and the tokens in none (see the module
        docstring for zero-width tokens, split characters and a ragged end).
    """
    s_units = _units(student_offsets, student_skip)
    t_units = _units(teacher_offsets, teacher_skip)
    groups = []
    for si, sj, ti, tj in _match_units(s_units, t_units):
        first_s, last_s, first_t, last_t = s_units[si], s_units[sj], t_units[ti], t_units[tj]
        span = (min(first_s.start, first_t.start), max(last_s.end, last_t.end))
        groups.append(AlignedGroup((first_s.first, last_s.last + 1), (first_t.first, last_t.last + 1), span))
    return SpanAlignment(
        tuple(groups),
        _outside(len(student_offsets), (g.student for g in groups)),
        _outside(len(teacher_offsets), (g.teacher for g in groups)),
    )


def char_to_byte_offsets(text: str, offsets: Sequence[Span]) -> list[Span]:
    """Convert ``(start, end)`` character offsets into ``text`` to UTF-8 byte offsets.

    ``"a€b"`` with character offsets ``(0, 1), (1, 2), (2, 3)`` gives ``(0, 1), (1, 4), (4, 5)``:
    ``€`` is three bytes.
    """
    cumulative = [0]  # cumulative[k]: the byte length of text[:k]
    for ch in text:
        cumulative.append(cumulative[-1] + len(ch.encode("utf-8")))
    return [(cumulative[start], cumulative[end]) for start, end in offsets]


@dataclass(frozen=True)
class TokenizedText:
    """One tokenizer's tokens of a text with their byte offsets.

    Attributes:
        ids: [T] token ids.
        offsets: [T] ``(start, end)`` UTF-8 byte offsets into the text, end exclusive; ``(0, 0)``
            for tokens the tokenizer adds (BOS/EOS), which ``align_spans`` skips.
    """

    ids: list[int]
    offsets: list[Span]


def byte_offsets(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> TokenizedText:
    """Tokenize ``text`` with a Hugging Face fast tokenizer and return its tokens' byte offsets.

    The fast tokenizer reports character offsets (``return_offsets_mapping=True``); they are
    converted to UTF-8 byte offsets. A byte-level BPE token holding part of a multi-byte character
    is reported with the whole character's span, so such tokens overlap and ``align_spans`` keeps
    them in one unit.

    Raises:
        ValueError: the tokenizer is a slow (Python) tokenizer, which has no offsets.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"{type(tokenizer).__name__} is a slow tokenizer: byte offsets need a fast tokenizer "
            "(load it with AutoTokenizer.from_pretrained(..., use_fast=True))."
        )
    encoded = tokenizer(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    offsets = [tuple(span) for span in encoded["offset_mapping"]]
    return TokenizedText(list(encoded["input_ids"]), char_to_byte_offsets(text, offsets))
