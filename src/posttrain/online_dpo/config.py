"""Configuration of the online DPO trainer: ``OnlineDPOConfig``.

The reference's fields with its names and defaults (``max_new_tokens``, ``max_length``,
``temperature=0.9``, ``missing_eos_penalty``, ``beta`` as a float or one value per epoch,
``loss_type`` ``"sigmoid"`` or ``"ipo"``, ``reward_model_path``, ``learning_rate=5e-7``), on top of
the online fields every posttrain online trainer shares (``sampling.config.OnlineConfig``).

As in the reference, ``per_device_train_batch_size`` counts *prompts*: each gets two completions,
so a process samples ``2 * per_device_train_batch_size`` completions per micro-step. The shared
online fields that do not apply to a method that samples one pair per prompt on every micro-step
must stay at their defaults (``OFF_FIELDS``); ``max_completion_length`` follows
``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_num, positive_int
from posttrain.sampling.config import ONLINE_RULES, ONLINE_UNBUILT, OnlineConfig

__all__ = ["LOSS_TYPES", "OFF_FIELDS", "OnlineDPOConfig"]

#: The loss types of the reference's online DPO (each a row of DPO's loss table).
LOSS_TYPES = ("sigmoid", "ipo")

#: Shared online fields online DPO does not use: the values they may hold (the first is the default;
#: a built config's derived value is accepted too, so a copy rebuilds) and why.
OFF_FIELDS: dict[str, tuple[Any, str]] = {
    "num_generations": ((2,), "online DPO samples exactly one pair (two completions) per prompt"),
    "num_generations_eval": ((None, 2), "online DPO samples exactly one pair per prompt"),
    "steps_per_generation": ((None, 1), "online DPO samples for every micro-step, as the reference does"),
    "num_iterations": ((1,), "each pair is trained on once, on-policy"),
    "epsilon": ((0.2,), "the DPO loss has no importance ratio to clip"),
    "epsilon_high": ((None,), "the DPO loss has no importance ratio to clip"),
    "mask_truncated_completions": ((False,), "use missing_eos_penalty to penalise completions without EOS"),
    "dynamic_sampling": ((False,), "a pair with equal rewards still trains (the first completion is chosen)"),
}


def _beta_ok(value: Any) -> bool:
    if isinstance(value, list):
        return bool(value) and all(is_num(v) and v > 0 for v in value)
    return is_num(value) and value > 0


# fmt: off
_RULES: tuple[Rule, ...] = tuple(r for r in ONLINE_RULES if r.name not in ("beta", "max_completion_length")) + (
    Rule("beta", _beta_ok, "a number > 0, or a non-empty list of numbers > 0 (one per epoch; the last one serves the later epochs)", "set beta=0.1 (the default), or e.g. beta=[0.1, 0.05]"),
    Rule("max_new_tokens", positive_int, "a positive integer (the most tokens a completion may have)", "set max_new_tokens to a positive integer such as 64 (the default)"),
    Rule("max_length", lambda v: v is None or positive_int(v), "None or a positive integer (prompt + completion tokens; the prompt is cut on the left)", "set max_length to a positive integer such as 512 (the default)"),
    Rule("missing_eos_penalty", lambda v: v is None or is_num(v), "None or a number (subtracted from the score of a completion without EOS)", "set missing_eos_penalty to a number such as 1.0, or None"),
) + choice_rules({"loss_type": LOSS_TYPES})
# fmt: on


@dataclass
class OnlineDPOConfig(OnlineConfig):
    r"""Configuration of ``OnlineDPOTrainer`` (online DPO: Guo et al. 2024, arXiv 2402.04792).

    The reference's public API (``trl.experimental.online_dpo.OnlineDPOConfig``). Every
    ``transformers.TrainingArguments`` field is accepted too.

    Online DPO's fields:
        reward_model_path (`str | None`, defaults to `None`): A sequence-classification reward
            model (hub id or folder) that scores the completions when the trainer gets no
            `reward_funcs` and no `judge`.
        max_new_tokens (`int`, defaults to `64`): Most tokens a completion may have.
        max_length (`int | None`, defaults to `512`): Most prompt + completion tokens scored; a
            longer prompt is cut on the left. `None` does not cut.
        temperature (`float`, defaults to `0.9`): Sampling temperature. The loss reads the
            policy's and the reference's own log-probabilities (temperature 1), as the reference
            and the paper do: DPO has no importance ratio for a sampling temperature to enter.
        missing_eos_penalty (`float | None`, defaults to `None`): Subtracted from the score of a
            completion that ends without EOS, before the pair is ordered.
        beta (`float | list[float]`, defaults to `[0.1]`): DPO's beta. A list gives one value
            per epoch (the last one serves the later epochs); a one-element list is its value.
        loss_type (`str`, defaults to `"sigmoid"`): `"sigmoid"` (DPO) or `"ipo"` (IPO on the
            completions' summed log-probabilities).
        disable_dropout (`bool`, defaults to `True`): Disable dropout in the policy and the
            reference.
        learning_rate (`float`, defaults to `5e-7`): Initial learning rate (AdamW).
        remove_unused_columns (`bool | None`, defaults to `False`): Keep the dataset's other
            columns, which reach the reward functions as keyword arguments.
        vllm_gpu_memory_utilization (`float`, defaults to `0.55`): As in `GRPOConfig`
            (docs/vllm.md).

    Shared with ``GRPOConfig`` (same meaning; documented there): `model_init_kwargs`,
    `trust_remote_code`, `router_aux_loss_coef`, `ds3_gather_for_generation`, `shuffle_dataset`,
    `pad_to_multiple_of`, `top_p`, `top_k`, `min_p`, `generation_kwargs`, `chat_template_kwargs`,
    `repetition_penalty`, `cache_implementation`, `reward_weights`, vLLM (docs/vllm.md; online
    DPO has no importance-sampling correction, as in the reference): `use_vllm`, `vllm_mode`, `vllm_model_impl`,
    `vllm_enable_sleep_mode`, `vllm_structured_outputs_regex`, `vllm_server_base_url`,
    `vllm_server_host`, `vllm_server_port`, `vllm_server_timeout`, `vllm_group_port`,
    `vllm_max_model_length`, `vllm_tensor_parallel_size`;
    `sync_ref_model`, `ref_model_mixup_alpha`, `ref_model_sync_steps`, `log_completions`,
    `log_multimodal`, `num_completions_to_print`, `log_unique_prompts`,
    `use_transformers_continuous_batching`, `transformers_continuous_batching_config`,
    `max_tool_calling_iterations`, `reward_fault_policy`, `reward_timeout`. The other shared
    online fields keep their defaults (`OFF_FIELDS`: `num_generations` is 2, `num_iterations` 1,
    ...); `max_completion_length` is set from `max_new_tokens`.
    """

    reward_model_path: str | None = field(
        default=None, metadata={"help": "Reward model (hub id or folder) used when no reward_funcs or judge."}
    )
    max_new_tokens: int = field(default=64, metadata={"help": "Most tokens a completion may have."})
    max_length: int | None = field(
        default=512,
        metadata={"help": "Most prompt + completion tokens scored; the prompt is cut on the left."},
    )
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature."})
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of a completion without EOS."}
    )
    beta: list[float] = field(  # a float is accepted too (the reference's type: float | list[float])
        default_factory=lambda: [0.1], metadata={"help": "DPO's beta: a float, or one value per epoch."}
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "'sigmoid' (DPO) or 'ipo'."})
    disable_dropout: bool = field(
        default=True, metadata={"help": "Disable dropout in the policy and reference."}
    )
    learning_rate: float = field(default=5e-7, metadata={"help": "Initial learning rate (AdamW)."})
    vllm_gpu_memory_utilization: float = field(
        default=0.55, metadata={"help": "GPU memory fraction of the colocated vLLM engine."}
    )
    num_generations: int | None = field(
        default=2, metadata={"help": "Completions per prompt: always 2 (one pair) for online DPO."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = OFF_FIELDS
    _method: ClassVar[str] = "online DPO"

    def _normalise_family(self) -> None:
        """The shared normalisation; a one-element ``beta`` list is its value (as in the reference)."""
        super()._normalise_family()
        if isinstance(self.beta, (list, tuple)):
            self.beta = list(self.beta)
            if len(self.beta) == 1:
                self.beta = self.beta[0]

    def _check_combinations(self) -> None:
        """The shared combinations (``OFF_FIELDS`` among them), then the completion length."""
        super()._check_combinations()
        if self.max_completion_length not in (OnlineConfig.max_completion_length, self.max_new_tokens):
            raise ValueError(
                f"max_completion_length={self.max_completion_length} is set, but online DPO takes the completion "
                f"length from max_new_tokens={self.max_new_tokens}; set max_new_tokens instead."
            )

    def _derive_generation_batch(self) -> None:
        """One pair per prompt, sampled for every micro-step: ``2 * per_device_train_batch_size``
        completions per process and step."""
        per_step = 2 * self.per_device_train_batch_size * self.world_size
        if self.generation_batch_size not in (None, per_step):
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} does not apply to online DPO (it samples "
                f"2 x per_device_train_batch_size x processes = {per_step} completions per micro-step); leave it None."
            )
        self.max_completion_length = self.max_new_tokens
        self.num_generations_eval = 2
        self.steps_per_generation = 1
        self.generation_batch_size = per_step

    def beta_at(self, epoch: float) -> float:
        """The beta of ``epoch`` (a list gives one value per epoch; the last serves the later ones)."""
        if isinstance(self.beta, list):
            return float(self.beta[min(int(epoch), len(self.beta) - 1)])
        return float(self.beta)
