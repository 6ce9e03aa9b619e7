"""GOLD and X-Token: distillation from a teacher of another model family (another tokenizer).

``GOLDConfig`` / ``GOLDTrainer`` are the reference's GOLD (General Online Logit Distillation,
"Unlocking On-Policy Distillation for Any Model Family", paper index) with X-Token's losses
("X-Token: Projection-Guided Cross-Tokenizer Knowledge Distillation", arXiv 2605.21699) on top.
``GOLDTrainer`` is ``GKDTrainer`` (its ``lmbda`` mix of the student's samples, the teacher's
samples and the dataset's completions) with three losses:

- **Same tokenizer** (no ``use_uld_loss``, no ``xtoken_loss_type``): the generalised JSD of the
  two models' ``logits / temperature`` at every completion token (``ops/divergence.py``), as
  ``DistillationTrainer``; the vocabularies must be equal.
- **ULD** (``use_uld_loss=True``): per sample, the mean over the aligned spans of
  ``||sort(p_s) - sort(p_t)||_1`` (or, hybrid, KL on the matched tokens plus ULD on the rest);
  the mean over the samples, times ``uld_distillation_weight``, plus ``uld_crossentropy_weight``
  times the student's token NLL (``ops/cross_tokenizer.uld_loss``'s composition).
- **X-Token** (``xtoken_loss_type``): P-KL or H-KL on the aligned spans with a precomputed
  projection ``W [Vs, Vt]``, combined with the student's NLL (Eq. 7 below).

How a batch crosses tokenizers (built once per generation batch, ``_attach_teacher_rows``):

1. **The completion's text** is the concatenation of the student's completion tokens' bytes
   (``token_bytes``; special tokens have none), decoded incrementally as UTF-8 with invalid bytes
   replaced. Each student token's byte span is where its bytes land in that text, so the offsets
   match the generated ids exactly (no re-tokenisation of the student's side); tokens that split
   a character get overlapping spans, which ``align_spans`` keeps in one unit.
2. **The teacher's tokens**: the prompt rendered with the *teacher's* chat template (a plain-text
   prompt as it is), then the completion text tokenised by the teacher's tokenizer
   (``byte_offsets``); a completion that ended with EOS gets the teacher's EOS too. With
   ``max_length``, the teacher's prompt keeps its last tokens.
3. **Alignment** (``align_spans``): EOS tokens sit on a virtual byte past the text, so with
   ``uld_skip_student_eos=False`` and ``uld_skip_teacher_eos=False`` the two EOS form the last
   group; each flag leaves its side's EOS out of every group. The last group is dropped (GOLD skips
   the completion's last token). ``use_extended_uld=False`` pairs the i-th tokens of the two
   completions instead (the original ULD paper's positional truncation).

The loss reads, per sample, one model's log-probs of ``[last prompt token, completion...]``:
row ``r`` is the output at that token, predicting the next one (``merge_group_distributions``'s
unshifted rows), merged per group with ``uld_token_merge_strategy`` (``observed``: rows at the
group's tokens; ``bayesian``: from the row before) and ``chain`` (ULD) or ``mean`` (X-Token,
both sides: the span average). One sample at a time, inside an activation checkpoint, so only
one sample's ``[T, V]`` log-probs exist at once, in forward and in backward.

Normalisation, exact under gradient accumulation (the counts are taken over the optimizer step
when the batch is generated, as ``Normalizers`` are): ULD sums the per-sample means and divides
by the step's number of samples that have at least one aligned group (samples without any carry
no signal and do not count, as in ``uld_loss``); the CE is the token sum over the step's
completion tokens; X-Token's KD is the span sum over the step's aligned spans (CE and KD count
separately, as the paper index says).

X-Token's objective (paper, Eq. 7): ``L = sg(L_CE / L_KD) L_KD + L_CE`` with
``xtoken_dynamic_scaling=True`` (the ratio per micro-batch, as the paper index says; ``|L_KD|``,
since P-KL is not renormalised and may be negative), else
``xtoken_kl_weight L_KD + xtoken_ce_scale L_CE``. ``L_KD`` is the per-span P-KL or H-KL at
``xtoken_temperature``, times its square (Hinton's ``T^2``); P-KL's top-k teacher tokens are
chosen per micro-batch.
"""

from __future__ import annotations

import codecs
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from accelerate.utils import gather
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_num, optional, positive_int
from posttrain.data import chat
from posttrain.distill.config import DistillationConfig
from posttrain.distill.trainer import GKDTrainer
from posttrain.models import loading
from posttrain.ops import chunked
from posttrain.ops.cross_tokenizer import (
    common_map_from_projection,
    hybrid_terms,
    load_projection_matrix,
    matched_tokens,
    merge_group_distributions,
    tempered_log_softmax,
    token_bytes,
    uld_distance,
)
from posttrain.ops.divergence import HeadInputs, target_logps
from posttrain.ops.logprobs import completion_head_inputs
from posttrain.ops.token_alignment import align_spans, byte_offsets
from posttrain.sampling.config import ONLINE_UNBUILT
from posttrain.sampling.rollout import ScoredRollout

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["XTOKEN_LOSS_TYPES", "GOLDConfig", "GOLDTrainer", "TeacherRow", "completion_text"]

Span = tuple[int, int]

#: X-Token's losses: ``xtoken_loss_type`` -> what it compares.
XTOKEN_LOSS_TYPES = {
    "p_kl": "forward KL of the teacher and the student projected through W, on the micro-batch's top-k teacher tokens",
    "h_kl": "KL on the tokens whose top-1 projection weight is >= 0.6, sorted-L1 (ULD) on the rest",
}
#: H-KL's bar for a student token's top-1 teacher token to count as common (the paper's).
H_KL_THRESHOLD = 0.6

