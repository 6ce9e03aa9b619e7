"""GRPOTrainer: Group Relative Policy Optimization on the shared core (``core.BaseTrainer``).

One training step, top to bottom (``_prepare_inputs`` then ``compute_loss``)::

    rollout, rewards = sampler.sample(rows)               # sampling/: generate (or tools), score
    adv     = advantages.compute(gathered rewards, ...)    # pure function
    chunks  = ScoredRollout(rollout, rewards, adv).split(steps_per_generation)
    loss    = grpo_loss(policy output, chunk, ...)         # pure: objectives + regularizers

``transformers.Trainer`` brings the optimisation loop, callbacks and integrations; the core
brings model loading, guards, crash-safe checkpoints and metrics; ``sampling.OnlineSampler``
brings generation, tools and rewards; ``sampling.OnlineTrainer`` the data plan (groups kept
whole), the generation buffer and the frozen log-probs. This class supplies the advantages, the
loss and its metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.generation import reduced_precision
from posttrain.grpo import advantages, regularizers
from posttrain.grpo.config import GRPOConfig
from posttrain.grpo.loss import LossSettings, grpo_loss
from posttrain.grpo.metrics import loss_metrics
from posttrain.sampling.metrics import combine_step_metrics, reduce_sampling_metrics
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


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
        precision = getattr(args, "sampler_precision", "float32")
        reduced_precision.check_sampler_sources(precision, tools, rollout_func, environment_factory)
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
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.loss_settings = replace(loss_settings, aux_loss_coef=self.aux_loss_coef)
        #: what the decode steps sample with ("float32", or the reduced copy's "int8"/"fp16"/"bf16")
        own_sampling = not (tools or rollout_func is not None or environment_factory is not None)
        self.sampler_precision = reduced_precision.configure_sampler(
            self.generator, self.accelerator.unwrap_model(self.model), precision, own_sampling
        )
        self.entropy_coef = float(args.entropy_coef)
        self._step_entropy: list[float] = []
        self._step_sampling: list[dict[str, float]] = []  # one optimizer step's sampling/* metrics

    # ---- advantages and loss ---------------------------------------------------------------

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Group-relative advantages of every process's rewards (``grpo.advantages``)."""
        a = self.args
        return advantages.compute(
            rewards, self.reward_weights, group, a.scale_rewards, a.multi_objective_aggregation
        )

    # ---- loss --------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The GRPO loss of one micro-batch (already normalised for accumulation and processes)."""
        a, r = self.args, inputs.rollout
        out, mode = self._policy_forward(
            model,
            inputs,
            return_outputs,
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
            reduced = reduce_sampling_metrics(result.sampling, device)
            if mode == "train":  # the step's max and min are over all its micro-batches
                self._step_sampling.append(reduced)
            else:
                self._metrics.add_all(mode, combine_step_metrics([reduced]))
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
        if self._step_sampling:
            self._metrics.add_all("train", combine_step_metrics(self._step_sampling))
            self._step_sampling = []
        super()._after_optimizer_step()

    # ---- hooks of the core -------------------------------------------------------------------

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """The shared state (generation buffer, synced reference) and the adaptive entropy coefficient."""
        return {**super()._save_extra_state(folder), "entropy_coef": self.entropy_coef}

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        super()._load_extra_state(folder, state)
        if state is not None:
            self.entropy_coef = float(state["entropy_coef"])
