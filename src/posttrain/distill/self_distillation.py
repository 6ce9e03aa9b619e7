"""SDFTTrainer and SDPOTrainer: the model as its own teacher, reading a privileged context.

One training step, top to bottom; the marked lines are SDFT's, the rest ``OnlineTrainer``'s::

    rollout  = sampler.sample(rows)                    # the student samples from the prompt
    teacher  = template(prompt, privileged_context)    # SDFT: the teacher's prompt per row
    student  = the model after the prompt, with gradient
    teacher  = the teacher (start / live / EMA weights) after its own prompt, without
    loss     = mean over samples of the token mean of D # SDFT: D per distillation_mode (losses.py)

The teacher reads exactly the completion tokens the student sampled, after a different prompt,
so the two sides' completion positions line up one to one. SDPO (``SDPOTrainer``) builds the
teacher's prompt from a successful sibling completion and the environment's feedback
(``reprompt.py``) and can mix a GRPO policy term in.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather, gather_object
from transformers import PreTrainedModel, TrainerCallback

from posttrain.data import distill as distill_data
from posttrain.data import vision
from posttrain.distill import losses, reprompt
from posttrain.distill.config import SDFTConfig, SDPOConfig
from posttrain.distill.trainer import TeacherStudentTrainer, select_rows
from posttrain.grpo import advantages, objectives
from posttrain.models import peft as peft_utils
from posttrain.models.reference import create_reference, mix_into_reference
from posttrain.ops.divergence import HeadInputs, target_logps, token_divergence, top_ids
from posttrain.ops.logprobs import completion_head_inputs
from posttrain.rewards.runner import weighted_sum
from posttrain.sampling.rollout import ScoredRollout

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


class SelfTeacherTrainer(TeacherStudentTrainer):
    """What SDFT and SDPO share: the model as its own teacher (start, live or EMA weights), the
    per-token divergence of the chosen ``distillation_mode``, per-sample means."""

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
        """The generator learns that the weights changed (a vLLM engine takes the new ones before
        the next sampling), then the EMA teacher's step toward the student, every
        ``teacher_sync_steps`` optimizer steps."""
        super()._after_optimizer_step()
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

    def _encode_teacher_prompts(
        self, scored: ScoredRollout, prompts: list[Any], batch: list[dict[str, Any]], limit: int | None
    ) -> None:
        """The teacher prompts' tokens (their images expanded, with their image inputs, for rows with images).

        Raises:
            ValueError: a teacher prompt with images longer than ``limit`` tokens (a cut would cut them).
        """
        images = [vision.row_images(row) for row in batch]
        if not any(images):
            scored.teacher_prompt_ids, scored.teacher_prompt_mask = self.sampler.encode_prompts(
                prompts, limit
            )
            return
        ids, mask, scored.teacher_vision = self.sampler.encode_with_images(prompts, images)
        if limit is not None and int(mask.sum(dim=1).max()) > limit:
            raise ValueError(
                f"A teacher prompt with images takes {int(mask.sum(dim=1).max())} tokens, more than "
                f"max_reprompt_len={limit}; cutting it would cut its image tokens. Raise max_reprompt_len."
            )
        scored.teacher_prompt_ids, scored.teacher_prompt_mask = ids, mask

    def _distillation_per_sample(
        self, student: HeadInputs, inputs: ScoredRollout, mask: torch.Tensor
    ) -> tuple[torch.Tensor, float]:
        """Each sample's token mean of the divergence from its teacher ([n], with gradient), and
        the metric ``self_distillation/distillation_loss``: the token mean of the divergence over
        every process's distilled tokens (the reference's; 0 when there are none).

        The teacher reads each completion after the row's teacher prompt; rows outside
        ``inputs.teacher_rows`` (SDPO's unreprompted samples) are not run and give 0.

        Args:
            student: the student's [n, T, ...] side of every completion position.
            inputs: the micro-batch, with its teacher prompts.
            mask: [n, T] the loss mask (float).
        """
        r = inputs.rollout
        rows = inputs.teacher_rows
        keep = mask.bool() if rows is None else mask.bool() & rows.unsqueeze(1)
        if not keep.any():  # no teacher in this micro-batch: a zero that keeps the graph
            metric = self._token_means({"d": torch.zeros(1, device=mask.device)}, 0)["d"]
            return student.hidden.sum() * 0.0 + torch.zeros(mask.shape[0], device=mask.device), metric
        sub = r if rows is None else select_rows(r, rows)
        with torch.no_grad(), self.accelerator.autocast(), self._teacher() as teacher_model:
            prompt_ids = inputs.teacher_prompt_ids if rows is None else inputs.teacher_prompt_ids[rows]
            prompt_mask = inputs.teacher_prompt_mask if rows is None else inputs.teacher_prompt_mask[rows]
            images = None
            if inputs.teacher_vision is not None:
                rows_vision = inputs.teacher_vision
                if rows is not None:
                    rows_vision = rows_vision.select(rows.nonzero().flatten().tolist())
                images = rows_vision.model_kwargs(
                    prompt_ids.shape[1], sub.completion_ids.shape[1], prompt_ids.device
                )
            teacher, _ = completion_head_inputs(
                teacher_model,
                prompt_ids,
                prompt_mask,
                sub.completion_ids,
                sub.completion_mask,
                model_inputs=images,
            )
        sub_keep = keep if rows is None else keep[rows]
        per_token = self._token_divergences(
            student.rows(keep), teacher.rows(sub_keep), r.completion_ids[keep], inputs, keep
        )
        values = torch.zeros_like(mask, dtype=per_token.dtype).masked_scatter(keep, per_token)  # [n, T]
        metric = self._token_means({"d": per_token}, int(keep.sum()))["d"]
        return losses.per_sample_means(values, keep.to(mask.dtype)), metric  # a row without a teacher: 0

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
        is_weights = None
        if inputs.old_logps is not None and a.distillation_is_clip is not None:
            with torch.no_grad():
                current = target_logps(student, tokens, temperature)
            is_weights = losses.truncated_is_weights(current, inputs.old_logps[keep], a.distillation_is_clip)
        if a.distillation_mode == "full_logits":
            # the loss's weights (each sample's token mean, the importance weights): the engine
            # builds the student's gradient for them in its forward pass
            weights = (1.0 / keep.sum(dim=-1).clamp(min=1)).unsqueeze(1).expand_as(keep)[keep]
            if is_weights is not None:
                weights = weights * is_weights
            divergence, _ = token_divergence(
                student, teacher, a.distillation_alpha, temperature, loss_weights=weights
            )
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
        return divergence * is_weights if is_weights is not None else divergence


class SDFTTrainer(SelfTeacherTrainer):
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

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]], mode: str) -> None:
        """The teacher's prompt of every row: the template with its privileged context."""
        template = self.args.teacher_prompt_template
        prompts = [
            distill_data.teacher_prompt(_placed(row), row.get(distill_data.PRIVILEGED_COLUMN), template, i)
            for i, row in enumerate(batch)
        ]
        self._encode_teacher_prompts(scored, prompts, batch, None)

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
        student, aux_loss, mode = self._student_side(model, inputs, return_outputs)
        mask = self._loss_mask(inputs.rollout).to(torch.float32)
        per_sample, metric = self._distillation_per_sample(student, inputs, mask)  # [n]
        metrics = {"self_distillation/distillation_loss": metric, "sdft/distillation_loss": metric}
        return self._finish_loss(per_sample.sum() / inputs.norms.sequences, aux_loss, inputs, metrics, mode)


class SDPOTrainer(SelfTeacherTrainer):
    """Self-Distillation Policy Optimization (arXiv 2601.20802): failed samples learn from the model
    reprompted with a successful sibling's answer and the environment's feedback.

    The public API is TRL's ``trl.experimental.sdpo.SDPOTrainer``. Each prompt's
    ``num_generations`` completions are scored; each failed completion's teacher prompt is the
    reprompt (``reprompt.py``); the loss is ``(1 - distillation_weight) * policy +
    distillation_weight * distillation``, the policy term GRPO's (``loss_type``, ``epsilon``,
    group-scaled advantages) and the distillation term the mean over samples of each sample's
    token mean of D (samples without a reprompt add 0 and still count). See
    ``docs/distillation.md``.

    Args:
        model: hub id, local path, embedded name, a ``PreTrainedModel`` causal LM or a ``peft.PeftModel``.
        reward_funcs: reward functions or models, as ``GRPOTrainer``'s (a success reaches
            ``success_reward_threshold``).
        args: an ``SDPOConfig``.
        train_dataset, eval_dataset: rows with ``prompt``, and ``privileged_context`` (the
            environment's feedback) with ``include_environment_feedback=True``.
        processing_class, reward_processing_classes, callbacks, optimizers, peft_config: as ``GRPOTrainer``.
    """

    _tag_names = ["posttrain", "sdpo"]
    _reward_required = True

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: SDPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: Any = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, SDPOConfig, "SDPO")
        if not isinstance(args, SDPOConfig):
            raise TypeError(f"args is a {type(args).__name__}; SDPOTrainer needs an SDPOConfig.")
        if args.include_environment_feedback:
            distill_data.check_privileged_column(train_dataset, "train dataset")
        super().__init__(
            model,
            args,
            reward_funcs,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            None,
            peft_config,
        )
        self.teacher_model = self._setup_self_teacher()
        self._objective = objectives.ObjectiveSettings(
            loss_type=args.loss_type,
            importance_sampling_level=args.importance_sampling_level,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        )

    # ---- rewards, advantages, reprompts ------------------------------------------------------------

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """GRPO's group-relative advantages (``scale_rewards``) and the reward diagnostics."""
        adv, metrics = advantages.compute(rewards, self.reward_weights, group, self.args.scale_rewards)
        total = weighted_sum(rewards, self.reward_weights)  # [N]
        grouped = total.view(-1, group)
        flat = (grouped.amax(dim=1) - grouped.amin(dim=1)) <= self.args.diagnostics_flat_tolerance
        stats = {
            "reward_mean": total.mean().item(),
            "reward_std": total.std().item() if total.numel() > 1 else 0.0,
            "reward_min": total.min().item(),
            "reward_max": total.max().item(),
            "group_reward_std_mean": grouped.std(dim=1).mean().item() if group > 1 else 0.0,
            "flat_group_fraction": flat.float().mean().item(),
        }
        for j, name in enumerate(self._reward_names):
            stats[f"rewards/{name}"] = rewards[:, j].nanmean().item()
        self._warn_if_flat(stats["flat_group_fraction"])
        return adv, {**metrics, **{f"self_distillation/{k}": v for k, v in stats.items()}}

    def _warn_if_flat(self, flat_fraction: float) -> None:
        """Every ``diagnostics_warning_interval`` steps, warn while no group has any reward spread."""
        step, every = self.state.global_step, self.args.diagnostics_warning_interval
        if flat_fraction >= 1.0 and step % every == 0 and getattr(self, "_flat_warned", None) != step:
            self._flat_warned = step
            warnings.warn(
                f"SDPO step {step}: every group's rewards are flat (no sample differs from its siblings by more than "
                f"diagnostics_flat_tolerance={self.args.diagnostics_flat_tolerance}); with no success there is no "
                "sibling to teach from. Check the reward functions, or include environment feedback.",
                stacklevel=2,
            )

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]], mode: str) -> None:
        """Every row's reprompt, decided over every process's rows (a group may span two processes)."""
        a = self.args
        r, n = scored.rollout, scored.rollout.completion_ids.shape[0]
        device = self.accelerator.device
        totals = gather(weighted_sum(scored.rewards, self.reward_weights).to(device)).cpu()  # [N]
        lengths = r.completion_mask.sum(dim=1).tolist()
        texts = self._tokenizer.batch_decode(
            [ids[: int(k)] for ids, k in zip(r.completion_ids.tolist(), lengths, strict=True)],
            skip_special_tokens=True,
        )
        feedback = [
            distill_data.context_text(row[distill_data.PRIVILEGED_COLUMN])
            if row.get(distill_data.PRIVILEGED_COLUMN)
            else None
            for row in batch
        ]
        everyone = gather_object([(texts, feedback)])
        all_texts = [t for ts, _ in everyone for t in ts]
        all_feedback = [f for _, fs in everyone for f in fs]
        group = a.num_generations if mode == "train" else a.num_generations_eval
        plan = reprompt.plan_reprompts(totals, all_texts, all_feedback, self._reprompt_settings(group))
        start = self.accelerator.process_index * n
        fills = plan.fills[start : start + n]
        prompts = [
            distill_data.fill_prompt(_placed(row), fill, i) if fill is not None else _placed(row)
            for i, (row, fill) in enumerate(zip(batch, fills, strict=True))
        ]
        self._encode_teacher_prompts(scored, prompts, batch, a.max_reprompt_len)
        scored.teacher_rows = torch.tensor(
            [fill is not None for fill in fills], device=r.completion_ids.device
        )
        self._metrics.add_all(mode, {f"self_distillation/{k}": v for k, v in plan.stats.items()})

    def _reprompt_settings(self, group: int) -> reprompt.RepromptSettings:
        a = self.args
        return reprompt.RepromptSettings(
            group=group,
            success_reward_threshold=a.success_reward_threshold,
            use_successful_as_teacher=a.use_successful_as_teacher,
            dont_reprompt_on_self_success=a.dont_reprompt_on_self_success,
            include_environment_feedback=a.include_environment_feedback,
            environment_feedback_only_without_solution=a.environment_feedback_only_without_solution,
            remove_thinking_from_demonstration=a.remove_thinking_from_demonstration,
            reprompt_template=a.reprompt_template,
            solution_template=a.solution_template,
            feedback_template=a.feedback_template,
        )

    # ---- the loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """``(1 - w) * policy + w * distillation`` of one micro-batch."""
        student, aux_loss, mode = self._student_side(model, inputs, return_outputs)
        a, r = self.args, inputs.rollout
        mask = self._loss_mask(r).to(torch.float32)
        logps = target_logps(student, r.completion_ids, a.temperature)  # [n, T]
        old = inputs.old_logps if inputs.old_logps is not None else logps.detach()
        policy, _ = objectives.policy_loss(logps, old, inputs.advantages, mask, self._objective, inputs.norms)
        per_sample, metric = self._distillation_per_sample(student, inputs, mask)  # [n]
        distillation = per_sample.sum() / inputs.norms.sequences
        w = a.distillation_weight
        loss = (1.0 - w) * policy + w * distillation
        values = self._token_means(
            {"p": policy.detach().reshape(1).expand(per_sample.numel())}, per_sample.numel()
        )
        metrics = {
            "self_distillation/distillation_loss": metric,
            "sdpo/distillation_loss": metric,
            "self_distillation/policy_loss": values["p"] * inputs.norms.accumulation,
        }
        return self._finish_loss(loss, aux_loss, inputs, metrics, mode)


def _placed(row: dict[str, Any]) -> Any:
    """A row's prompt with its images placed (blocks at the start of the first user message when it
    has none), as the student's prompt is."""
    return vision.place_images(row["prompt"], vision.row_images(row))
