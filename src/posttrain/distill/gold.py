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

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel, TrainerCallback

from posttrain.data import chat
from posttrain.distill.trainer import GKDTrainer
from posttrain.models import loading
from posttrain.ops import chunked
from posttrain.ops.cross_tokenizer import (
    hybrid_terms,
    uld_distance,
)
from posttrain.ops.divergence import HeadInputs, target_logps
from posttrain.ops.token_alignment import align_spans, byte_offsets
from posttrain.sampling.rollout import ScoredRollout

if TYPE_CHECKING:
    from peft import PeftModel

from posttrain.distill.gold_alignment import (
    Span,
    TeacherRow,
    _head_inputs,
    _merged_pair,
    _merged_side,
    _p_kl_rows,
    _pad_rows,
    _Pair,
    _positional_groups,
    _SampleSides,
    _valid,
    completion_text,
)
from posttrain.distill.gold_config import XTOKEN_LOSS_TYPES, GOLDConfig

__all__ = ["XTOKEN_LOSS_TYPES", "GOLDConfig", "GOLDTrainer", "TeacherRow", "completion_text"]


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

    @property
    def _dataset_completion_through_end(self) -> bool:  # type: ignore[override]
        """With one tokenizer a dataset completion keeps the chat template's tokens after its EOS,
        as the reference and GKD train on them; the cross-tokenizer losses (ULD, X-Token) end it
        at the EOS, where the byte alignment ends both tokenisations (the tokens after it are not
        aligned across tokenizers yet)."""
        return not self.args.cross_tokenizer

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
        sizes = (chunked.vocab_size(self.model), chunked.vocab_size(self.teacher_model))
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
        self._refuse_outputs(return_outputs)
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
        with torch.no_grad(), self.accelerator.autocast():  # the student's precision (bf16=True)
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
        side = HeadInputs(
            student.hidden[:, :width], student.weight, student.bias, student.product_dtype
        ).rows(keep)
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
