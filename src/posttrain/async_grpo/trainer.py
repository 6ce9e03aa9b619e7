"""AsyncGRPOTrainer: GRPO with generation running alongside training, on the shared online core.

One optimizer step, top to bottom; the data plan, rewards, metrics and the completions table
are ``sampling.OnlineTrainer``'s::

    background thread: batch k = sample(rows k) with the weights of step max(0, k - S),
                       scored, with the sampler's log-probs and its top-K tokens   # sampler.py
                       (and its truncated supports with top-k / top-p / min-p)
    trainer, step k:   batch k -> group advantages (population std, + 1e-8)      # losses.py
                       loss = score-centred (or clipped) objective against the sampler
                       after the step: publish the weights of step k + 1 to the sampler
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.async_grpo import losses
from posttrain.async_grpo.config import AsyncGRPOConfig
from posttrain.async_grpo.sampler import BackgroundSampler, SampledBatch, sampler_report
from posttrain.models.loading import image_placeholder_ids
from posttrain.observe.metrics import MetricStore, clip_ratios
from posttrain.ops import support
from posttrain.ops.logprobs import PolicyOutput
from posttrain.ops.support import Truncation
from posttrain.rewards.runner import weighted_sum
from posttrain.sampling.pipeline import OnlineSampler
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]

#: Each process's generation batches made before a checkpoint and not yet trained on.
READY_STATE = "async_batches_rank{}.pt"


def _check_async_arguments(
    args: Any, eval_dataset: Any, tools: Any, environment_factory: Any, rollout_func: Any
) -> None:
    """None, once ``args`` is an ``AsyncGRPOConfig`` and nothing asks for what the trainer cannot do yet."""
    if not isinstance(args, AsyncGRPOConfig):
        raise TypeError(
            f"args is a {type(args).__name__}; AsyncGRPOTrainer needs an AsyncGRPOConfig (max_staleness, "
            "score_centering, num_sampler_logprobs)."
        )
    if rollout_func is not None:
        raise NotImplementedError(
            "AsyncGRPOTrainer(rollout_func=...) is not built yet: the background sampler scores its batches with "
            "its own copy of the policy, which a rollout_func's sampler is not. Use GRPOTrainer for a rollout_func."
        )
    if args.use_vllm and (args.world_size > 1 or eval_dataset is not None):
        raise NotImplementedError(
            "AsyncGRPOTrainer with use_vllm=True is built for one training process without an eval_dataset: "
            "the server holds one set of weights, and another process's sampler or an evaluation would load "
            "other weights into it between a batch's push and its request. Use one process and no "
            "eval_dataset, or use_vllm=False."
        )


class AsyncGRPOTrainer(OnlineTrainer):
    """Trainer for asynchronous GRPO: a background sampler generates while the policy trains.

    The reference's public API (``trl.experimental.async_grpo.AsyncGRPOTrainer``), sampling in a
    thread of the training process: with transformers on its own copy of the weights, or (with
    ``use_vllm=True``, ``vllm_mode="server"``) through a vLLM server fed with that copy's weights.
    See ``docs/online.md``.

    Args:
        model: hub id, local path, embedded name, a ``PreTrainedModel`` causal LM or a
            ``peft.PeftModel``.
        reward_funcs: reward functions or reward models (as in ``GRPOTrainer``).
        args: an ``AsyncGRPOConfig``; defaults to one with ``output_dir="<model name>-AsyncGRPO"``.
        train_dataset, eval_dataset: datasets with a ``prompt`` column (text or messages).
        processing_class: the policy's tokenizer; reward_processing_classes: the reward models'.
        callbacks, optimizers, peft_config, quantization_config: as ``GRPOTrainer``.
        tools, environment_factory: tool-calling and environment episodes, run by the background
            sampler (its own tool loop and environments) as ``GRPOTrainer`` runs them.
        rollout_func: not built for the background sampler yet (``NotImplementedError``).
    """

    _tag_names = ["posttrain", "async-grpo"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        peft_config: Any = None,
        quantization_config: Any = None,
        tools: list[Callable] | None = None,
        environment_factory: Any = None,
        rollout_func: Callable | None = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, AsyncGRPOConfig, "AsyncGRPO")
        _check_async_arguments(args, eval_dataset, tools, environment_factory, rollout_func)
        super().__init__(
            model=model,
            args=args,
            reward_funcs=reward_funcs,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            environment_factory=environment_factory,
        )
        self._agent_parts = (tools, environment_factory)
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self._truncation = Truncation(args.top_k, args.top_p, args.min_p)
        self._built_generator = self.sampler.generator
        self.background: BackgroundSampler | None = None
        self._resumed: list[SampledBatch] = []

    # ---- the background sampler ----------------------------------------------------------------

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``transformers.Trainer.train``; the background sampler stops when it returns or fails."""
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_background()

    def _stop_background(self) -> None:
        if self.background is not None:
            self.background.stop()
            self.background = None

    def _start_background(self, step: int) -> None:
        """A sampler on a copy of the policy as it is now (after ``step`` optimizer steps)."""
        a = self.args
        own = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval().requires_grad_(False)
        store = MetricStore()
        runner = copy.copy(self.rewards)  # its own fault counts: the thread scores alongside evaluation
        runner.faults = {}
        generator = self.sampler.generator
        if generator is self._built_generator and a.use_vllm:  # the server, fed with the copy's weights
            generator = copy.copy(generator)
            generator.get_model, generator.sync, generator.stale = (lambda: own), None, True
        elif generator is self._built_generator:  # not replaced by the user: generate with the copy
            from posttrain.sampling import setup

            generator = setup.build_generator(
                a, self.accelerator, lambda: own, self._tokenizer, self._eos_token_ids,
                suppress=image_placeholder_ids(own), processor=self._image_processor,
            )  # fmt: skip
        sampler = OnlineSampler(
            tokenizer=self._tokenizer,
            generator=generator,
            rewards=runner,
            settings=self.sampler.settings,
            metrics=store,
            device=self.accelerator.device,
            trainer=self,
            agent=self._background_agent(),
            processor=self._image_processor,
            collective=False,
        )
        ready = [b for b in self._resumed if b.index >= step]
        self._resumed = []
        self.background = BackgroundSampler(
            model=own,
            sampler=sampler,
            metrics=store,
            batches=self._batch_rows,
            first_index=max([b.index + 1 for b in ready], default=step),
            version=step,
            max_staleness=a.max_staleness,
            group=a.num_generations,
            temperature=a.temperature,
            num_logprobs=a.num_sampler_logprobs,
            timeout=a.weight_sync_timeout,
            ready=ready,
            last_index=self.state.max_steps if self.state.max_steps > 0 else None,
            truncation=self._truncation,
        )
        self.background.start()

    def _background_agent(self) -> Any:
        """The background sampler's own tool loop, with its own environments (evaluation runs the
        trainer's on the main thread meanwhile); None without tools or environments."""
        if self.agent is None:
            return None
        from posttrain.sampling import setup

        max_length = getattr(self.model.config, "max_position_embeddings", None)
        return setup.build_agent(
            self._agent_parts[0],
            self._agent_parts[1],
            self._tokenizer,
            self.args,
            max_length,
            self._eos_token_ids,
        )

    def _batch_rows(self, start: int) -> Iterator[list[dict[str, Any]]]:
        """This process's rows of generation batches ``start``, ``start + 1``, ... across epochs."""
        a = self.args
        loader = self._dataloader(
            self.train_dataset,
            per_process=a.per_device_train_batch_size * a.steps_per_generation,
            group=a.num_generations,
            repeat=1,
            shuffle=a.shuffle_dataset,
        )
        epoch, skip = divmod(start, len(loader))
        while True:
            loader.set_epoch(epoch)
            for i, rows in enumerate(loader):
                if i >= skip:
                    yield rows
            epoch, skip = epoch + 1, 0

    def _prepare_inputs(self, batch: list[dict[str, Any]]) -> ScoredRollout:  # type: ignore[override]
        """The micro-batches of the background sampler's batch for this optimizer step (the
        dataloader's rows only pace the loop: the sampler reads the same plan ahead)."""
        a = self.args
        if self._micro_step % a.steps_per_generation == 0 or not self._buffer:
            self._buffer = self._take_batch(self.state.global_step)
        micro = self._buffer[self._micro_step % a.steps_per_generation]
        self._micro_step += 1
        return micro

    def _take_batch(self, step: int) -> list[ScoredRollout]:
        a = self.args
        if self.background is None:
            self._start_background(step)
        got = self.background.get(step)
        staleness = step - got.version
        if not 0 <= staleness <= a.max_staleness:  # the sampler's rule makes this impossible
            raise RuntimeError(
                f"batch {step} was sampled {staleness} steps ago; max_staleness={a.max_staleness}"
            )
        for name, count in got.faults.items():
            self.rewards.faults[name] = self.rewards.faults.get(name, 0) + count
        self._metrics.add_all("train", got.metrics)
        self._metrics.add_all(
            "train", {"batch/staleness": float(staleness), "batch/sampler_version": float(got.version)}
        )
        self.sampler.sampled_text = got.texts  # the completions table reads the last sampled texts
        scored = ScoredRollout(
            rollout=got.rollout,
            rewards=got.rewards,
            advantages=torch.zeros(got.rewards.shape[0]),
            sampler_logps=got.sampler_logps,
            sampler_top_logps=got.sampler_top_logps,
            sampler_top_ids=got.sampler_top_ids,
            sampler_support=got.sampler_support,
        )
        return self._score_rollout(scored, "train", a.steps_per_generation, a.num_generations)

    def _after_optimizer_step(self) -> None:
        """Hand the new weights to the background sampler (in memory)."""
        super()._after_optimizer_step()
        if self.background is not None:
            state = self.accelerator.unwrap_model(self.model).state_dict()
            self.background.publish(self.state.global_step, state)

    # ---- advantages and loss --------------------------------------------------------------------

    def _needs_old_logps(self, mode: str) -> bool:
        """Never: the old log-probs are the sampler's own."""
        return False

    def _needs_ref_logps(self) -> bool:
        return False

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The reference's group advantages of every process's rewards."""
        total = weighted_sum(rewards, self.reward_weights)
        adv = losses.group_advantages(total, group)
        zero_std = (total.view(-1, group).std(dim=1, unbiased=False) == 0).float().mean().item()
        return adv, {"frac_reward_zero_std": zero_std}

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The score-centred (or clipped) objective of one micro-batch against its sampler."""
        a, r = self.args, inputs.rollout
        if inputs.sampler_logps is None:  # evaluation samples with the policy itself
            with torch.no_grad():
                (inputs.sampler_logps, inputs.sampler_top_logps, inputs.sampler_top_ids,
                 inputs.sampler_support) = sampler_report(
                    model, r, a.temperature, a.num_sampler_logprobs, self._truncation
                )  # fmt: skip
        out, mode = self._renormalised_forward(model, inputs, return_outputs)
        mask = self._loss_mask(r).to(out.logps.dtype)
        lo, hi = a.vllm_importance_sampling_clip_min, a.vllm_importance_sampling_clip_max
        if a.score_centering:
            loss, stats = losses.score_centred_loss(
                out.logps, out.extra_logps, inputs.sampler_logps, inputs.sampler_top_logps, inputs.advantages,
                mask, lo, hi, inputs.norms,
            )  # fmt: skip
        else:
            loss, stats = losses.masked_clipped_loss(
                out.logps, inputs.sampler_logps, inputs.advantages, mask, a.epsilon, self.epsilon_high, lo, hi,
                inputs.norms,
            )  # fmt: skip
        metrics = self._loss_metrics(out, inputs, mask, stats)
        loss = self._with_aux_loss(loss, out, inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _renormalised_forward(
        self, model: torch.nn.Module, inputs: ScoredRollout, return_outputs: bool
    ) -> tuple[PolicyOutput, str]:
        """The policy's log-probs of the tokens (and of the sampler's top tokens with score
        centering), renormalised on the sampler's truncated support when it has one: the paper
        index's Keep Sampling Mask, ``log pi_S(v) = log pi(v) - log sum_{u in S} pi(u)``."""
        top_ids = inputs.sampler_top_ids if self.args.score_centering else None
        kept = inputs.sampler_support
        parts = [t for t in (top_ids, None if kept is None else support.gather_ids(kept)) if t is not None]
        extra = torch.cat(parts, dim=-1) if parts else None
        out, mode = self._policy_forward(model, inputs, return_outputs, with_entropy=True, extra_ids=extra)
        if kept is None:
            return out, mode
        k = 0 if top_ids is None else top_ids.shape[-1]
        log_mass = support.support_log_mass(out.extra_logps[..., k:], kept)  # [B, T], with gradient
        top = out.extra_logps[..., :k] - log_mass.unsqueeze(-1) if k else None
        return replace(out, logps=out.logps - log_mass, extra_logps=top), mode

    def _loss_metrics(
        self, out: Any, inputs: ScoredRollout, mask: torch.Tensor, stats: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """Token means over every process: ``entropy``, ``kl`` (sampler to policy, ``log mu - log pi``),
        the importance ratio and the share of tokens its bounds mask; the clip ratios when clipping."""
        diff = (inputs.sampler_logps.to(out.logps.dtype) - out.logps.detach()) * mask
        ratio = stats["ratio"] * mask
        values = {
            "entropy": (out.entropy.detach() * mask).sum(),
            "kl": diff.sum(),
            "sampling/importance_sampling_ratio/mean": ratio.sum(),
            "sampling/masked_ratio": (stats["masked"].to(mask.dtype) * mask).sum(),
        }
        local = torch.stack([*values.values(), mask.sum()]).float().to(self.accelerator.device)
        totals = gather(local.unsqueeze(0)).sum(dim=0).tolist()
        tokens = max(totals[-1], 1.0)
        metrics = {name: total / tokens for name, total in zip(values, totals[:-1], strict=False)}
        if "low" in stats:
            metrics.update(self._clip_ratios(stats, mask))
        return metrics

    def _clip_ratios(self, stats: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, float]:
        """``observe.metrics.clip_ratios`` of every process's completions, weighted by their tokens."""
        low, high = stats["low"].to(mask.dtype), stats["high"].to(mask.dtype)
        counted = mask.sum(dim=1)  # [B]
        fractions = [
            ((x * mask).sum(dim=1) / counted.clamp(min=1.0)) for x in (low, high, torch.maximum(low, high))
        ]
        local = torch.stack([*fractions, counted], dim=1).float().to(self.accelerator.device)
        low_f, high_f, region_f, counts = gather(local).cpu().unbind(dim=1)  # [N] each
        return clip_ratios(low_f, high_f, region_f, counts / counts.sum().clamp(min=1.0))

    # ---- checkpoints ----------------------------------------------------------------------------

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """The shared state, and the batches made with weights older than the checkpoint's and not yet
        trained on (a resume samples nothing again with weights it no longer has)."""
        state = super()._save_extra_state(folder)
        step = self.state.global_step
        ready = (
            self.background.ready_until(step + self.args.max_staleness) if self.background is not None else []
        )
        saved = {"max_staleness": self.args.max_staleness, "batches": [b for b in ready if b.index >= step]}
        torch.save(saved, os.path.join(folder, READY_STATE.format(self.accelerator.process_index)))
        return state

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        super()._load_extra_state(folder, state)
        path = os.path.join(folder, READY_STATE.format(self.accelerator.process_index))
        if not os.path.isfile(path):
            return
        saved = torch.load(path, map_location=self._load_location, weights_only=False)  # our own file
        if saved["max_staleness"] != self.args.max_staleness:
            raise ValueError(
                f"{folder} was saved with max_staleness={saved['max_staleness']}, this run has "
                f"max_staleness={self.args.max_staleness}; resume with the same value."
            )
        self._resumed = saved["batches"]
