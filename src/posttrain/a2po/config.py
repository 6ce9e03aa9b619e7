"""Configuration of the A*-PO trainer: ``A2POConfig``.

The reference's fields with its names and defaults (``max_prompt_length=512``,
``max_completion_length=256``, ``temperature``, ``top_p``, ``top_k=None``, ``num_value_samples=8``,
``beta1=0.5``, ``filter_all_incorrect=True``, ``beta2=1e-3``, ``reward_weights``), on top of the
online fields every posttrain online trainer shares (``sampling.config.OnlineConfig``).

A*-PO trains on one completion per prompt, on-policy, with a regression loss against a fixed
reference: the shared fields that belong to group baselines, importance ratios or a moving
reference must stay at their defaults (``OFF_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import Rule, UnbuiltOption, is_int, is_num, optional, positive_int
from posttrain.sampling.config import ONLINE_RULES, ONLINE_UNBUILT, OnlineConfig

__all__ = ["OFF_FIELDS", "A2POConfig"]

#: Shared online fields A*-PO does not use: the values they may hold (the first is the default;
#: a built config's derived value is accepted too, so a copy rebuilds) and why.
OFF_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "num_generations": ((1,), "it trains on one completion per prompt; num_value_samples sets the reference samples of stage 1"),
    "num_generations_eval": ((None, 1), "it evaluates one completion per prompt"),
    "num_iterations": ((1,), "each completion is regressed on once"),
    "beta": ((0.0,), "its KL temperatures are beta1 (the value estimate) and beta2 (the regression)"),
    "epsilon": ((0.2,), "the regression loss has no importance ratio to clip"),
    "epsilon_high": ((None,), "the regression loss has no importance ratio to clip"),
    "sync_ref_model": ((False,), "V*(x) is estimated under the fixed reference; a moving reference would void it"),
    "dynamic_sampling": ((False,), "filter_all_incorrect drops the prompts the reference never solves, before training"),
}  # fmt: skip

_SHARED = ("num_generations", "top_k")

# fmt: off
_RULES: tuple[Rule, ...] = tuple(r for r in ONLINE_RULES if r.name not in _SHARED) + (
    Rule("top_k", optional(lambda v: is_int(v) and v >= 0), "None or an integer >= 0", "set top_k to a positive integer, or to None (the default) or 0 for no top-k filter"),
    Rule("max_prompt_length", optional(positive_int), "None or a positive integer (a longer prompt keeps its last tokens)", "set max_prompt_length to a positive integer such as 512 (the default), or None to keep whole prompts"),
    Rule("num_value_samples", positive_int, "a positive integer (reference samples per prompt in the V* estimate)", "set num_value_samples to 8 (the default) or more"),
    Rule("beta1", lambda v: is_num(v) and v > 0, "a number > 0 (the KL temperature of the V* estimate)", "set beta1=0.5 (the default)"),
    Rule("beta2", lambda v: is_num(v) and v > 0, "a number > 0 (the KL temperature of the regression)", "set beta2=1e-3 (the default)"),
    Rule("filter_all_incorrect", lambda v: isinstance(v, bool), "True or False", "set filter_all_incorrect=True (the default) or False"),
)
# fmt: on


@dataclass
class A2POConfig(OnlineConfig):
    r"""Configuration of ``A2POTrainer`` (A*-PO: arXiv 2505.20686).

    The reference's public API (``trl.experimental.a2po.A2POConfig``). Every
    ``transformers.TrainingArguments`` field is accepted too.

    A*-PO's fields:
        max_prompt_length (`int | None`, defaults to `512`): Most prompt tokens; a longer prompt
            keeps its last tokens. `None` keeps whole prompts.
        max_completion_length (`int`, defaults to `256`): Most tokens a completion may have, in
            both stages.
        temperature (`float`, defaults to `1.0`): Sampling temperature of both stages. The
            loss reads the policy's and the reference's own log-probabilities (temperature 1),
            as the reference does.
        top_p (`float`, defaults to `1.0`): Nucleus sampling mass, in (0, 1].
        top_k (`int | None`, defaults to `None`): Keep the `top_k` most likely tokens; `None` or
            `0` keeps them all.
        num_value_samples (`int`, defaults to `8`): Completions sampled from the reference per
            prompt in stage 1, to estimate `V*(x)`.
        beta1 (`float`, defaults to `0.5`): KL temperature of the value estimate,
            `V*(x) = beta1 * log mean_j exp(r_j / beta1)`.
        filter_all_incorrect (`bool`, defaults to `True`): Drop the training prompts whose
            `num_value_samples` reference samples all have reward 0 (no learning signal).
        beta2 (`float`, defaults to `1e-3`): KL temperature of the regression loss
            `(beta2 * log(pi / pi_ref)(y|x) - (r - V*(x)))^2`.
        reward_weights (`list[float] | None`, defaults to `None`): One weight per reward
            function; the weighted sum must be 0 or 1 (A*-PO assumes a binary reward).
        learning_rate (`float`, defaults to `5e-5`): Initial learning rate (AdamW): the
            reference's, which keeps the `TrainingArguments` default (the paper trains at 1e-6).

    Shared with ``GRPOConfig`` (same meaning; documented there): `model_init_kwargs`,
    `trust_remote_code`, `router_aux_loss_coef`, `disable_dropout`, `ds3_gather_for_generation`,
    `shuffle_dataset`, `pad_to_multiple_of`, `generation_batch_size`, `steps_per_generation`,
    `min_p`, `generation_kwargs`, `chat_template_kwargs`, `repetition_penalty`,
    `cache_implementation`, `mask_truncated_completions`, `log_completions`,
    `num_completions_to_print`, `log_unique_prompts`, `use_transformers_continuous_batching`,
    `transformers_continuous_batching_config`, `reward_fault_policy`, `reward_timeout`, and vLLM
    (docs/vllm.md: the engine gets the reference's weights for stage 1). The other shared online
    fields keep their defaults (`OFF_FIELDS`: `num_generations` is 1, `beta` 0.0, ...).
    """

    max_prompt_length: int | None = field(
        default=512, metadata={"help": "Most prompt tokens; a longer prompt keeps its last tokens."}
    )
    max_completion_length: int | None = field(
        default=256, metadata={"help": "Most tokens a completion may have (both stages)."}
    )
    top_k: int | None = field(
        default=None, metadata={"help": "Keep the top_k most likely tokens; None or 0 keeps them all."}
    )
    num_value_samples: int = field(
        default=8, metadata={"help": "Reference samples per prompt in the V*(x) estimate (stage 1)."}
    )
    beta1: float = field(default=0.5, metadata={"help": "KL temperature of the V*(x) estimate."})
    filter_all_incorrect: bool = field(
        default=True, metadata={"help": "Drop training prompts whose reference samples all score 0."}
    )
    beta2: float = field(default=1e-3, metadata={"help": "KL temperature of the regression loss."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Initial learning rate (AdamW)."})
    num_generations: int | None = field(
        default=1, metadata={"help": "Completions per prompt in training: always 1 for A*-PO."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ONLINE_UNBUILT
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = OFF_FIELDS
    _method: ClassVar[str] = "A*-PO"
