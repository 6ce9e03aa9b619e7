"""Vocabularies across tokenizers: token text as bytes, matched tokens, X-Token's projection matrix.

``token_bytes`` reads each token's text as the bytes it stands for (byte-level BPE's stand-in
characters, SentencePiece's ``▁`` and byte fallback); ``matched_tokens`` pairs the student and
teacher tokens of identical text (GOLD's map for the hybrid loss); ``build_projection_matrix``
makes X-Token's sparse ``W [Vs, Vt]`` (``ops/cross_tokenizer.py`` describes it), saved and loaded
with ``save_projection_matrix`` / ``load_projection_matrix``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "build_projection_matrix",
    "load_projection_matrix",
    "matched_tokens",
    "save_projection_matrix",
    "token_bytes",
]


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, inverted: char -> byte.

    Bytes that print as themselves (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) keep their character;
    the others take ``chr(256 + n)`` in byte order (space is ``Ġ``, newline ``Ċ``).
    """
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    out, extra = {}, 0
    for b in range(256):
        if b in printable:
            out[chr(b)] = b
        else:
            out[chr(256 + extra)] = b
            extra += 1
    return out


def _has_type(node: Any, name: str) -> bool:
    """Whether a tokenizer JSON component (or one in its ``Sequence``) has ``type == name``."""
    if not isinstance(node, dict):
        return False
    children = node.get("decoders") or node.get("pretokenizers") or []
    return node.get("type") == name or any(_has_type(c, name) for c in children)


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str, byte_level: bool, alphabet: dict[str, int]) -> bytes:
    """The text bytes of one vocabulary entry (byte-level, or SentencePiece-style ``▁``/``<0xHH>``)."""
    if byte_level and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    fallback = _BYTE_FALLBACK.fullmatch(piece)
    if fallback:
        return bytes([int(fallback.group(1), 16)])
    return piece.replace("▁", " ").encode("utf-8")


def token_bytes(tokenizer: Any, vocab_size: int | None = None) -> list[bytes | None]:
    """The UTF-8 bytes each token id stands for: [V] (``None`` for ids without a token).

    Byte-level BPE vocabularies (a ``ByteLevel`` decoder) are read through the byte alphabet, so a
    token holding half of a multi-byte character gets its raw byte; otherwise ``▁`` reads as a
    space and ``<0xHH>`` as byte ``HH`` (SentencePiece). Added and special tokens are their text.
    """
    size = len(tokenizer) if vocab_size is None else vocab_size
    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    byte_level = _has_type(backend.get("decoder"), "ByteLevel")
    alphabet = _byte_alphabet()
    added = {tok.content for tok in tokenizer.added_tokens_decoder.values()}
    out: list[bytes | None] = [None] * size
    for piece, idx in tokenizer.get_vocab().items():
        if idx < size:
            out[idx] = piece.encode("utf-8") if piece in added else _piece_bytes(piece, byte_level, alphabet)
    return out


def _index(pieces: Sequence[bytes | None]) -> dict[bytes, int]:
    """bytes -> the lowest id with those bytes (empty and missing entries left out)."""
    index: dict[bytes, int] = {}
    for idx, b in enumerate(pieces):
        if b and b not in index:
            index[b] = idx
    return index


def matched_tokens(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
) -> torch.Tensor:
    """The teacher token whose text is identical to each student token's: [Vs] long, -1 for none.

    Texts are compared as bytes (``token_bytes``), so ``Ġthe`` (byte-level) matches ``▁the``
    (SentencePiece). This is the hybrid ULD's "matched" set.
    """
    teacher = _index(token_bytes(teacher_tokenizer, teacher_vocab_size))
    student = token_bytes(student_tokenizer, student_vocab_size)
    return torch.tensor([teacher.get(b, -1) if b else -1 for b in student], dtype=torch.long)


def _fallback_id(tokenizer: Any) -> int:
    """Where a student token without any teacher counterpart sends its mass: unk, else EOS, else 0."""
    for idx in (tokenizer.unk_token_id, tokenizer.eos_token_id):
        if idx is not None:
            return int(idx)
    return 0


def _greedy_pieces(data: bytes, index: dict[bytes, int], longest: int) -> list[int]:
    """Cut ``data`` left to right into the longest teacher tokens (at most ``longest`` bytes); [] if
    some byte has none."""
    pieces, at = [], 0
    while at < len(data):
        for width in range(min(longest, len(data) - at), 0, -1):
            if data[at : at + width] in index:
                pieces.append(index[data[at : at + width]])
                at += width
                break
        else:
            return []
    return pieces


def _row_weights(pieces: list[int], multi_token: str, decay: float) -> dict[int, float]:
    """One student token's weights over the teacher pieces of its text (they sum to 1)."""
    if multi_token == "first" or len(pieces) == 1:
        return {pieces[0]: 1.0}
    weights: dict[int, float] = {}
    for k, piece in enumerate(pieces):  # spread: the k-th piece weighs decay**k
        weights[piece] = weights.get(piece, 0.0) + decay**k
    total = sum(weights.values())
    return {piece: w / total for piece, w in weights.items()}


def _keep_top(weights: dict[int, float], top_k: int | None) -> dict[int, float]:
    """The ``top_k`` heaviest entries of a row, renormalised to sum to 1."""
    if top_k is None or len(weights) <= top_k:
        return weights
    kept = dict(sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))[:top_k])
    total = sum(kept.values())
    return {k: v / total for k, v in kept.items()}


