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

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_int, is_num, optional, positive_int
from posttrain.sampling.config import (
    JSON_DICT_FIELDS,
    ONLINE_RULES,
    ONLINE_UNBUILT,
    OnlineConfig,
)

__all__ = [
    "OFF_FIELDS",
    "SELF_OFF_FIELDS",
    "DistillationConfig",
    "GKDConfig",
    "IWOPDConfig",
    "SDFTConfig",
    "SDPOConfig",
    "SelfDistillationConfig",
]

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
    (`use_vllm` and the `vllm_*` fields: the student samples with the engine, and GKD's
    `seq_kd` teacher with a second engine holding the teacher's weights). The fields of rewards,
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
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT
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


#: The self-distillation options accepted but not built yet (one row per option).
# fmt: off
SELF_UNBUILT: dict[str, UnbuiltOption] = {
    **ONLINE_UNBUILT,
    "use_teacher_server": UnbuiltOption(False, "a teacher served by another process", "Use use_teacher_server=False (the teacher is the model itself, in this process).", True),
}
_SDFT_UNBUILT: dict[str, UnbuiltOption] = {
    **SELF_UNBUILT,
    "generate_from_teacher": UnbuiltOption(False, "sampling from the teacher's privileged prompt", "Use generate_from_teacher=False (the student samples from its own prompt).", True),
}

SELF_CHOICES: dict[str, tuple[str, ...]] = {
    "teacher_model_kind": ("base", "live", "ema"),
    "distillation_mode": ("sampled_token", "full_logits", "topk_logits"),
}

SELF_OFF_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    **{k: v for k, v in OFF_FIELDS.items() if k != "num_iterations"},  # off-policy passes are importance-weighted
    "beta": ((0.0,), "the divergence is set by distillation_alpha; there is no KL reference"),
}

_SELF_RULES: tuple[Rule, ...] = tuple(r for r in ONLINE_RULES if r.name != "num_generations") + choice_rules(SELF_CHOICES) + (
    Rule("num_generations", positive_int, "an integer >= 1 (completions sampled per prompt)", "set num_generations=8 (the default) or another positive integer"),
    Rule("max_prompt_length", optional(positive_int), "None or a positive integer (a longer prompt keeps its last tokens)", "set max_prompt_length=512 (the default), or None to keep whole prompts"),
    Rule("distillation_alpha", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (0 forward KL, 1 reverse KL, in between the generalised JSD)", "set distillation_alpha=0.5 (the default)"),
    Rule("distillation_topk", optional(positive_int), "None or a positive integer (the student's top tokens the divergence is taken over)", "set distillation_topk=100, or None with another distillation_mode"),
    Rule("distillation_is_clip", optional(lambda v: is_num(v) and v > 0), "None or a number > 0 (the cap of the importance weight of off-policy tokens)", "set distillation_is_clip=2.0 (the default), or None for no importance weight"),
    Rule("teacher_update_rate", lambda v: is_num(v) and 0 < v <= 1, "a number in (0, 1] (the EMA teacher's step toward the student)", "set teacher_update_rate=0.05 (the default)"),
    Rule("teacher_sync_steps", positive_int, "a positive integer (optimizer steps between EMA updates)", "set teacher_sync_steps=1 (the default)"),
)

_SDFT_RULES: tuple[Rule, ...] = _SELF_RULES + (
    Rule("num_loss_tokens_to_skip", lambda v: is_int(v) and v >= 0, "an integer >= 0 (completion tokens left out of the loss at the start)", "set num_loss_tokens_to_skip=0 (the default)"),
    Rule("teacher_prompt_template", lambda v: isinstance(v, str) and "{prompt}" in v and "{privileged_context}" in v, "a string holding both '{prompt}' and '{privileged_context}'", "use the default '{prompt}\\n\\n{privileged_context}', or another template with both fields"),
)
# fmt: on


@dataclass
class SelfDistillationConfig(OnlineConfig):
    """The fields SDFT and SDPO share (the model as its own teacher); documented in their configs."""

    teacher_model_kind: str = field(default="base", metadata={"help": "'base', 'live' or 'ema'."})
    distillation_alpha: float = field(
        default=0.5, metadata={"help": "0 forward KL, 1 reverse KL, in between the generalised JSD."}
    )
    distillation_mode: str = field(
        default="topk_logits", metadata={"help": "'full_logits', 'topk_logits' or 'sampled_token'."}
    )
    distillation_topk: int | None = field(default=100, metadata={"help": "Tokens of 'topk_logits'."})
    distillation_add_tail: bool = field(
        default=False, metadata={"help": "In 'topk_logits', keep the rest of the mass as one category."}
    )
    distillation_is_clip: float | None = field(
        default=2.0, metadata={"help": "Cap of the importance weight of off-policy tokens."}
    )
    teacher_update_rate: float = field(default=0.05, metadata={"help": "The EMA teacher's step."})
    teacher_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between EMA updates."})
    use_teacher_server: bool = field(default=False, metadata={"help": "Not built."})
    max_prompt_length: int | None = field(default=512, metadata={"help": "Most prompt tokens."})
    max_completion_length: int | None = field(default=256, metadata={"help": "Most completion tokens."})
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the model."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Initial learning rate (AdamW)."})

    _rules: ClassVar[tuple[Rule, ...]] = _SELF_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = SELF_UNBUILT
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = SELF_OFF_FIELDS

    def _check_combinations(self) -> None:
        """The mode's own needs, then the shared checks."""
        if self.distillation_mode == "sampled_token" and self.distillation_alpha != 1.0:
            raise ValueError(
                f"distillation_mode='sampled_token' estimates the reverse KL, so it needs distillation_alpha=1.0 "
                f"(got {self.distillation_alpha}); set distillation_alpha=1.0, or use 'full_logits' or 'topk_logits'."
            )
        if self.distillation_mode == "topk_logits" and self.distillation_topk is None:
            raise ValueError(
                "distillation_mode='topk_logits' needs distillation_topk (the student's top tokens the divergence is "
                "taken over); set distillation_topk=100, or use distillation_mode='full_logits'."
            )
        super()._check_combinations()