# ---- the config ------------------------------------------------------------------------------------

# fmt: off
_GOLD_RULES: tuple[Rule, ...] = (
    Rule("lmbda", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (the share of steps trained on the student's own samples)", "set lmbda=0.5 (the default), 1.0 for fully on-policy or 0.0 for the dataset's completions only"),
    Rule("max_length", optional(positive_int), "None or a positive integer (the most prompt + completion tokens)", "set max_length=1024 (the default), or None to keep whole rows"),
    Rule("teacher_tokenizer_name_or_path", optional(lambda v: isinstance(v, str) and bool(v)), "None or a tokenizer id or path", "pass the teacher's tokenizer hub id or folder, or leave None to load it from the teacher"),
    Rule("uld_crossentropy_weight", lambda v: is_num(v) and v >= 0, "a number >= 0 (the weight of the student's NLL)", "set uld_crossentropy_weight=0.0 (the default)"),
    Rule("uld_distillation_weight", lambda v: is_num(v) and v >= 0, "a number >= 0 (the weight of the ULD term)", "set uld_distillation_weight=1.0 (the default)"),
    Rule("uld_student_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set uld_student_temperature=1.0 (the default)"),
    Rule("uld_teacher_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set uld_teacher_temperature=1.0 (the default)"),
    Rule("uld_hybrid_matched_weight", optional(lambda v: is_num(v) and v >= 0), "None (1.0) or a number >= 0", "leave uld_hybrid_matched_weight=None, or set a weight >= 0"),
    Rule("uld_hybrid_unmatched_weight", optional(lambda v: is_num(v) and v >= 0), "None (1.0) or a number >= 0", "leave uld_hybrid_unmatched_weight=None, or set a weight >= 0"),
    Rule("xtoken_loss_type", lambda v: v is None or v in XTOKEN_LOSS_TYPES, "None, 'p_kl' or 'h_kl'", "leave xtoken_loss_type=None, or pick 'p_kl' or 'h_kl'"),
    Rule("xtoken_projection_matrix_path", optional(lambda v: isinstance(v, str) and bool(v)), "None or the path of a saved projection matrix", "build one with `posttrain xtoken-projection` and pass its path"),
    Rule("xtoken_temperature", lambda v: is_num(v) and v > 0, "a number > 0", "set xtoken_temperature=1.0 (the default)"),
    Rule("xtoken_vocab_topk", positive_int, "a positive integer (P-KL's teacher tokens per micro-batch)", "set xtoken_vocab_topk=8192 (the default)"),
    Rule("xtoken_kl_weight", lambda v: is_num(v) and v >= 0, "a number >= 0", "set xtoken_kl_weight=1.0 (the default)"),
    Rule("xtoken_ce_scale", lambda v: is_num(v) and v >= 0, "a number >= 0", "set xtoken_ce_scale=0.1 (the default)"),
    Rule("vllm_sync_frequency", positive_int, "a positive integer", "set vllm_sync_frequency=1 (the default)"),
    Rule("log_completions_steps", positive_int, "a positive integer", "set log_completions_steps=100 (the default)"),
    Rule("callbacks", lambda v: isinstance(v, (list, tuple)), "a list", "leave callbacks=[] and pass callbacks to the trainer"),
) + choice_rules({"uld_token_merge_strategy": ("observed", "bayesian")}) + DistillationConfig._rules

_GOLD_UNBUILT: dict[str, UnbuiltOption] = {
    **ONLINE_UNBUILT,
    "log_completions_steps": UnbuiltOption(100, "logging completions at their own period", "Leave log_completions_steps=100: completions are logged at every logging step (logging_steps).", 10),
}
# fmt: on


@dataclass
class GOLDConfig(DistillationConfig):
    r"""Configuration of ``GOLDTrainer``: on-policy distillation across model families (GOLD, X-Token).

    The reference's public API (``trl.experimental.gold.GOLDConfig``) with X-Token's fields. Every
    ``transformers.TrainingArguments`` field is accepted too.

    GOLD's fields:
        temperature (`float`, defaults to `0.9`): Sampling temperature; the same-tokenizer JSD is
            taken of `logits / temperature` too (ULD and X-Token have their own temperatures).
        top_p (`float`, defaults to `0.95`), top_k (`int`, defaults to `0`): Sampling filters.
        lmbda (`float`, defaults to `0.5`): Probability that a step trains on the student's own
            samples; otherwise on the teacher's (`seq_kd=True`) or the dataset's completions.
        beta (`float`, defaults to `0.5`): The same-tokenizer generalised JSD's interpolation
            (0 forward KL, 1 reverse KL).
        max_completion_length (`int`, defaults to `128`): Most completion tokens; below
            `max_length`.
        max_length (`int | None`, defaults to `1024`): Most prompt + completion tokens of a
            dataset row (the teacher's prompt is cut to it too).
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: as
            ``DistillationConfig``.
        teacher_tokenizer_name_or_path (`str | None`, defaults to `None`): The teacher's tokenizer
            (cross-tokenizer losses); `None` loads it from the teacher's path.
        disable_dropout (`bool`, defaults to `True`), seq_kd (`bool`, defaults to `False`),
            num_generations (`int`, defaults to `1`), generation_batch_size (`int | None`).
        use_uld_loss (`bool`, defaults to `False`): Universal Logit Distillation across tokenizers.
        uld_token_merge_strategy (`str`, defaults to `"observed"`): Which rows a span's merged
            distribution starts from: `"observed"` the rows at its tokens, `"bayesian"` the row
            before (the one predicting its first token).
        use_extended_uld (`bool`, defaults to `True`): Align the completions by text spans and
            merge the distributions within a span; `False` pairs the i-th tokens of the two
            completions (the original ULD paper's positional truncation).
        uld_use_hybrid_loss (`bool`, defaults to `False`): KL on the tokens whose text both
            vocabularies hold (matched), ULD on the rest; needs `use_uld_loss`.
        uld_hybrid_matched_weight, uld_hybrid_unmatched_weight (`float | None`, default `None`:
            1.0): The hybrid's two weights.
        uld_crossentropy_weight (`float`, defaults to `0.0`), uld_distillation_weight (`float`,
            defaults to `1.0`): `loss = w_d ULD + w_ce NLL`.
        uld_student_temperature, uld_teacher_temperature (`float`, defaults to `1.0`): Each side's
            logits are divided by its temperature before the ULD comparison.
        uld_skip_student_eos, uld_skip_teacher_eos (`bool`, defaults to `True`): Leave each side's
            EOS out of the alignment (also used by X-Token).
        vllm_server_port (`int`, defaults to `8001`), vllm_gpu_memory_utilization (`float`,
            defaults to `0.9`; on vLLM's CPU build a share of main memory: 0.3 there),
            vllm_sync_frequency (`int`, defaults to `1`): vLLM for the student's samples (as
            ``GRPOConfig``; docs/vllm.md); the engine gets the student's weights every
            `vllm_sync_frequency` optimizer steps.
        log_completions (`bool`, defaults to `False`), num_completions_to_print (`int | None`).
        log_completions_steps (`int`, defaults to `100`): Not built: completions are logged at
            every logging step; another value raises `NotImplementedError`.
        wandb_log_unique_prompts (`bool`, defaults to `True`): The reference's name for
            `log_unique_prompts` (each distinct prompt once in the completions table); either
            turns it on.
        callbacks (`list`, defaults to `[]`): The reference's config field; must stay empty: pass
            callbacks to the trainer (`GOLDTrainer(callbacks=...)`).
        learning_rate (`float`, defaults to `1e-7`): The reference's default, kept as the contract
            though it is far below the usual distillation rates (the seed's examples set their own).

    X-Token's fields:
        xtoken_loss_type (`str | None`, defaults to `None`): `"p_kl"` or `"h_kl"`
            (``XTOKEN_LOSS_TYPES``); needs `xtoken_projection_matrix_path`. The paper's recipe is
            off-policy (`lmbda=0.0`).
        xtoken_projection_matrix_path (`str | None`): A projection matrix `[Vs, Vt]` saved by
            `posttrain xtoken-projection` (``save_projection_matrix``).
        xtoken_temperature (`float`, defaults to `1.0`): Both sides' temperature in the KD term,
            which is multiplied by its square.
        xtoken_dynamic_scaling (`bool`, defaults to `True`): Eq. 7, `sg(L_CE / L_KD) L_KD + L_CE`,
            per micro-batch; `False`: `xtoken_kl_weight L_KD + xtoken_ce_scale L_CE`.
        xtoken_vocab_topk (`int`, defaults to `8192`): P-KL's teacher tokens (the micro-batch's
            top-k by teacher mass).
        xtoken_kl_weight (`float`, defaults to `1.0`), xtoken_ce_scale (`float`, defaults to
            `0.1`): The weights without dynamic scaling.

    Other shared online fields are as ``DistillationConfig``; GKD's `max_new_tokens` is not a
    GOLD field (`max_completion_length` is).
    """

    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (and the JSD's)."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass."})
    top_k: int = field(default=0, metadata={"help": "Keep only the top_k tokens when sampling; 0: all."})
    lmbda: float = field(
        default=0.5, metadata={"help": "Probability that a step trains on the student's own samples."}
    )
    beta: float = field(
        default=0.5, metadata={"help": "Generalised JSD interpolation: 0 forward KL, 1 reverse KL."}
    )
    max_completion_length: int | None = field(default=128, metadata={"help": "Most completion tokens."})
    max_length: int | None = field(default=1024, metadata={"help": "Most prompt + completion tokens."})
    teacher_tokenizer_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher's tokenizer; None: the teacher's path."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student."})
    seq_kd: bool = field(
        default=False, metadata={"help": "Off the student's steps, train on the teacher's samples."}
    )
    use_uld_loss: bool = field(default=False, metadata={"help": "Universal Logit Distillation."})
    uld_token_merge_strategy: str = field(default="observed", metadata={"help": "'observed' or 'bayesian'."})
    use_extended_uld: bool = field(
        default=True, metadata={"help": "Align by text spans (False: position by position)."}
    )
    uld_use_hybrid_loss: bool = field(
        default=False, metadata={"help": "KL on matched tokens, ULD on the rest."}
    )
    uld_hybrid_matched_weight: float | None = field(
        default=None, metadata={"help": "The matched part's weight."}
    )
    uld_hybrid_unmatched_weight: float | None = field(
        default=None, metadata={"help": "The unmatched part's weight."}
    )
    uld_crossentropy_weight: float = field(default=0.0, metadata={"help": "Weight of the student's NLL."})
    uld_distillation_weight: float = field(default=1.0, metadata={"help": "Weight of the ULD term."})
    uld_student_temperature: float = field(default=1.0, metadata={"help": "The student's ULD temperature."})
    uld_teacher_temperature: float = field(default=1.0, metadata={"help": "The teacher's ULD temperature."})
    uld_skip_student_eos: bool = field(default=True, metadata={"help": "Leave the student's EOS unaligned."})
    uld_skip_teacher_eos: bool = field(default=True, metadata={"help": "Leave the teacher's EOS unaligned."})
    vllm_server_port: int = field(default=8001, metadata={"help": "Port of the vLLM server."})
    vllm_gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM's GPU memory share."})
    vllm_sync_frequency: int = field(default=1, metadata={"help": "Steps between vLLM weight syncs."})
    log_completions_steps: int = field(default=100, metadata={"help": "Not built (logging_steps applies)."})
    wandb_log_unique_prompts: bool = field(
        default=True, metadata={"help": "Log each distinct prompt once (log_unique_prompts)."}
    )
    callbacks: list[str] = field(
        default_factory=list, metadata={"help": "Must stay empty: pass them to the trainer."}
    )
    learning_rate: float = field(default=1e-7, metadata={"help": "Initial learning rate (the reference's)."})
    xtoken_loss_type: str | None = field(default=None, metadata={"help": "X-Token: 'p_kl' or 'h_kl'."})
    xtoken_projection_matrix_path: str | None = field(
        default=None, metadata={"help": "The saved projection matrix [Vs, Vt]."}
    )
    xtoken_temperature: float = field(default=1.0, metadata={"help": "X-Token's KD temperature."})
    xtoken_dynamic_scaling: bool = field(
        default=True, metadata={"help": "Eq. 7: sg(L_CE / L_KD) L_KD + L_CE."}
    )
    xtoken_vocab_topk: int = field(default=8192, metadata={"help": "P-KL's teacher tokens per micro-batch."})
    xtoken_kl_weight: float = field(default=1.0, metadata={"help": "KD weight without dynamic scaling."})
    xtoken_ce_scale: float = field(default=0.1, metadata={"help": "CE weight without dynamic scaling."})

    _rules: ClassVar[tuple[Rule, ...]] = _GOLD_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = _GOLD_UNBUILT
    _method: ClassVar[str] = "GOLD"
    loss_uses_temperature: ClassVar[bool] = True

    @property
    def cross_tokenizer(self) -> bool:
        """Whether the loss compares the models across tokenizers (ULD or X-Token)."""
        return bool(self.use_uld_loss) or self.xtoken_loss_type is not None

    def _normalise_family(self) -> None:
        """``wandb_log_unique_prompts`` is the reference's name for ``log_unique_prompts``."""
        super()._normalise_family()
        self.log_unique_prompts = bool(self.log_unique_prompts or self.wandb_log_unique_prompts)

    def _check_combinations(self) -> None:
        """The combinations GOLD and X-Token cannot run, then the shared checks.

        Raises:
            ValueError: a combination that cannot work (the message says which and how to fix it).
            NotImplementedError: the teacher sampling in its own tokens (``seq_kd``) across tokenizers.
        """
        if self.max_length is not None and self.max_completion_length >= self.max_length:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} must be below max_length={self.max_length} "
                "(the prompt needs room); raise max_length or lower max_completion_length."
            )
        if self.callbacks:
            raise ValueError(
                f"GOLDConfig(callbacks={self.callbacks!r}): the config's callbacks field is the reference's and must "
                "stay empty; pass callbacks to the trainer instead: GOLDTrainer(..., callbacks=[...])."
            )
        if self.use_uld_loss and self.xtoken_loss_type is not None:
            raise ValueError(
                f"use_uld_loss=True and xtoken_loss_type={self.xtoken_loss_type!r} are two cross-tokenizer losses; "
                "pick one (set use_uld_loss=False for X-Token, or xtoken_loss_type=None for ULD)."
            )
        if (self.xtoken_loss_type is None) != (self.xtoken_projection_matrix_path is None):
            raise ValueError(
                f"xtoken_loss_type={self.xtoken_loss_type!r} and xtoken_projection_matrix_path="
                f"{self.xtoken_projection_matrix_path!r}: X-Token needs both (a loss type and the projection matrix "
                "built by `posttrain xtoken-projection`), and neither is used without the other."
            )
        if self.uld_use_hybrid_loss and not self.use_uld_loss:
            raise ValueError(
                "uld_use_hybrid_loss=True is a variant of the ULD loss; set use_uld_loss=True as well (or leave "
                "uld_use_hybrid_loss=False)."
            )
        if self.seq_kd and self.cross_tokenizer:
            raise NotImplementedError(
                "seq_kd=True with a cross-tokenizer loss (use_uld_loss / xtoken_loss_type) is not built in posttrain: "
                "the teacher would sample in its own tokens. Use seq_kd=False (the dataset's completions off the "
                "student's steps)."
            )
        super()._check_combinations()


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


