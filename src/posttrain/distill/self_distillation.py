"""SDFTTrainer: Self-Distilled Fine-Tuning, the model as its own teacher under a privileged context.

One training step, top to bottom; the marked lines are SDFT's, the rest ``OnlineTrainer``'s::

    rollout  = sampler.sample(rows)                    # the student samples from the prompt
    teacher  = template(prompt, privileged_context)    # SDFT: the teacher's prompt per row
    student  = the model after the prompt, with gradient
    teacher  = the teacher (start / live / EMA weights) after its own prompt, without
    loss     = mean over samples of the token mean of D # SDFT: D per distillation_mode (losses.py)

The teacher reads exactly the completion tokens the student sampled, after a different prompt,
so the two sides' completion positions line up one to one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel, TrainerCallback

from posttrain.data import distill as distill_data
from posttrain.distill import losses
from posttrain.distill.config import SDFTConfig
from posttrain.distill.trainer import TeacherStudentTrainer
from posttrain.models import peft as peft_utils
from posttrain.models.reference import create_reference, mix_into_reference
from posttrain.ops.divergence import HeadInputs, target_logps, token_divergence, top_ids
from posttrain.ops.logprobs import completion_head_inputs
from posttrain.sampling.rollout import ScoredRollout

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


class SDFTTrainer(TeacherStudentTrainer):
    """Self-Distilled Fine-Tuning (arXiv 2601.19897): on-policy self-distillation from a privileged context.

    The public API is TRL's ``trl.experimental.sdft.SDFTTrainer``. See ``docs/distillation.md``.

    Args:
        model: hub id, local path, embedded name, a ``PreTrainedModel`` causal LM or a ``peft.PeftModel``.
        args: an ``SDFTConfig``; defaults to one with ``output_dir="<model name>-SDFT"``.
        train_dataset, eval_dataset: rows with ``prompt`` (text or messages) and
            ``privileged_context`` (what only the teacher reads: a worked solution, a hint).
        processing_class: the tokenizer; loaded from the model when ``None``.
        callbacks, optimizers, peft_config: as ``GRPOTrainer``.
        reward_funcs: optional reward functions, logged (``rewards/<name>/mean``) but not trained on.
    """

    _tag_names = ["posttrain", "sdft"]

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        args: SDFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: Any = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, SDFTConfig, "SDFT")
        if not isinstance(args, SDFTConfig):
            raise TypeError(f"args is a {type(args).__name__}; SDFTTrainer needs an SDFTConfig.")
        distill_data.check_privileged_column(train_dataset, "train dataset")
        for name, dataset in (
            eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval", eval_dataset)]
        ):
            distill_data.check_privileged_column(dataset, f"{name} dataset")
        super().__init__(
            model,
            args,
            reward_funcs,
            train_dataset,
            eval_dataset,
            processing_class,
            None,
            callbacks,
            optimizers,
            None,
            peft_config,
        )
        self.teacher_model = self._setup_self_teacher()

    # ---- the teacher -----------------------------------------------------------------------------

    def _setup_self_teacher(self) -> torch.nn.Module | None:
        """A frozen copy of the start weights (``base``, ``ema``), or ``None``: the live model
        (``live``), or the adapters-off base of a PEFT model (``base``)."""
        kind = self.args.teacher_model_kind
        if kind == "live" or (kind == "base" and peft_utils.is_peft_model(self.model)):
            return None
        return create_reference(self.model)

    @contextmanager
    def _teacher(self) -> Iterator[torch.nn.Module]:
        """The model the teacher's forward runs on."""
        if self.teacher_model is not None:
            yield self.teacher_model
        elif self.args.teacher_model_kind == "live":
            yield self.model
        else:
            with peft_utils.adapters_disabled(self.model) as base:
                yield base

    def _after_optimizer_step(self) -> None:
        """The EMA teacher's step toward the student, every ``teacher_sync_steps`` optimizer steps."""
        a = self.args
        if a.teacher_model_kind == "ema" and self.state.global_step % a.teacher_sync_steps == 0:
            mix_into_reference(
                self.teacher_model.parameters(), self.model.parameters(), a.teacher_update_rate
            )

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        state = super()._save_extra_state(folder)
        if self.args.teacher_model_kind == "ema":
            self._save_reference(folder, self.teacher_model)
        return state

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        super()._load_extra_state(folder, state)
        if self.args.teacher_model_kind == "ema":
            self._load_reference(folder, self.teacher_model)

    # ---- the batch ---------------------------------------------------------------------------------

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]]) -> None:
        """The teacher's prompt of every row: the template with its privileged context."""
        template = self.args.teacher_prompt_template
        prompts = [
            distill_data.teacher_prompt(row["prompt"], row.get(distill_data.PRIVILEGED_COLUMN), template, i)
            for i, row in enumerate(batch)
        ]
        scored.teacher_prompt_ids, scored.teacher_prompt_mask = self.sampler.encode_prompts(prompts)

    def _loss_mask(self, rollout: Any) -> torch.Tensor:
        """The shared mask, less the first ``num_loss_tokens_to_skip`` completion tokens."""
        mask = super()._loss_mask(rollout)
        skip = self.args.num_loss_tokens_to_skip
        if skip:
            mask = mask.clone()
            mask[:, :skip] = 0
        return mask

    # ---- the loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The mean over the micro-batch's samples of each sample's token mean of the divergence."""
        if return_outputs:
            raise ValueError("SDFTTrainer.compute_loss does not return model outputs.")
        r = inputs.rollout
        mode = "train" if model.training else "eval"
        mask = self._loss_mask(r).to(torch.float32)
        keep = mask.bool()
        completion = (r.completion_ids, r.completion_mask)
        student, aux_loss = completion_head_inputs(model, r.prompt_ids, r.prompt_mask, *completion)
        with torch.no_grad(), self._teacher() as teacher_model:
            teacher, _ = completion_head_inputs(
                teacher_model, inputs.teacher_prompt_ids, inputs.teacher_prompt_mask, *completion
            )
        per_token = self._token_divergences(
            student.rows(keep), teacher.rows(keep), r.completion_ids[keep], inputs, keep
        )
        values = torch.zeros_like(mask, dtype=per_token.dtype).masked_scatter(keep, per_token)  # [n, T]
        per_sample = losses.per_sample_means(values, mask)  # [n]
        loss = per_sample.sum() / inputs.norms.sequences
        metric = self._token_means({"loss": per_sample}, per_sample.numel())["loss"]
        metrics = {"self_distillation/distillation_loss": metric, "sdft/distillation_loss": metric}
        loss = self._with_aux_loss(loss, SimpleNamespace(aux_loss=aux_loss), inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _token_divergences(
        self,
        student: HeadInputs,
        teacher: HeadInputs,
        tokens: torch.Tensor,
        inputs: ScoredRollout,
        keep: torch.Tensor,
    ) -> torch.Tensor:
        """D at each kept position ([n_tokens], with gradient), importance-weighted off-policy."""
        a = self.args
        temperature = a.temperature
        if a.distillation_mode == "full_logits":
            divergence, _ = token_divergence(student, teacher, a.distillation_alpha, temperature)
        elif a.distillation_mode == "topk_logits":
            ids = top_ids(student, a.distillation_topk, temperature)  # [n, k]
            divergence = losses.topk_divergence(
                target_logps(student, ids, temperature),
                target_logps(teacher, ids, temperature),
                a.distillation_alpha,
                a.distillation_add_tail,
            )
        else:
            divergence = losses.sampled_token_loss(
                target_logps(student, tokens, temperature), target_logps(teacher, tokens, temperature)
            )
        if inputs.old_logps is not None and a.distillation_is_clip is not None:
            with torch.no_grad():
                current = target_logps(student, tokens, temperature)
            divergence = divergence * losses.truncated_is_weights(
                current, inputs.old_logps[keep], a.distillation_is_clip
            )
        return divergence
