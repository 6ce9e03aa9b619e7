"""Configuration of the RLOO trainer: ``RLOOConfig``.

``RLOOConfig`` has the fields of the reference's ``RLOOConfig`` with the same names, types and
defaults: the online fields it shares with ``GRPOConfig`` (``sampling.config.OnlineConfig``),
RLOO's defaults where they differ (``num_generations=2``, ``beta=0.05``), and its own
``normalize_advantages`` (REINFORCE++) and ``reward_clip_range``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import Rule, UnbuiltOption, is_num
from posttrain.sampling.config import ONLINE_RULES, ONLINE_UNBUILT, SAMPLING_EXTENSIONS, OnlineConfig

__all__ = ["POSTTRAIN_EXTENSIONS", "RLOOConfig"]

#: Fields posttrain's RLOOConfig has that the reference's lacks (shared with posttrain's GRPO).
POSTTRAIN_EXTENSIONS = (
    "max_tool_calling_iterations",
    "dynamic_sampling",
    "dynamic_sampling_max_rounds",
    "dynamic_sampling_oversample",
    "dynamic_sampling_prefer",
    "reward_fault_policy",
    "reward_timeout",
    *SAMPLING_EXTENSIONS,
)


def _clip_range_ok(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(is_num(v) for v in value)
        and value[0] <= value[1]
    )


# fmt: off
_RULES: tuple[Rule, ...] = ONLINE_RULES + (
    Rule("reward_clip_range", lambda v: v is None or _clip_range_ok(v), "None or a pair (low, high) of numbers with low <= high", "pass reward_clip_range=(-10.0, 10.0), or None not to clip"),
)
# fmt: on


@dataclass
class RLOOConfig(OnlineConfig):
    r"""Configuration of ``RLOOTrainer`` (REINFORCE Leave-One-Out, and REINFORCE++).

    The reference's public API: a script written for ``trl.RLOOConfig`` runs after changing the
    import. Every ``transformers.TrainingArguments`` field is accepted too.

    RLOO's own fields and defaults:
        num_generations (`int | None`, defaults to `2`): Completions sampled per prompt (the
            group). At least 2: each completion's baseline is the mean reward of the others.
        beta (`float`, defaults to `0.05`): Coefficient of the KL penalty, folded into the
            reward: `r_i - beta * sum_t (log pi_old - log pi_ref)(y_i,t)`. `0.0` loads no
            reference model.
        normalize_advantages (`bool`, defaults to `False`): Normalise the leave-one-out
            advantages over the whole generation batch, `(A - mean) / (std + 1e-4)`
            (REINFORCE++'s global normalisation).
        reward_clip_range (`tuple[float, float] | None`, defaults to `None`): Clip each
            completion's weighted reward to `[low, high]` before the KL penalty; `None` does not
            clip.
        epsilon (`float`, defaults to `0.2`): Lower clipping range of the sequence-level
            importance ratio.
        epsilon_high (`float | None`, defaults to `None`): Upper clipping range; `None` reuses
            `epsilon`.
        num_iterations (`int`, defaults to `1`): Optimisation passes over each generation batch.
        reward_weights (`list[float] | None`, defaults to `None`): One weight per reward
            function; `None` weights each 1.0.
        mask_truncated_completions (`bool`, defaults to `False`): Leave completions that hit
            `max_completion_length` out of the loss (their KL counts 0 in the reward).
        learning_rate (`float`, defaults to `1e-6`): Initial learning rate (AdamW).
        remove_unused_columns (`bool | None`, defaults to `False`): Keep the dataset's other
            columns, which reach the reward functions as keyword arguments.

    Shared with ``GRPOConfig`` (same names, defaults and meaning; documented there):
        model and reference: `model_init_kwargs`, `trust_remote_code`, `router_aux_loss_coef`,
        `disable_dropout`, `sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`;
        data: `num_generations_eval`, `max_completion_length`, `ds3_gather_for_generation`,
        `shuffle_dataset`, `pad_to_multiple_of`;
        generation: `generation_batch_size`, `steps_per_generation`, `temperature`, `top_p`,
        `top_k`, `min_p`, `generation_kwargs`, `chat_template_kwargs`, `repetition_penalty`,
        `cache_implementation`, `use_transformers_continuous_batching`,
        `transformers_continuous_batching_config`, `use_transformers_paged` (deprecated);
        vLLM (as in GRPOConfig; docs/vllm.md): `use_vllm`,
        `vllm_mode`, `vllm_model_impl`, `vllm_enable_sleep_mode`,
        `vllm_structured_outputs_regex`, `vllm_server_base_url`, `vllm_server_host`,
        `vllm_server_port`, `vllm_server_timeout`, `vllm_group_port`,
        `vllm_gpu_memory_utilization`, `vllm_max_model_length`, `vllm_tensor_parallel_size`;
        logging: `log_completions`, `log_multimodal`, `num_completions_to_print`,
        `log_unique_prompts`;
        posttrain extensions (the reference's RLOO lacks them): `max_tool_calling_iterations`,
        `dynamic_sampling`, `dynamic_sampling_max_rounds`, `dynamic_sampling_oversample`,
        `dynamic_sampling_prefer`, `reward_fault_policy`, `reward_timeout`, `vllm_engine_kwargs`
        (GRPOConfig documents it).
    """

    num_generations: int | None = field(
        default=2,
        metadata={"help": "Completions sampled per prompt; at least 2 (the leave-one-out baseline)."},
    )
    beta: float = field(
        default=0.05,
        metadata={"help": "KL coefficient, folded into the reward; 0.0 loads no reference model."},
    )
    normalize_advantages: bool = field(
        default=False,
        metadata={"help": "Normalise the advantages over the generation batch (REINFORCE++)."},
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None,
        metadata={"help": "Clip each completion's weighted reward to [low, high] before the KL penalty."},
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT

    def _normalise_family(self) -> None:
        """The shared normalisation; a ``reward_clip_range`` list (YAML, command line) becomes a tuple."""
        super()._normalise_family()
        if isinstance(self.reward_clip_range, list):
            self.reward_clip_range = tuple(self.reward_clip_range)

    def _check_combinations(self) -> None:
        """The shared combinations, and ``auto_find_batch_size`` (a batch must hold whole groups)."""
        super()._check_combinations()
        if self.auto_find_batch_size:
            raise ValueError(
                "auto_find_batch_size=True would change per_device_train_batch_size during training, but a "
                "generation batch must hold whole groups of num_generations completions; set "
                "auto_find_batch_size=False and choose per_device_train_batch_size yourself."
            )
        if self.dynamic_sampling and self.beta != 0.0:
            warnings.warn(
                "dynamic_sampling=True keeps groups whose task rewards differ; with beta > 0 the KL term "
                "also moves the rewards, which dynamic sampling does not look at.",
                UserWarning,
                stacklevel=5,
            )