def _vocab_size(model: torch.nn.Module) -> int:
    """The number of logits the model's LM head produces."""
    return int(chunked.causal_lm(model).get_output_embeddings().weight.shape[0])


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


class GOLDTrainer(GKDTrainer):
    """GOLD: on-policy distillation from a teacher of any model family (see the module docstring).

    The public API is TRL's ``trl.experimental.gold.GOLDTrainer``, with X-Token's losses. As
    ``GKDTrainer``, each optimizer step trains on the student's own samples with probability
    ``lmbda``, otherwise on the dataset's completions (``messages`` rows). With the same tokenizer
    the loss is the JSD of ``logits / temperature``; across tokenizers (``use_uld_loss`` or
    ``xtoken_loss_type``) the completions are re-read by the teacher in its own tokens.

    Args:
        model: the student (as ``DistillationTrainer``).
        teacher_model: the teacher, a model or its id / path (a ``TeacherServer`` or several
            teachers only with the same tokenizer).
        args: a ``GOLDConfig``.
        data_collator, compute_metrics, preprocess_logits_for_metrics: not built: must be ``None``.
        train_dataset, eval_dataset: ``messages`` or ``prompt`` / ``completion`` rows (as GKD).
        processing_class: the student's tokenizer.
        callbacks, optimizers, peft_config: as ``DistillationTrainer``.
        teacher_processing_class: the teacher's tokenizer (cross-tokenizer losses); ``None`` loads
            it from ``teacher_tokenizer_name_or_path``, the teacher's path, or a teacher model's
            ``config._name_or_path``.

    Raises:
        ValueError: the vocabularies differ without a cross-tokenizer loss, a projection matrix of
            the wrong shape, or a teacher whose tokenizer cannot be found.
    """

    _tag_names = ["posttrain", "gold"]
    _config_class = GOLDConfig
    _suffix = "GOLD"
    #: Dataset completions end at their EOS: the byte alignment ends both tokenisations there (the
    #: template's tokens after it, which GKD and SFT train on, are not aligned across tokenizers yet).
    _dataset_completion_through_end = False

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel | None = None,
        teacher_model: str | PreTrainedModel | None = None,
        args: GOLDConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        preprocess_logits_for_metrics: Any = None,
        peft_config: Any = None,
        teacher_processing_class: Any = None,
    ) -> None:
        super().__init__(
            model, teacher_model, args, data_collator, train_dataset, eval_dataset, processing_class,
            compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics, peft_config,
        )  # fmt: skip
        self._pair: _Pair | None = None
        if self.args.cross_tokenizer:
            self._pair = self._setup_pair(teacher_model, teacher_processing_class)

    # ---- setup ---------------------------------------------------------------------------------

    def _check_vocabularies(self, student_vocab: int, teacher_vocab: int) -> None:
        """Different vocabularies need a cross-tokenizer loss (the reference resizes the teacher silently).

        Raises:
            ValueError: the vocabularies differ and neither ``use_uld_loss`` nor ``xtoken_loss_type`` is set.
        """
        if student_vocab != teacher_vocab and not self.args.cross_tokenizer:
            raise ValueError(
                f"The teacher's vocabulary has {teacher_vocab} tokens and the student's {student_vocab}; the "
                f"same-tokenizer JSD compares them token by token. For a teacher of another family set "
                "use_uld_loss=True (ULD) or xtoken_loss_type='p_kl' / 'h_kl' with xtoken_projection_matrix_path "
                "(X-Token); for a teacher of the student's family, check that it shares the student's tokenizer."
            )

    def _setup_pair(self, teacher_model: Any, teacher_processing_class: Any) -> _Pair:
        """The teacher's tokenizer and the pair's fixed tables (projection, matched tokens).

        Raises:
            ValueError: a served teacher, no way to find the teacher's tokenizer, or a bad projection.
            NotImplementedError: several teachers.
        """
        if self._served:
            raise ValueError(
                "A served teacher (TeacherServer) sends log-probs of the student's own tokens; the cross-tokenizer "
                "losses need the teacher's whole distributions over its own tokens. Load the teacher in this process."
            )
        if None not in self.teachers:
            raise NotImplementedError(
                "Several teachers (a dict of teacher_model) with a cross-tokenizer loss are not built in posttrain; "
                "pass one teacher."
            )
        tokenizer = teacher_processing_class
        if tokenizer is None:
            source, revision = self._teacher_tokenizer_source(teacher_model)
            tokenizer = loading.load_tokenizer(source, revision, self.args.trust_remote_code)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor wraps its tokenizer
        sizes = (_vocab_size(self.model), _vocab_size(self.teacher_model))
        self._check_teacher_template(tokenizer)
        pair = _Pair(self._tokenizer, tokenizer, sizes, self.args)
        device = self.accelerator.device  # the fixed tables once on the device, not per micro-batch
        pair.projection = pair.projection.to(device) if pair.projection is not None else None
        pair.common = pair.common.to(device) if pair.common is not None else None
        return pair

    def _check_teacher_template(self, tokenizer: Any) -> None:
        """Conversational prompts need the teacher's chat template (checked on the first train row).

        Raises:
            ValueError: the train prompts are conversations and the teacher's tokenizer has no template.
        """
        dataset = self.train_dataset
        if (
            dataset is None
            or len(dataset) == 0
            or "prompt" not in (getattr(dataset, "column_names", None) or [])
        ):
            return
        if isinstance(dataset[0]["prompt"], list) and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                "The train prompts are conversations, which the teacher reads rendered with its own chat template, "
                "but the teacher's tokenizer has none. Set teacher_processing_class.chat_template (or pass a "
                "tokenizer that has one via teacher_tokenizer_name_or_path), or use plain-text prompts."
            )

    def _teacher_tokenizer_source(self, teacher_model: Any) -> tuple[str, str | None]:
        """Where the teacher's tokenizer loads from, and the revision that goes with it.

        Raises:
            ValueError: the teacher is a model object without a name or path.
        """
        a = self.args
        if a.teacher_tokenizer_name_or_path is not None:
            return a.teacher_tokenizer_name_or_path, None
        if isinstance(teacher_model, str):
            return teacher_model, a.teacher_model_revision
        if teacher_model is None and a.teacher_model_name_or_path is not None:
            return a.teacher_model_name_or_path, a.teacher_model_revision
        name = getattr(getattr(self.teacher_model, "config", None), "_name_or_path", "")
        if name:
            return name, a.teacher_model_revision
        raise ValueError(
            "The cross-tokenizer losses read the completions in the teacher's own tokens, but the teacher model has "
            "no name or path to load its tokenizer from; pass teacher_processing_class=<its tokenizer> to "
            "GOLDTrainer, or set teacher_tokenizer_name_or_path."
        )

    # ---- the teacher's side of a generated batch ------------------------------------------------

    def _generate_and_score(
        self, batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> list[ScoredRollout]:
        """GKD's batch; across tokenizers each micro-batch also carries its rows in the teacher's tokens."""
        parts = super()._generate_and_score(batch, mode, num_chunks)
        if self._pair is not None:
            self._attach_teacher_rows(parts, batch, mode, num_chunks)
        return parts

    def _attach_teacher_rows(
        self, parts: list[ScoredRollout], batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> None:
        """Each micro-batch's ``TeacherRow`` s (``extra["gold_rows"]``) and the step's counts.

        The micro-batches are consecutive rows of ``batch`` (one row per completion). The counts
        (samples with an aligned span, aligned spans) are taken over the optimizer step, as
        ``Normalizers`` are, so that gradient accumulation gives the step's mean.
        """
        start, counts = 0, torch.zeros(2)
        for part in parts:
            r = part.rollout
            n = r.completion_ids.shape[0]
            loss_rows = (
                self._loss_mask(r).sum(dim=1) > 0
            )  # e.g. a truncated one under mask_truncated_completions
            rows = [self._teacher_row(part, j, batch[start + j], bool(loss_rows[j])) for j in range(n)]
            part.extra["gold_rows"] = rows
            counts += torch.tensor([sum(row.kept > 0 for row in rows), sum(row.kept for row in rows)])
            start += n
        a = self.args
        accumulation = a.gradient_accumulation_steps if mode == "train" else 1
        total = gather(counts.to(self.accelerator.device).unsqueeze(0)).sum(0).cpu()
        samples, spans = (max(float(c) / num_chunks * accumulation / a.world_size, 1.0) for c in total)
        for part in parts:
            part.extra["gold_norms"] = {"samples": samples, "spans": spans}

    def _teacher_row(self, part: ScoredRollout, j: int, row: dict[str, Any], in_loss: bool) -> TeacherRow:
        """Row ``j`` of a micro-batch in the teacher's tokens, aligned with the student's."""
        a, pair, r = self.args, self._pair, part.rollout
        n = int(r.completion_mask[j].sum())
        ids = r.completion_ids[j, :n].tolist()
        terminated = bool(r.is_terminated[j]) and n > 0
        text, s_offsets = completion_text(ids, pair.pieces, pair.special)
        end = len(text.encode("utf-8"))
        teacher = byte_offsets(pair.tokenizer, text)
        t_ids, t_offsets = list(teacher.ids), list(teacher.offsets)
        s_skip, t_skip = [], []
        if terminated:  # both EOS on a virtual byte past the text: the last group when neither is skipped
            s_offsets[-1] = (end, end + 1)
            s_skip = [n - 1] if a.uld_skip_student_eos else []
            if pair.eos is not None:
                t_ids.append(int(pair.eos))
                t_offsets.append((end, end + 1))
                t_skip = [len(t_ids) - 1] if a.uld_skip_teacher_eos else []
        pairs = self._groups(s_offsets, t_offsets, s_skip, t_skip) if in_loss else []
        s_groups = torch.tensor([s for s, _ in pairs], dtype=torch.long).reshape(-1, 2) + 1  # local: +1
        t_groups = torch.tensor([t for _, t in pairs], dtype=torch.long).reshape(-1, 2) + 1
        prompt_ids = self._teacher_prompt(row.get("prompt"), len(t_ids))
        merge = self._merge
        s_tokens = torch.tensor([0, *ids], dtype=torch.long)  # only the length and later tokens matter here
        t_tokens = torch.tensor([0, *t_ids], dtype=torch.long)
        strategy = a.uld_token_merge_strategy
        valid = _valid(s_groups, s_tokens, strategy, merge) & _valid(t_groups, t_tokens, strategy, merge)
        return TeacherRow(prompt_ids, t_ids, s_groups, t_groups, int(valid.sum()))

    def _groups(
        self, s_offsets: list[Span], t_offsets: list[Span], s_skip: list[int], t_skip: list[int]
    ) -> list[tuple[Span, Span]]:
        """The aligned ``(student, teacher)`` completion token ranges, the last group dropped."""
        if self.args.use_extended_uld or self.args.xtoken_loss_type is not None:
            aligned = align_spans(s_offsets, t_offsets, student_skip=s_skip, teacher_skip=t_skip).drop_last()
            return [(g.student, g.teacher) for g in aligned.groups]
        groups = _positional_groups(len(s_offsets) - len(s_skip), len(t_offsets) - len(t_skip))
        return groups[:-1]

    def _teacher_prompt(self, prompt: Any, completion_length: int) -> list[int]:
        """The prompt in the teacher's tokens: rendered with its chat template, cut to ``max_length``.

        Raises:
            ValueError: the prompt is missing or renders to no token.
        """
        tok, a = self._pair.tokenizer, self.args
        if prompt is None:
            raise ValueError(
                "A batch row has no 'prompt'; the teacher reads each completion after its prompt."
            )
        text = chat.render_prompt(prompt, tok, a.chat_template_kwargs)
        ids = list(tok(text, add_special_tokens=isinstance(prompt, str))["input_ids"])
        if a.max_length is not None:
            ids = ids[-max(a.max_length - completion_length, 1) :]
        if not ids:
            raise ValueError(
                f"The prompt {prompt!r} is empty in the teacher's tokens; the teacher needs at least one prompt token "
                "to predict the completion's first token. Drop empty prompts."
            )
        return ids

    @property
    def _merge(self) -> str:
        """How a span's rows merge: ULD's chain rule, X-Token's span average (``MERGES``)."""
        return "mean" if self.args.xtoken_loss_type is not None else "chain"

    # ---- the loss ------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The same-tokenizer JSD (``DistillationTrainer``'s), or the cross-tokenizer loss (ULD or X-Token)."""
        if self._pair is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if return_outputs:
            raise ValueError("GOLDTrainer.compute_loss does not return model outputs.")
        mode = "train" if model.training else "eval"
        sides, student, aux_loss = self._sample_sides(model, inputs)
        nll = None
        if self.args.xtoken_loss_type is not None or self.args.uld_crossentropy_weight > 0:
            keep = self._loss_mask(inputs.rollout).bool()
            nll = self._student_nll(student, inputs.rollout.completion_ids, keep)
        if self.args.xtoken_loss_type is not None:
            loss, metrics = self._xtoken_loss(sides, student, inputs, nll)
        else:
            loss, metrics = self._uld_loss(sides, student, inputs, nll)
        loss = self._with_aux_loss(loss, SimpleNamespace(aux_loss=aux_loss), inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _sample_sides(
        self, model: torch.nn.Module, inputs: ScoredRollout
    ) -> tuple[list[_SampleSides], HeadInputs, Any]:
        """Both models' forwards over the micro-batch (each in its own tokens) and each sample's sides.

        Returns:
            ``(sides, student, aux_loss)``: one ``_SampleSides`` per sample with aligned spans, the
            student's [B, T + 1] side (for its NLL) and a Mixture-of-Experts router loss or ``None``.
        """
        r, rows, pair = inputs.rollout, inputs.extra["gold_rows"], self._pair
        device = r.completion_ids.device
        pad_s = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        pad_t = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else (pair.eos or 0)
        s_ids = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        student, aux_loss = _head_inputs(model, s_ids, pad_s)
        t_ids = (
            *_pad_rows([row.prompt_ids for row in rows], pad_t, True, device),
            *_pad_rows([row.completion_ids for row in rows], pad_t, False, device),
        )
        with torch.no_grad():
            teacher, _ = _head_inputs(self.teacher_model, t_ids, pad_t)
        lengths = r.completion_mask.sum(dim=1).tolist()
        sides = []
        for i, row in enumerate(rows):
            if row.kept == 0:
                continue
            n_s, n_t = (
                int(lengths[i]) + 1,
                len(row.completion_ids) + 1,
            )  # the last prompt token, then each token
            sides.append(
                _SampleSides(
                    (student.hidden[i, :n_s], student.weight, student.bias),
                    (teacher.hidden[i, :n_t], teacher.weight, teacher.bias),
                    torch.cat([r.prompt_ids[i, -1:], r.completion_ids[i, : n_s - 1]]),
                    torch.cat([t_ids[0][i, -1:], t_ids[2][i, : n_t - 1]]),
                    row,
                )
            )
        return sides, student, aux_loss

    @staticmethod
    def _student_nll(student: HeadInputs, completion_ids: torch.Tensor, keep: torch.Tensor) -> _Nll:
        """The student's NLL summed over the kept completion tokens (with gradient), and their number."""
        width = completion_ids.shape[1]
        side = HeadInputs(student.hidden[:, :width], student.weight, student.bias).rows(keep)
        count = int(keep.sum())
        if count == 0:
            return _Nll(student.hidden.sum() * 0.0, 0)
        return _Nll(-target_logps(side, completion_ids[keep]).sum(), count)

    def _per_sample(self, fn: Callable[..., Any], sides: _SampleSides) -> Any:
        """``fn(sides, student rows)``, recomputed in backward (one sample's [T, V] at a time)."""
        x = sides.student[0]
        if torch.is_grad_enabled() and x.requires_grad:
            return checkpoint(functools.partial(fn, sides), x, use_reentrant=False)
        return fn(sides, x)

    def _process_means(self, sums: dict[str, torch.Tensor], count: int) -> dict[str, float]:
        """Each value's sum over every process divided by the processes' total ``count``."""
        local = torch.stack(
            [v.detach().float().sum().cpu() for v in sums.values()] + [torch.tensor(float(count))]
        )
        totals = gather(local.to(self.accelerator.device).unsqueeze(0)).sum(0).tolist()
        return {name: total / max(totals[-1], 1.0) for name, total in zip(sums, totals[:-1], strict=True)}

    def _uld_sample(self, sides: _SampleSides, s_x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One sample's mean over its spans of the ULD distance (or the hybrid), and the hybrid's two parts."""
        a = self.args
        temps = (a.uld_student_temperature, a.uld_teacher_temperature)
        s, t = _merged_pair(sides, s_x, temps, (a.uld_token_merge_strategy, "chain"))
        if self._pair.common is None:
            per_span = uld_distance(s.exp(), t.exp())
            return per_span.mean(), per_span.new_zeros(()), per_span.new_zeros(())
        terms = hybrid_terms(s.exp(), t.exp(), self._pair.common)
        w_m = 1.0 if a.uld_hybrid_matched_weight is None else a.uld_hybrid_matched_weight
        w_u = 1.0 if a.uld_hybrid_unmatched_weight is None else a.uld_hybrid_unmatched_weight
        per_span = terms.total(w_m, w_u)
        return per_span.mean(), terms.common.detach().mean(), terms.uncommon.detach().mean()

    def _uld_loss(
        self, sides: list[_SampleSides], student: HeadInputs, inputs: ScoredRollout, nll: _Nll | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``w_d sum_b mean_spans ULD / samples + w_ce NLL / tokens`` (the step's counts) and its metrics."""
        a = self.args
        values = [self._per_sample(self._uld_sample, s) for s in sides]
        zero = student.hidden.sum() * 0.0  # a micro-batch without spans still gives a (zero) gradient
        parts = [
            torch.stack([v[k] for v in values]) if values else zero.detach().reshape(1)[:0] for k in range(3)
        ]
        loss = a.uld_distillation_weight * (parts[0].sum() + zero) / inputs.extra["gold_norms"]["samples"]
        if nll is not None:
            loss = loss + a.uld_crossentropy_weight * nll.total / inputs.norms.tokens
        sums = {"distillation_loss": parts[0]}
        if self._pair.common is not None:
            sums.update(matched_loss=parts[1], unmatched_loss=parts[2])
        metrics = self._process_means(sums, len(values))
        metrics[_source_metric(inputs)] = metrics["distillation_loss"]
        if nll is not None:
            metrics.update(self._process_means({"crossentropy": nll.total}, nll.tokens))
        return loss, metrics

    def _xtoken_sample(
        self, top: tuple[torch.Tensor, torch.Tensor] | None, sides: _SampleSides, s_x: torch.Tensor
    ) -> torch.Tensor:
        """One sample's KD summed over its spans (P-KL on the micro-batch's teacher tokens, or H-KL)."""
        a = self.args
        temps = (a.xtoken_temperature, a.xtoken_temperature)
        s, t = _merged_pair(sides, s_x, temps, (a.uld_token_merge_strategy, "mean"))
        if a.xtoken_loss_type == "h_kl":
            return hybrid_terms(s.exp(), t.exp(), self._pair.common).total().sum()
        keep_ids, projection_t = top
        return _p_kl_rows(s, t[:, keep_ids.to(t.device)], projection_t).sum()

    @torch.no_grad()
    def _p_kl_top(self, sides: list[_SampleSides]) -> tuple[torch.Tensor, torch.Tensor]:
        """P-KL's teacher tokens K (the micro-batch's ``xtoken_vocab_topk`` most massive) and ``W[:, K]^T``.

        The mass is summed over the spans the loss compares (valid on both sides), the teacher's
        rows computed here without the student's.
        """
        a, projection = self.args, self._pair.projection
        how = (a.uld_token_merge_strategy, "mean")
        mass = torch.zeros(projection.shape[1], device=self.accelerator.device)
        for s in sides:
            t, t_valid = _merged_side(
                s.teacher, s.teacher_tokens, s.row.teacher_groups, a.xtoken_temperature, how
            )
            s_valid = _valid(s.row.student_groups, s.student_tokens.cpu(), *how)
            keep = t_valid.cpu() & s_valid
            mass += t[keep.to(t.device)].float().exp().sum(dim=0).to(mass.device)
        keep_ids = mass.topk(min(a.xtoken_vocab_topk, mass.numel())).indices
        cols = projection.to(mass.device).index_select(1, keep_ids)
        return keep_ids, cols.t().coalesce()

    def _xtoken_loss(
        self, sides: list[_SampleSides], student: HeadInputs, inputs: ScoredRollout, nll: _Nll
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Eq. 7 (or the fixed weights) over the step's span and token counts, and its metrics."""
        a = self.args
        top = self._p_kl_top(sides) if a.xtoken_loss_type == "p_kl" else None
        spans = sum(s.row.kept for s in sides)
        zero = student.hidden.sum() * 0.0
        sample = functools.partial(self._xtoken_sample, top)
        kd_sum = torch.stack([self._per_sample(sample, s) for s in sides]).sum() if sides else zero
        scale = a.xtoken_temperature**2  # Hinton's T^2: gradients independent of the temperature
        kd = scale * (kd_sum + zero) / inputs.extra["gold_norms"]["spans"]
        ce = nll.total / inputs.norms.tokens
        if a.xtoken_dynamic_scaling:  # sg(L_CE / |L_KD|) of the micro-batch's means
            local_kd = scale * kd_sum.detach() / max(spans, 1)
            ratio = (nll.total.detach() / max(nll.tokens, 1)) / local_kd.abs().clamp_min(1e-8)
            ratio = ratio if spans else torch.zeros_like(ratio)
            loss = ratio * kd + ce
        else:
            ratio = torch.tensor(float(a.xtoken_kl_weight))
            loss = a.xtoken_kl_weight * kd + a.xtoken_ce_scale * ce
        metrics = self._process_means({"distillation_loss": kd_sum}, spans)
        metrics[_source_metric(inputs)] = metrics["distillation_loss"]
        metrics.update(self._process_means({"crossentropy": nll.total}, nll.tokens))
        metrics.update(self._process_means({"xtoken/kd_scale": ratio}, 1))
        return loss, metrics


@dataclass(frozen=True)
class _Nll:
    """The student's NLL over a micro-batch's kept completion tokens: ``total`` (with gradient) over ``tokens``."""

    total: torch.Tensor
    tokens: int


def _source_metric(inputs: ScoredRollout) -> str:
    """``on_policy_loss`` for the student's samples, ``off_policy_loss`` for the others."""
    return "on_policy_loss" if inputs.extra.get("source", "student") == "student" else "off_policy_loss"