@dataclass
class SDFTConfig(SelfDistillationConfig):
    r"""Configuration of ``SDFTTrainer``: Self-Distilled Fine-Tuning (arXiv 2601.19897).

    The reference's public API (``trl.experimental.sdft.SDFTConfig``). The student samples
    completions of each prompt; the teacher (the model itself: its start weights, its live
    weights or their EMA) reads the same completions after the prompt with the row's
    ``privileged_context``, and the student learns the teacher's next-token distributions.

    SDFT's fields:
        teacher_model_kind (`str`, defaults to `"base"`): The teacher: `"base"` the student's
            start weights (the adapters-off base under PEFT), `"live"` the current weights, `"ema"`
            an exponential moving average of them.
        distillation_alpha (`float`, defaults to `0.5`): The divergence, in [0, 1]: 0 the forward
            KL, 1 the reverse KL, in between the generalised Jensen-Shannon divergence.
        distillation_mode (`str`, defaults to `"topk_logits"`): `"full_logits"` (whole vocabulary),
            `"topk_logits"` (the student's `distillation_topk` tokens) or `"sampled_token"` (the
            sampled token's reverse-KL estimate; needs `distillation_alpha=1`).
        distillation_topk (`int | None`, defaults to `100`): Tokens of `"topk_logits"`.
        distillation_add_tail (`bool`, defaults to `False`): In `"topk_logits"`, keep the rest of
            each distribution's mass as one more category instead of renormalising.
        distillation_is_clip (`float | None`, defaults to `2.0`): Cap of the importance weight of
            off-policy tokens (`num_iterations > 1`); `None` drops the weight.
        teacher_prompt_template (`str`, defaults to `"{prompt}\n\n{privileged_context}"`): How the
            teacher's prompt is composed (for conversational prompts: the last user message's
            content).
        num_loss_tokens_to_skip (`int`, defaults to `0`): Completion tokens at the start left out
            of the loss.
        generate_from_teacher (`bool`, defaults to `False`): Not built (`True` raises
            `NotImplementedError`).
        teacher_update_rate (`float`, defaults to `0.05`): The EMA teacher's step toward the
            student at each update.
        teacher_sync_steps (`int`, defaults to `1`): Optimizer steps between EMA updates.
        use_teacher_server (`bool`, defaults to `False`): Not built.
        max_prompt_length (`int | None`, defaults to `512`): Most prompt tokens (student's and
            teacher's); a longer prompt keeps its last tokens.
        max_completion_length (`int`, defaults to `256`), num_generations (`int`, defaults to `8`).
        disable_dropout (`bool`, defaults to `True`), learning_rate (`float`, defaults to `5e-5`).

    Shared with ``GRPOConfig`` (same meaning; documented there): the generation options
    (`temperature`, also applied in the loss, `top_p`, `top_k`, `min_p`, ...), `num_iterations`,
    `generation_batch_size`, `steps_per_generation`, logging and vLLM (`use_vllm`: the student samples with the engine). The fields of
    rewards, clipping and KL references keep their defaults (`SELF_OFF_FIELDS`).
    """

    teacher_prompt_template: str = field(
        default="{prompt}\n\n{privileged_context}", metadata={"help": "How the teacher's prompt is composed."}
    )
    num_loss_tokens_to_skip: int = field(
        default=0, metadata={"help": "Completion tokens at the start left out of the loss."}
    )
    generate_from_teacher: bool = field(default=False, metadata={"help": "Not built."})

    _rules: ClassVar[tuple[Rule, ...]] = _SDFT_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = _SDFT_UNBUILT
    _method: ClassVar[str] = "SDFT"


