"""Building the parts of the online sampling pipeline from a config: the reward runner, the
generation backend, the tool loop and the reward weights.

Every online trainer's config carries the same options for these (the reference's GRPO
names: ``reward_weights``, ``temperature``, ``top_p``, ``use_transformers_continuous_batching``,
``max_tool_calling_iterations``, ...); these functions read them in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.agents.loop import LoopSettings
from posttrain.agents.runner import AgentRunner
from posttrain.generation.base import Generator
from posttrain.generation.continuous_batching import ContinuousBatchingGenerator
from posttrain.generation.transformers_backend import TransformersGenerator, sampling_config
from posttrain.models import distributed
from posttrain.rewards.models import resolve_reward_funcs
from posttrain.rewards.runner import RewardRunner

RewardFunc = Callable[..., list[float | None]]


def build_rewards(
    reward_funcs: Any, processing_classes: Any, args: Any, optional: bool, trainer: str
) -> RewardRunner:
    """The reward runner: callables as given, reward models (a name or a PreTrainedModel) loaded.

    Args:
        reward_funcs: one reward function or model, or a list of them.
        processing_classes: the reward models' tokenizers (``reward_processing_classes``).
        args: the trainer's config (``reward_weights``, ``reward_fault_policy``, ``reward_timeout``,
            ``model_init_kwargs``, ``trust_remote_code``, ``chat_template_kwargs``).
        optional: environments may own the reward (``get_reward``), so none may be given.
        trainer: the trainer's name, for the message.
    """
    if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
        if not optional:
            raise ValueError(
                f"{trainer} needs a reward: pass reward_funcs (a callable or a list of callables, a reward "
                "model name or PreTrainedModel)."
            )
        funcs: list[RewardFunc] = []
    else:
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        funcs = resolve_reward_funcs(
            funcs,
            processing_classes,
            args.model_init_kwargs,
            args.trust_remote_code,
            args.chat_template_kwargs,
        )
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise ValueError(
            f"reward_weights has {len(args.reward_weights)} entries but there are {len(funcs)} reward "
            "functions; give one weight per function, in the same order, or leave reward_weights=None."
        )
    return RewardRunner(funcs, fault_policy=args.reward_fault_policy, timeout=args.reward_timeout)


def build_reward_weights(
    args: Any, num_funcs: int, names: list[str], trainer: str, judged: bool = False
) -> torch.Tensor:
    """[F] weights: ``reward_weights`` for the reward functions, 1 for each environment reward.

    ``judged``: a judge orders the completions (online DPO), so no reward is needed.
    """
    if not names and not judged:
        raise ValueError(
            f"{trainer} needs a reward: pass reward_funcs, or give the environment class a get_reward() "
            "method that scores the episode."
        )
    weights = list(args.reward_weights or [1.0] * num_funcs)
    weights += [1.0] * (len(names) - num_funcs)
    return torch.tensor(weights, dtype=torch.float32)


def build_agent(
    tools: Any,
    environment_factory: Any,
    tokenizer: Any,
    args: Any,
    max_model_length: int | None,
    eos: list[int],
    processor: Any = None,
) -> AgentRunner:
    """The tool loop (``agents/``): tool schemas, environments, the chat template it trains with;
    ``processor``: a vision-language model's (images in prompts and tool results)."""
    settings = LoopSettings(
        max_completion_length=args.max_completion_length,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        max_model_length=max_model_length,
        eos_token_ids=eos,
        pad_token_id=tokenizer.pad_token_id,
        chat_template_kwargs=dict(args.chat_template_kwargs or {}),
    )
    return AgentRunner(tools, environment_factory, tokenizer, settings, args.reward_fault_policy, processor)


def build_generator(
    args: Any,
    accelerator: Any,
    model: Callable[[], Any],
    tokenizer: Any,
    eos: list[int],
    suppress: list[int] | None = None,
    shared_engine: Any = None,
    processor: Any = None,
) -> Generator:
    """transformers ``generate`` (shared prompt prefill, the lean loop, prepacked weights), its
    continuous batching engine with ``use_transformers_continuous_batching``, or vLLM with
    ``use_vllm`` (``generation/vllm_backend.py``).

    Args:
        args: the sampling options of the config.
        accelerator: the trainer's; the model is unwrapped at each call (it changes under DDP).
        model: returns the trainer's model (wrapped or not; FSDP may replace it).
        tokenizer: for the pad token.
        eos: ids that end a completion.
        suppress: token ids never sampled (a VLM's image placeholders); ``generation_kwargs`` may override.
        shared_engine: with ``use_vllm``, the ``vllm_lora.SharedEngine`` of a sweep's runs.
        processor: a vision-language model's processor (vLLM runs it on the images itself).
    """
    generation_kwargs = dict(args.generation_kwargs or {})
    if suppress:
        generation_kwargs.setdefault("suppress_tokens", list(suppress))
    config = sampling_config(
        max_new_tokens=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0 if args.top_k is None else args.top_k,  # A*-PO's None: no top-k filter
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        cache_implementation=args.cache_implementation,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_ids=eos,
        generation_kwargs=generation_kwargs,
    )
    get_model = lambda: accelerator.unwrap_model(model())  # noqa: E731
    full_parameters = lambda m: distributed.generation_parameters(  # noqa: E731
        accelerator, m, args.ds3_gather_for_generation
    )
    if getattr(args, "use_vllm", False):
        from posttrain.generation.vllm_backend import build_vllm_generator

        vllm_args = (args, accelerator, get_model, tokenizer, eos, full_parameters, shared_engine, processor)
        return build_vllm_generator(*vllm_args, suppress=suppress or ())
    if args.use_transformers_continuous_batching:
        return ContinuousBatchingGenerator(
            get_model=get_model,
            config=config,
            cb_config=args.transformers_continuous_batching_config,
            full_parameters=full_parameters,
        )
    # accelerate wraps the forward in autocast for bf16/fp16; the fused decode step mirrors it
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    return TransformersGenerator(
        get_model=get_model, config=config, full_parameters=full_parameters, autocast_dtype=autocast
    )
