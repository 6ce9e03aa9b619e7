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
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import contextmanager
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.data import distill as distill_data
from posttrain.distill import losses
from posttrain.distill.config import DistillationConfig, GKDConfig, IWOPDConfig
from posttrain.models import loading
from posttrain.models.reference import create_reference
from posttrain.ops import chunked
from posttrain.ops.divergence import HeadInputs, target_logps, token_divergence, top_ids
from posttrain.ops.logprobs import completion_head_inputs
from posttrain.sampling import setup
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]

#: where a batch's completions come from (``ScoredRollout.extra["source"]``)
SOURCES = ("student", "teacher", "dataset")


class TeacherStudentTrainer(OnlineTrainer):
    """What the trainers that learn a teacher's token distributions share (distillation, GKD, SDFT):
    no rewards needed (any given are only logged), no KL reference, no advantages."""

    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself
    _reward_required = False

    def _setup_reference(self) -> torch.nn.Module | None:
        """No KL reference: the teacher is the target."""
        return None

    def _needs_ref_logps(self) -> bool:
        return False

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """No advantages: the teacher's distribution is the signal (rewards, if any, are only logged)."""
        return torch.zeros(rewards.shape[0]), {}

    def _token_means(self, values: dict[str, torch.Tensor], tokens: int) -> dict[str, float]:
        """Each [tokens] tensor's mean over every process's tokens."""
        local = torch.stack(
            [v.detach().float().sum() for v in values.values()] + [torch.tensor(float(tokens))]
        )
        sums = gather(local.to(self.accelerator.device).unsqueeze(0)).sum(0).tolist()
        count = max(sums[-1], 1.0)
        return {name: total / count for name, total in zip(values, sums[:-1], strict=True)}


