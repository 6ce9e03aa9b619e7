"""The base of every trainer that samples from the policy while it trains: ``OnlineTrainer``.

GRPO, RLOO and online DPO today, and on-policy distillation and asynchronous GRPO next, share
everything here on top of ``core.BaseTrainer``: the checks of their prompt datasets, the reward
runner and weights, the tool loop, the ``OnlineSampler`` (generation, ``rollout_func``, rewards,
dynamic sampling), the grouped data plan (each prompt's ``num_generations`` completions kept in
one generation batch, also across processes), the rollout metrics, the completions table, and
the reference's public attributes (``reward_funcs``, ``reward_func_names``,
``reward_processing_classes``). A family adds what it does with a scored batch: its advantages
and its loss.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather

from posttrain.agents.environments import check_environment_dataset
from posttrain.core.batch import Rollout
from posttrain.core.trainer import BaseTrainer
from posttrain.data import formats
from posttrain.data.sampling import online_dataloader
from posttrain.data.vision import image_processor_of
from posttrain.generation.base import Generator
from posttrain.generation.reduced_precision import configure_sampler
from posttrain.models import peft as peft_utils
from posttrain.models.loading import image_placeholder_ids, is_vision_model
from posttrain.observe.completions import COMPLETIONS_FILE, IMAGES_FOLDER, CompletionLog
from posttrain.ops.logprobs import completion_logps
from posttrain.ops.reductions import Normalizers
from posttrain.rewards.models import RewardModel, reward_models
from posttrain.sampling import checks, setup
from posttrain.sampling.metrics import batch_tokens, rollout_metrics
from posttrain.sampling.pipeline import OnlineSampler, SamplerSettings
from posttrain.sampling.rollout import ScoredRollout

BUFFER_STATE = "generation_buffer_rank{}.pt"


class OnlineTrainer(BaseTrainer):
    """The shared base of the online trainers (see the module docstring).

    Args:
        model, args, processing_class, peft_config, quantization_config: as ``BaseTrainer``.
        reward_funcs, reward_processing_classes: the rewards (``sampling.setup.build_rewards``).
        train_dataset, eval_dataset: prompt datasets (``sampling.checks``).
        tools, rollout_func, environment_factory: agent training or the user's own sampler.
        callbacks, optimizers: as ``transformers.Trainer``.
    """

    def __init__(
        self,
        model: Any,
        args: Any,
        reward_funcs: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: Any = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        rollout_func: Callable | None = None,
        environment_factory: Any = None,
    ) -> None:
        name = type(self).__name__
        train_dataset = self._check_inputs(
            args, train_dataset, eval_dataset, tools, rollout_func, environment_factory
        )
        # environments may own the reward (get_reward); a judge (online DPO) or a teacher may replace it
        no_reward_needed = self._judged or not self._reward_required
        optional = environment_factory is not None or no_reward_needed
        rewards = setup.build_rewards(reward_funcs, reward_processing_classes, args, optional, name)
        super().__init__(
            model,
            args,
            processing_class,
            peft_config,
            quantization_config,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        checks.check_chat_template(train_dataset, self.processing_class)
        agent = bool(tools) or environment_factory is not None
        checks.check_vision_inputs(
            train_dataset, eval_dataset, self.model, self.processing_class, args, agent
        )
        for reward_model in reward_models(rewards.funcs):
            reward_model.to(self.accelerator.device)
        self.rewards, self.rollout_func, self.agent = rewards, rollout_func, None
        if agent:
            max_length = getattr(self.model.config, "max_position_embeddings", None)
            self.agent = setup.build_agent(
                tools, environment_factory, self._tokenizer, args, max_length, self._eos_token_ids,
                processor=self._image_processor if is_vision_model(self.model) else None,
            )  # fmt: skip
        self.sampler = self._setup_sampler()
        self.reward_weights = setup.build_reward_weights(
            args, len(rewards.funcs), self.sampler.reward_names, name, no_reward_needed
        )
        self._completion_logs = self._setup_completion_logs()
        self.ref_model = self._setup_reference()
        self._buffer: list[ScoredRollout] = []
        self._micro_step = 0

    @staticmethod
    def _check_inputs(
        args: Any, train_dataset: Any, eval_dataset: Any, tools: Any, rollout_func: Any, factory: Any
    ) -> Any:
        """The cheap checks, before any model loads; returns the train dataset (made for environments)."""
        if (bool(tools) or factory is not None) and rollout_func is not None:
            raise ValueError(
                "rollout_func replaces generation, so it cannot be combined with tools or environment_factory, "
                "which need posttrain's tool-calling loop; call the tools inside your rollout_func instead."
            )
        if factory is not None:
            check_environment_dataset(factory, train_dataset, args.max_steps)
            if train_dataset is None:
                train_dataset = checks.episode_dataset(args)
        checks.check_datasets(train_dataset, eval_dataset, args, prompt_optional=factory is not None)
        if rollout_func is not None:
            checks.check_rollout_func_batches(args, eval_dataset is not None)
        checks.settle_streaming_options(args, train_dataset, eval_dataset)
        return train_dataset

    def _setup_sampler(self) -> OnlineSampler:
        a = self.args
        settings = SamplerSettings(
            eos_token_ids=self._eos_token_ids,
            pad_token_id=self._tokenizer.pad_token_id,
            chat_template_kwargs=a.chat_template_kwargs,
            pad_to_multiple_of=a.pad_to_multiple_of if isinstance(a.pad_to_multiple_of, int) else None,
            max_prompt_length=self._prompt_token_budget,
        )
        generator = setup.build_generator(
            a, self.accelerator, lambda: self.model, self._tokenizer, self._eos_token_ids,
            suppress=image_placeholder_ids(self.model), shared_engine=self._shared_vllm_engine,
            processor=self._image_processor,
        )  # fmt: skip
        if self._bf16_sampler_copy:  # under bf16=True on a bf16 CPU: the decode steps on a bf16 copy
            own_sampling = self.agent is None and self.rollout_func is None
            configure_sampler(generator, self.accelerator.unwrap_model(self.model), "float32", own_sampling)
        return OnlineSampler(
            tokenizer=self._tokenizer,
            generator=generator,
            rewards=self.rewards,
            settings=settings,
            metrics=self._metrics,
            device=self.accelerator.device,
            trainer=self,
            agent=self.agent,
            rollout_func=self.rollout_func,
            processor=self._image_processor,
            log_images=a.log_completions and a.log_multimodal,
        )

    @property
    def _image_processor(self) -> Any:
        """The processing class when it processes images (a vision-language model's processor), else None."""
        return self.processing_class if image_processor_of(self.processing_class) is not None else None

    def _setup_completion_logs(self) -> dict[str, CompletionLog]:
        """One completion log per mode with ``log_completions``, none without."""
        if not self.args.log_completions:
            return {}
        size = self.args.generation_batch_size
        images = os.path.join(self.args.output_dir, IMAGES_FOLDER) if self.args.log_multimodal else None
        return {m: CompletionLog(self.accelerator.is_main_process, size, images) for m in ("train", "eval")}

    def _setup_reference(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy when the KL penalty is on (``beta != 0``).

        ``None`` for a PEFT policy: its reference is its own base model, adapters disabled.
        """
        if self.args.beta == 0.0 or peft_utils.is_peft_model(self.model):
            return None
        self._check_reference_sync()
        return self._create_reference()

    #: whether the family learns from rewards (distillation learns from a teacher: rewards optional)
    _reward_required: bool = True

    #: whether ``bf16=True`` on a CPU with bf16 instructions samples from a bf16 copy of the weights
    #: (``reduced_precision.trainer_precision_sampler``: the products autocast would run, without
    #: casting every weight again at every token); for families that do not read the sampler's
    #: log-probs, so only the speed changes. GRPO sets its sampler itself (``sampler_precision``).
    _bf16_sampler_copy: bool = False

    #: with ``use_vllm``: the engine (colocated or a server) this trainer serves its adapter from,
    #: shared with other trainers (``vllm_lora.SharedEngine``; a sweep's run classes set it); None: its own
    _shared_vllm_engine: Any = None

    @property
    def _judged(self) -> bool:
        """Whether a judge orders the completions instead of rewards (online DPO overrides it)."""
        return False

    @property
    def _prompt_token_budget(self) -> int | None:
        """The most prompt tokens a sampled prompt keeps (its last ones); None keeps whole prompts
        (A*-PO overrides it with its ``max_prompt_length``)."""
        return None

    @property
    def generator(self) -> Generator:
        """The generation backend (assign a scripted one in tests)."""
        return self.sampler.generator

    @generator.setter
    def generator(self, value: Generator) -> None:
        self.sampler.generator = value

    @property
    def log_extra_columns(self) -> dict[str, list[Any]]:
        """The columns reward functions added with ``log_extra`` in the last sampled batch."""
        return self.sampler.log_extra_columns

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
    def _reward_names(self) -> list[str]:
        return self.sampler.reward_names

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
        return online_dataloader(dataset, self.args, per_process, group, repeat, shuffle, seed)

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

    def _endless_batches(self) -> Any:
        """Endless per-process generation batches of fresh prompts, for dynamic sampling."""
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

    # ---- sampling and its metrics ---------------------------------------------------------------

    def _sample(self, batch: list[dict[str, Any]], mode: str) -> tuple[Rollout, torch.Tensor]:
        """One completion per row, scored (``sampling.OnlineSampler``): the rollout and [n, F] rewards."""
        group = self.args.num_generations if mode == "train" else self.args.num_generations_eval
        return self.sampler.sample(batch, mode, group)

    def _record_rollout_metrics(
        self, mode: str, rollout: Rollout, rewards: torch.Tensor, adv_metrics: dict[str, float]
    ) -> None:
        tokens = batch_tokens(rollout, self.accelerator.device)
        if mode == "train":
            self.state.num_input_tokens_seen += tokens
        faults = self.rewards.pop_faults()
        m = {"num_tokens": float(self.state.num_input_tokens_seen)}
        m.update(
            rollout_metrics(
                rollout,
                rewards,
                self._reward_names,
                self.reward_weights,
                faults if self.args.reward_fault_policy == "skip" else None,
                self.accelerator.device,
            )
        )
        m.update(adv_metrics)
        self._metrics.add_all(mode, m)

    def _add_completions(self, mode: str, rewards: torch.Tensor, adv: torch.Tensor) -> None:
        """Gather every process's prompts, completions and log_extra columns for the completion log."""
        prompts, completions, extra = self.sampler.gathered_texts()
        columns: dict[str, list[float]] = {}
        for j, name in enumerate(self._reward_names):
            columns[name if name not in columns else f"{name}_{j}"] = rewards[:, j].tolist()
        self._completion_logs[mode].add(
            self.state.global_step, prompts, completions, columns, adv.tolist(), extra
        )

    def _flush_completions(self, mode: str) -> None:
        """Print the completions table and append the rows to the completions file."""
        log = self._completion_logs.get(mode)
        if log is None:
            return
        log.print_table(self.args.num_completions_to_print, self.args.log_unique_prompts)
        name = COMPLETIONS_FILE if mode == "train" else "eval_completions.jsonl"
        log.flush_to_file(os.path.join(self.args.output_dir, name))

    def _before_log(self, mode: str) -> None:
        self._flush_completions(mode)

    def _on_train_end(self) -> None:
        for mode in ("train", "eval"):
            self._flush_completions(mode)

    def _batch_tokens(self, inputs: Any) -> int:
        """FLOPs are not estimated for online steps (generation dominates and varies)."""
        return 0

    # ---- one step: generate, score, buffer ---------------------------------------------------

    def _prepare_inputs(self, batch: list[dict[str, Any]]) -> ScoredRollout:  # type: ignore[override]
        """Generate and score once per ``steps_per_generation * num_iterations`` micro-steps."""
        a = self.args
        period = a.steps_per_generation * a.num_iterations
        if self._micro_step % period == 0 or not self._buffer:
            self._buffer = self._generate_and_score(batch, "train", num_chunks=a.steps_per_generation)
            # an optimizer step comes before the next sampling and makes a reduced-precision copy stale
            release = getattr(self.generator, "release_reduced_copy", None)
            if release is not None and period >= a.gradient_accumulation_steps:
                release()
        micro = self._buffer[self._micro_step % a.steps_per_generation]
        self._micro_step += 1
        return micro

    def _generate_and_score(
        self, batch: list[dict[str, Any]], mode: str, num_chunks: int
    ) -> list[ScoredRollout]:
        """Sample completions for this process's rows, score them, compute advantages, split."""
        a = self.args
        group = a.num_generations if mode == "train" else a.num_generations_eval
        if not (mode == "train" and a.dynamic_sampling):
            rollout, rewards_local = self._sample(batch, mode)
        else:
            if getattr(self, "_refill_iter", None) is None:
                self._refill_iter = self._endless_batches()
            oversample = a.dynamic_sampling_oversample
            candidates = [row for _ in range(oversample - 1) for row in next(self._refill_iter)]
            rollout, rewards_local = self._sample(batch + candidates, mode)  # one generation call
            rollout, rewards_local = self.sampler.refill(
                rollout,
                rewards_local,
                group,
                self.reward_weights,
                a.dynamic_sampling_max_rounds,
                self._refill_iter,
                slots=len(batch) // group,
                oversample=oversample,
                prefer=a.dynamic_sampling_prefer,
            )
        n = rewards_local.shape[0]
        scored = ScoredRollout(rollout=rollout, rewards=rewards_local, advantages=torch.zeros(n))
        self._annotate(scored, batch, mode)
        return self._score_rollout(scored, mode, num_chunks, group)

    def _annotate(self, scored: ScoredRollout, batch: list[dict[str, Any]], mode: str) -> None:
        """A family's per-row additions to a sampled batch, from its dataset rows (one per
        completion, in order), before the split (self-distillation: the teacher's prompts)."""

    def _score_rollout(
        self, scored: ScoredRollout, mode: str, num_chunks: int, group: int
    ) -> list[ScoredRollout]:
        """A sampled, rewarded batch of this process: frozen log-probs, advantages over every
        process, the rollout metrics and completions, the loss normalisers, then the split."""
        rollout, rewards_local, n = scored.rollout, scored.rewards, scored.rewards.shape[0]
        self._attach_frozen_logps(scored, num_chunks, mode)
        rewards = gather(rewards_local.to(self.accelerator.device)).cpu()  # [N, F]
        adv, adv_metrics = self._advantages(scored, rewards, group)  # [N] over every process
        self._record_rollout_metrics(mode, rollout, rewards, adv_metrics)
        period = getattr(self.args, "log_completions_steps", None)  # GOLD, IW-OPD: every that many steps
        if self._completion_logs and (mode != "train" or not period or self.state.global_step % period == 0):
            self._add_completions(mode, rewards, adv)
        start = self.accelerator.process_index * n
        scored.advantages = adv[start : start + n]
        scored.norms = self._normalizers(scored, num_chunks, mode)
        return scored.split(num_chunks)

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The family's advantages of every process's completions.

        Args:
            scored: this process's rows, with their frozen log-probs attached.
            rewards: [N, F] every process's rewards, in process order.
            group: completions per prompt.

        Returns:
            [N] advantages and the metrics to log with the rollout (``frac_reward_zero_std``...).
        """
        raise NotImplementedError(f"{type(self).__name__} must define _advantages.")

    def _normalizers(self, scored: ScoredRollout, num_chunks: int, mode: str) -> Normalizers:
        """The counts each micro-batch's loss is divided by, taken over the whole optimizer step."""
        a = self.args
        mask = self._loss_mask(scored.rollout)
        accumulation = a.gradient_accumulation_steps if mode == "train" else 1
        global_tokens = gather(mask.sum().reshape(1).float()).sum().item()
        return Normalizers(
            tokens=max(global_tokens / num_chunks * accumulation / a.world_size, 1.0),
            sequences=float(scored.advantages.shape[0] // num_chunks * accumulation),
            accumulation=accumulation,
            max_completion_length=a.max_completion_length,
        )

    def _needs_old_logps(self, mode: str) -> bool:
        """Whether the sampling policy's log-probs must be computed now (the step is off-policy)."""
        a = self.args
        on_policy = a.num_iterations == 1 and a.gradient_accumulation_steps % a.steps_per_generation == 0
        return mode == "train" and not on_policy

    def _needs_ref_logps(self) -> bool:
        """Whether the loss needs the reference's log-probs (GRPO, RLOO: a KL, ``beta != 0``)."""
        return self.args.beta != 0.0

    def _attach_frozen_logps(self, scored: ScoredRollout, num_chunks: int, mode: str) -> None:
        """``old_logps`` when needed and, with a KL, ``ref_logps``: one micro-batch of rows at a time."""
        need_old, need_ref = self._needs_old_logps(mode), self._needs_ref_logps()
        if not (need_old or need_ref):
            return
        r = scored.rollout
        n, width = r.completion_ids.shape
        size = n // num_chunks if n % num_chunks == 0 else n
        old, ref = [], []
        for begin in range(0, n, size):
            rows = r.rows(slice(begin, begin + size))
            if need_old:
                old.append(self._frozen_logps(self.model, rows))
            if need_ref:
                with self._as_reference() as reference:
                    ref.append(self._frozen_logps(reference, rows))
        scored.old_logps = _stitch(old, width) if need_old else None
        scored.ref_logps = _stitch(ref, width) if need_ref else None

    @property
    def _loss_temperature(self) -> float:
        """What the loss's log-probs divide the logits by. The sampling temperature for GRPO and
        RLOO (their importance ratio compares the distribution the tokens were drawn from, as in
        the reference); a family whose loss reads the policy itself (online DPO, A*-PO) says 1."""
        return self.args.temperature

    @torch.no_grad()
    def _frozen_logps(self, model: torch.nn.Module, r: Rollout) -> torch.Tensor:
        """Log-probs of a rollout's completions under ``model``, without gradient: [N, T]."""
        out = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            self._loss_temperature,
            model_inputs=r.vision_kwargs(),
        )
        return out.logps

    def _loss_mask(self, rollout: Rollout) -> torch.Tensor:
        """Completion tokens that count in the loss (sampled by the model, not tool results): [N, T]."""
        mask = rollout.model_token_mask
        if self.args.mask_truncated_completions:
            mask = mask * rollout.is_terminated.unsqueeze(1).to(mask.dtype)
        return mask

    def _policy_forward(
        self, model: torch.nn.Module, inputs: ScoredRollout, return_outputs: bool, **options: Any
    ) -> tuple[Any, str]:
        """The start of every family's ``compute_loss``: the micro-batch's completion log-probs
        under ``model`` (at ``_loss_temperature``; ``options`` go to ``completion_logps``) and the mode.

        Raises:
            ValueError: ``return_outputs`` is asked for (no logits are built).
        """
        self._refuse_outputs(return_outputs)
        r = inputs.rollout
        out = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            self._loss_temperature,
            model_inputs=r.vision_kwargs(),
            **options,
        )
        return out, ("train" if model.training else "eval")

    def _with_aux_loss(
        self, loss: torch.Tensor, out: Any, inputs: ScoredRollout, metrics: dict[str, float]
    ) -> torch.Tensor:
        """Add the MoE load-balancing loss (``router_aux_loss_coef``), its share of the accumulated
        step, and log ``aux_loss`` (the mean over processes) in ``metrics``; a dense model: unchanged."""
        if not self.aux_loss_coef or out.aux_loss is None:
            return loss
        aux = out.aux_loss.detach().float().reshape(1).to(self.accelerator.device)
        metrics["aux_loss"] = gather(aux).mean().item()
        return self._plus_aux_loss(loss, out.aux_loss, inputs.norms.accumulation)

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

    def _after_optimizer_step(self) -> None:
        """The reference's sync (TR-DPO), once per optimizer step; the generator learns that the
        weights changed (a reduced-precision copy is rebuilt, vLLM gets the new weights, before
        the next sampling)."""
        weights_changed = getattr(self.generator, "weights_changed", None)
        if weights_changed is not None:
            weights_changed()
        self._sync_reference(self.ref_model)

    def close_generators(self) -> None:
        """Shut down the generation engines this trainer started (a colocated vLLM engine), once
        training is over; a generator without an engine has nothing to close."""
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()

    # ---- hooks of the core -------------------------------------------------------------------

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """Every process's generation buffer (a resume inside it replays the same rollouts) and the
        synced reference."""
        buffer = {"micro_step": self._micro_step, "buffer": self._buffer}
        torch.save(buffer, os.path.join(folder, BUFFER_STATE.format(self.accelerator.process_index)))
        return super()._save_extra_state(folder)  # and the synced reference

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        buffer_path = os.path.join(folder, BUFFER_STATE.format(self.accelerator.process_index))
        if os.path.isfile(buffer_path):  # our own file: rollouts are dataclasses of tensors
            saved = torch.load(buffer_path, map_location=self._load_location, weights_only=False)
            self._micro_step, self._buffer = saved["micro_step"], saved["buffer"]
        super()._load_extra_state(folder, state)


def _stitch(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """Concatenate [n_i, t_i] row blocks (each trimmed to its own longest row) into [sum n_i, width]."""
    padded = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(padded, dim=0)


def _identity(batch: list[Any]) -> list[Any]:
    return batch
