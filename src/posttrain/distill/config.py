"""Configuration of the distillation trainers: ``DistillationConfig`` and ``GKDConfig``.

The reference's fields with its names and defaults, on top of the online fields every posttrain
online trainer shares (``sampling.config.OnlineConfig``): the student samples completions
through the shared pipeline and is trained on the divergence from a frozen teacher at every
completion token (``ops/divergence.py``).

``beta`` here is the reference's: the interpolation of the generalised Jensen-Shannon divergence
(0 forward KL, 1 reverse KL), not GRPO's KL coefficient. The shared fields that belong to
rewards, importance ratios or a KL reference do not apply and must stay at their defaults
(``OFF_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import Rule, is_num, optional, positive_int
from posttrain.sampling.config import JSON_DICT_FIELDS, ONLINE_RULES, OnlineConfig

__all__ = ["OFF_FIELDS", "DistillationConfig", "GKDConfig"]

#: Shared online fields distillation does not use: the values they may hold (the first is the
#: default; a built config's derived value is accepted too, so a copy rebuilds) and why.
OFF_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_iterations": ((1,), "each batch of completions is distilled on once"),
    "epsilon": ((0.2,), "the distillation loss has no importance ratio to clip"),
    "epsilon_high": ((None,), "the distillation loss has no importance ratio to clip"),
    "sync_ref_model": ((False,), "the teacher is the target, and it stays frozen"),
    "dynamic_sampling": ((False,), "there are no rewards whose spread it could select for"),
}  # fmt: skip

_SHARED = ("num_generations", "beta")

# fmt: off
_RULES: tuple[Rule, ...] = tuple(r for r in ONLINE_RULES if r.name not in _SHARED) + (
    Rule("num_generations", positive_int, "an integer >= 1 (completions sampled per prompt)", "set num_generations=1 (the default) or more"),
    Rule("beta", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (0 forward KL, 1 reverse KL, in between the generalised Jensen-Shannon divergence)", "set beta=1.0 for on-policy distillation's reverse KL, 0.0 for the forward KL, or 0.5 for the symmetric JSD"),
    Rule("teacher_model_name_or_path", optional(lambda v: isinstance(v, str) and bool(v)), "None or a model id or path", "pass the teacher's hub id or local folder, or pass teacher_model to the trainer"),
)
# fmt: on


@dataclass
class DistillationConfig(OnlineConfig):
    r"""Configuration of ``DistillationTrainer``: on-policy distillation from a frozen teacher.

    The reference's public API (``trl.DistillationConfig``). Every
    ``transformers.TrainingArguments`` field is accepted too.

    Distillation's fields:
        teacher_model_name_or_path (`str | None`, defaults to `None`): The teacher's hub id or
            local path, loaded when the trainer gets no `teacher_model` object.
        teacher_model_revision (`str | None`, defaults to `None`): The teacher's revision on the hub.
        teacher_model_init_kwargs (`dict | None`, defaults to `None`): Keyword arguments of the
            teacher's `from_pretrained` (e.g. `{"dtype": "bfloat16"}`: the teacher may run in its
            own dtype).
        beta (`float`, defaults to `1.0`): The divergence, in [0, 1]: `0.0` the forward KL
            `KL(teacher || student)`, `1.0` the reverse KL `KL(student || teacher)` (on-policy
            distillation's), in between the generalised Jensen-Shannon divergence of GKD.
        temperature (`float`, defaults to `1.0`): Sampling temperature; both models' logits are
            divided by it in the loss too.
        max_completion_length (`int`, defaults to `512`): Most tokens a sampled completion may have.
        num_generations (`int`, defaults to `1`): Completions the student samples per prompt.
        disable_dropout (`bool`, defaults to `False`): Disable dropout in the student (the teacher
            always runs in eval mode).
        learning_rate (`float`, defaults to `1e-6`): Initial learning rate (AdamW).

    Shared with ``GRPOConfig`` (same meaning; documented there): `model_init_kwargs`,
    `trust_remote_code`, `router_aux_loss_coef`, `ds3_gather_for_generation`, `shuffle_dataset`,
    `pad_to_multiple_of`, `generation_batch_size`, `steps_per_generation`, `top_p`, `top_k`,
    `min_p`, `generation_kwargs`, `chat_template_kwargs`, `repetition_penalty`,
    `cache_implementation`, `max_tool_calling_iterations`, `mask_truncated_completions`,
    `log_completions`, `num_completions_to_print`, `log_unique_prompts`,
    `use_transformers_continuous_batching`, `transformers_continuous_batching_config`, and vLLM
    (not built yet: `use_vllm=True` raises `NotImplementedError`). The fields of rewards,
    importance ratios and KL references keep their defaults (`OFF_FIELDS`).
    """

    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "The teacher's hub id or local path."}
    )
    teacher_model_revision: str | None = field(
        default=None, metadata={"help": "The teacher's revision on the hub."}
    )
    teacher_model_init_kwargs: dict | str | None = field(
        default=None, metadata={"help": "Keyword arguments of the teacher's from_pretrained."}
    )
    beta: float = field(
        default=1.0,
        metadata={
            "help": "0 forward KL, 1 reverse KL, in between the generalised Jensen-Shannon divergence."
        },
    )
    num_generations: int | None = field(
        default=1, metadata={"help": "Completions the student samples per prompt."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _json_dict_fields: ClassVar[tuple[str, ...]] = (*JSON_DICT_FIELDS, "teacher_model_init_kwargs")
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = OFF_FIELDS
    _method: ClassVar[str] = "distillation"

    #: whether the divergence is taken of ``logits / temperature`` (GKD's is not: it samples only)
    loss_uses_temperature: ClassVar[bool] = True

    def _check_combinations(self) -> None:
        """The shared checks, less the KL reference's: ``beta`` is the divergence's here."""
        beta, self.beta = self.beta, 0.0  # OnlineConfig reads beta as a KL coefficient
        try:
            super()._check_combinations()
        finally:
            self.beta = beta


# fmt: off
_GKD_RULES: tuple[Rule, ...] = (
    Rule("lmbda", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (the share of steps trained on the student's own samples)", "set lmbda=0.5 (the default), 1.0 for fully on-policy or 0.0 for the dataset's completions only"),
    Rule("max_new_tokens", positive_int, "a positive integer (the most tokens a sampled completion may have)", "set max_new_tokens=128 (the default)"),
    Rule("max_length", optional(positive_int), "None or a positive integer (the most prompt + completion tokens of a dataset row)", "set max_length=1024 (the default), or None to keep whole rows"),
) + _RULES  # max_new_tokens is checked before the max_completion_length it sets
# fmt: on


@dataclass
class GKDConfig(DistillationConfig):
    r"""Configuration of ``GKDTrainer``: Generalized Knowledge Distillation (arXiv 2306.13649).

    The reference's public API (``trl.experimental.gkd.GKDConfig``). Each optimizer step trains on
    the student's own samples with probability `lmbda`, else on the teacher's samples
    (`seq_kd=True`) or the dataset's completions.

    GKD's fields:
        lmbda (`float`, defaults to `0.5`): Probability that a step trains on the student's own
            samples (the paper's student data fraction), in [0, 1].
        beta (`float`, defaults to `0.5`): The generalised JSD's interpolation, in [0, 1]: `0.0`
            the forward KL, `1.0` the reverse KL.
        temperature (`float`, defaults to `0.9`): Sampling temperature of the student's (and the
            teacher's) completions. As in the reference, the loss is taken at temperature 1.
        max_new_tokens (`int`, defaults to `128`): Most tokens a sampled completion may have.
        seq_kd (`bool`, defaults to `False`): On the steps that are not the student's own, train
            on completions the teacher samples (sequence-level KD) instead of the dataset's.
        max_length (`int | None`, defaults to `1024`): Most prompt + completion tokens of a dataset
            row; a longer completion is cut at the end, a longer prompt keeps its last tokens.
        disable_dropout (`bool`, defaults to `True`): Disable dropout in the student.
        learning_rate (`float`, defaults to `2e-5`): Initial learning rate (AdamW), the reference's.
        teacher_model_name_or_path, teacher_model_init_kwargs: as ``DistillationConfig``.

    The reference's `GKDConfig` also inherits the SFT fields (`packing`, `dataset_text_field`,
    ...), which its trainer ignores; they are not accepted here. The other shared online fields
    are as ``DistillationConfig``.
    """

    lmbda: float = field(
        default=0.5, metadata={"help": "Probability that a step trains on the student's own samples."}
    )
    beta: float = field(
        default=0.5, metadata={"help": "Generalised JSD interpolation: 0 forward KL, 1 reverse KL."}
    )
    temperature: float = field(
        default=0.9, metadata={"help": "Sampling temperature (the loss is taken at temperature 1)."}
    )
    max_new_tokens: int = field(default=128, metadata={"help": "Most tokens of a sampled completion."})
    max_completion_length: int | None = field(
        default=None, metadata={"help": "Set from max_new_tokens (GKD's name for it)."}
    )
    seq_kd: bool = field(
        default=False,
        metadata={
            "help": "Off the student's steps, train on the teacher's samples instead of the dataset's."
        },
    )
    max_length: int | None = field(
        default=1024, metadata={"help": "Most prompt + completion tokens of a dataset row."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Initial learning rate (AdamW)."})

    _rules: ClassVar[tuple[Rule, ...]] = _GKD_RULES
    _method: ClassVar[str] = "GKD"
    loss_uses_temperature: ClassVar[bool] = False

    def _normalise_family(self) -> None:
        """``max_completion_length`` follows ``max_new_tokens`` (a rebuilt copy carries both, equal)."""
        super()._normalise_family()
        if self.max_completion_length is not None and self.max_completion_length != self.max_new_tokens:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} and max_new_tokens={self.max_new_tokens} "
                "differ; GKDConfig's name for the completion budget is max_new_tokens: set only that."
            )
        self.max_completion_length = self.max_new_tokens