# fmt: off
SDPO_CHOICES: dict[str, tuple[str, ...]] = {
    "scale_rewards": ("group", "batch", "none"),
    "importance_sampling_level": ("token", "sequence"),
}

_SDPO_RULES: tuple[Rule, ...] = _SELF_RULES + choice_rules(SDPO_CHOICES) + (
    Rule("distillation_weight", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (loss = (1 - w) policy + w distillation)", "set distillation_weight=1.0 (the default: pure distillation) or 0.5"),
    Rule("success_reward_threshold", is_num, "a number (a sample whose reward reaches it is a success)", "set success_reward_threshold=1.0 (the default)"),
    Rule("max_reprompt_len", positive_int, "a positive integer (the most tokens of the teacher's prompt; a longer one keeps its last tokens)", "set max_reprompt_len=10240 (the default)"),
    Rule("reprompt_template", lambda v: isinstance(v, str) and all(f in v for f in ("{prompt}", "{solution}", "{feedback}")), "a string holding '{prompt}', '{solution}' and '{feedback}'", "keep the default template, or write one with all three fields"),
    Rule("solution_template", lambda v: isinstance(v, str) and "{successful_previous_attempt}" in v, "a string holding '{successful_previous_attempt}'", "keep the default template, or write one with that field"),
    Rule("feedback_template", lambda v: isinstance(v, str) and "{feedback_raw}" in v, "a string holding '{feedback_raw}'", "keep the default template, or write one with that field"),
    Rule("diagnostics_warning_interval", positive_int, "a positive integer (steps between warnings about flat rewards)", "set diagnostics_warning_interval=10 (the default)"),
    Rule("diagnostics_flat_tolerance", lambda v: is_num(v) and v >= 0, "a number >= 0 (a group whose rewards spread less is flat)", "set diagnostics_flat_tolerance=1e-8 (the default)"),
)

_SDPO_OFF_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "sync_ref_model": OFF_FIELDS["sync_ref_model"],
    "dynamic_sampling": ((False,), "every group is distilled on, flat or not: its failures still get a teacher"),
}

_SDPO_UNBUILT: dict[str, UnbuiltOption] = {
    **SELF_UNBUILT,
    "beta": UnbuiltOption(0.0, "a KL penalty in SDPO's policy term", "Use beta=0.0 (the reference's default).", 0.04),
}
# fmt: on


