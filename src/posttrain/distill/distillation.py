"""TeacherStudentTrainer and DistillationTrainer: a student trained on a frozen teacher's token
distributions, on its own samples.

``TeacherStudentTrainer`` is what the trainers that learn a teacher's distributions share
(distillation, GKD, IW-OPD, SDFT): no rewards needed, no KL reference, no advantages, metrics
reduced once per micro-batch. ``DistillationTrainer`` adds the teachers (in-process, served, or
several routed by ``teacher_id``) and the loss; ``distill/trainer.py`` gives the step top to
bottom and holds GKD and IW-OPD, which build on it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Rollout
from posttrain.data import vision
from posttrain.distill import losses, teachers
from posttrain.distill.config import DistillationConfig
from posttrain.models import loading
from posttrain.models.reference import create_reference
from posttrain.ops import chunked
from posttrain.ops.divergence import HeadInputs, target_logps, token_divergence
from posttrain.ops.logprobs import completion_head_inputs
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


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

    def _student_side(
        self, model: torch.nn.Module, inputs: ScoredRollout, return_outputs: bool
    ) -> tuple[HeadInputs, Any, str]:
        """The start of each family's ``compute_loss``: the student's side at the completion
        positions (with gradient), its MoE router loss, and the mode.

        Raises:
            ValueError: ``return_outputs`` is asked for (no logits are built).
        """
        self._refuse_outputs(return_outputs)
        r = inputs.rollout
        side, aux_loss = completion_head_inputs(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            model_inputs=r.vision_kwargs(),
        )
        return side, aux_loss, ("train" if model.training else "eval")

    def _finish_loss(
        self, loss: torch.Tensor, aux_loss: Any, inputs: ScoredRollout, metrics: dict[str, float], mode: str
    ) -> torch.Tensor:
        """The end of each family's ``compute_loss``: the MoE router loss added, the metrics recorded."""
        loss = self._with_aux_loss(loss, SimpleNamespace(aux_loss=aux_loss), inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _token_means(self, values: dict[str, torch.Tensor], tokens: int) -> dict[str, float]:
        """Each [tokens] tensor's mean over every process's tokens."""
        local = torch.stack(
            [v.detach().float().sum().to(self.accelerator.device) for v in values.values()]
            + [torch.tensor(float(tokens), device=self.accelerator.device)]
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
        if getattr(args, "use_teacher_server", False):  # IW-OPD's served teacher, from the config
            teacher_model = _config_teacher_server(args, teacher_model)
        sources = teachers.teacher_sources(teacher_model, args.teacher_model_name_or_path)  # paths checked
        self._served = isinstance(next(iter(sources.values())), teachers.TeacherServer)
        if self._served:
            self._check_served(args)
        images = image_datasets(train_dataset, eval_dataset)
        if images:
            self._check_image_options(args, images[0])
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
        self.teachers = {key: self._setup_teacher(source) for key, source in sources.items()}
        #: the teacher (a dict of them, keyed by ``teacher_id``, for several)
        self.teacher_model = self.teachers[None] if None in self.teachers else dict(self.teachers)
        for teacher in self.teachers.values() if images else ():
            if not loading.is_vision_model(teacher):
                raise ValueError(
                    f"{images[0]} has images, but the teacher is a {type(teacher).__name__}, a text-only model that "
                    "cannot read them. Distil from a vision-language teacher that reads the student's processor "
                    "inputs (e.g. a larger model of the student's family), or remove the image column."
                )

    # ---- setup ---------------------------------------------------------------------------------

    def _check_image_options(self, args: Any, name: str) -> None:
        """What datasets with images cannot do yet, refused before any model loads.

        Raises:
            NotImplementedError: a served teacher, or GOLD's cross-tokenizer loss.
        """
        trainer = type(self).__name__
        if self._served:
            raise NotImplementedError(
                f"{name} has images, but a served teacher (TeacherServer) with images is not built yet: it would score "
                "the completions without the pixels. Load the teacher in this process (a model or a path)."
            )
        if getattr(args, "cross_tokenizer", False):
            raise NotImplementedError(
                f"{name} has images, but {trainer}'s cross-tokenizer loss with images is not built yet; distil from a "
                "teacher that shares the student's tokenizer."
            )

    def _prepare_datasets(self, train_dataset: Any, eval_dataset: Any, args: Any) -> tuple[Any, Any]:
        """The datasets as the sampler reads them (GKD turns ``messages`` into prompt and completion)."""
        return train_dataset, eval_dataset

    def _setup_teacher(self, source: Any) -> Any:
        """A teacher, loaded (with ``teacher_model_init_kwargs``) or as given, frozen, on the device;
        a ``TeacherServer`` as it is.

        Raises:
            ValueError: its vocabulary differs from the student's.
        """
        a = self.args
        if isinstance(source, teachers.TeacherServer):
            return source
        if isinstance(source, str):
            kwargs = dict(a.teacher_model_init_kwargs or {})
            if a.teacher_model_revision is not None:
                kwargs.setdefault("revision", a.teacher_model_revision)
            source = loading.load_policy(source, kwargs, a.trust_remote_code)
        teacher = create_reference(source) if _needs_copy(source, self.model) else source
        teacher.eval()
        teacher.requires_grad_(False)
        self._check_vocabularies(chunked.vocab_size(self.model), chunked.vocab_size(teacher))
        return teacher.to(self.accelerator.device)

    def _check_vocabularies(self, student_vocab: int, teacher_vocab: int) -> None:
        """The teacher's logits must be the student's tokens (a hook: GOLD compares across tokenizers).

        Raises:
            ValueError: the two vocabularies differ.
        """
        if student_vocab != teacher_vocab:
            raise ValueError(
                f"The teacher's vocabulary has {teacher_vocab} tokens and the student's {student_vocab}; "
                f"{type(self).__name__} compares their next-token distributions token by token, so they must "
                "share one tokenizer. Pick a teacher of the student's family, or distil across tokenizers with "
                "GOLDTrainer (use_uld_loss=True, or X-Token's xtoken_loss_type)."
            )

    @staticmethod
    def _check_served(args: Any) -> None:
        """A served teacher sends sampled-token log-probs: the objective must need no more.

        Raises:
            ValueError: the objective needs the teacher's whole distributions.
        """
        if args.beta != 1.0:
            raise ValueError(
                f"A served teacher (TeacherServer) sends the log-probs of the sampled tokens only, which estimate "
                f"the reverse KL (beta=1.0), not beta={args.beta}; set beta=1.0, or load the teacher in this "
                "process (a model or its path) for the forward KL or the JSD."
            )

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]], mode: str) -> None:
        """Several teachers: each row's index among them, from its ``teacher_id``."""
        if None in self.teachers:
            return
        keys = list(self.teachers)
        index = []
        for i, row in enumerate(batch):
            key = row.get(teachers.TEACHER_COLUMN)
            if key not in self.teachers:
                raise ValueError(
                    f"Row {i} of this batch has {teachers.TEACHER_COLUMN}={key!r}, which names none of the teachers "
                    f"{keys}; give every row the id of one of them."
                )
            index.append(keys.index(key))
        scored.teacher_index = torch.tensor(index)

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
        student, aux_loss, mode = self._student_side(model, inputs, return_outputs)
        r = inputs.rollout
        keep = self._loss_mask(r).bool()  # [n, T]
        parts: list[tuple[torch.Tensor, dict[str, torch.Tensor]]] = []
        for teacher_model, rows in self._teacher_groups(inputs):
            sub = r if rows is None else select_rows(r, rows)
            sub_keep = keep if rows is None else keep & rows.unsqueeze(1)
            with torch.no_grad(), self.accelerator.autocast():  # the student's precision (bf16=True)
                if self._served:
                    teacher = teachers.served_logps(
                        teacher_model, sub, keep[rows] if rows is not None else keep, self._loss_temperature
                    )
                else:
                    side, _ = completion_head_inputs(
                        teacher_model,
                        sub.prompt_ids,
                        sub.prompt_mask,
                        sub.completion_ids,
                        sub.completion_mask,
                        model_inputs=sub.vision_kwargs(),  # the teacher reads the prompts' images too
                    )
                    teacher = side.rows(keep[rows] if rows is not None else keep)
            parts.append(self._token_losses(student.rows(sub_keep), teacher, inputs, sub_keep))
        per_token = torch.cat([p for p, _ in parts])
        metrics = self._reduce_metrics({k: torch.cat([t[k] for _, t in parts]) for k in parts[0][1]})
        return self._finish_loss(per_token.sum() / inputs.norms.tokens, aux_loss, inputs, metrics, mode)

    def _teacher_groups(self, inputs: ScoredRollout) -> list[tuple[Any, torch.Tensor | None]]:
        """Each teacher with the rows it scores ([n] bool; ``None``: all rows)."""
        if inputs.teacher_index is None:
            return [(next(iter(self.teachers.values())), None)]
        index = inputs.teacher_index.to(inputs.rollout.completion_ids.device)
        models = list(self.teachers.values())
        return [(models[i], index == i) for i in index.unique().tolist()]

    def _token_losses(
        self,
        student: HeadInputs,
        teacher: HeadInputs | torch.Tensor,
        inputs: ScoredRollout,
        keep: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of each kept completion token ([n_tokens], with gradient) and per-token metric values.

        Args:
            student: the student's side at the kept positions.
            teacher: the teacher's side there, or (a served teacher) its log-probs of the sampled tokens.
            inputs: the micro-batch.
            keep: [n, T] the kept positions (the loss mask, restricted to one teacher's rows).

        Returns:
            ``(per_token, values)``: ``values`` maps metric names to [n_tokens] tensors, reduced over
            the micro-batch and every process by ``_reduce_metrics``.
        """
        name = "on_policy_loss" if inputs.extra.get("source", "student") == "student" else "off_policy_loss"
        if isinstance(teacher, torch.Tensor):  # served: the reverse KL's sampled-token estimate
            logps = target_logps(student, inputs.rollout.completion_ids[keep], self._loss_temperature)
            per_token = losses.sampled_token_loss(logps, teacher)
            return per_token, {name: (logps - teacher).detach()}
        divergence, entropy = token_divergence(student, teacher, self.args.beta, self._loss_temperature)
        return divergence, {"entropy": entropy, name: divergence.detach()}

    def _reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """The per-token metric values' means over every process's tokens."""
        tokens = next(iter(values.values())).numel()
        return self._token_means(values, tokens)


def select_rows(r: Rollout, rows: torch.Tensor) -> Rollout:
    """The rows of a rollout where ``rows`` ([n] bool) holds, columns kept."""
    return Rollout(
        r.prompt_ids[rows], r.prompt_mask[rows], r.completion_ids[rows], r.completion_mask[rows], r.is_terminated[rows],
        r.sampler_logps[rows] if r.sampler_logps is not None else None,
        r.tool_mask[rows] if r.tool_mask is not None else None,
        vision=r.vision.select(rows.nonzero().flatten().tolist()) if r.vision is not None else None,
    )  # fmt: skip


def image_datasets(train_dataset: Any, eval_dataset: Any) -> list[str]:
    """The names of the datasets with an image column (``image`` / ``images``)."""
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    return [
        name
        for name, dataset in [("train_dataset", train_dataset), *evals]
        if vision.image_column(getattr(dataset, "column_names", None)) is not None
    ]


def _needs_copy(teacher: torch.nn.Module, student: torch.nn.Module) -> bool:
    """Whether the teacher object is the student itself (self-distillation from the start weights):
    it is then copied, so training the student leaves the teacher as it was."""
    return chunked.causal_lm(student) is teacher


def _config_teacher_server(args: Any, teacher_model: Any) -> teachers.VLLMTeacherServer:
    """The teacher ``use_teacher_server=True`` names: a client of the vLLM server at
    ``teacher_model_server_url``.

    Raises:
        ValueError: a ``teacher_model`` is given as well; no address; a temperature other than 1.
    """
    if not args.teacher_model_server_url or args.temperature != 1.0:
        raise ValueError(
            "use_teacher_server=True needs teacher_model_server_url (the vLLM server holding the teacher) and "
            f"temperature=1.0 (vLLM's prompt log-probs are untempered); got {args.teacher_model_server_url!r} and "
            f"temperature={args.temperature}."
        )
    if teacher_model is not None or args.teacher_model_name_or_path is not None:
        raise ValueError(
            "use_teacher_server=True scores with the teacher served at teacher_model_server_url, but a teacher_model "
            "(or teacher_model_name_or_path) is given too; leave it None, or set use_teacher_server=False."
        )
    return teachers.VLLMTeacherServer(
        args.teacher_model_server_url, getattr(args, "vllm_server_timeout", 240.0)
    )
