"""Configuration of the GRPO trainer: ``GRPOConfig``.

``GRPOConfig`` extends :class:`transformers.TrainingArguments` with the GRPO-specific parameters of
the public TRL API, with the same names, types and defaults, so that code written for
``trl.GRPOConfig`` only has to change its import.

Everything a config can get wrong is checked in ``__post_init__``, before any model or dataset is
touched: each error names the parameter, the value it got and how to fix it. Options that the API
accepts but posttrain does not build yet are listed in :data:`UNBUILT_OPTIONS` and raise
``NotImplementedError`` when set away from their default.
"""

import warnings
from dataclasses import dataclass, field
from typing import ClassVar

from posttrain.core.config import Rule, UnbuiltOption, choice_rules, is_num, optional
from posttrain.generation.reduced_kernels import SAMPLER_PRECISIONS
from posttrain.grpo import objectives
from posttrain.sampling.config import (
    JSON_DICT_FIELDS,
    ONLINE_CHOICES,
    ONLINE_RULES,
    ONLINE_UNBUILT,
    SAMPLING_EXTENSIONS,
    OnlineConfig,
)

__all__ = ["GRPOConfig", "POSTTRAIN_EXTENSIONS", "UNBUILT_OPTIONS", "UnbuiltOption"]

#: Fields posttrain adds to the reference's GRPOConfig (features the reference lacks).
POSTTRAIN_EXTENSIONS = (
    "dynamic_sampling",
    "dynamic_sampling_max_rounds",
    "dynamic_sampling_oversample",
    "dynamic_sampling_prefer",
    "reward_fault_policy",
    "reward_timeout",
    "sampler_precision",
    *SAMPLING_EXTENSIONS,
)


# --------------------------------------------------------------------------------------------
# Options accepted by the API but not built yet. Building a feature means deleting its row.
# --------------------------------------------------------------------------------------------


# One row per option; when a feature is built, delete its row (and its line in docs/config.md).
# fmt: off
UNBUILT_OPTIONS: dict[str, UnbuiltOption] = {
    **ONLINE_UNBUILT,
    "log_completions_hub_repo":             UnbuiltOption(None, "completion upload to the Hub", "Leave log_completions_hub_repo=None.", "user/completions"),
}
# fmt: on


# --------------------------------------------------------------------------------------------
# Validation tables
# --------------------------------------------------------------------------------------------

# The reference's loss types, plus "gmpo" (Geometric-Mean Policy Optimization), a posttrain
# extension: the keys of the one table of objectives (no second list here).
LOSS_TYPES = tuple(objectives.LOSS_TYPES)

#: Allowed values of the string-valued choice parameters.
CHOICES: dict[str, tuple[str, ...]] = {
    "loss_type": LOSS_TYPES,
    "scale_rewards": ("group", "batch", "none"),
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
    "sampler_precision": SAMPLER_PRECISIONS,
    **ONLINE_CHOICES,
}

# One row per parameter: name, is the value ok?, what it must be, how to fix it.
# fmt: off
_RULES: tuple[Rule, ...] = ONLINE_RULES + (
    Rule("delta", optional(lambda v: is_num(v) and v > 1), "None or a number > 1 (a cap on the ratio for negative advantages; INTELLECT-2 uses 4)", "set delta above 1 + epsilon, e.g. 4.0, or leave it None"),
    Rule("entropy_coef_delta", lambda v: is_num(v) and v >= 0, "a number >= 0", "set entropy_coef_delta to a non-negative step such as 0.005"),
    Rule("off_policy_mask_threshold", optional(lambda v: is_num(v) and v >= 0), "None or a number >= 0", "set off_policy_mask_threshold to a positive value such as 0.5, or leave it None"),
    Rule("vllm_importance_sampling_clip_min", optional(lambda v: is_num(v) and v >= 0), "None or a number >= 0", "set vllm_importance_sampling_clip_min to a non-negative value, or leave it None"),
    Rule("vllm_importance_sampling_clip_max", optional(lambda v: is_num(v) and v > 0), "None or a number > 0", "set vllm_importance_sampling_clip_max to a positive value such as 3.0, or None for no upper bound"),
    Rule("top_entropy_quantile", lambda v: is_num(v) and 0 <= v <= 1, "a number in [0, 1]", "set top_entropy_quantile to a value in [0, 1], or to 1.0 to keep every token"),
) + choice_rules({k: v for k, v in CHOICES.items() if k not in ONLINE_CHOICES})
# fmt: on