class DistillationTrainer(TeacherStudentTrainer):
    """On-policy distillation: the student samples, a frozen teacher scores every token.

    The public API is TRL's ``DistillationTrainer``: a script written for it runs after changing
    the import. Generation, tools, PEFT, scale-out and exact resume are shared with
    ``GRPOTrainer``. See ``docs/distillation.md``.

    Args:
        model: the student: hub id, local path, embedded name (``"smollm2-135m-instruct"``), a
            ``PreTrainedModel`` causal LM or a ``peft.PeftModel``.
        teacher_model: the teacher: a ``PreTrainedModel`` or a hub id / path; ``None`` loads
            ``args.teacher_model_name_or_path``. It must share the student's vocabulary; it is
            frozen and kept in eval mode.
        args: a ``DistillationConfig``; defaults to one with ``output_dir="<model name>-Distillation"``.
        train_dataset, eval_dataset: datasets with a ``prompt`` column (text or messages).
        processing_class: the student's tokenizer; loaded from the model when ``None``.
        callbacks: extra ``TrainerCallback`` s.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        quantization_config: a transformers quantization config to load ``model`` by name.
        peft_config: a ``peft.PeftConfig`` to train adapters on the student.
        tools: tool functions the student may call while sampling (``docs/agents.md``); tool
            results are not distilled on.
        reward_funcs: optional reward functions, logged (``rewards/<name>/mean``) but not trained on.
    """

    _tag_names = ["posttrain", "distillation"]
    _config_class: type = DistillationConfig
    _suffix = "Distillation"

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        teacher_model: str | PreTrainedModel | None = None,
        args: DistillationConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, self._config_class, self._suffix)
        if not isinstance(args, self._config_class):
            raise TypeError(
                f"args is a {type(args).__name__}; {type(self).__name__} needs a {self._config_class.__name__} "
                "(its beta is the divergence's, in [0, 1], not a KL coefficient)."
            )
        teacher_source = _teacher_source(teacher_model, args)  # a missing path fails before any load
        train_dataset, eval_dataset = self._prepare_datasets(train_dataset, eval_dataset, args)
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
            quantization_config,
            peft_config,
            tools,
        )
        self.teacher_model = self._setup_teacher(teacher_source)

    # ---- setup ---------------------------------------------------------------------------------

    def _prepare_datasets(self, train_dataset: Any, eval_dataset: Any, args: Any) -> tuple[Any, Any]:
        """The datasets as the sampler reads them (GKD turns ``messages`` into prompt and completion)."""
        return train_dataset, eval_dataset

    def _setup_teacher(self, source: str | PreTrainedModel) -> torch.nn.Module:
        """The teacher, loaded (with ``teacher_model_init_kwargs``) or as given, frozen, on the device.

        Raises:
            ValueError: its vocabulary differs from the student's.
        """
        a = self.args
        if isinstance(source, str):
            kwargs = dict(a.teacher_model_init_kwargs or {})
            if a.teacher_model_revision is not None:
                kwargs.setdefault("revision", a.teacher_model_revision)
            source = loading.load_policy(source, kwargs, a.trust_remote_code)
        teacher = (
            create_reference(source.to(self.accelerator.device))
            if _needs_copy(source, self.model)
            else source
        )
        teacher.eval()
        teacher.requires_grad_(False)
        student_vocab = _vocab_size(self.model)
        teacher_vocab = _vocab_size(teacher)
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The teacher's vocabulary has {teacher_vocab} tokens and the student's {student_vocab}; "
                f"{type(self).__name__} compares their next-token distributions token by token, so they must "
                "share one tokenizer. Pick a teacher of the student's family; distillation across tokenizers "
                "(GOLD's use_uld_loss, X-Token's xtoken_loss_type) is not built yet in posttrain."
            )
        return teacher.to(self.accelerator.device)

    def _needs_old_logps(self, mode: str) -> bool:
        """No importance ratio: the sampling policy's log-probs are never needed."""
        return False

    @property
    def _loss_temperature(self) -> float:
        """The temperature both models' logits are divided by in the loss (GKD's: 1)."""
        return self.args.temperature if self.args.loss_uses_temperature else 1.0

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The per-token losses summed over the micro-batch's completion tokens, over the step's token count."""
        if return_outputs:
            raise ValueError(f"{type(self).__name__}.compute_loss does not return model outputs.")
        r = inputs.rollout
        mode = "train" if model.training else "eval"
        keep = self._loss_mask(r).bool()  # [n, T]
        args = (r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask)
        student, aux_loss = completion_head_inputs(model, *args)
        with torch.no_grad():
            teacher, _ = completion_head_inputs(self.teacher_model, *args)
        per_token, metrics = self._token_losses(student.rows(keep), teacher.rows(keep), inputs, keep)
        loss = per_token.sum() / inputs.norms.tokens
        loss = self._with_aux_loss(loss, SimpleNamespace(aux_loss=aux_loss), inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _token_losses(
        self, student: HeadInputs, teacher: HeadInputs, inputs: ScoredRollout, keep: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of each kept completion token ([n_tokens], with gradient) and the metrics.

        Args:
            student, teacher: the two sides at the kept positions.
            inputs: the micro-batch.
            keep: [n, T] the kept positions (the loss mask).
        """
        divergence, entropy = token_divergence(student, teacher, self.args.beta, self._loss_temperature)
        metrics = self._loss_metrics(divergence.detach(), entropy, inputs.extra.get("source", "student"))
        return divergence, metrics

    def _loss_metrics(self, divergence: torch.Tensor, entropy: torch.Tensor, source: str) -> dict[str, float]:
        """``entropy`` (the student's, token mean over processes) and the divergence's token mean,
        named by where the completions came from (``on_policy_loss`` for the student's own)."""
        name = "on_policy_loss" if source == "student" else "off_policy_loss"
        return self._token_means({"entropy": entropy, name: divergence}, entropy.numel())


def _teacher_source(teacher_model: Any, args: DistillationConfig) -> str | PreTrainedModel:
    """The teacher as given, or its resolved path (checked to exist before anything loads).

    Raises:
        ValueError: neither a teacher model nor ``teacher_model_name_or_path``.
        FileNotFoundError: a local path that does not exist.
    """
    teacher = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
    if teacher is None:
        raise ValueError(
            "Distillation needs a teacher: pass teacher_model (a model or its id / path) to the trainer, or set "
            "teacher_model_name_or_path in the config."
        )
    if isinstance(teacher, str):
        return loading.resolve_model_path(teacher)
    if not isinstance(teacher, PreTrainedModel):
        raise TypeError(
            f"teacher_model is a {type(teacher).__name__}; pass a transformers PreTrainedModel (a causal LM) or "
            "its hub id / local path."
        )
    return teacher


