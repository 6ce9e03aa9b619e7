"""``posttrain xtoken-projection``: build X-Token's projection matrix for a student/teacher pair.

X-Token (paper index: "X-Token: Projection-Guided Cross-Tokenizer Knowledge Distillation")
compares a student and a teacher with different tokenizers through a sparse matrix
``W [Vs, Vt]`` that sends each student token to the teacher tokens its text most plausibly is
(``ops/cross_tokenizer.build_projection_matrix``: the teacher token with the same text, else the
teacher's re-tokenisation of it). This command builds it once per pair and saves it for
``GOLDConfig(xtoken_loss_type=..., xtoken_projection_matrix_path=PATH)``::

    posttrain xtoken-projection --student meta-llama/Llama-3.2-1B-Instruct \\
        --teacher Qwen/Qwen3-4B --top-k 4 --output projection.pt

The matrix's shape is the two *models'* logit widths (their configs' ``vocab_size``, often
padded past the tokenizer), which is what the trainer checks it against.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from posttrain.cli.options import CLIError, one_paragraph

__all__ = ["xtoken_projection"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain xtoken-projection",
        description="Build X-Token's projection matrix W [Vs, Vt] for a student/teacher pair and save it.",
    )
    parser.add_argument(
        "--student", required=True, help="The student: hub id, local folder or embedded name."
    )
    parser.add_argument(
        "--teacher", required=True, help="The teacher: hub id, local folder or embedded name."
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="Keep each row's k heaviest teacher tokens, renormalised (the paper's runtime top-k, e.g. 4); "
        "default: keep all.",
    )
    parser.add_argument(
        "--multi-token",
        choices=("first", "spread"),
        default="first",
        help="A student token the teacher splits into several: all weight on the first piece, or spread "
        "with geometric decay (default: first).",
    )
    parser.add_argument(
        "--decay", type=float, default=0.5, help="The spread's decay, in (0, 1] (default 0.5)."
    )
    parser.add_argument(
        "--student-vocab-size", type=int, default=None, help="Override the student's logit width."
    )
    parser.add_argument(
        "--teacher-vocab-size", type=int, default=None, help="Override the teacher's logit width."
    )
    parser.add_argument("--output", required=True, help="Where to save the matrix (a .pt file).")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="Allow tokenizers that ship custom code."
    )
    return parser


def _tokenizer_and_width(name: str, role: str, width: int | None, trust_remote_code: bool) -> tuple[Any, int]:
    """A model's tokenizer and its logit width (the config's ``vocab_size``, else the tokenizer's length).

    Raises:
        CLIError: the tokenizer cannot be loaded, or is a slow one (no byte offsets).
    """
    from posttrain.models import loading

    try:
        tokenizer = loading.load_tokenizer(name, None, trust_remote_code)
    except (OSError, ValueError) as exc:
        raise CLIError(f"--{role} {name!r}: its tokenizer cannot be loaded ({one_paragraph(exc)}).") from None
    if not getattr(tokenizer, "is_fast", False):
        raise CLIError(
            f"--{role} {name!r} has a slow tokenizer ({type(tokenizer).__name__}); the projection reads token "
            "texts from a fast tokenizer. Use a model that ships tokenizer.json."
        )
    if width is None:
        width = _config_vocab_size(name, trust_remote_code) or len(tokenizer)
    if width < len(tokenizer):
        raise CLIError(
            f"--{role} {name!r}: its tokenizer has {len(tokenizer)} tokens but the logit width is {width}; pass "
            f"--{role}-vocab-size of at least {len(tokenizer)} (the model's vocab_size)."
        )
    return tokenizer, width


def _config_vocab_size(name: str, trust_remote_code: bool) -> int | None:
    """The model config's ``vocab_size`` (the text config's), or ``None`` without a config."""
    from transformers import AutoConfig

    from posttrain.models import loading

    try:
        config = AutoConfig.from_pretrained(
            loading.resolve_model_path(name), trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    size = getattr(text, "vocab_size", None)
    return int(size) if size else None


def _check(args: argparse.Namespace) -> None:
    """Numbers in range and an output that can be written.

    Raises:
        CLIError: a bad value.
    """
    if args.top_k is not None and args.top_k < 1:
        raise CLIError(
            f"--top-k {args.top_k}: it must be a positive number of teacher tokens per row (e.g. 4)."
        )
    if not 0 < args.decay <= 1:
        raise CLIError(
            f"--decay {args.decay}: it must be in (0, 1] (0.5 halves the weight of each later piece)."
        )
    for role in ("student", "teacher"):
        width = getattr(args, f"{role}_vocab_size")
        if width is not None and width < 1:
            raise CLIError(f"--{role}-vocab-size {width}: it must be a positive number of logits.")
    folder = os.path.dirname(os.path.abspath(args.output))
    if os.path.isdir(args.output):
        raise CLIError(
            f"--output {args.output!r} is a folder; give a file path such as {args.output}/projection.pt."
        )
    if not os.path.isdir(folder):
        raise CLIError(f"--output {args.output!r}: the folder {folder!r} does not exist; create it first.")


def xtoken_projection(argv: list[str]) -> None:
    """Build X-Token's projection matrix for a student/teacher pair (GOLD's xtoken_projection_matrix_path)."""
    from posttrain.ops.cross_tokenizer import build_projection_matrix, save_projection_matrix

    args = _parser().parse_args(argv)
    _check(args)
    student, vs = _tokenizer_and_width(
        args.student, "student", args.student_vocab_size, args.trust_remote_code
    )
    teacher, vt = _tokenizer_and_width(
        args.teacher, "teacher", args.teacher_vocab_size, args.trust_remote_code
    )
    projection = build_projection_matrix(
        student,
        teacher,
        args.top_k,
        multi_token=args.multi_token,
        decay=args.decay,
        student_vocab_size=vs,
        teacher_vocab_size=vt,
    )
    save_projection_matrix(projection, args.output)
    print(
        f"Saved the projection matrix [{vs}, {vt}] ({projection._nnz()} weights) to {args.output}; train with "
        f"GOLDConfig(xtoken_loss_type='p_kl', xtoken_projection_matrix_path={args.output!r})."
    )
