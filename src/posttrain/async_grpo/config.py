"""Configuration of the asynchronous GRPO trainer: ``AsyncGRPOConfig``.

The reference's fields with its names and defaults (``max_staleness=4``, ``dtype``,
``max_completion_length=2048``, ``epsilon``, the vLLM worker's options, ``learning_rate=1e-6``,
a constant schedule, ``logging_steps=1``), the spec's score-centering options
(``score_centering``, ``num_sampler_logprobs``, ``vllm_importance_sampling_clip_min`` /
``..._clip_max``), on top of the online fields every posttrain online trainer shares
(``sampling.config.OnlineConfig``).

posttrain samples in a background thread of the training process, from its own copy of the
weights (``async_grpo/sampler.py``), with transformers or, with ``use_vllm=True`` and
``vllm_mode="server"``, through a vLLM server that receives that copy's weights; the reference's
other vLLM-worker options are accepted at their defaults and raise ``NotImplementedError`` when
changed (``ASYNC_UNBUILT``). The shared
online fields the reference's asynchronous trainer does not have keep their defaults
(``OFF_FIELDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_int, is_num, positive_int
from posttrain.sampling.config import ONLINE_RULES, ONLINE_UNBUILT, OnlineConfig

__all__ = ["ASYNC_UNBUILT", "OFF_FIELDS", "AsyncGRPOConfig"]

_SERVER = "Leave it at its default: the background sampler sends one request per generation batch."

#: The reference's vLLM-worker options beyond the server's address and request timeout: accepted at
#: their defaults, not built otherwise.
# fmt: off
ASYNC_UNBUILT: dict[str, UnbuiltOption] = {
    **ONLINE_UNBUILT,
    "fork_threshold_tokens": UnbuiltOption(1024, "forked tool-calling requests to a vLLM server", _SERVER, 512),
    "token_budget": UnbuiltOption(None, "token-budget batching of a vLLM server's completions", _SERVER, 4096),
    "max_inflight_tasks": UnbuiltOption(-1, "a bound on a vLLM server's requests in flight", _SERVER, 8),
    "queue_maxsize": UnbuiltOption(1024, "the vLLM worker's completion queue (the background sampler holds at most max_staleness batches ahead)", _SERVER, 64),
    "heartbeat_stale_after_s": UnbuiltOption(300, "the vLLM worker's heartbeat", _SERVER, 60),
    "weight_sync_steps": UnbuiltOption(1, "weight pushes every few steps (the background sampler takes every optimizer step's weights)", "Leave weight_sync_steps=1.", 2),
}
# fmt: on

#: Shared online fields the asynchronous trainer does not use: the values they may hold and why.
OFF_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "beta": ((0.0,), "the asynchronous objective has no KL term (as in the reference)"),
    "num_iterations": ((1,), "each generation batch is trained on once; max_staleness bounds how old it may be"),
    "sync_ref_model": ((False,), "there is no reference model"),
    "dynamic_sampling": ((False,), "the background sampler keeps every group it samples"),
    "use_transformers_continuous_batching": ((False,), "the background sampler generates with transformers generate"),
}  # fmt: skip

DTYPES = ("auto", "bfloat16", "float16", "float32")

# fmt: off
_RULES: tuple[Rule, ...] = ONLINE_RULES + (
    Rule("max_staleness", lambda v: is_int(v) and v >= 0, "an integer >= 0 (how many optimizer steps older than the trained weights a batch's sampling weights may be; 0 is synchronous)", "set max_staleness=4 (the default), 1 for one-step-off-policy, or 0 for synchronous sampling"),
    Rule("num_sampler_logprobs", positive_int, "a positive integer (the sampler's top tokens per position that score centering takes its expectation over)", "set num_sampler_logprobs=8 (the default)"),
    Rule("vllm_importance_sampling_clip_min", lambda v: is_num(v) and v >= 0, "a number >= 0 (C_min: tokens whose ratio to the sampler is below it leave the loss)", "set vllm_importance_sampling_clip_min=0.5 (the default)"),
    Rule("vllm_importance_sampling_clip_max", lambda v: is_num(v) and v > 0, "a number > 0 (C_max: tokens whose ratio to the sampler is above it leave the loss)", "set vllm_importance_sampling_clip_max=5.0 (the default)"),
    Rule("request_timeout", lambda v: is_num(v) and v > 0, "a number of seconds > 0", "set request_timeout=600 (the default)"),
    Rule("weight_sync_timeout", lambda v: is_num(v) and v > 0, "a number of seconds > 0 (how long the trainer and the sampler wait for each other)", "set weight_sync_timeout=1800 (the default)"),
) + choice_rules({"dtype": DTYPES})
# fmt: on


@dataclass
class AsyncGRPOConfig(OnlineConfig):
    r"""Configuration of ``AsyncGRPOTrainer``: GRPO with generation running alongside training.

    The reference's public API (``trl.experimental.async_grpo.AsyncGRPOConfig``), with the
    score-centering options of the paper index ("Score Centering Stabilizes Off-policy RL").
    Every ``transformers.TrainingArguments`` field is accepted too.

    Asynchronous GRPO's fields:
        max_staleness (`int`, defaults to `4`): The batch trained on at optimizer step `k` was
            sampled with the weights of step `max(0, k - max_staleness)`, exactly: generation
            runs up to `max_staleness` steps ahead of training. `0` samples each batch with the
            current weights (no overlap).
        score_centering (`bool`, defaults to `True`): Train with the score-centred objective
            (the sampler's expected score subtracted at each position); `False` trains with the
            clipped objective against the sampler's log-probabilities.
        num_sampler_logprobs (`int`, defaults to `8`): The sampler's top tokens per position whose
            log-probabilities are recorded; score centering takes its expectation over them (the
            rest of the vocabulary is modelled as the trained policy rescaled to the remaining
            mass).
        vllm_importance_sampling_clip_min (`float`, defaults to `0.5`): C_min; a token whose
            ratio `pi / mu` to the sampler is below it leaves the loss (masked importance
            sampling).
        vllm_importance_sampling_clip_max (`float`, defaults to `5.0`): C_max; above it, the same.
        dtype (`str`, defaults to `"float32"`): The dtype a model given by name is loaded in:
            `"auto"`, `"bfloat16"`, `"float16"` or `"float32"` (a `model_init_kwargs` dtype wins).
        max_completion_length (`int`, defaults to `2048`): Most tokens a completion may have.
        epsilon (`float`, defaults to `0.2`), epsilon_high (`float | None`, defaults to `None`):
            The clipping range of the clipped objective (`score_centering=False`).
        weight_sync_timeout (`float`, defaults to `1800`): Seconds the trainer and the sampler
            wait for each other (new weights, the next batch) before failing with an error.
        `learning_rate` (defaults to `1e-6`), `lr_scheduler_type` (defaults to `"constant"`),
            `logging_steps` (defaults to `1`), `ignore_data_skip` (defaults to `True`): the
            reference's training defaults. The background sampler resumes at the
            exact batch either way.
        use_vllm (`bool`, defaults to `False`): With `vllm_mode="server"`, the background sampler
            generates with the vLLM server at `vllm_server_base_url` (started with
            `posttrain vllm-serve`), pushing its own copy's weights (those of step
            `k - max_staleness`, exactly) before the batch of step `k`; one training process,
            no evaluation set (docs/vllm.md). `False`: it generates with transformers.
        vllm_server_base_url (`str`, defaults to `"http://localhost:8000"`): The server's address
            (only with `use_vllm=True`).
        request_timeout (`float`, defaults to `600`): Seconds one generation request to the server
            may take (only with `use_vllm=True`).
        `fork_threshold_tokens`, `token_budget`, `max_inflight_tasks`, `queue_maxsize`,
            `heartbeat_stale_after_s`, `weight_sync_steps`: the reference's other vLLM-worker
            options, at their defaults (1024, `None`, -1, 1024, 300, 1); another value raises
            `NotImplementedError`.

    Shared with ``GRPOConfig`` (same meaning; documented there): `model_init_kwargs`,
    `trust_remote_code`, `router_aux_loss_coef`, `disable_dropout`, `num_generations` (8),
    `num_generations_eval`, `shuffle_dataset`, `pad_to_multiple_of`, `generation_batch_size`,
    `steps_per_generation`, `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`,
    `generation_kwargs`, `chat_template_kwargs`, `cache_implementation`, `reward_weights`,
    `mask_truncated_completions`, `max_tool_calling_iterations`, `log_completions`,
    `num_completions_to_print`, `log_unique_prompts`, `reward_fault_policy`, `reward_timeout`,
    `vllm_server_timeout`. The other shared online fields keep their defaults (`OFF_FIELDS`).
    """

    dtype: str = field(default="float32", metadata={"help": "dtype of a model loaded by name."})
    max_completion_length: int | None = field(
        default=2048, metadata={"help": "Maximum number of tokens in a generated completion."}
    )
    max_staleness: int = field(
        default=4,
        metadata={"help": "Optimizer steps the sampling weights may lag the trained ones (0: synchronous)."},
    )
    score_centering: bool = field(
        default=True, metadata={"help": "Score-centred objective; False: the clipped objective."}
    )
    num_sampler_logprobs: int = field(
        default=8, metadata={"help": "Sampler top tokens per position recorded for score centering."}
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5, metadata={"help": "C_min: tokens with pi / mu below it leave the loss."}
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata={"help": "C_max: tokens with pi / mu above it leave the loss."}
    )
    weight_sync_timeout: float = field(
        default=1800, metadata={"help": "Seconds the trainer and the sampler wait for each other."}
    )
    vllm_server_base_url: str | None = field(
        default="http://localhost:8000", metadata={"help": "vLLM server URL (with use_vllm=True)."}
    )
    request_timeout: float = field(
        default=600, metadata={"help": "Seconds one vLLM generation request may take (with use_vllm=True)."}
    )
    fork_threshold_tokens: int = field(default=1024, metadata={"help": "vLLM tool forking (not built)."})
    token_budget: int | None = field(default=None, metadata={"help": "vLLM token budget (not built)."})
    max_inflight_tasks: int = field(default=-1, metadata={"help": "vLLM requests in flight (not built)."})
    queue_maxsize: int = field(default=1024, metadata={"help": "vLLM worker queue size (not built)."})
    heartbeat_stale_after_s: float = field(
        default=300, metadata={"help": "vLLM worker heartbeat (not built)."}
    )
    weight_sync_steps: int = field(
        default=1, metadata={"help": "Steps between weight pushes (only 1 is built)."}
    )
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    logging_steps: float = field(default=1, metadata={"help": "Log every this many steps."})
    ignore_data_skip: bool = field(
        default=True, metadata={"help": "Do not fast-forward the dataloader on resume."}
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = ASYNC_UNBUILT
    _off_fields: ClassVar[dict[str, tuple[tuple[Any, ...], str]]] = OFF_FIELDS
    _method: ClassVar[str] = "asynchronous GRPO"

    def _normalise_family(self) -> None:
        """The shared normalisation; ``dtype`` reaches the model loader (a ``model_init_kwargs`` dtype wins)."""
        super()._normalise_family()
        if isinstance(self.model_init_kwargs, dict | type(None)):
            kwargs = dict(self.model_init_kwargs or {})
            kwargs.setdefault("dtype", self.dtype)
            self.model_init_kwargs = kwargs

    def _derive_generation_batch(self) -> None:
        """The shared arithmetic; one generation batch feeds exactly one optimizer step."""
        super()._derive_generation_batch()
        if self.steps_per_generation != self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation={self.steps_per_generation} differs from gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}: the background sampler makes one generation batch per "
                "optimizer step (max_staleness sets how far ahead it runs); leave steps_per_generation and "
                "generation_batch_size unset."
            )

    def _check_combinations(self) -> None:
        """The shared combinations, then the importance-sampling bounds and the sampling filters."""
        super()._check_combinations()
        if self.vllm_importance_sampling_clip_min >= self.vllm_importance_sampling_clip_max:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={self.vllm_importance_sampling_clip_min} must be below "
                f"vllm_importance_sampling_clip_max={self.vllm_importance_sampling_clip_max}; the defaults are 0.5 "
                "and 5.0."
            )
        if self.use_vllm and self.vllm_mode != "server":
            raise ValueError(
                "AsyncGRPOConfig(use_vllm=True) samples from a vLLM server beside the trainer; set "
                "vllm_mode='server' (and start it with `posttrain vllm-serve`), or use_vllm=False for the "
                "transformers sampler thread."
            )
        unused = [
            f"{name}={getattr(self, name)!r}"
            for name, default in (("vllm_server_base_url", "http://localhost:8000"), ("request_timeout", 600))
            if getattr(self, name) != default
        ]
        if unused and not self.use_vllm:
            raise ValueError(
                f"{', '.join(unused)} only apply to sampling from a vLLM server; set use_vllm=True and "
                "vllm_mode='server' to use it, or leave them at their defaults."
            )