def _needs_copy(teacher: torch.nn.Module, student: torch.nn.Module) -> bool:
    """Whether the teacher object is the student itself (self-distillation from the start weights):
    it is then copied, so training the student leaves the teacher as it was."""
    return chunked.causal_lm(student) is teacher


def _vocab_size(model: torch.nn.Module) -> int:
    """The number of logits the model's LM head produces."""
    return int(chunked.causal_lm(model).get_output_embeddings().weight.shape[0])


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
            and not args.seq_kd
            and not distill_data.has_completions(train)
        ):
            raise ValueError(
                f"With lmbda={args.lmbda} and seq_kd=False, {1 - args.lmbda:.0%} of the steps train on the "
                "dataset's completions, but the train dataset has none: give 'messages' rows (the last message "
                "the assistant's) or 'prompt' and 'completion' columns, or set lmbda=1.0 (the student samples "
                "every step) or seq_kd=True (the teacher samples the others)."
            )
        return train, evals

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

    def _dataset_batch(self, batch: list[dict[str, Any]], mode: str, num_chunks: int) -> list[ScoredRollout]:
        """The rows' own completions, tokenised like sampled ones, through the shared scoring path."""
        a = self.args
        rollout = distill_data.dataset_rollout(
            batch,
            self._tokenizer,
            self._eos_token_ids,
            a.max_completion_length,
            a.max_length,
            a.chat_template_kwargs,
            self.accelerator.device,
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

    @contextmanager
    def _teacher_sampling(self):
        """Sample with the teacher (``seq_kd``): its own generator, built once."""
        if self._teacher_generator is None:
            self._teacher_generator = setup.build_generator(
                self.args, self.accelerator, lambda: self.teacher_model, self._tokenizer, self._eos_token_ids
            )
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

    def _needs_old_logps(self, mode: str) -> bool:
        """The rollout policy's log-probs, where they differ from the current ones (an off-policy micro-batch)."""
        return OnlineTrainer._needs_old_logps(self, mode)

    def _token_losses(
        self, student: HeadInputs, teacher: HeadInputs, inputs: ScoredRollout, keep: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        a = self.args
        if a.distillation_objective == "jsd" and a.loss_top_k == 0:
            return super()._token_losses(student, teacher, inputs, keep)
        temperature, tokens = self._loss_temperature, inputs.rollout.completion_ids[keep]
        name = "on_policy_loss" if inputs.extra.get("source", "student") == "student" else "off_policy_loss"
        if a.distillation_objective == "jsd":
            if a.loss_top_k == 1 and a.reverse_kl_top_1_mode == "sampled":
                ids = tokens.unsqueeze(-1)
            else:
                ids = top_ids(student, a.loss_top_k, temperature)
            per_token = losses.topk_divergence(
                target_logps(student, ids, temperature),
                target_logps(teacher, ids, temperature),
                a.beta,
                a.loss_add_tail,
            )
            return per_token, self._token_means({name: per_token}, per_token.numel())
        logps = target_logps(student, tokens, temperature)
        with torch.no_grad():
            teacher_logps = target_logps(teacher, tokens, temperature)
            rollout = inputs.old_logps[keep] if inputs.old_logps is not None else logps.detach()
            advantages = torch.zeros(keep.shape, dtype=logps.dtype, device=logps.device)
            advantages[keep] = teacher_logps - rollout
            weights = losses.iw_opd_weights(advantages, keep, a.iw_opd_gamma, a.iw_opd_epsilon)[keep]
        per_token = losses.iw_opd_token_losses(logps, advantages[keep], weights)
        metrics = self._token_means(
            {name: per_token, "iw_opd/mean_advantage": advantages[keep], "iw_opd/mean_abs_advantage": advantages[keep].abs(),
             "iw_opd/mean_weight": weights},
            per_token.numel(),
        )  # fmt: skip
        extremes = gather(
            torch.stack([-weights.min(), weights.max()]).unsqueeze(0).to(self.accelerator.device)
        )
        metrics["iw_opd/min_weight"] = -extremes[:, 0].max().item()
        metrics["iw_opd/max_weight"] = extremes[:, 1].max().item()
        return per_token, metrics
