"""DistillationTrainer and GKDTrainer: a student trained on a frozen teacher's token distributions.

One training step, top to bottom; everything but the marked lines is ``sampling.OnlineTrainer``'s,
shared with GRPO::

    rollout   = sampler.sample(rows)                   # the student samples (GKD: or the teacher,
                                                       # or the dataset's completions)
    student   = hidden states of the completion positions, with gradient
    teacher   = the teacher's, without                 # distillation: the frozen teacher
    loss      = sum of token_divergence / tokens       # distillation: ops/divergence.py, chunked

The divergence is taken position by position over the whole vocabulary, chunk by chunk: neither
model's ``[B, T, V]`` logits exist (``ops/divergence.py``). The loss is the sum over the step's
completion tokens divided by their number, counted over the tokens actually trained on (the
reference's GKD divides on-policy steps by the dataset batch's token count instead).

``TeacherStudentTrainer`` and ``DistillationTrainer`` are in ``distill/distillation.py`` and
imported here; this module holds GKD and IW-OPD, which build on them.
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.data import distill as distill_data
from posttrain.distill import losses
from posttrain.distill.config import GKDConfig, IWOPDConfig
from posttrain.distill.distillation import (  # noqa: F401  (re-exported)
    DistillationTrainer,
    RewardFunc,
    TeacherStudentTrainer,
    select_rows,
)
from posttrain.models.loading import image_placeholder_ids
from posttrain.ops.divergence import HeadInputs, target_logps, top_ids
from posttrain.sampling import setup
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

#: where a batch's completions come from (``ScoredRollout.extra["source"]``)
SOURCES = ("student", "teacher", "dataset")


class GKDTrainer(DistillationTrainer):
    """Generalized Knowledge Distillation (arXiv 2306.13649): on- and off-policy steps mixed by ``lmbda``.

    The public API is TRL's ``trl.experimental.gkd.GKDTrainer``. Each optimizer step trains on the
    student's own samples with probability ``lmbda``; otherwise on completions the teacher samples
    (``seq_kd=True``) or the dataset's. The draw depends only on ``seed`` and the step, so every
    process agrees and a resumed run repeats it. The loss is the generalised JSD at temperature 1
    (``temperature`` is the sampling temperature, as in the reference).

    Args:
        model: the student (as ``DistillationTrainer``).
        teacher_model: the teacher (as ``DistillationTrainer``).
        args: a ``GKDConfig``.
        data_collator: not used (the rows are tokenised by the trainer): must be ``None``.
        train_dataset, eval_dataset: ``messages`` rows (the last message, the assistant's, is the
            completion) or ``prompt`` / ``completion`` rows, standard or conversational; with
            ``lmbda=1`` (or ``seq_kd=True``) prompts alone do.
        processing_class: the student's tokenizer.
        compute_metrics, preprocess_logits_for_metrics, formatting_func: not built: must be ``None``.
        callbacks, optimizers, peft_config: as ``DistillationTrainer``.
    """

    _tag_names = ["posttrain", "gkd"]
    _config_class = GKDConfig
    _suffix = "GKD"
    #: whether a ``messages`` row may end without the assistant's message (a prompt alone)
    _completion_optional = False

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel | None = None,
        teacher_model: str | PreTrainedModel | None = None,
        args: GKDConfig | None = None,
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
        formatting_func: Any = None,
    ) -> None:
        unbuilt = {
            "data_collator": data_collator,
            "compute_metrics": compute_metrics,
            "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
            "formatting_func": formatting_func,
        }
        for name, value in unbuilt.items():
            if value is not None:
                raise NotImplementedError(
                    f"GKDTrainer's {name} is not built in posttrain (the trainer tokenises prompt and completion "
                    f"itself, and evaluates with its loss); pass {name}=None."
                )
        if model is None:
            raise ValueError("GKDTrainer needs a student model: pass model (a model or its id / path).")
        super().__init__(
            model,
            teacher_model,
            args,
            train_dataset,
            eval_dataset,
            processing_class,
            callbacks,
            optimizers,
            None,
            peft_config,
        )
        self._teacher_generator = None

    def _prepare_datasets(self, train_dataset: Any, eval_dataset: Any, args: Any) -> tuple[Any, Any]:
        """``messages`` rows become ``prompt`` / ``completion``; off-policy steps need completions.

        Raises:
            ValueError: the train rows have no completions but some steps would train on them.
        """
        optional = self._completion_optional
        train = distill_data.as_prompt_completion(train_dataset, optional)
        if isinstance(eval_dataset, dict):
            evals = {k: distill_data.as_prompt_completion(v, optional) for k, v in eval_dataset.items()}
        else:
            evals = distill_data.as_prompt_completion(eval_dataset, optional)
        if (
            train is not None
            and args.lmbda < 1.0
            and not getattr(args, "seq_kd", False)  # IW-OPD has none
            and not distill_data.has_completions(train)
        ):
            raise ValueError(
                f"With lmbda={args.lmbda} and seq_kd=False, {1 - args.lmbda:.0%} of the steps train on the "
                "dataset's completions, but the train dataset has none: give 'messages' rows (the last message "
                "the assistant's) or 'prompt' and 'completion' columns, or set lmbda=1.0 (the student samples "
                "every step) or seq_kd=True (the teacher samples the others)."
            )
        return train, evals

    #: A dataset completion keeps the chat template's tokens after its EOS (as SFT tokenises it).
    _dataset_completion_through_end: ClassVar[bool] = True

    def _source(self, batch: list[dict[str, Any]], mode: str) -> str:
        """Where this step's completions come from: one draw per optimizer step, from ``seed`` and the step."""
        a = self.args
        if mode != "train":  # evaluation: the dataset's completions where it has them
            return "dataset" if all(row.get("completion") is not None for row in batch) else "student"
        draw = random.Random(f"gkd-{a.seed}-{self.state.global_step}").random()
        if draw < a.lmbda:
            return "student"
        return "teacher" if getattr(a, "seq_kd", False) else "dataset"

    def _generate_and_score(
        self, batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> list[ScoredRollout]:
        """The student's samples, the teacher's (``seq_kd``) or the dataset's completions."""
        source = self._source(batch, mode)
        if source == "student":
            parts = super()._generate_and_score(batch, mode, num_chunks)
        elif source == "teacher":
            with self._teacher_sampling():
                parts = super()._generate_and_score(batch, mode, num_chunks)
        else:
            parts = self._dataset_batch(batch, mode, num_chunks)
        for part in parts:
            part.extra["source"] = source
        return parts

    def _dataset_prompt_budget(self) -> int | None:
        """The most prompt tokens a dataset row keeps (None: bounded by ``max_length`` only, as GKD's
        and GOLD's ChatML collator bounds it in the reference)."""
        return None

    def _dataset_batch(self, batch: list[dict[str, Any]], mode: str, num_chunks: int) -> list[ScoredRollout]:
        """The rows' own completions, tokenised like sampled ones, through the shared scoring path."""
        a = self.args
        rollout = distill_data.dataset_rollout(
            batch,
            self._tokenizer,
            self._eos_token_ids,
            a.max_length,
            a.chat_template_kwargs,
            self.accelerator.device,
            through_end=self._dataset_completion_through_end,
            max_prompt_length=self._dataset_prompt_budget(),
            processor=self.processing_class,
        )
        n = rollout.completion_ids.shape[0]
        completions = self._tokenizer.batch_decode(
            [
                ids[: int(length)]
                for ids, length in zip(rollout.completion_ids, rollout.completion_lengths, strict=True)
            ],
            skip_special_tokens=True,
        )
        self.sampler.sampled_text = ([row["prompt"] for row in batch], completions, {})
        scored = ScoredRollout(rollout=rollout, rewards=torch.zeros(n, 0), advantages=torch.zeros(n))
        group = a.num_generations if mode == "train" else a.num_generations_eval
        return self._score_rollout(scored, mode, num_chunks, group)

    def _after_optimizer_step(self) -> None:
        """``vllm_sync_frequency`` (IW-OPD's and GOLD's field): the vLLM engine gets the student's
        weights every that many optimizer steps (after steps k, 2k, ...) and samples with the last
        ones in between, as in the reference."""
        every = getattr(self.args, "vllm_sync_frequency", 1)
        if self.args.use_vllm and every > 1 and self.state.global_step % every != 0:
            return  # distillation keeps no reference to sync: the generator is all the base does
        super()._after_optimizer_step()

    def close_generators(self) -> None:
        """The student's engine, and the teacher's where ``seq_kd`` built one."""
        super().close_generators()
        close = getattr(self._teacher_generator, "close", None)
        if close is not None:
            close()

    @contextmanager
    def _teacher_sampling(self):
        """Sample with the teacher (``seq_kd``): its own generator, built once."""
        if self._teacher_generator is None:
            self._teacher_generator = setup.build_generator(
                self.args, self.accelerator, lambda: self.teacher_model, self._tokenizer, self._eos_token_ids,
                suppress=image_placeholder_ids(self.teacher_model), processor=self._image_processor,
            )  # fmt: skip
        student = self.sampler.generator
        self.sampler.generator = self._teacher_generator
        try:
            yield
        finally:
            self.sampler.generator = student


class IWOPDTrainer(GKDTrainer):
    """Importance-weighted on-policy distillation (IW-OPD): sampled-token advantages, weighted by position.

    The public API is TRL's ``trl.experimental.iw_opd.IWOPDTrainer`` (the arguments of
    ``GKDTrainer``). With ``distillation_objective="iw_opd"`` each sampled token ``y_t`` gets the
    advantage ``a_t = log p_T(y_t) - log p_rollout(y_t)`` and the weight
    ``w_t = 1 + gamma (1 - sum_{k<t} |a_k| / (sum_k |a_k| + epsilon))`` (``losses.iw_opd_weights``);
    the loss is ``-sum_t w_t a_t log p_S(y_t)`` over the step's tokens. ``"jsd"``: the generalised
    JSD over the sampled (or argmax) token and the tail, the student's ``loss_top_k`` tokens, or
    (``loss_top_k=0``) the whole vocabulary.
    """

    _tag_names = ["posttrain", "iw_opd"]
    _config_class = IWOPDConfig
    _suffix = "IWOPD"
    _completion_optional = True  # the reference's IW-OPD reads prompt-only conversations

    @staticmethod
    def _check_served(args: Any) -> None:
        """IW-OPD needs only the sampled tokens' log-probs, as does the JSD over the sampled token and the tail.

        Raises:
            ValueError: the JSD over more tokens than the sampled one.
        """
        if args.distillation_objective == "jsd" and not (
            args.loss_top_k == 1 and args.reverse_kl_top_1_mode == "sampled"
        ):
            raise ValueError(
                "A served teacher (TeacherServer) sends the log-probs of the sampled tokens only; with "
                "distillation_objective='jsd' that allows loss_top_k=1 with reverse_kl_top_1_mode='sampled' (the "
                "token and the tail). Use those, distillation_objective='iw_opd', or a teacher loaded in this process."
            )

    def _dataset_prompt_budget(self) -> int | None:
        """IW-OPD's ``max_prompt_length`` (the reference tokenises a dataset row's prompt within it and
        lets the completion fill ``max_length``)."""
        return self.args.max_prompt_length

    def _needs_old_logps(self, mode: str) -> bool:
        """The rollout policy's log-probs, where they differ from the current ones (an off-policy micro-batch)."""
        return OnlineTrainer._needs_old_logps(self, mode)

    def _token_losses(
        self,
        student: HeadInputs,
        teacher: HeadInputs | torch.Tensor,
        inputs: ScoredRollout,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a = self.args
        served = isinstance(teacher, torch.Tensor)
        if a.distillation_objective == "jsd" and a.loss_top_k == 0 and not served:
            return super()._token_losses(student, teacher, inputs, keep)
        temperature, tokens = self._loss_temperature, inputs.rollout.completion_ids[keep]
        name = "on_policy_loss" if inputs.extra.get("source", "student") == "student" else "off_policy_loss"
        if a.distillation_objective == "jsd":
            ids, valid = (
                (tokens.unsqueeze(-1), None) if served else self._jsd_support(student, teacher, tokens)
            )
            teacher_logps = teacher.unsqueeze(-1) if served else target_logps(teacher, ids, temperature)
            per_token = losses.topk_divergence(
                target_logps(student, ids, temperature), teacher_logps, a.beta, a.loss_add_tail, valid
            )
            return per_token, {name: per_token.detach()}
        logps = target_logps(student, tokens, temperature)
        with torch.no_grad():
            teacher_logps = teacher if served else target_logps(teacher, tokens, temperature)
            rollout = inputs.old_logps[keep] if inputs.old_logps is not None else logps.detach()
            advantages = torch.zeros(keep.shape, dtype=logps.dtype, device=logps.device)
            advantages[keep] = teacher_logps - rollout
            weights = losses.iw_opd_weights(advantages, keep, a.iw_opd_gamma, a.iw_opd_epsilon)[keep]
        per_token = losses.iw_opd_token_losses(logps, advantages[keep], weights)
        values = {
            name: per_token.detach(),
            "iw_opd/mean_advantage": weights * advantages[keep],  # the weighted advantage, as the reference's
            "iw_opd/mean_abs_advantage": advantages[keep].abs(),
            "iw_opd/mean_weight": weights,
        }
        return per_token, values

    def _jsd_support(
        self, student: HeadInputs, teacher: HeadInputs, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reduced JSD's token ids per position ([n, m]) and which of them count ([n, m] bool, a
        token both sides picked counting once; ``None``: all), as the reference picks them: the
        teacher's top ``loss_top_k`` for the forward KL (``beta=0``), the student's for the reverse
        KL (``beta=1``), both for the JSD in between; with ``loss_top_k=1`` and ``beta > 0`` the
        reverse side's token is the sampled one (``reverse_kl_top_1_mode="sampled"``) or the
        student's argmax."""
        a, temperature = self.args, self._loss_temperature
        if a.loss_top_k == 1 and a.beta > 0 and a.reverse_kl_top_1_mode == "sampled":
            reverse = tokens.unsqueeze(-1)
        else:
            reverse = top_ids(student, a.loss_top_k, temperature)
        if a.beta == 1.0:
            return reverse, None
        forward = top_ids(teacher, a.loss_top_k, temperature)
        if a.beta == 0.0:
            return forward, None
        ids = torch.cat([forward, reverse], dim=-1)  # [n, 2k]
        repeat = (ids.unsqueeze(-1) == ids.unsqueeze(-2)).tril(-1).any(-1)  # the id is in an earlier column
        return ids, ~repeat

    def _reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """The token means, and the extreme position weights over every process."""
        metrics = super()._reduce_metrics(values)
        weights = values.get("iw_opd/mean_weight")
        if weights is not None:
            local = (
                torch.stack([-weights.min(), weights.max()]) if weights.numel() else torch.tensor([-1.0, 1.0])
            )
            extremes = gather(local.float().unsqueeze(0).to(self.accelerator.device))
            metrics["iw_opd/min_weight"] = -extremes[:, 0].max().item()
            metrics["iw_opd/max_weight"] = extremes[:, 1].max().item()
        return metrics