@dataclass
class SDPOConfig(SelfDistillationConfig):
    r"""Configuration of ``SDPOTrainer``: Self-Distillation Policy Optimization (arXiv 2601.20802).

    The reference's public API (``trl.experimental.sdpo.SDPOConfig``). The student samples
    `num_generations` completions per prompt, scored by reward functions; each failed completion
    gets a teacher prompt (the reprompt): the prompt with a successful sibling's completion (the
    first other completion of its group whose reward reaches `success_reward_threshold`) and/or
    the environment's feedback (`privileged_context`). The teacher (the model itself) reads the
    completion after that reprompt, and the student learns its token distributions; a GRPO-style
    policy term can be mixed in (`distillation_weight < 1`).

    SDPO's fields (the others as ``SDFTConfig``):
        teacher_model_kind (`str`, defaults to `"ema"`), distillation_alpha (`float`, defaults to
            `1.0`), distillation_mode (`str`, defaults to `"sampled_token"`), distillation_topk
            (`int | None`, defaults to `None`).
        distillation_weight (`float`, defaults to `1.0`): `loss = (1 - w) policy + w distillation`.
        loss_type (`str`, defaults to `"dapo"`), epsilon (`0.2`), epsilon_high (`None`),
            importance_sampling_level (`"token"`), scale_rewards (`"group"`), reward_weights,
            mask_truncated_completions: the policy term's, as ``GRPOConfig``'s.
        beta (`float`, defaults to `0.0`): Not built above 0 (`NotImplementedError`).
        use_successful_as_teacher (`bool`, defaults to `True`): Put a successful sibling's
            completion in the reprompt.
        success_reward_threshold (`float`, defaults to `1.0`): The reward a success reaches.
        dont_reprompt_on_self_success (`bool`, defaults to `True`): A completion is never its own
            demonstration (a successful one learns from a successful sibling); off, the group's
            first success may be the row itself.
        include_environment_feedback (`bool`, defaults to `False`): Put the row's
            `privileged_context` (the environment's feedback) in the reprompt.
        environment_feedback_only_without_solution (`bool`, defaults to `False`): Only where no
            successful sibling exists.
        remove_thinking_from_demonstration (`bool`, defaults to `False`): Drop `<think>...</think>`
            from the sibling's completion.
        reprompt_template, solution_template, feedback_template (`str`): How the reprompt is
            composed (the reference's defaults); for conversational prompts, the last user
            message's content is the `{prompt}`.
        max_reprompt_len (`int`, defaults to `10240`): Most tokens of the reprompt (its last kept).
        diagnostics_warning_interval (`int`, defaults to `10`), diagnostics_flat_tolerance
            (`float`, defaults to `1e-8`): Warn every that many steps while every group's rewards
            are flat (no success to teach from).
        num_generations (`int`, defaults to `8`), learning_rate (`float`, defaults to `5e-5`).
    """

    teacher_model_kind: str = field(default="ema", metadata={"help": "'base', 'live' or 'ema'."})
    distillation_alpha: float = field(default=1.0, metadata={"help": "0 forward KL, 1 reverse KL."})
    distillation_mode: str = field(
        default="sampled_token", metadata={"help": "'full_logits', 'topk_logits' or 'sampled_token'."}
    )
    distillation_topk: int | None = field(default=None, metadata={"help": "Tokens of 'topk_logits'."})
    distillation_weight: float = field(
        default=1.0, metadata={"help": "loss = (1 - w) policy + w distillation."}
    )
    loss_type: str = field(default="dapo", metadata={"help": "The policy term's loss type (GRPO's)."})
    importance_sampling_level: str = field(default="token", metadata={"help": "'token' or 'sequence'."})
    scale_rewards: str = field(default="group", metadata={"help": "'group', 'batch' or 'none'."})
    dont_reprompt_on_self_success: bool = field(
        default=True,
        metadata={"help": "A completion is never its own demonstration (a sibling's success is)."},
    )
    max_reprompt_len: int = field(default=10240, metadata={"help": "Most tokens of the reprompt."})
    use_successful_as_teacher: bool = field(
        default=True, metadata={"help": "Put a successful sibling's completion in the reprompt."}
    )
    success_reward_threshold: float = field(default=1.0, metadata={"help": "The reward a success reaches."})
    reprompt_template: str = field(
        default="{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
        metadata={"help": "How the reprompt is composed."},
    )
    solution_template: str = field(
        default="\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
        metadata={"help": "How a successful sibling's completion enters the reprompt."},
    )
    feedback_template: str = field(
        default="\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
        metadata={"help": "How the environment's feedback enters the reprompt."},
    )
    include_environment_feedback: bool = field(
        default=False, metadata={"help": "Put the row's privileged_context in the reprompt."}
    )
    environment_feedback_only_without_solution: bool = field(
        default=False, metadata={"help": "Feedback only where no successful sibling exists."}
    )
    remove_thinking_from_demonstration: bool = field(
        default=False, metadata={"help": "Drop <think>...</think> from the sibling's completion."}
    )
    diagnostics_warning_interval: int = field(
        default=10, metadata={"help": "Steps between warnings about flat rewards."}
    )
    diagnostics_flat_tolerance: float = field(
        default=1e-8, metadata={"help": "Reward spread of a flat group."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _SDPO_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = _SDPO_UNBUILT
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = _SDPO_OFF_FIELDS
    _method: ClassVar[str] = "SDPO"

    def _check_combinations(self) -> None:
        from posttrain.grpo.objectives import LOSS_TYPES

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(
                f"loss_type={self.loss_type!r} is invalid: it must be one of {sorted(LOSS_TYPES)} (GRPO's policy "
                "terms); set loss_type='dapo' (the default)."
            )
        super()._check_combinations()


# fmt: off
IWOPD_CHOICES: dict[str, tuple[str, ...]] = {
    "distillation_objective": ("iw_opd", "jsd"),
    "reverse_kl_top_1_mode": ("sampled", "argmax"),
}

_IWOPD_RULES: tuple[Rule, ...] = (
    Rule("lmbda", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1] (the share of steps trained on the student's own samples)", "set lmbda=1.0 (the default: fully on-policy)"),
    Rule("iw_opd_gamma", lambda v: is_num(v) and v >= 0, "a number >= 0 (how much more the early tokens weigh)", "set iw_opd_gamma=0.5 (the default), or 0 for plain on-policy distillation"),
    Rule("iw_opd_epsilon", lambda v: is_num(v) and v > 0, "a number > 0 (keeps the weights' denominator away from 0)", "set iw_opd_epsilon=1e-8 (the default)"),
    Rule("loss_top_k", lambda v: is_int(v) and v >= 0, "an integer >= 0 (the tokens of the reduced 'jsd' objective; 0: the whole vocabulary)", "set loss_top_k=1 (the default) or 0 for the whole vocabulary"),
    Rule("max_length", positive_int, "a positive integer (the most prompt + completion tokens)", "set max_length=1024 (the default)"),
    Rule("max_prompt_length", optional(positive_int), "None (max_length - max_completion_length) or a positive integer", "leave max_prompt_length=None, or set a positive integer"),
    Rule("teacher_model_server_url", optional(lambda v: isinstance(v, str)), "None or a URL", "leave teacher_model_server_url=None"),
    Rule("log_completions_steps", positive_int, "a positive integer (the steps between logged completions)", "set log_completions_steps=100 (the default)"),
) + choice_rules(IWOPD_CHOICES) + _RULES
# fmt: on


@dataclass
class IWOPDConfig(DistillationConfig):
    r"""Configuration of ``IWOPDTrainer``: importance-weighted on-policy distillation (IW-OPD).

    The reference's public API (``trl.experimental.iw_opd.IWOPDConfig``), from "On Position Bias
    in On-Policy Distillation" (paper index). The student samples; per sampled token the
    advantage is `a_t = log p_T(y_t) - log p_rollout(y_t)`, weighted by
    `w_t = 1 + gamma (1 - sum_{k<t} |a_k| / sum_k |a_k|)`, so the tokens before a large
    discrepancy weigh more; the loss is `-sum_t w_t a_t log p_S(y_t) / N` (no gradient through
    `a` or `w`).

    IW-OPD's fields:
        distillation_objective (`str`, defaults to `"iw_opd"`): `"iw_opd"` (needs `lmbda=1`) or
            `"jsd"` (the generalised JSD with `beta`, over `loss_top_k` tokens).
        iw_opd_gamma (`float`, defaults to `0.5`): The weights' amplification `gamma`.
        iw_opd_epsilon (`float`, defaults to `1e-8`): Added to the weights' denominator.
        lmbda (`float`, defaults to `1.0`): Probability that a step trains on the student's own
            samples; otherwise on the dataset's completions (`messages` rows).
        beta (`float`, defaults to `1.0`): The `"jsd"` objective's interpolation (1 reverse KL).
        loss_top_k (`int`, defaults to `1`): Tokens of the `"jsd"` objective: the sampled (or
            argmax: `reverse_kl_top_1_mode`) token for 1, the student's top k above; 0 the whole
            vocabulary.
        loss_add_tail (`bool`, defaults to `True`): Keep the rest of the mass as one more category
            (else the k tokens are renormalised; with k = 1 that leaves nothing to learn).
        reverse_kl_top_1_mode (`str`, defaults to `"sampled"`): `"sampled"` or `"argmax"`.
        temperature (`float`, defaults to `1.0`): Sampling temperature, applied in the loss too.
        top_p (`float`, defaults to `0.95`): Nucleus sampling mass.
        max_length (`int`, defaults to `1024`): Most prompt + completion tokens.
        max_completion_length (`int`, defaults to `512`): Most completion tokens (< `max_length`).
        max_prompt_length (`int | None`, defaults to `None`): Most prompt tokens; `None` is
            `max_length - max_completion_length`.
        disable_dropout (`bool`, defaults to `True`).
        use_teacher_server (`bool`, defaults to `False`), teacher_model_server_url (`str | None`):
            The teacher served by vLLM at that address (``teachers.VLLMTeacherServer``: the sampled
            tokens' log-probs at temperature 1; `teacher_model` is then left `None`).
        vllm_sync_frequency (`int`, defaults to `1`): With `use_vllm=True`, the engine gets the
            student's weights every this many optimizer steps and samples with the last ones in
            between (the rollout log-probs of the advantage are then the engine's).
        log_completions_steps (`int`, defaults to `100`): With `log_completions`, the training
            completions of every this many optimizer steps are logged (step 0 included).
        teacher_model_name_or_path, teacher_model_revision, teacher_model_init_kwargs: as
            ``DistillationConfig``.
    """

    distillation_objective: str = field(default="iw_opd", metadata={"help": "'iw_opd' or 'jsd'."})
    iw_opd_gamma: float = field(default=0.5, metadata={"help": "The weights' amplification gamma."})
    iw_opd_epsilon: float = field(default=1e-8, metadata={"help": "Added to the weights' denominator."})
    lmbda: float = field(
        default=1.0, metadata={"help": "Probability that a step uses the student's samples."}
    )
    loss_top_k: int = field(default=1, metadata={"help": "Tokens of the 'jsd' objective (0: all)."})
    loss_add_tail: bool = field(default=True, metadata={"help": "Keep the rest of the mass as one category."})
    reverse_kl_top_1_mode: str = field(default="sampled", metadata={"help": "'sampled' or 'argmax'."})
    top_p: float = field(default=0.95, metadata={"help": "Nucleus sampling mass."})
    max_length: int = field(default=1024, metadata={"help": "Most prompt + completion tokens."})
    max_completion_length: int | None = field(default=512, metadata={"help": "Most completion tokens."})
    max_prompt_length: int | None = field(
        default=None, metadata={"help": "Most prompt tokens; None: max_length - max_completion_length."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the student."})
    use_teacher_server: bool = field(default=False, metadata={"help": "Score with a teacher vLLM serves."})
    teacher_model_server_url: str | None = field(default=None, metadata={"help": "That server's address."})
    vllm_sync_frequency: int = field(
        default=1, metadata={"help": "Optimizer steps between vLLM weight syncs (with use_vllm)."}
    )
    log_completions_steps: int = field(
        default=100, metadata={"help": "Optimizer steps between logged training completions."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _IWOPD_RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT
    _method: ClassVar[str] = "IW-OPD"

    def _check_combinations(self) -> None:
        if self.distillation_objective == "iw_opd" and self.lmbda != 1.0:
            raise ValueError(
                f"distillation_objective='iw_opd' weighs the student's own samples, so it needs lmbda=1.0 (got "
                f"{self.lmbda}); set lmbda=1.0, or use distillation_objective='jsd' to mix in dataset completions."
            )
        if self.max_completion_length >= self.max_length:
            raise ValueError(
                f"max_completion_length={self.max_completion_length} must be below max_length={self.max_length} "
                "(the prompt needs room); raise max_length or lower max_completion_length."
            )
        super()._check_combinations()

    def _derive(self) -> None:
        super()._derive()
        if self.max_prompt_length is None:
            self.max_prompt_length = self.max_length - self.max_completion_length