def _teacher_pieces(student_tokenizer: Any, teacher_tokenizer: Any, vs: int, vt: int) -> list[list[int]]:
    """For each student id, the teacher ids its text becomes (the rule of ``build_projection_matrix``)."""
    s_bytes, t_index = token_bytes(student_tokenizer, vs), _index(token_bytes(teacher_tokenizer, vt))
    longest = max((len(b) for b in t_index), default=0)
    pieces: list[list[int]] = [[] for _ in range(vs)]
    texts: dict[int, str] = {}
    for i, b in enumerate(s_bytes):
        if b and b in t_index:
            pieces[i] = [t_index[b]]
        elif i == student_tokenizer.eos_token_id and teacher_tokenizer.eos_token_id is not None:
            pieces[i] = [int(teacher_tokenizer.eos_token_id)]
        elif b:
            try:
                texts[i] = b.decode("utf-8")
            except UnicodeDecodeError:  # part of a character: cut the bytes into teacher tokens
                pieces[i] = _greedy_pieces(b, t_index, longest)
    if texts:
        encoded = teacher_tokenizer(list(texts.values()), add_special_tokens=False)["input_ids"]
        for i, ids in zip(texts, encoded, strict=True):
            pieces[i] = [t for t in ids if t < vt]
    return pieces


def build_projection_matrix(
    student_tokenizer: Any,
    teacher_tokenizer: Any,
    top_k: int | None = None,
    *,
    multi_token: str = "first",
    decay: float = 0.5,
    student_vocab_size: int | None = None,
    teacher_vocab_size: int | None = None,
) -> torch.Tensor:
    """X-Token's projection matrix ``W``: [Vs, Vt] sparse COO float32, each row summing to 1.

    Each student token's text (``token_bytes``) goes to: the teacher token with the same text
    (weight 1); else, for the student's EOS, the teacher's EOS; else the teacher tokenizer's
    re-tokenisation of the text (bytes that are part of a character: the longest teacher tokens,
    left to right). A multi-token re-tokenisation gives ``multi_token="first"`` weight 1 on its
    first piece, or ``"spread"`` weights proportional to ``decay**k`` on the k-th. Ids with no text
    (padding rows past the tokenizer) or no pieces go to the teacher's unk, else EOS, else id 0.

    Args:
        student_tokenizer, teacher_tokenizer: Hugging Face fast tokenizers.
        top_k: keep each row's ``top_k`` heaviest entries, renormalised ("runtime top-k").
        multi_token: ``first`` or ``spread``.
        decay: the spread's geometric decay, in (0, 1].
        student_vocab_size, teacher_vocab_size: the models' logit widths (default: the tokenizers'
            lengths); a model's embedding is often padded past its tokenizer.
    """
    if multi_token not in ("first", "spread"):
        raise ValueError(f"multi_token must be 'first' or 'spread', got {multi_token!r}.")
    if not 0 < decay <= 1:
        raise ValueError(f"decay must be in (0, 1], got {decay}.")
    vs = len(student_tokenizer) if student_vocab_size is None else student_vocab_size
    vt = len(teacher_tokenizer) if teacher_vocab_size is None else teacher_vocab_size
    fallback = _fallback_id(teacher_tokenizer)
    rows, cols, vals = [], [], []
    for i, pieces in enumerate(_teacher_pieces(student_tokenizer, teacher_tokenizer, vs, vt)):
        weights = _keep_top(_row_weights(pieces or [fallback], multi_token, decay), top_k)
        for col, w in weights.items():
            rows.append(i)
            cols.append(col)
            vals.append(w)
    indices = torch.tensor([rows, cols], dtype=torch.long)
    return torch.sparse_coo_tensor(
        indices, torch.tensor(vals, dtype=torch.float32), (vs, vt), check_invariants=True
    ).coalesce()


def save_projection_matrix(projection: torch.Tensor, path: str | os.PathLike) -> None:
    """Save a sparse [Vs, Vt] projection matrix as plain tensors (``torch.load(weights_only=True)`` reads it)."""
    projection = projection.coalesce().cpu()
    torch.save(
        {"indices": projection.indices(), "values": projection.values(), "shape": list(projection.shape)},
        path,
    )


def load_projection_matrix(path: str | os.PathLike, student_vocab: int, teacher_vocab: int) -> torch.Tensor:
    """Load a projection matrix and check it is [student_vocab, teacher_vocab].

    Reads what ``save_projection_matrix`` writes, or a saved sparse or dense tensor.

    Raises:
        ValueError: the matrix's shape is not ``(student_vocab, teacher_vocab)`` (the message names
            both), or it holds negative or non-finite weights.
    """
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(saved, dict):
        shape = tuple(int(d) for d in saved["shape"])
        matrix = torch.sparse_coo_tensor(saved["indices"], saved["values"], shape, check_invariants=True)
    else:
        matrix = saved if saved.is_sparse else saved.to_sparse()
    found, expected = tuple(matrix.shape), (student_vocab, teacher_vocab)
    if found != expected:
        raise ValueError(
            f"The projection matrix at {os.fspath(path)} has shape {found}, but the student's vocabulary "
            f"has {student_vocab} tokens and the teacher's {teacher_vocab}: expected {expected}. Build it "
            "for this student/teacher pair (build_projection_matrix) with the models' vocabulary sizes."
        )
    matrix = matrix.coalesce().float()
    values = matrix.values()
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError(f"The projection matrix at {os.fspath(path)} holds negative or non-finite weights.")
    return matrix