# --------------------------------------------------------------------------------------------
# The config
# --------------------------------------------------------------------------------------------


@dataclass
class GRPOConfig(OnlineConfig):
    r"""Configuration of :class:`~posttrain.GRPOTrainer`, a drop-in for ``trl.GRPOConfig``.

    It holds every :class:`transformers.TrainingArguments` parameter plus the GRPO-specific ones
    below; a few ``TrainingArguments`` defaults are changed to suit GRPO (first group below).

    Derived values, filled in after construction: ``num_generations_eval`` (from
    ``num_generations``), and ``steps_per_generation`` and ``generation_batch_size`` (one from the
    other; see ``generation_batch_size``). Invalid values raise ``ValueError``; options that
    posttrain accepts but does not build yet raise ``NotImplementedError`` (see
    :data:`UNBUILT_OPTIONS`). With :class:`~transformers.HfArgumentParser` every parameter is also
    a command-line flag; dict-valued ones accept a JSON object string.

    TrainingArguments defaults changed for GRPO:
        learning_rate (`float`, defaults to `1e-6` instead of `5e-5`): Initial learning rate.
        logging_steps (`float`, defaults to `10` instead of `500`): Log every this many steps.
        gradient_checkpointing (`bool`, defaults to `True` instead of off): Recompute activations
            in the backward pass to save memory. Passed on to `activation_checkpointing`, its
            transformers 5 name, unless that one is set.
        activation_checkpointing (`bool | None`, defaults to `None`) and
            activation_checkpointing_kwargs (`dict | str | None`, defaults to `None`): transformers
            5's names for the two above (`None` follows them). With transformers before 5.20,
            which lacks them, the config declares them itself and hands them to
            `gradient_checkpointing*`, so both spellings work on every supported release.
        bf16 (`bool | None`, defaults to `None` instead of `False`): bfloat16 mixed precision.
            `None` resolves to `True` unless `fp16=True`; on a machine that cannot run bfloat16
            (no bf16 GPU or XLA device) without `use_cpu=True` it resolves to `False` instead.
        remove_unused_columns (`bool | None`, defaults to `False` instead of `True`): Keep only the
            `"prompt"` column of the dataset. Leave `False` when a reward function reads other
            columns.

    Model and reference model:
        model_init_kwargs (`dict[str, Any] | str | None`, defaults to `None`): Keyword arguments
            for `from_pretrained` when the trainer's `model` is given as a string. Its `revision`
            is also used to load the processing class.
        trust_remote_code (`bool`, defaults to `False`): Allow models and tokenizers that ship
            custom Python code on the Hub, for the policy, the reward models and their tokenizers.
        router_aux_loss_coef (`float | None`, defaults to `None`): Weight of the load-balancing
            auxiliary loss of Mixture-of-Experts models; `None` uses the model config's value and
            `0.0` turns it off. Only valid for MoE models.
        disable_dropout (`bool`, defaults to `False`): Disable dropout in the model, so that the
            same input always yields the same log-probabilities.
        cast_lm_head_to_fp32 (`bool`, defaults to `False`): Run the language-model head of the
            policy and reference models in float32 (ScaleRL recipe); needs untied word embeddings.

    Data preprocessing (and `remove_unused_columns`, above):
        num_generations (`int | None`, defaults to `8`): Completions sampled per prompt (the group
            size G). At least 2, and it must divide `generation_batch_size`.
        num_generations_eval (`int | None`, defaults to `None`): Completions per prompt during
            evaluation; `None` uses `num_generations`.
        max_completion_length (`int | None`, defaults to `512`): Maximum number of tokens of a
            generated completion.
        ds3_gather_for_generation (`bool`, defaults to `True`): With DeepSpeed ZeRO-3, gather the
            policy weights for generation (faster); disable it to train models larger than one
            GPU's memory, at the cost of slower generation. Disabling it is incompatible with vLLM.
        shuffle_dataset (`bool | None`, defaults to `True`): Shuffle the training dataset.
        pad_to_multiple_of (`int | str | None`, defaults to `"auto"`): Pad prompt and completion
            ids to a multiple of this value; `"auto"` pads to multiples of 128 on AWS Neuron
            (which compiles once per shape) and does not pad elsewhere.

    Generation:
        generation_batch_size (`int | None`, defaults to `None`): Number of completions generated
            at once, for all processes together. `None` means `per_device_train_batch_size *
            num_processes * steps_per_generation`, i.e. one generation batch per optimizer step.
            Mutually exclusive with `steps_per_generation`.
        steps_per_generation (`int | None`, defaults to `None`): Optimizer micro-steps fed by one
            generation batch; `None` means `gradient_accumulation_steps`. Mutually exclusive with
            `generation_batch_size`.
        temperature (`float`, defaults to `1.0`): Sampling temperature; higher is more random.
        top_p (`float`, defaults to `1.0`): Nucleus sampling: keep the smallest set of tokens whose
            cumulative probability reaches `top_p`. In (0, 1]; `1.0` keeps all tokens.
        top_k (`int`, defaults to `0`): Keep only the `top_k` most likely tokens; `0` disables
            the filter.
        min_p (`float | None`, defaults to `None`): Minimum token probability, relative to the most
            likely token's probability. In [0, 1]; typical values are 0.01-0.2.
        generation_kwargs (`dict | str | None`, defaults to `None`): Extra keyword arguments for
            the generation config (transformers) or `SamplingParams` (vLLM), e.g.
            `suppress_tokens`. They override the sampling parameters above on conflict.
        chat_template_kwargs (`dict | str | None`, defaults to `None`): Extra keyword arguments for
            `apply_chat_template` when building prompts for generation.
        repetition_penalty (`float`, defaults to `1.0`): Penalty on tokens already present in the
            prompt or the text so far; above 1.0 favours new tokens, below 1.0 repetition.
        cache_implementation (`str | None`, defaults to `None`): KV-cache implementation used by
            transformers generation (when `use_vllm=False`).

    vLLM generation:
        use_vllm (`bool`, defaults to `False`): Generate completions with vLLM instead of
            `model.generate()`. Needs `vllm` installed (`pip install "posttrain[vllm]"`) and a
            CUDA GPU; the sampler's log-probs feed the importance-sampling correction below
            (docs/vllm.md).
        vllm_mode (`str`, defaults to `"colocate"`): `"server"` sends requests to a separate vLLM
            server (start it with `posttrain vllm-serve`); `"colocate"` runs vLLM inside the
            training processes, sharing their GPUs.
        vllm_model_impl (`str`, defaults to `"vllm"`): Model implementation used by vLLM:
            `"vllm"` or `"transformers"`.
        vllm_enable_sleep_mode (`bool`, defaults to `False`): Put vLLM to sleep during the
            optimizer step to release its weights and cache; saves GPU memory, costs wake-up time.
        vllm_structured_outputs_regex (`str | None`, defaults to `None`): Regex constraining vLLM
            outputs; `None` disables structured outputs.
        vllm_lora_sync (`bool | None`, defaults to `None`): posttrain's. With a LoRA (PEFT) policy, the
            engine (or the server, started with `--enable-lora`) serves the adapter and each weight
            push sends only the adapter (a few MB) instead of merging it into the base and pushing
            every weight (docs/vllm.md, "LoRA: adapter-only sync"). `None`: so in colocate mode
            wherever vLLM can serve the adapter alone, the merged push elsewhere; `False`: always
            merged.

    vLLM server (`vllm_mode="server"`):
        vllm_server_base_url (`str | None`, defaults to `None`): Base URL of the vLLM server, e.g.
            `"http://localhost:8000"`; when set, host and port are ignored.
        vllm_server_host (`str`, defaults to `"0.0.0.0"`): Host of the vLLM server.
        vllm_server_port (`int`, defaults to `8000`): Port of the vLLM server.
        vllm_server_timeout (`float`, defaults to `240.0`): Seconds to wait for the server to come
            up before raising `ConnectionError`.
        vllm_group_port (`int`, defaults to `51216`): Port of the weight-update process group
            shared with the server.

    vLLM colocated (`vllm_mode="colocate"`):
        vllm_gpu_memory_utilization (`float`, defaults to `0.3`): Fraction of GPU memory vLLM may
            use. For a server, pass it to the server instead.
        vllm_max_model_length (`int | None`, defaults to `None`): Context window of vLLM; at least
            the longest prompt plus `max_completion_length`. `None` reads it from the model config.
        vllm_tensor_parallel_size (`int`, defaults to `1`): Tensor-parallel size of the colocated
            vLLM engine. For a server, pass it to the server instead.
        vllm_engine_kwargs (`dict | str | None`, defaults to `None`): posttrain extension. Extra
            keyword arguments for the colocated `vllm.LLM` (a dict, or a JSON object string from the
            command line), e.g. `{"enforce_eager": True}`; they win over posttrain's own, `dtype`
            included, which is otherwise the trainer's compute dtype (`bfloat16` with `bf16=True`,
            `float16` with `fp16=True`, else the policy's parameters' dtype).

    Training:
        beta (`float`, defaults to `0.0`): KL coefficient. `0.0` skips the reference model
            entirely (less memory, faster); DeepSeek-R1 uses `0.001`.
        num_iterations (`int`, defaults to `1`): Optimisation passes over each generation batch
            (μ in the GRPO algorithm).
        epsilon (`float`, defaults to `0.2`): Clipping range of the importance ratio.
        delta (`float | None`, defaults to `None`): Upper clip of the two-sided GRPO loss
            (INTELLECT-2); should exceed `1 + epsilon`. `None` uses standard clipping.
        epsilon_high (`float | None`, defaults to `None`): Upper clipping range; `None` reuses
            `epsilon`. DAPO recommends `0.28`; with `loss_type="cispo"` it is ε_max of ScaleRL
            and defaults to `5.0`.
        sapo_temperature_neg (`float`, defaults to `1.05`): SAPO temperature for tokens with
            non-positive advantage.
        sapo_temperature_pos (`float`, defaults to `1.0`): SAPO temperature for tokens with
            positive advantage.
        vespo_k_pos (`float`, defaults to `2.0`): VESPO power exponent for positive advantages;
            how strongly samples with importance ratio < 1 are down-weighted.
        vespo_lambda_pos (`float`, defaults to `3.0`): VESPO decay factor for positive
            advantages; how strongly samples with importance ratio > 1 are down-weighted.
        vespo_k_neg (`float`, defaults to `3.0`): VESPO power exponent for negative advantages.
        vespo_lambda_neg (`float`, defaults to `2.0`): VESPO exponential decay factor for
            negative advantages.
        importance_sampling_level (`str`, defaults to `"token"`): `"token"` keeps one importance
            ratio per token; `"sequence"` averages the log-ratios over a sequence's tokens into one
            ratio per sequence (GSPO).
        reward_weights (`list[float] | None`, defaults to `None`): One weight per reward function;
            `None` weights all of them 1.0.
        multi_objective_aggregation (`str`, defaults to `"sum_then_normalize"`): How several
            rewards combine. `"sum_then_normalize"` sums the weighted rewards, then scales as
            `scale_rewards` says; `"normalize_then_sum"` normalises each reward within its group
            first, sums with the weights and normalises the sum over the batch (GDPO).
        scale_rewards (`str`, defaults to `"group"`): Reward scaling. `"group"` (or `True`)
            divides by the group's standard deviation; `"batch"` by the batch's (PPO Lite);
            `"none"` (or `False`) does not scale (Dr. GRPO).
        loss_type (`str`, defaults to `"dapo"`): Loss formulation. `"grpo"` normalises each
            sequence by its length (length-biased); `"dr_grpo"` by a global constant
            (`max_completion_length`); `"dapo"` by the active tokens of the global accumulated
            batch; `"bnpo"` by the active tokens of the local batch; `"cispo"` clips the importance
            weights themselves (MiniMax-M1); `"sapo"` replaces hard clipping with a soft,
            temperature-controlled gate; `"luspo"` is a length-unbiased sequence-level loss that
            needs `importance_sampling_level="sequence"`; `"vespo"` weights sequence-level
            importance ratios with a smooth asymmetric Gamma function; `"gmpo"` (a posttrain
            extension) maximises the geometric mean of token ratios clipped in log space.
        mask_truncated_completions (`bool`, defaults to `False`): Leave truncated completions out
            of the loss (recommended by DAPO).
        sync_ref_model (`bool`, defaults to `False`): Mix the policy into the reference model
            every `ref_model_sync_steps` steps with weight `ref_model_mixup_alpha` (TR-DPO).
        ref_model_mixup_alpha (`float`, defaults to `0.6`): α of TR-DPO:
            `ref = α * policy + (1 - α) * ref_prev`. Needs `sync_ref_model=True`.
        ref_model_sync_steps (`int`, defaults to `512`): τ of TR-DPO, steps between reference
            syncs. Needs `sync_ref_model=True`.
        top_entropy_quantile (`float`, defaults to `1.0`): ρ of "Beyond the 80/20 rule": keep only
            the top-ρ quantile of tokens by entropy in the policy loss. In [0, 1]; `1.0` keeps
            all tokens, `0.0` only the highest-entropy one; the paper uses `0.2`.
        entropy_coef (`float`, defaults to `0.0`): Coefficient of an entropy bonus (mean per-token
            entropy, same meaning for every loss type); the starting value under adaptive control.
        use_adaptive_entropy (`bool`, defaults to `False`): Adaptive entropy control
            (Skywork-OR1): each optimizer step moves `entropy_coef` by `entropy_coef_delta`, up
            below `entropy_target` and down otherwise; the bonus applies only at or below target.
        entropy_coef_min (`float`, defaults to `0.0`): Lower bound of the adaptive coefficient.
        entropy_coef_max (`float`, defaults to `1.0`): Upper bound of the adaptive coefficient.
        entropy_coef_delta (`float`, defaults to `0.005`): Step of the adaptive coefficient.
        entropy_target (`float`, defaults to `0.2`): Target mean per-token entropy (nats) of
            adaptive control, measured on the tokens the policy loss uses.
        max_tool_calling_iterations (`int | None`, defaults to `None`): Maximum tool-calling turns
            of an agent; `None` is unlimited.
        vllm_importance_sampling_correction (`bool`, defaults to `True`): Correct the mismatch
            between vLLM's sampling log-probs and the recomputed training log-probs with importance
            sampling.
        vllm_importance_sampling_mode (`str`, defaults to `"sequence_mask"`): How that correction
            works: `"token_truncate"`, `"token_mask"`, `"sequence_truncate"` or `"sequence_mask"`
            (truncate clips ratios to [C_min, C_max], mask zeroes those outside).
        vllm_importance_sampling_clip_max (`float | None`, defaults to `3.0`): C_max of that
            correction; `None` means no upper bound.
        vllm_importance_sampling_clip_min (`float | None`, defaults to `None`): C_min of that
            correction; `None` means no lower bound.
        off_policy_mask_threshold (`float | None`, defaults to `None`): Mask sequences with
            negative advantage whose KL divergence exceeds this threshold (δ of DeepSeek-V3.2,
            e.g. 0.5); `None` disables masking.
        use_bias_correction_kl (`bool`, defaults to `True`): Multiply the KL term by the
            importance ratio so its gradient is the unbiased reverse-KL gradient (DeepSeek-V3.2).

    Logging:
        log_completions (`bool`, defaults to `False`): Log a sample of (prompt, completion) pairs
            every `logging_steps` steps.
        log_multimodal (`bool`, defaults to `True`): Log images and other media with completions.
        num_completions_to_print (`int | None`, defaults to `None`): Completions printed with
            `rich`; `None` prints all.
        log_unique_prompts (`bool`, defaults to `False`): Log each distinct prompt only once.
        log_completions_hub_repo (`str | None`, defaults to `None`): Hub repository
            (`"user/name"`, `"org/name"` or `"name"`) to save completions to; public unless
            `hub_private_repo=True` or the organisation defaults to private.

    Transformers continuous batching:
        use_transformers_continuous_batching (`bool`, defaults to `False`): Generate with the
            continuous-batching engine of transformers (>= 5.8).
        transformers_continuous_batching_config (`dict | str | None`, defaults to `None`): Keyword
            arguments for `ContinuousBatchingConfig`.

    Deprecated:
        use_transformers_paged (`bool`, defaults to `False`): Deprecated alias of
            `use_transformers_continuous_batching`; removed in TRL v2.0.0.
        vllm_importance_sampling_cap (`float | None`, defaults to `None`): Deprecated alias of
            `vllm_importance_sampling_clip_max`; removed in TRL v2.0.0.

    posttrain extensions (not in the reference; see :data:`POSTTRAIN_EXTENSIONS`):
        dynamic_sampling (`bool`, defaults to `False`): DAPO's dynamic sampling: replace the
            groups whose rewards all agree by groups with spread from further prompts, so every
            slot of the batch carries a learning signal. Needs the per-process generation batch
            (`per_device_train_batch_size * steps_per_generation`) to be a multiple of
            `num_generations`.
        dynamic_sampling_max_rounds (`int`, defaults to `3`): At most this many extra generation
            rounds per generation batch; slots still empty afterwards keep their groups.
        dynamic_sampling_oversample (`int`, defaults to `1`): Each round samples this many times
            the prompts the batch needs, in one generation call (DAPO's over-sampling), and the
            groups with spread fill the batch. Decoding a few prompts more costs little where it is
            memory-bound (4 prompts' groups took 1.7x to 1.9x one's on a 2-core CPU).
        dynamic_sampling_prefer (`str`, defaults to `"first"`): Which groups with spread fill the
            batch: `"first"` (in sampling order) or `"hardest"` (lowest mean reward first: the
            prompts the policy most often fails, whose right samples move its likeliest answer).
        reward_fault_policy (`str`, defaults to `"raise"`): What a reward function that raises,
            returns NaN or inf, or times out does: `"raise"` stops training with an error naming
            the function and the sample; `"skip"` leaves those rewards out (like `None`) and
            counts them in the `rewards/{name}/faults` metric.
        reward_timeout (`float | None`, defaults to `None`): Seconds an `async def` reward
            function may take per call; a slower call is a fault. Sync functions are not timed.
        sampler_precision (`str`, defaults to `"float32"`): Precision of the weights the CPU
            decode steps sample with: `"float32"` (the policy itself), `"fp16"` (float16 weights,
            float32 activations and accumulation), `"bf16"`, `"int8"` (int8 weights and
            dynamically quantised activations) or `"auto"` (`"bf16"` on CPUs with bf16
            instructions, else `"fp16"`). The reduced copy is rebuilt after each optimizer step,
            and the sampler's own log-probs feed the `vllm_importance_sampling_*` correction.
            Needs a float32 policy on the CPU of a family the fused decode step covers (Llama,
            Qwen2, Qwen3, Mistral) and the trainer's own sampling (no tools, environments or
            `rollout_func`). Off by default: see docs/performance.md, "Reduced-precision sampler".
    """

    # ---- GRPO's own fields (the shared online ones are in sampling.config.OnlineConfig) ----
    cast_lm_head_to_fp32: bool = field(
        default=False,
        metadata={
            "help": "Run the LM head of the policy and reference models in float32 (ScaleRL); needs "
            "untied word embeddings."
        },
    )

    # ---- Training --------------------------------------------------------------------------
    delta: float | None = field(
        default=None,
        metadata={
            "help": "Upper clip of the two-sided GRPO loss (INTELLECT-2), above 1 + epsilon; None uses "
            "standard clipping."
        },
    )
    sapo_temperature_neg: float = field(
        default=1.05,
        metadata={"help": "SAPO temperature for tokens with non-positive advantage."},
    )
    sapo_temperature_pos: float = field(
        default=1.0, metadata={"help": "SAPO temperature for tokens with positive advantage."}
    )
    vespo_k_pos: float = field(
        default=2.0,
        metadata={
            "help": "VESPO power exponent for positive advantages (down-weights importance ratios < 1)."
        },
    )
    vespo_lambda_pos: float = field(
        default=3.0,
        metadata={"help": "VESPO decay factor for positive advantages (down-weights importance ratios > 1)."},
    )
    vespo_k_neg: float = field(
        default=3.0,
        metadata={
            "help": "VESPO power exponent for negative advantages (down-weights importance ratios < 1)."
        },
    )
    vespo_lambda_neg: float = field(
        default=2.0,
        metadata={
            "help": "VESPO exponential decay factor for negative advantages (down-weights importance "
            "ratios > 1)."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one importance ratio per token; 'sequence': one ratio per sequence from "
            "the mean log-ratio (GSPO)."
        },
    )
    multi_objective_aggregation: str = field(
        default="sum_then_normalize",
        metadata={
            "help": "'sum_then_normalize': sum weighted rewards, then scale; 'normalize_then_sum': "
            "normalise each reward per group, sum, then normalise over the batch (GDPO)."
        },
    )
    scale_rewards: str = field(
        default="group",
        metadata={
            "help": "Reward scaling: 'group' (or true) by the group std, 'batch' by the batch std, "
            "'none' (or false) not at all."
        },
    )
    loss_type: str = field(
        default="dapo",
        metadata={
            "help": "Loss formulation: one of "
            + ", ".join(
                f"{name!r}"
                + (f" (importance_sampling_level={spec.levels[0]!r} only)" if len(spec.levels) == 1 else "")
                for name, spec in objectives.LOSS_TYPES.items()
            )
            + " (gmpo is posttrain's geometric-mean policy optimisation)."
        },
    )
    top_entropy_quantile: float = field(
        default=1.0,
        metadata={
            "help": "Keep only the top rho quantile of tokens by entropy in the policy loss, in [0, 1]; "
            "1.0 keeps all tokens."
        },
    )
    entropy_coef: float = field(
        default=0.0,
        metadata={
            "help": "Coefficient of the mean per-token entropy bonus; the starting value under "
            "adaptive entropy control. 0.0 disables it."
        },
    )
    use_adaptive_entropy: bool = field(
        default=False,
        metadata={"help": "Adapt entropy_coef every optimizer step towards entropy_target (Skywork-OR1)."},
    )
    entropy_coef_min: float = field(
        default=0.0, metadata={"help": "Lower bound of the adaptive entropy coefficient."}
    )
    entropy_coef_max: float = field(
        default=1.0, metadata={"help": "Upper bound of the adaptive entropy coefficient."}
    )
    entropy_coef_delta: float = field(
        default=0.005,
        metadata={"help": "Change of the adaptive entropy coefficient per optimizer step."},
    )
    entropy_target: float = field(
        default=0.2,
        metadata={
            "help": "Target mean per-token entropy (nats) of adaptive entropy control; set it near the "
            "entropy logged early in training."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct the gap between vLLM sampling log-probs and training log-probs with "
            "importance sampling."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="sequence_mask",
        metadata={
            "help": "Importance-sampling correction: 'token_truncate', 'token_mask', "
            "'sequence_truncate' or 'sequence_mask'."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=3.0,
        metadata={"help": "Upper bound C_max of the importance-sampling correction; None: unbounded."},
    )
    vllm_importance_sampling_clip_min: float | None = field(
        default=None,
        metadata={"help": "Lower bound C_min of the importance-sampling correction; None: unbounded."},
    )
    off_policy_mask_threshold: float | None = field(
        default=None,
        metadata={
            "help": "Mask negative-advantage sequences whose KL divergence exceeds this threshold "
            "(DeepSeek-V3.2, e.g. 0.5); None disables it."
        },
    )
    use_bias_correction_kl: bool = field(
        default=True,
        metadata={
            "help": "Multiply the KL term by the importance ratio for an unbiased reverse-KL gradient "
            "(DeepSeek-V3.2)."
        },
    )

    # ---- Logging ---------------------------------------------------------------------------
    log_completions_hub_repo: str | None = field(
        default=None,
        metadata={
            "help": "Hub repository ('user/name', 'org/name' or 'name') to save completions to; public "
            "unless hub_private_repo=True."
        },
    )

    # ---- Deprecated ------------------------------------------------------------------------
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "Deprecated: use vllm_importance_sampling_clip_max instead."},
    )

    # ---- posttrain extensions ---------------------------------------------------------------
    sampler_precision: str = field(
        default="float32",
        metadata={
            "help": "Precision of the weights the CPU decode steps sample with: 'float32' (the "
            "policy), 'fp16', 'bf16', 'int8' or 'auto'; the sampler's log-probs feed the "
            "vllm_importance_sampling_* correction."
        },
    )

    _rules: ClassVar[tuple[Rule, ...]] = _RULES
    _unbuilt: ClassVar[dict[str, UnbuiltOption]] = UNBUILT_OPTIONS
    _json_dict_fields: ClassVar[tuple[str, ...]] = JSON_DICT_FIELDS

    # ---- hooks of BaseConfig.__post_init__ ----------------------------------------------------

    def _normalise_family(self) -> None:
        """The shared normalisation, ``scale_rewards`` aliases, the deprecated IS cap."""
        super()._normalise_family()

        scale = self.scale_rewards
        if isinstance(scale, bool):
            self.scale_rewards = "group" if scale else "none"
        elif isinstance(scale, str) and scale.lower() in ("true", "false"):
            self.scale_rewards = "group" if scale.lower() == "true" else "none"

        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                "`vllm_importance_sampling_cap` is deprecated and will be removed; use "
                f"`vllm_importance_sampling_clip_max={self.vllm_importance_sampling_cap}` instead.",
                FutureWarning,
                stacklevel=4,
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap

    def _check_combinations(self) -> None:
        """The combinations that cannot work (each parameter passed its rule already)."""
        super()._check_combinations()
        if self.use_vllm and self.vllm_importance_sampling_correction and self.repetition_penalty != 1.0:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty} with use_vllm=True: vLLM applies the penalty to the "
                "log-probs it returns, so the importance-sampling correction would compare them with the "
                "policy's unpenalised ones; set repetition_penalty=1.0, or vllm_importance_sampling_correction=False."
            )
        if (
            objectives.LOSS_TYPES[self.loss_type].levels == ("sequence",)
            and self.importance_sampling_level != "sequence"
        ):
            raise ValueError(
                f"loss_type={self.loss_type!r} is a sequence-level loss but importance_sampling_level="
                f"{self.importance_sampling_level!r}; set importance_sampling_level='sequence'."
            )
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(
                f"entropy_coef_min={self.entropy_coef_min} is above entropy_coef_max={self.entropy_coef_max}; "
                "set entropy_coef_min <= entropy_coef_max."
            )
        self._check_sampler_precision()
        cmin, cmax = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if cmin is not None and cmax is not None and cmin > cmax:
            raise ValueError(
                f"vllm_importance_sampling_clip_min={cmin} is above vllm_importance_sampling_clip_max={cmax}; "
                "the weights' range [C_min, C_max] must not be empty."
            )
        levels = objectives.LOSS_TYPES[self.loss_type].levels
        if levels == ("token",) and self.importance_sampling_level != "token":
            raise ValueError(
                f"loss_type={self.loss_type!r} builds its own sequence-level weight from token ratios, so "
                f"importance_sampling_level={self.importance_sampling_level!r} does not apply; set "
                "importance_sampling_level='token'."
            )
        if (
            self.importance_sampling_level == "sequence"
            and objectives.LOSS_TYPES[self.loss_type].reduction in objectives.TOKEN_SUMMED_REDUCTIONS
        ):
            warnings.warn(
                f"importance_sampling_level='sequence' (GSPO) with loss_type={self.loss_type!r}: every token of a "
                "completion carries the same sequence ratio, but this loss sums over tokens, so a completion "
                "weighs in proportion to its length, which GSPO's per-sequence objective does not. GSPO uses "
                "loss_type='grpo' (a mean per sequence); keep this pairing only if you mean it.",
                UserWarning,
                stacklevel=4,
            )

    def _check_sampler_precision(self) -> None:
        """A reduced-precision sampler needs the trainer's own generation; without the correction, warn."""
        if self.sampler_precision == "float32":
            return
        if self.use_transformers_continuous_batching:
            raise ValueError(
                f"sampler_precision={self.sampler_precision!r} runs the lean decode loop, which "
                "use_transformers_continuous_batching=True replaces; set one of them back "
                "(sampler_precision='float32' or use_transformers_continuous_batching=False)."
            )
        if self.use_vllm:
            raise ValueError(
                f"sampler_precision={self.sampler_precision!r} runs the lean decode loop, which use_vllm=True "
                "replaces (vLLM samples in its own precision, and its log-probs feed the same correction); "
                "set sampler_precision='float32' or use_vllm=False."
            )
        if not self.vllm_importance_sampling_correction:
            warnings.warn(
                f"sampler_precision={self.sampler_precision!r} with vllm_importance_sampling_correction=False: "
                "the completions come from a reduced-precision copy of the policy, but the loss treats "
                "them as the policy's own; set vllm_importance_sampling_correction=True to correct the "
                "mismatch (the sampling/sampling_logp_difference/* metrics measure it).",
                UserWarning,
                stacklevel=4,
            )
