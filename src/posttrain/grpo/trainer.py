"""GRPOTrainer: Group Relative Policy Optimization on top of ``transformers.Trainer``.

One training step, top to bottom (``_prepare_inputs`` then ``compute_loss``)::

    rollout = generator.generate(prompts)                 # Rollout: ids and masks
    rewards = rewards.score(...)                           # [N, F], NaN where a function skipped
    adv     = advantages.compute(gathered rewards, ...)    # pure function
    loss    = objectives.policy_loss(logps, old, adv, ...) # pure function

``transformers.Trainer`` brings the optimisation loop, checkpoints, callbacks, integrations,
``resume_from_checkpoint`` and ``push_to_hub``. This class only supplies the data plan (groups
kept whole), the generation buffer, the loss and the metrics.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather, gather_object
from transformers import PreTrainedModel, Trainer, TrainerCallback
from transformers.trainer_utils import TrainOutput, rotate_checkpoints

from posttrain.agents.environments import check_environment_dataset
from posttrain.agents.loop import LoopSettings
from posttrain.agents.runner import AgentRunner
from posttrain.data import formats
from posttrain.data.sampling import grouped_dataloader
from posttrain.generation.base import Generator, build_rollout
from posttrain.generation.continuous_batching import ContinuousBatchingGenerator
from posttrain.generation.rollout_func import call_rollout_func
from posttrain.generation.transformers_backend import TransformersGenerator, sampling_config
from posttrain.grpo import advantages, checkpoints, dynamic_sampling, objectives, regularizers
from posttrain.grpo.config import GRPOConfig
from posttrain.grpo.loss import LossSettings, grpo_loss
from posttrain.grpo.rollout import Rollout, ScoredRollout
from posttrain.models import distributed, loading
from posttrain.models import peft as peft_utils
from posttrain.models import reference as model_options
from posttrain.observe.completions import COMPLETIONS_FILE, CompletionLog
from posttrain.observe.metrics import MetricStore
from posttrain.ops import checkpointing, memory
from posttrain.ops.logprobs import completion_logps
from posttrain.ops.padding import left_pad
from posttrain.rewards.models import RewardModel, resolve_reward_funcs, reward_models
from posttrain.rewards.runner import RewardRunner

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


class GRPOTrainer(Trainer):
    """Trainer for Group Relative Policy Optimization (GRPO, DeepSeekMath).

    The public API is TRL's: a script written for ``trl.GRPOTrainer`` runs after changing the
    import.

    Args:
        model: hub id, local path, embedded name (``"smollm2-135m-instruct"``), a
            ``PreTrainedModel`` causal LM or a ``peft.PeftModel`` (trained as is). Strings are
            loaded with ``args.model_init_kwargs``, in float32 unless a ``dtype`` is given there.
        reward_funcs: a reward callable (sync or ``async def``), a reward model (hub id, path or
            ``PreTrainedModel`` for sequence classification with one label, scoring
            prompt + completion), or a list of them. A callable receives
            ``prompts``, ``completions``, ``completion_ids``, ``trainer_state``, ``log_metric``,
            ``log_extra`` and every dataset column but ``prompt`` as keyword arguments, and
            returns one float (or ``None`` when it does not apply) per completion.
        args: the configuration; a default ``GRPOConfig`` when ``None``.
        train_dataset: a ``Dataset`` or ``IterableDataset`` (then ``max_steps`` is required)
            with a ``"prompt"`` column, standard or conversational.
        eval_dataset: same format, or a dict of such datasets evaluated one by one.
        processing_class: the tokenizer; loaded from the model when ``None``. Left padding is
            set, and the pad token falls back to EOS.
        reward_processing_classes: tokenizers of reward models: one for a single reward function,
            or a list aligned with ``reward_funcs`` (entries for callables are ignored); ``None``
            loads each reward model's own tokenizer.
        callbacks: extra ``TrainerCallback`` s.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        quantization_config: a transformers quantization config (e.g. ``BitsAndBytesConfig``) to load
            ``model`` by name with quantized weights; needs ``peft_config`` (QLoRA: only the adapter
            trains). Ignored, with a warning, for a model already built. See ``docs/peft.md``.
        peft_config: a ``peft.PeftConfig`` (e.g. ``LoraConfig``): the policy is wrapped with
            ``peft.get_peft_model`` and only the adapter trains. With ``beta > 0`` the KL
            reference is the base model (adapters disabled), not a second copy. See ``docs/peft.md``.
        tools: plain Python functions (sync or ``async``, with type hints and a Google-style
            docstring) the model may call during generation; see ``docs/agents.md``.
        rollout_func: ``rollout_func(prompts, trainer) -> dict`` producing the completions
            instead of ``generate``: it gets each prompt of the process's batch once and returns
            ``prompt_ids``, ``completion_ids`` and ``logprobs`` with ``num_generations`` entries
            per prompt (optionally ``logprob_token_ids``; other fields reach the reward
            functions). Its log-probs feed the importance-sampling correction.
        environment_factory: a class (or callable) making one environment per rollout, or a dict
            of them chosen by each row's ``environment`` column: its public methods are tools,
            ``reset(**row)`` starts an episode and may return the prompt, and an optional
            ``get_reward()`` is an extra reward source. Without ``train_dataset`` the environment
            owns the data and ``max_steps`` sets the length of training. See ``docs/agents.md``.
    """

    _tag_names = ["posttrain", "grpo"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Any = None,
    ) -> None:
        if args is None:
            base = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(output_dir=f"{os.path.basename(str(base).rstrip('/')) or 'model'}-GRPO")
        peft_utils.check_peft_arguments(model, peft_config, args, quantization_config)
        agent_mode = bool(tools) or environment_factory is not None
        if agent_mode and rollout_func is not None:
            raise ValueError(
                "rollout_func replaces generation, so it cannot be combined with tools or environment_factory, "
                "which need posttrain's tool-calling loop; call the tools inside your rollout_func instead."
            )
        if environment_factory is not None:
            check_environment_dataset(environment_factory, train_dataset, args.max_steps)
            if train_dataset is None:
                train_dataset = _episode_dataset(args)
        rewards = RewardRunner(
            self._setup_reward_funcs(
                reward_funcs, reward_processing_classes, args, optional=environment_factory is not None
            ),
            fault_policy=args.reward_fault_policy,
            timeout=args.reward_timeout,
        )
        self._check_datasets(
            train_dataset, eval_dataset, args, prompt_optional=environment_factory is not None
        )
        if rollout_func is not None:
            _check_rollout_func_batches(args, eval_dataset is not None)
        _settle_streaming_options(args, train_dataset, eval_dataset)
        loss_settings = LossSettings.from_config(args)
        model, source = self._setup_model(model, args, peft_config, quantization_config)
        processing_class = self._setup_tokenizer(processing_class, source, args)
        _check_chat_template(train_dataset, processing_class)
        super().__init__(
            model=model,
            args=args,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.rewards = rewards
        for reward_model in reward_models(rewards.funcs):
            reward_model.to(self.accelerator.device)
        self.rollout_func = rollout_func
        self._trim_hooks: list[Any] = []
        if self.accelerator.device.type == "cpu":  # glibc's heap (ops/memory.py):
            memory.map_large_blocks()  # large activations stay out of it,
            self._trim_hooks = memory.trim_heap_in_backward(self.model)  # freed small ones leave it
            checkpointing.enabled()  # a bad POSTTRAIN_SELECTIVE_CHECKPOINTING fails here, not mid-step
        self.generator: Generator = self._setup_generator()
        self.agent = self._setup_agent(tools, environment_factory) if agent_mode else None
        self._reward_names = list(rewards.names) + (self.agent.reward_names if self.agent else [])
        self._setup_reward_weights()
        aux = model_options.set_router_aux_loss_coef(self.model, args.router_aux_loss_coef)
        self.loss_settings = replace(loss_settings, aux_loss_coef=aux)
        self.ref_model = self._setup_reference()
        self.entropy_coef = float(args.entropy_coef)
        self._step_entropy: list[float] = []
        self._last_logs: dict[str, float] = {}
        self._sampled_text: tuple[list[Any], list[Any], dict[str, list[Any]]] = ([], [], {})
        self._completion_logs = (
            {
                mode: CompletionLog(
                    self.accelerator.is_main_process, display_limit=args.generation_batch_size
                )
                for mode in ("train", "eval")
            }
            if args.log_completions
            else {}
        )
        self.add_callback(_AfterOptimizerStep(self))
        self._metrics = MetricStore()
        self._buffer: list[ScoredRollout] = []
        self._micro_step = 0
        self._step_time = 0.0
        self._micro_in_step = 0
        self.log_extra_columns: dict[str, list[Any]] = {}

    # ---- setup -------------------------------------------------------------------------------

    @staticmethod
    def _setup_reward_funcs(
        reward_funcs: Any, processing_classes: Any, args: GRPOConfig, optional: bool = False
    ) -> list[RewardFunc]:
        """Reward callables; reward models (a name or a PreTrainedModel) are wrapped to score completions.

        ``optional``: environments may own the reward (``get_reward``), so none may be given.
        """
        if reward_funcs is None or (isinstance(reward_funcs, list) and not reward_funcs):
            if optional:
                return []
            raise ValueError(
                "GRPOTrainer needs a reward: pass reward_funcs (a callable or a list of callables, a reward "
                "model name or PreTrainedModel)."
            )
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
        return funcs

    def _setup_agent(self, tools: Any, environment_factory: Any) -> AgentRunner:
        """The tool loop (``agents/``): tool schemas, environments, the chat template it trains with."""
        a = self.args
        settings = LoopSettings(
            max_completion_length=a.max_completion_length,
            max_tool_calling_iterations=a.max_tool_calling_iterations,
            max_model_length=getattr(self.model.config, "max_position_embeddings", None),
            eos_token_ids=self._eos_token_ids,
            pad_token_id=self._tokenizer.pad_token_id,
            chat_template_kwargs=dict(a.chat_template_kwargs or {}),
        )
        return AgentRunner(tools, environment_factory, self._tokenizer, settings, a.reward_fault_policy)

    def _setup_reward_weights(self) -> None:
        """``reward_weights`` weigh the reward functions; environment rewards always weigh 1."""
        if not self._reward_names:
            raise ValueError(
                "GRPOTrainer needs a reward: pass reward_funcs, or give the environment class a get_reward() "
                "method that scores the episode."
            )
        weights = list(self.args.reward_weights or [1.0] * len(self.rewards.funcs))
        weights += [1.0] * (len(self._reward_names) - len(self.rewards.funcs))
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    @staticmethod
    def _check_datasets(
        train_dataset: Any, eval_dataset: Any, args: GRPOConfig, prompt_optional: bool = False
    ) -> None:
        if train_dataset is None:
            raise ValueError("GRPOTrainer needs a train_dataset with a 'prompt' column.")
        _check_dataset(
            train_dataset,
            "train_dataset",
            args,
            args.num_generations,
            train=True,
            prompt_optional=prompt_optional,
        )
        if eval_dataset is None:
            return
        items = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [("", eval_dataset)]
        for key, ds in items:
            name = f"eval_dataset[{key!r}]" if key else "eval_dataset"
            _check_dataset(
                ds, name, args, args.num_generations_eval, train=False, prompt_optional=prompt_optional
            )

    @staticmethod
    def _setup_model(
        model: Any, args: GRPOConfig, peft_config: Any = None, quantization_config: Any = None
    ) -> tuple[Any, str]:
        if isinstance(model, str):
            source = loading.resolve_model_path(model)
            policy = loading.load_policy(
                source, args.model_init_kwargs, args.trust_remote_code, quantization_config, args.device
            )
        elif isinstance(model, PreTrainedModel):
            policy, source = (
                model,
                model.config._name_or_path,
            )  # model_init_kwargs then only load reward models
        elif peft_utils.is_peft_model(model):
            policy, source = model, model.get_base_model().config._name_or_path
        else:
            raise TypeError(
                f"model must be a hub id, a local path, an embedded name, a PreTrainedModel or a PeftModel; "
                f"got {type(model).__name__}."
            )
        if not hasattr(policy, "generate"):
            raise TypeError("model must be a causal language model (it has no generate method).")
        if peft_config is not None or peft_utils.is_peft_model(policy):
            policy = peft_utils.wrap_policy(policy, peft_config, bool(args.activation_checkpointing))
        if args.disable_dropout:
            loading.disable_dropout(policy)
        if args.cast_lm_head_to_fp32:
            model_options.cast_lm_head_to_fp32(policy)
        if args.router_aux_loss_coef is not None and not model_options.is_moe(policy):
            model_options.set_router_aux_loss_coef(
                policy, args.router_aux_loss_coef
            )  # raises, before training
        return policy, source

    def _setup_reference(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy when the KL penalty is on (``beta != 0``).

        ``None`` for a PEFT policy: its reference is its own base model, adapters disabled.
        """
        a = self.args
        if a.beta == 0.0 or peft_utils.is_peft_model(self.model):
            return None
        if a.sync_ref_model and (self.is_fsdp_enabled or self.is_deepspeed_enabled):
            raise NotImplementedError(
                "sync_ref_model=True is not supported with FSDP2 or DeepSpeed in posttrain: the reference is "
                "mixed with the policy parameter by parameter, which sharded parameters do not allow. Train "
                "without sync_ref_model, or with DDP."
            )
        return distributed.create_reference(
            self.model,
            self.accelerator,
            reload=lambda: loading.load_policy(
                self.model.config._name_or_path, a.model_init_kwargs, a.trust_remote_code
            ),
        )

    def create_accelerator_and_postprocess(self) -> None:
        """transformers' Accelerator; on CPU processes switched to the FSDP2 that ``fsdp`` asks for."""
        super().create_accelerator_and_postprocess()
        distributed.use_fsdp_on_cpu(self)

    @staticmethod
    def _setup_tokenizer(processing_class: Any, source: str, args: GRPOConfig) -> Any:
        if processing_class is None:
            revision = (args.model_init_kwargs or {}).get("revision")
            processing_class = loading.load_tokenizer(source, revision, args.trust_remote_code)
        return loading.prepare_tokenizer(processing_class)

    def _setup_generator(self) -> Generator:
        """transformers ``generate`` (shared prompt prefill, prepacked weights), or its continuous
        batching engine with ``use_transformers_continuous_batching``."""
        a = self.args
        config = sampling_config(
            max_new_tokens=a.max_completion_length,
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            min_p=a.min_p,
            repetition_penalty=a.repetition_penalty,
            cache_implementation=a.cache_implementation,
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_ids=self._eos_token_ids,
            generation_kwargs=a.generation_kwargs,
        )
        get_model = lambda: self.accelerator.unwrap_model(self.model)  # noqa: E731
        full_parameters = lambda m: distributed.generation_parameters(  # noqa: E731
            self.accelerator, m, a.ds3_gather_for_generation
        )
        if a.use_transformers_continuous_batching:
            return ContinuousBatchingGenerator(
                get_model=get_model,
                config=config,
                cb_config=a.transformers_continuous_batching_config,
                full_parameters=full_parameters,
            )
        # accelerate wraps the forward in autocast for bf16/fp16; the fused decode step mirrors it
        autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.accelerator.mixed_precision)
        return TransformersGenerator(
            get_model=get_model, config=config, full_parameters=full_parameters, autocast_dtype=autocast
        )

    @property
    def reward_funcs(self) -> list[Any]:
        """The reward functions in order: callables as given, reward models as ``PreTrainedModel`` s."""
        return [f.model if isinstance(f, RewardModel) else f for f in self.rewards.funcs]

    @property
    def reward_func_names(self) -> list[str]:
        """The name of each reward function (a callable's ``__name__``, a reward model's last path
        component), as in the ``rewards/<name>/mean`` metrics."""
        return list(self.rewards.names)

    @property
    def reward_processing_classes(self) -> list[Any]:
        """Aligned with ``reward_funcs``: each reward model's tokenizer, ``None`` for a callable."""
        return [f.tokenizer if isinstance(f, RewardModel) else None for f in self.rewards.funcs]

    @property
    def _tokenizer(self) -> Any:
        return getattr(self.processing_class, "tokenizer", self.processing_class)

    @property
    def _eos_token_ids(self) -> list[int]:
        ids = {self._tokenizer.eos_token_id}
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return sorted(i for i in ids if i is not None)

    # ---- data --------------------------------------------------------------------------------

    def _dataloader(
        self, dataset: Any, per_process: int, group: int, repeat: int, shuffle: bool, seed: int | None = None
    ) -> Any:
        a = self.args
        seed = (a.data_seed or a.seed) if seed is None else seed
        if a.remove_unused_columns and hasattr(dataset, "select_columns"):
            dataset = dataset.select_columns([formats.PROMPT_COLUMN])
        if shuffle and not hasattr(dataset, "__len__") and hasattr(dataset, "shuffle"):
            dataset = dataset.shuffle(seed=seed, buffer_size=1000)
        return grouped_dataloader(
            dataset, group, per_process, a.world_size, a.process_index, repeat, shuffle, seed
        )

    def get_train_dataloader(self) -> Any:
        """Per-process generation batches, each yielded ``steps_per_generation * num_iterations`` times."""
        a = self.args
        return self._dataloader(
            self.train_dataset,
            per_process=a.per_device_train_batch_size * a.steps_per_generation,
            group=a.num_generations,
            repeat=a.steps_per_generation * a.num_iterations,
            shuffle=a.shuffle_dataset,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Evaluation batches with ``num_generations_eval`` completions per prompt, in order."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        a = self.args
        return self._dataloader(dataset, a.per_device_eval_batch_size, a.num_generations_eval, 1, False)

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = [formats.PROMPT_COLUMN]

    # ---- one step: generate, score, buffer ---------------------------------------------------

    def _prepare_inputs(self, batch: list[dict[str, Any]]) -> ScoredRollout:  # type: ignore[override]
        """Generate and score once per ``steps_per_generation * num_iterations`` micro-steps."""
        a = self.args
        period = a.steps_per_generation * a.num_iterations
        if self._micro_step % period == 0 or not self._buffer:
            self._buffer = self._generate_and_score(batch, "train", num_chunks=a.steps_per_generation)
        micro = self._buffer[self._micro_step % a.steps_per_generation]
        self._micro_step += 1
        return micro

    def _generate_and_score(
        self, batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> list[ScoredRollout]:
        """Sample completions for this process's rows, score them, compute advantages."""
        group = self.args.num_generations if mode == "train" else self.args.num_generations_eval
        rollout, rewards_local = self._sample(batch, mode)
        if mode == "train" and self.args.dynamic_sampling:
            rollout, rewards_local = self._refill(rollout, rewards_local, group)
        rewards = gather(rewards_local.to(self.accelerator.device)).cpu()  # [N, F]
        adv, adv_metrics = advantages.compute(
            rewards,
            self.reward_weights,
            group,
            self.args.scale_rewards,
            self.args.multi_objective_aggregation,
        )
        n = rewards_local.shape[0]
        start = self.accelerator.process_index * n
        adv_local = adv[start : start + n]
        self._record_rollout_metrics(mode, rollout, rewards, adv_metrics)
        if self._completion_logs:
            self._add_completions(mode, rewards, adv)
        scored = ScoredRollout(rollout=rollout, rewards=rewards_local, advantages=adv_local)
        return self._prepare_chunks(scored, num_chunks, mode)

    def _sample(self, batch: list[dict[str, Any]], mode: str) -> tuple[Rollout, torch.Tensor]:
        """Generate one completion per row and score it: the rollout and [n, F] local rewards."""
        prompts = [row.get(formats.PROMPT_COLUMN) for row in batch]
        if self.agent is not None:
            return self._sample_episodes(batch, prompts, mode)
        for i, p in enumerate(prompts):
            formats.check_prompt(p, f"{i} of this batch")
        extra: dict[str, Any] = {}
        if self.rollout_func is not None:
            group = self.args.num_generations if mode == "train" else self.args.num_generations_eval
            result = call_rollout_func(
                self.rollout_func,
                prompts,
                group,
                self,
                self._eos_token_ids,
                self._tokenizer.pad_token_id,
                self.accelerator.device,
            )
            rollout, extra = result.rollout, result.extra
        else:
            rollout = self._generate(prompts)
        completions, completion_ids = self._decode(rollout, prompts)
        kwargs = {**self._reward_kwargs(batch, prompts, completions, completion_ids, mode), **extra}
        rewards = self.rewards.score(len(batch), kwargs)
        self._sampled_text = (prompts, completions, dict(self.log_extra_columns))
        return rollout, rewards

    def _sample_episodes(
        self, batch: list[dict[str, Any]], prompts: list[Any], mode: str
    ) -> tuple[Rollout, torch.Tensor]:
        """Agent rollouts (``agents/``): tool-calling episodes, scored by the reward functions and
        the environments' ``get_reward``."""
        assert self.agent is not None
        rows = [{k: v for k, v in row.items() if k != EPISODE_COLUMN} for row in batch]
        out = self.agent.rollout(self.generator, rows, prompts, self.accelerator.device)
        rollout, completions = out.result.rollout, out.result.completions
        ids = [
            row[mask.bool()].tolist()
            for row, mask in zip(rollout.completion_ids, rollout.completion_mask, strict=True)
        ]
        kwargs = self._reward_kwargs(rows, out.prompts, completions, ids, mode)
        if out.environments is not None:
            kwargs["environments"] = out.environments
        rewards = torch.cat([self.rewards.score(len(batch), kwargs), out.environment_rewards], dim=1)
        for name, count in out.faults.items():  # reported with the reward functions' faults
            self.rewards.faults[name] = self.rewards.faults.get(name, 0) + count
        self._record_tool_metrics(mode, out.result.tool_calls, out.result.tool_failures)
        self._sampled_text = (out.prompts, completions, dict(self.log_extra_columns))
        return rollout, rewards

    def _record_tool_metrics(self, mode: str, calls: list[int], failures: list[int]) -> None:
        """``tools/call_frequency`` (calls per completion) and ``tools/failure_frequency`` (failed calls
        per call), from counts summed over processes."""
        local = torch.tensor(
            [float(len(calls)), float(sum(calls)), float(sum(failures))], device=self.accelerator.device
        )
        completions, total_calls, total_failures = gather(local.unsqueeze(0)).sum(dim=0).tolist()
        self._metrics.add_all(
            mode,
            {
                "tools/call_frequency": total_calls / max(completions, 1.0),
                "tools/failure_frequency": total_failures / total_calls if total_calls else 0.0,
            },
        )

    def _refill(self, rollout: Rollout, rewards: torch.Tensor, group: int) -> tuple[Rollout, torch.Tensor]:
        """DAPO dynamic sampling: replace this process's zero-spread groups (``dynamic_sampling.py``)."""
        rollouts, scores, texts = [rollout], [rewards], [self._sampled_text]
        spread = [dynamic_sampling.groups_with_spread(rewards, self.reward_weights, group)]
        missing = int((~spread[0]).sum())
        rounds = 0
        while rounds < self.args.dynamic_sampling_max_rounds and self._on_any_process(missing > 0):
            rounds += 1
            extra, extra_rewards = self._sample(next(self._refill_batches), "train")
            ok = dynamic_sampling.groups_with_spread(extra_rewards, self.reward_weights, group)
            rollouts.append(extra)
            texts.append(self._sampled_text)
            scores.append(extra_rewards)
            spread.append(ok)
            missing = max(0, missing - int(ok.sum()))
        chosen = dynamic_sampling.select_groups(spread, len(spread[0]))
        counts = torch.tensor(
            [float((~spread[0]).sum()), float(sum(r > 0 for r, _ in chosen)), float(missing)],
            device=self.accelerator.device,
        )
        dropped, refilled, unfilled = gather(counts.unsqueeze(0)).sum(dim=0).tolist()
        self._metrics.add_all(
            "train",
            {
                "dynamic_sampling/dropped_groups": dropped,
                "dynamic_sampling/refilled_groups": refilled,
                "dynamic_sampling/unfilled_groups": unfilled,
                "dynamic_sampling/rounds": float(rounds),
            },
        )
        if rounds == 0:
            return rollout, rewards
        pad = self._tokenizer.pad_token_id
        merged = dynamic_sampling.take_groups(rollouts, chosen, group, pad)
        merged_rewards = torch.cat([scores[r][g * group : (g + 1) * group] for r, g in chosen])
        self._sampled_text = _take_texts(texts, chosen, group)
        return merged, merged_rewards

    def _on_any_process(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (every process must call this together)."""
        return bool(gather(torch.tensor([float(flag)], device=self.accelerator.device)).max().item() > 0)

    @property
    def _refill_batches(self) -> Any:
        """Endless per-process generation batches of fresh prompts for dynamic sampling."""
        if getattr(self, "_refill_iter", None) is None:
            self._refill_iter = self._endless_batches()
        return self._refill_iter

    def _endless_batches(self) -> Any:
        a = self.args
        epoch = 0
        while True:
            loader = self._dataloader(
                self.train_dataset,
                per_process=a.per_device_train_batch_size * a.steps_per_generation,
                group=a.num_generations,
                repeat=1,
                shuffle=True,
                seed=(a.data_seed or a.seed) + 7919,  # another order than the main sampler's
            )
            loader.set_epoch(epoch)
            yield from loader
            epoch += 1

    def _add_completions(self, mode: str, rewards: torch.Tensor, adv: torch.Tensor) -> None:
        """Gather every process's prompts, completions and log_extra columns for the completion log."""
        per_process = gather_object([self._sampled_text])  # rank order, like gather()
        prompts = [p for ps, _, _ in per_process for p in ps]
        completions = [c for _, cs, _ in per_process for c in cs]
        names = dict.fromkeys(n for _, _, e in per_process for n in e)
        extra = {  # padded / cut per process: a wrong-length column must not break the log
            n: [v for ps, _, e in per_process for v in (list(e.get(n, [])) + [None] * len(ps))[: len(ps)]]
            for n in names
        }
        columns: dict[str, list[float]] = {}
        for j, name in enumerate(self._reward_names):
            columns[name if name not in columns else f"{name}_{j}"] = rewards[:, j].tolist()
        self._completion_logs[mode].add(
            self.state.global_step, prompts, completions, columns, adv.tolist(), extra
        )

    def _write_plots(self) -> None:
        """The run's curves as PNGs in ``output_dir/plots`` (needs matplotlib: the ``plot`` extra)."""
        from posttrain.observe.plots import write_plots_from_log_history

        try:
            write_plots_from_log_history(self.state.log_history, os.path.join(self.args.output_dir, "plots"))
        except ImportError as exc:
            warnings.warn(f"No plots written at the end of training: {exc}", stacklevel=2)

    def _flush_completions(self, mode: str) -> None:
        """Print the completions table and append the rows to the completions file."""
        log = self._completion_logs.get(mode)
        if log is None:
            return
        log.print_table(self.args.num_completions_to_print, self.args.log_unique_prompts)
        name = COMPLETIONS_FILE if mode == "train" else "eval_completions.jsonl"
        log.flush_to_file(os.path.join(self.args.output_dir, name))

    def _generate(self, prompts: list[Any]) -> Rollout:
        tok = self._tokenizer
        kwargs = self.args.chat_template_kwargs
        ids = [
            tok(formats.render_prompt(p, tok, kwargs), add_special_tokens=isinstance(p, str))["input_ids"]
            for p in prompts
        ]
        multiple = self.args.pad_to_multiple_of if isinstance(self.args.pad_to_multiple_of, int) else None
        prompt_ids, prompt_mask = left_pad(ids, tok.pad_token_id, multiple)
        device = self.accelerator.device
        prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
        samples = self.generator.generate(prompt_ids, prompt_mask)
        return build_rollout(prompt_ids, prompt_mask, samples, self._eos_token_ids, tok.pad_token_id)

    def _decode(self, rollout: Rollout, prompts: list[Any]) -> tuple[list[Any], list[list[int]]]:
        lengths = rollout.completion_lengths.tolist()
        completion_ids = [row[:n] for row, n in zip(rollout.completion_ids.tolist(), lengths, strict=True)]
        texts = self._tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return [formats.as_completion(t, p) for t, p in zip(texts, prompts, strict=True)], completion_ids

    def _reward_kwargs(
        self,
        batch: list[dict[str, Any]],
        prompts: list[Any],
        completions: list[Any],
        ids: list[list[int]],
        mode: str,
    ) -> dict[str, Any]:
        columns = {k: [row.get(k) for row in batch] for k in batch[0] if k != formats.PROMPT_COLUMN}
        self.log_extra_columns = {}
        return {
            **columns,
            "prompts": prompts,
            "completions": completions,
            "completion_ids": ids,
            "trainer_state": self.state,
            "log_metric": lambda name, value: self._metrics.add(mode, name, value),
            "log_extra": lambda column, values: self.log_extra_columns.__setitem__(column, list(values)),
        }

    def _prepare_chunks(self, scored: ScoredRollout, num_chunks: int, mode: str) -> list[ScoredRollout]:
        """Split into micro-batches, set the loss normalisers and, off-policy, the old log-probs."""
        a = self.args
        mask = self._loss_mask(scored.rollout)
        accumulation = a.gradient_accumulation_steps if mode == "train" else 1
        global_tokens = gather(mask.sum().reshape(1).float()).sum().item()
        scored.norms = objectives.Normalizers(
            tokens=max(global_tokens / num_chunks * accumulation / a.world_size, 1.0),
            sequences=float(scored.advantages.shape[0] // num_chunks * accumulation),
            accumulation=accumulation,
            max_completion_length=a.max_completion_length,
        )
        chunks = scored.split(num_chunks)
        on_policy = a.num_iterations == 1 and a.gradient_accumulation_steps % a.steps_per_generation == 0
        for c in chunks:
            if mode == "train" and not on_policy:
                c.old_logps = self._frozen_logps(self.model, c.rollout)
            if self.ref_model is not None:
                c.ref_logps = self._frozen_logps(self.ref_model, c.rollout)
            elif a.beta != 0.0 and peft_utils.is_peft_model(self.model):
                with peft_utils.adapters_disabled(self.model) as base:  # the reference: no second copy
                    c.ref_logps = self._frozen_logps(base, c.rollout)
        return chunks

    @torch.no_grad()
    def _frozen_logps(self, model: torch.nn.Module, r: Rollout) -> torch.Tensor:
        """Log-probs of a rollout's completions under ``model``, without gradient: [N, T]."""
        out = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, self.args.temperature
        )
        return out.logps

    def _loss_mask(self, rollout: Rollout) -> torch.Tensor:
        """Completion tokens that count in the loss (sampled by the model, not tool results): [N, T]."""
        mask = rollout.model_token_mask
        if self.args.mask_truncated_completions:
            mask = mask * rollout.is_terminated.unsqueeze(1).to(mask.dtype)
        return mask

    # ---- loss --------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The GRPO loss of one micro-batch (already normalised for accumulation and processes)."""
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        a, r = self.args, inputs.rollout
        mode = "train" if model.training else "eval"
        out = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            a.temperature,
            with_entropy=True,
            entropy_grad=self.loss_settings.entropy_regularized,
        )
        result = grpo_loss(
            out, inputs, self._loss_mask(r), self.loss_settings, self.entropy_coef, self._gather_values
        )
        if mode == "train" and "entropy_bonus" in result.scalars:
            self._step_entropy.append(result.scalars["entropy_bonus"])
        self._record_loss_metrics(mode, result.per_completion, result.scalars)
        if result.sampling:
            self._record_sampling_metrics(mode, result.sampling)
        return result.loss

    def _gather_values(self, local: torch.Tensor) -> torch.Tensor:
        """Every process's 1-D ``local`` values, concatenated (lengths may differ between processes)."""
        if self.accelerator.num_processes == 1:
            return local
        device = self.accelerator.device
        counts = gather(torch.tensor([local.numel()], device=device)).tolist()
        padded = torch.zeros(max(counts), dtype=local.dtype, device=device)
        padded[: local.numel()] = local.to(device)
        rows = gather(padded.unsqueeze(0))  # [processes, max count]
        return torch.cat([row[:n] for row, n in zip(rows, counts, strict=True)])

    def get_high_entropy_mask(
        self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float
    ) -> torch.Tensor:
        """The reference's helper: tokens whose entropy is at or above the ``threshold`` quantile.

        Args:
            entropies: [B, T] per-token entropies.
            mask: [B, T] 1 on valid tokens.
            threshold: the quantile level in [0, 1], taken over the valid entropies of every
                process (``top_entropy_quantile=rho`` uses ``1 - rho``).

        Returns:
            [B, T] bool: ``True`` on the valid tokens at or above the threshold; all ``False``
            when no process has a valid token.
        """
        population = self._gather_values(entropies.detach()[mask.bool()].float())
        return regularizers.entropy_quantile_mask(entropies, mask, threshold, population)

    @staticmethod
    def get_off_policy_mask(
        advantages: torch.Tensor,
        per_token_logps: torch.Tensor,
        sampling_per_token_logps: torch.Tensor,
        mask: torch.Tensor,
        off_policy_threshold: float,
    ) -> torch.Tensor:
        """The reference's helper: DeepSeek-V3.2's off-policy sequence mask.

        Args:
            advantages: [B, 1] (or [B]) advantages.
            per_token_logps: [B, T] log-probs under the current policy.
            sampling_per_token_logps: [B, T] log-probs under the sampling policy.
            mask: [B, T] valid tokens.
            off_policy_threshold: ``delta``: a sequence with a negative advantage whose mean
                ``log pi_sampler - log pi`` exceeds it is dropped.

        Returns:
            [B, 1] in ``mask``'s dtype: 1 to keep a sequence, 0 to drop it.
        """
        keep = regularizers.off_policy_sequence_mask(
            sampling_per_token_logps, per_token_logps, advantages, mask, off_policy_threshold
        )
        return keep.unsqueeze(1).to(mask.dtype)

    def training_step(
        self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One micro-step; also times whole optimizer steps for the ``step_time`` metric."""
        start = time.perf_counter()
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"The loss became {loss.item()} at optimizer step {self.state.global_step + 1}, before any update "
                f"was applied (the parameters and the checkpoints are intact). Last logged metrics: "
                f"{self._last_logs}. Lower the learning rate, check the rewards, or use bf16/fp32."
            )
        self._step_time += time.perf_counter() - start
        self._micro_in_step += 1
        if self._micro_in_step >= self.current_gradient_accumulation_steps:
            self._metrics.add("train", "step_time", self._step_time)
            self._step_time, self._micro_in_step = 0.0, 0
        return loss

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor, None, None]:
        """Evaluation: generate ``num_generations_eval`` completions per prompt, score, report the loss."""
        with torch.no_grad():
            (scored,) = self._generate_and_score(inputs, "eval", num_chunks=1)
            loss = self.compute_loss(model, scored)
        return loss.detach(), None, None

    # ---- metrics -----------------------------------------------------------------------------

    def _record_rollout_metrics(
        self, mode: str, rollout: Rollout, rewards: torch.Tensor, adv_metrics: dict[str, float]
    ) -> None:
        device = self.accelerator.device
        lengths = gather(rollout.generated_lengths.to(device)).float().cpu()  # tool results not counted
        terminated = gather(rollout.is_terminated.to(device)).cpu()
        tokens = gather(
            (rollout.prompt_mask.sum() + rollout.model_token_mask.sum()).reshape(1).to(device)
        ).sum()
        if mode == "train":
            self.state.num_input_tokens_seen += int(tokens.item())
        m = {"num_tokens": float(self.state.num_input_tokens_seen)}
        m.update(_stats("completions/{}_length", lengths))
        m.update(_stats("completions/{}_terminated_length", lengths[terminated]))
        m["completions/clipped_ratio"] = 1.0 - terminated.float().mean().item()
        for j, name in enumerate(self._reward_names):
            col = rewards[:, j]
            m[f"rewards/{name}/mean"] = torch.nanmean(col).item()
            m[f"rewards/{name}/std"] = _nanstd(col)
        faults = self.rewards.pop_faults()
        if self.args.reward_fault_policy == "skip":
            local = torch.tensor([float(faults.get(name, 0)) for name in self._reward_names], device=device)
            for name, count in zip(
                self._reward_names, gather(local.unsqueeze(0)).sum(dim=0).tolist(), strict=True
            ):
                m[f"rewards/{name}/faults"] = count
        total = advantages.weighted_sum(rewards, self.reward_weights)
        m["reward"] = total.mean().item()
        m["reward_std"] = total.std().item() if total.numel() > 1 else 0.0
        m.update(adv_metrics)
        self._metrics.add_all(mode, m)

    def _record_loss_metrics(
        self, mode: str, per_completion: dict[str, torch.Tensor], scalars: dict[str, float]
    ) -> None:
        """Gather the per-completion statistics of a micro-batch and record the metrics."""
        device = self.accelerator.device
        g = {k: gather(v.detach().float().to(device)).cpu() for k, v in per_completion.items()}
        tokens = g["tokens"].clamp(min=0)
        total = max(tokens.sum().item(), 1.0)
        sequence_level = self.args.importance_sampling_level == "sequence"
        # at sequence level each completion is clipped as a whole: average over completions
        weight = torch.ones_like(tokens) / len(tokens) if sequence_level else tokens / total
        m = {"entropy": g["entropy_sum"].sum().item() / total}
        spec = objectives.LOSS_TYPES[self.args.loss_type]
        if spec.clip_region != "none":
            m["clip_ratio/low_mean"] = (g["low"] * weight).sum().item()
            m["clip_ratio/low_min"] = g["low"].min().item()
            m["clip_ratio/high_mean"] = (g["high"] * weight).sum().item()
            m["clip_ratio/high_max"] = g["high"].max().item()
            m["clip_ratio/region_mean"] = (g["region"] * weight).sum().item()
        if "cispo_clip" in g:
            m["cispo_clip_ratio"] = (g["cispo_clip"] * weight).sum().item()
        if "vespo_phi" in g:
            m["vespo/phi_seq_mean"] = g["vespo_phi"].mean().item()
        if "kl_sum" in g:
            m["kl"] = g["kl_sum"].sum().item() / total
        local = torch.tensor([scalars[k] for k in sorted(scalars)], device=device)
        means = gather(local.unsqueeze(0)).mean(dim=0).tolist()
        reported = {"aux_loss"}
        if self.loss_settings.entropy_regularized:
            reported.add("policy_loss")  # the spec logs it only next to an entropy term
            m["entropy_coef"] = self.entropy_coef  # the current coefficient (adaptive: before gating)
        for key, value in zip(sorted(scalars), means, strict=True):
            if key in reported:
                m[key] = value
        self._metrics.add_all(mode, m)

    def _record_sampling_metrics(self, mode: str, sampling: dict[str, float]) -> None:
        """Reduce the importance-sampling metrics across processes, ignoring NaN (nothing measured)."""
        keys = sorted(sampling)
        local = torch.tensor([[sampling[k] for k in keys]], device=self.accelerator.device)
        everyone = gather(local).cpu()  # [processes, K]
        m = {}
        for j, key in enumerate(keys):
            column = everyone[:, j]
            column = column[~torch.isnan(column)]
            if column.numel() == 0:
                continue
            if key.endswith("/min"):
                m[key] = column.min().item()
            elif key.endswith("/max"):
                m[key] = column.max().item()
            else:
                m[key] = column.mean().item()
        self._metrics.add_all(mode, m)

    def _check_gradients(self) -> None:
        """Stop before the optimizer applies a NaN or inf gradient."""
        named = [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]
        if not named:
            return
        # One norm per gradient: no gradient-sized temporaries (isfinite on a 28M-entry embedding
        # gradient allocates ~150 MB). A norm is non-finite if an entry is, or if it overflows; the
        # suspects are then checked entry by entry.
        norms = torch._foreach_norm([g for _, g in named])
        norms = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms])  # FSDP2
        suspects = torch.nonzero(~torch.isfinite(norms)).flatten().tolist()
        bad = [named[i][0] for i in suspects if not torch.isfinite(named[i][1]).all()]
        if bad:
            raise FloatingPointError(
                f"Non-finite gradients in {bad[:3]}{' ...' if len(bad) > 3 else ''} at optimizer step "
                f"{self.state.global_step + 1}; the update was not applied (the parameters and the checkpoints "
                f"are intact). Last logged metrics: {self._last_logs}. Lower the learning rate or check the inputs."
            )

    def _after_optimizer_step(self) -> None:
        """Adaptive entropy coefficient (Skywork-OR1) and reference sync (TR-DPO), once per step."""
        a = self.args
        if a.use_adaptive_entropy and self._step_entropy:
            local = torch.tensor(
                [sum(self._step_entropy) / len(self._step_entropy)], device=self.accelerator.device
            )
            entropy = gather(local).mean().item()
            self.entropy_coef = regularizers.next_entropy_coef(
                self.entropy_coef,
                entropy,
                a.entropy_target,
                a.entropy_coef_delta,
                a.entropy_coef_min,
                a.entropy_coef_max,
            )
        self._step_entropy = []
        if self.ref_model is not None and a.sync_ref_model:
            if regularizers.should_sync_reference(self.state.global_step, a.ref_model_sync_steps):
                regularizers.mix_into_reference(
                    self.ref_model.parameters(), self.model.parameters(), a.ref_model_mixup_alpha
                )

    # ---- checkpoints: what transformers.Trainer does not save ---------------------------------

    def train(
        self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any
    ) -> Any:
        """Train; ``resume_from_checkpoint=True`` resumes from the newest *complete* checkpoint."""
        if resume_from_checkpoint is True:  # None when only an interrupted first save is there
            resume_from_checkpoint = checkpoints.latest_complete_checkpoint(self.args.output_dir)
        if isinstance(resume_from_checkpoint, str):
            done = checkpoints.finished_output(resume_from_checkpoint, self.args.max_steps)
            if done is not None:  # transformers would train one more step
                self.state = done
                self._load_from_checkpoint(resume_from_checkpoint)
                return TrainOutput(done.global_step, 0.0, {})
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save as transformers does, then posttrain's state last, as the completion mark.

        Old checkpoints are rotated only after the new one is complete, so a kill while saving
        always leaves a complete checkpoint behind.
        """
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        if self.args.should_save and os.path.isdir(folder) and not checkpoints.is_complete(folder):
            shutil.rmtree(folder)  # left by a run killed while saving: no stale file may survive
        self.accelerator.wait_for_everyone()
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        # every process's generation buffer, so a resume inside it replays the same rollouts
        os.makedirs(folder, exist_ok=True)
        buffer = {"micro_step": self._micro_step, "buffer": self._buffer}
        torch.save(buffer, os.path.join(folder, BUFFER_STATE.format(self.accelerator.process_index)))
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            if self.ref_model is not None and self.args.sync_ref_model:
                torch.save(self.ref_model.state_dict(), os.path.join(folder, REFERENCE_STATE))
            checkpoints.write_state(folder, {"entropy_coef": self.entropy_coef})
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    @property
    def _load_location(self) -> Any:
        """Where checkpoint tensors load: "cpu" on CPU processes (torch cannot restore "cpu:0")."""
        return "cpu" if self.accelerator.device.type == "cpu" else self.accelerator.device

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        buffer_path = os.path.join(
            resume_from_checkpoint, BUFFER_STATE.format(self.accelerator.process_index)
        )
        if os.path.isfile(buffer_path):  # our own file: rollouts are dataclasses of tensors
            saved = torch.load(buffer_path, map_location=self._load_location, weights_only=False)
            self._micro_step, self._buffer = saved["micro_step"], saved["buffer"]
        state = checkpoints.read_state(resume_from_checkpoint)
        if state is not None:
            self.entropy_coef = float(state["entropy_coef"])
        ref_path = os.path.join(resume_from_checkpoint, REFERENCE_STATE)
        if self.ref_model is not None and os.path.isfile(ref_path):
            self.ref_model.load_state_dict(torch.load(ref_path, map_location=self._load_location))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the GRPO metrics averaged since the last log (``eval_``-prefixed during evaluation)."""
        eval_loss = next((k for k in logs if k.startswith("eval") and k.endswith("_loss")), None)
        self._flush_completions("eval" if eval_loss is not None else "train")
        if eval_loss is not None:
            prefix = eval_loss[: -len("loss")]
            metrics = {prefix + k: v for k, v in self._metrics.pop_means("eval").items()}
        else:
            metrics = self._metrics.pop_means("train")
        merged = {**logs, **metrics}
        if all(isinstance(v, (int, float)) and v == v for v in merged.values()):
            self._last_logs = {"step": self.state.global_step, **merged}
        super().log(merged, start_time)

    def _track_num_input_tokens(self, inputs: Any) -> None:
        """Token counting happens at generation (``num_tokens``); nothing to do per micro-batch."""

    def floating_point_ops(self, inputs: Any) -> int:
        """FLOPs are not estimated for GRPO steps (generation dominates and varies)."""
        return 0


def _check_rollout_func_batches(args: GRPOConfig, has_eval: bool) -> None:
    """rollout_func gets each prompt once, so each process must hold whole groups."""
    per_process = args.per_device_train_batch_size * args.steps_per_generation
    if per_process % args.num_generations != 0:
        raise ValueError(
            f"rollout_func receives each prompt of a process's batch once, so the per-process generation batch "
            f"(per_device_train_batch_size x steps_per_generation = {per_process}) must be a multiple of "
            f"num_generations={args.num_generations}; adjust per_device_train_batch_size or steps_per_generation."
        )
    if has_eval and args.per_device_eval_batch_size % args.num_generations_eval != 0:
        raise ValueError(
            f"rollout_func needs per_device_eval_batch_size={args.per_device_eval_batch_size} to be a multiple of "
            f"num_generations_eval={args.num_generations_eval}; adjust one of them."
        )


REFERENCE_STATE = "reference_model.pt"
BUFFER_STATE = "generation_buffer_rank{}.pt"


class _AfterOptimizerStep(TrainerCallback):
    """Calls the trainer's per-step updates after each optimizer step."""

    def __init__(self, trainer: GRPOTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._check_gradients()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._after_optimizer_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        for mode in ("train", "eval"):
            self.trainer._flush_completions(mode)
        if state.is_world_process_zero and state.log_history:
            self.trainer._write_plots()


def _take_texts(texts: list[tuple], chosen: list[tuple[int, int]], group: int) -> tuple[list, list, dict]:
    """Prompts, completions and log_extra columns of the chosen groups, in ``take_groups``' order."""
    rows = [(r, g * group + k) for r, g in chosen for k in range(group)]
    names = dict.fromkeys(n for _, _, extra in texts for n in extra)

    def cell(r: int, i: int, name: str) -> Any:
        values = texts[r][2].get(name)
        return values[i] if values is not None and i < len(values) else None

    return (
        [texts[r][0][i] for r, i in rows],
        [texts[r][1][i] for r, i in rows],
        {n: [cell(r, i, n) for r, i in rows] for n in names},
    )


# The column of the dataset made when the environment owns the data (``_episode_dataset``); never
# forwarded to ``reset``.
EPISODE_COLUMN = "posttrain_episode"


def _episode_dataset(args: GRPOConfig) -> Any:
    """Rows to drive episodes when the environment owns the data: ``reset`` writes each prompt."""
    from datasets import Dataset

    prompts_per_step = max(args.generation_batch_size // args.num_generations, 1)
    return Dataset.from_dict({EPISODE_COLUMN: list(range(max(args.max_steps, 1) * prompts_per_step))})


def _identity(batch: list[Any]) -> list[Any]:
    return batch


def _stats(pattern: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {pattern.format(k): 0.0 for k in ("mean", "min", "max")}
    return {
        pattern.format("mean"): values.mean().item(),
        pattern.format("min"): values.min().item(),
        pattern.format("max"): values.max().item(),
    }


def _nanstd(values: torch.Tensor) -> float:
    present = values[~torch.isnan(values)]
    return present.std().item() if present.numel() > 1 else 0.0


def _check_chat_template(dataset: Any, processing_class: Any) -> None:
    """A conversational dataset needs a tokenizer with a chat template: say so before training."""
    if not hasattr(dataset, "__len__") or len(dataset) == 0 or formats.PROMPT_COLUMN not in dataset[0]:
        return
    tok = getattr(processing_class, "tokenizer", processing_class)
    if (
        formats.is_conversational(dataset[0][formats.PROMPT_COLUMN])
        and getattr(tok, "chat_template", None) is None
    ):
        raise ValueError(
            "train_dataset is conversational (its prompts are lists of messages) but the tokenizer has no chat "
            "template. Set tokenizer.chat_template (and pass it as processing_class), or use plain-text prompts."
        )


def _is_stream(dataset: Any) -> bool:
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        dataset is not None and not isinstance(dataset, Mapping) and not hasattr(dataset, "__len__")
    )


def _settle_streaming_options(args: GRPOConfig, train_dataset: Any, eval_dataset: Any) -> None:
    """With a streamed (iterable) dataset, the options a stream needs, set as the reference sets them.

    A stream is read in order and sliced per process (``data/sampling.py``): accelerate must not
    dispatch its batches from the main process, and the train stream is read by one worker, so
    ``dataloader_num_workers`` becomes 0 (with a warning); a map-style eval set keeps its workers.

    Raises:
        ValueError: ``accelerator_config.dispatch_batches=True`` was asked for with a stream.
    """
    evals = eval_dataset.values() if isinstance(eval_dataset, Mapping) else [eval_dataset]
    if _is_stream(train_dataset) or any(_is_stream(ds) for ds in evals):
        if args.accelerator_config.dispatch_batches:
            raise ValueError(
                "An IterableDataset is read in order by every process, so accelerate must not dispatch its batches, "
                "but accelerator_config.dispatch_batches=True; set it to False (or leave it unset)."
            )
        args.accelerator_config.dispatch_batches = False
    if _is_stream(train_dataset) and args.dataloader_num_workers != 0:
        warnings.warn(
            f"dataloader_num_workers={args.dataloader_num_workers} with an IterableDataset: workers would split "
            "the stream and break the groups of num_generations completions; using 0.",
            UserWarning,
            stacklevel=3,
        )
        args.dataloader_num_workers = 0


def _check_dataset(
    dataset: Any, name: str, args: GRPOConfig, group: int, train: bool, prompt_optional: bool = False
) -> None:
    """Clear errors for a dataset GRPO cannot use, before any model is loaded.

    ``prompt_optional``: environments may write the prompt (``reset``), so the column may be absent.
    """
    columns = getattr(dataset, "column_names", None)
    has_prompts = columns is None or formats.PROMPT_COLUMN in columns
    if not prompt_optional:
        formats.check_prompt_column(columns, name)
    per_process = (
        args.per_device_train_batch_size * args.steps_per_generation
        if train
        else args.per_device_eval_batch_size
    )
    global_batch = per_process * args.world_size
    if global_batch % group != 0:
        which = "per_device_train_batch_size" if train else "per_device_eval_batch_size"
        raise ValueError(
            f"The global {'generation' if train else 'evaluation'} batch ({global_batch} completions) is not a "
            f"multiple of the {'num_generations' if train else 'num_generations_eval'}={group}; adjust {which} "
            "or the number of generations so every prompt's completions fit in one batch."
        )
    if not hasattr(dataset, "__len__"):
        if train and args.max_steps <= 0:
            raise ValueError(
                f"{name} is an IterableDataset, whose length is unknown; set max_steps in GRPOConfig "
                "(e.g. max_steps=1000) so the trainer knows when to stop and how to schedule the learning rate."
            )
        return
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty; it needs at least one row with a 'prompt'.")
    if has_prompts:
        for i, p in enumerate(dataset[formats.PROMPT_COLUMN]):
            formats.check_prompt(p, i)
    needed = global_batch // group
    if len(dataset) < needed:
        raise ValueError(
            f"{name} has {len(dataset)} prompts but one batch needs {needed} distinct prompts "
            f"({global_batch} completions / {group} per prompt). Add prompts or lower the batch size."
        )
