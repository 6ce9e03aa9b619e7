"""GRPOTrainer: Group Relative Policy Optimization on the shared core (``core.BaseTrainer``).

One training step, top to bottom (``_prepare_inputs`` then ``compute_loss``)::

    rollout, rewards = sampler.sample(rows)               # sampling/: generate (or tools), score
    adv     = advantages.compute(gathered rewards, ...)    # pure function
    chunks  = ScoredRollout(rollout, rewards, adv).split(steps_per_generation)
    loss    = grpo_loss(policy output, chunk, ...)         # pure: objectives + regularizers

``transformers.Trainer`` brings the optimisation loop, callbacks and integrations; the core
brings model loading, guards, crash-safe checkpoints and metrics; ``sampling.OnlineSampler``
brings generation, tools and rewards. This class supplies the data plan (groups kept whole),
the generation buffer, the advantages, the loss and its metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Rollout
from posttrain.grpo import advantages, objectives, regularizers
from posttrain.grpo.config import GRPOConfig
from posttrain.grpo.loss import LossSettings, grpo_loss
from posttrain.grpo.metrics import loss_metrics
from posttrain.grpo.rollout import ScoredRollout
from posttrain.models import peft as peft_utils
from posttrain.models import reference as model_options
from posttrain.ops.logprobs import completion_logps
from posttrain.sampling.metrics import reduce_sampling_metrics
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]
BUFFER_STATE = "generation_buffer_rank{}.pt"


class GRPOTrainer(OnlineTrainer):
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
        args = args if args is not None else self.default_args(model, GRPOConfig, "GRPO")
        loss_settings = LossSettings.from_config(args)
        super().__init__(
            model,
            args,
            reward_funcs,
            train_dataset,
            eval_dataset,
            processing_class,
            reward_processing_classes,
            callbacks,
            optimizers,
            quantization_config,
            peft_config,
            tools,
            rollout_func,
            environment_factory,
        )
        aux = model_options.set_router_aux_loss_coef(self.model, args.router_aux_loss_coef)
        self.loss_settings = replace(loss_settings, aux_loss_coef=aux)
        self.ref_model = self._setup_reference()
        self.entropy_coef = float(args.entropy_coef)
        self._step_entropy: list[float] = []
        self._buffer: list[ScoredRollout] = []
        self._micro_step = 0

    # ---- setup -------------------------------------------------------------------------------

    def _setup_reference(self) -> torch.nn.Module | None:
        """A frozen copy of the initial policy when the KL penalty is on (``beta != 0``).

        ``None`` for a PEFT policy: its reference is its own base model, adapters disabled.
        """
        a = self.args
        if a.beta == 0.0 or peft_utils.is_peft_model(self.model):
            return None
        self._check_reference_sync()
        return self._create_reference()

    # ---- the reference's attributes ------------------------------------------------------------

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
        a = self.args
        group = a.num_generations if mode == "train" else a.num_generations_eval
        rollout, rewards_local = self._sample(batch, mode)
        if mode == "train" and a.dynamic_sampling:
            if getattr(self, "_refill_iter", None) is None:
                self._refill_iter = self._endless_batches()
            rollout, rewards_local = self.sampler.refill(
                rollout,
                rewards_local,
                group,
                self.reward_weights,
                a.dynamic_sampling_max_rounds,
                self._refill_iter,
            )
        rewards = gather(rewards_local.to(self.accelerator.device)).cpu()  # [N, F]
        adv, adv_metrics = advantages.compute(
            rewards, self.reward_weights, group, a.scale_rewards, a.multi_objective_aggregation
        )
        n = rewards_local.shape[0]
        start = self.accelerator.process_index * n
        self._record_rollout_metrics(mode, rollout, rewards, adv_metrics)
        if self._completion_logs:
            self._add_completions(mode, rewards, adv)
        scored = ScoredRollout(rollout=rollout, rewards=rewards_local, advantages=adv[start : start + n])
        return self._prepare_chunks(scored, num_chunks, mode)

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
            out, inputs, self._loss_mask(r), self.loss_settings, self.entropy_coef, self.gather_values
        )
        if mode == "train" and "entropy_bonus" in result.scalars:
            self._step_entropy.append(result.scalars["entropy_bonus"])
        device = self.accelerator.device
        s = self.loss_settings
        m = loss_metrics(
            result.per_completion, result.scalars, a, s.entropy_regularized, self.entropy_coef, device
        )
        self._metrics.add_all(mode, m)
        if result.sampling:
            self._metrics.add_all(mode, reduce_sampling_metrics(result.sampling, device))
        return result.loss

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
        population = self.gather_values(entropies.detach()[mask.bool()].float())
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
        self._sync_reference(self.ref_model)

    # ---- hooks of the core -------------------------------------------------------------------

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """Every process's generation buffer (a resume inside it replays the same rollouts), the
        synced reference, and the adaptive entropy coefficient."""
        buffer = {"micro_step": self._micro_step, "buffer": self._buffer}
        torch.save(buffer, os.path.join(folder, BUFFER_STATE.format(self.accelerator.process_index)))
        if self.ref_model is not None and self.args.sync_ref_model:
            self._save_reference(folder, self.ref_model)
        return {"entropy_coef": self.entropy_coef}

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        buffer_path = os.path.join(folder, BUFFER_STATE.format(self.accelerator.process_index))
        if os.path.isfile(buffer_path):  # our own file: rollouts are dataclasses of tensors
            saved = torch.load(buffer_path, map_location=self._load_location, weights_only=False)
            self._micro_step, self._buffer = saved["micro_step"], saved["buffer"]
        if state is not None:
            self.entropy_coef = float(state["entropy_coef"])
        if self.ref_model is not None:
            self._load_reference(folder, self.ref_model)
