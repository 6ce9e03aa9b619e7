"""RLOOTrainer: REINFORCE Leave-One-Out (and REINFORCE++) on the shared online core.

One training step, top to bottom; everything but the two marked lines is
``sampling.OnlineTrainer``'s, shared with GRPO::

    rollout, rewards = sampler.sample(rows)                 # generate (or tools), score
    old, ref = frozen log-probs of the rows                 # with beta > 0: the KL in the reward
    adv      = rloo_advantages(gathered rewards, KL sums)   # RLOO: leave-one-out (losses.py)
    loss     = sequence_clipped_loss(policy logps, chunk)   # RLOO: one ratio per completion
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.observe.metrics import clip_ratios
from posttrain.rloo import losses
from posttrain.rloo.config import RLOOConfig
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


class RLOOTrainer(OnlineTrainer):
    """Trainer for REINFORCE Leave-One-Out (RLOO) and REINFORCE++ (``normalize_advantages=True``).

    The public API is TRL's: a script written for ``trl.RLOOTrainer`` runs after changing the
    import. Everything but the advantage and the loss is shared with ``GRPOTrainer``: reward
    functions and reward models, tools and environments, ``rollout_func``, PEFT, scale-out,
    exact resume. See ``docs/rloo.md``.

    Args:
        model: hub id, local path, embedded name (``"smollm2-135m-instruct"``), a
            ``PreTrainedModel`` causal LM or a ``peft.PeftModel``.
        reward_funcs: one or a list of reward functions (``f(prompts, completions, **kwargs) ->
            list[float | None]``) or reward models (a path or id of a sequence classifier, or
            the model).
        args: an ``RLOOConfig``; defaults to one with ``output_dir="<model name>-RLOO"``.
        train_dataset, eval_dataset: datasets with a ``prompt`` column (text or messages); other
            columns reach the reward functions as keyword arguments.
        processing_class: the policy's tokenizer; loaded from the model when ``None``.
        reward_processing_classes: tokenizers of the reward models, aligned with
            ``reward_funcs``; ``None`` loads each reward model's own.
        callbacks: extra ``TrainerCallback`` s.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        quantization_config: a transformers quantization config to load ``model`` by name
            (QLoRA, with ``peft_config``).
        peft_config: a ``peft.PeftConfig``; with ``beta > 0`` the KL reference is the base model
            with the adapters disabled.
        tools, rollout_func, environment_factory: as ``GRPOTrainer`` (``docs/agents.md``).
    """

    _bf16_sampler_copy = True  # its loss never reads the sampler's log-probs

    _tag_names = ["posttrain", "rloo"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: RLOOConfig | None = None,
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
        args = args if args is not None else self.default_args(model, RLOOConfig, "RLOO")
        if not isinstance(args, RLOOConfig):
            raise TypeError(
                f"args is a {type(args).__name__}; RLOOTrainer needs an RLOOConfig (its defaults and fields "
                "differ from GRPOConfig's: num_generations=2, beta=0.05, normalize_advantages)."
            )
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
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon

    # ---- advantages ----------------------------------------------------------------------------

    def _needs_old_logps(self, mode: str) -> bool:
        """Off-policy steps, and any step with a KL: the penalty uses the sampling policy's log-probs."""
        return super()._needs_old_logps(mode) or self.args.beta != 0.0

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Leave-one-out advantages of every process's rewards, the KL folded in (``losses``)."""
        a = self.args
        kl, metrics = None, {}
        if a.beta != 0.0:
            mask = self._loss_mask(scored.rollout).to(scored.old_logps.dtype)
            local = losses.kl_sums(scored.old_logps, scored.ref_logps, mask)  # [n]
            device = self.accelerator.device
            kl = gather(local.to(device)).cpu()  # [N]
            tokens = gather(mask.sum().reshape(1).to(device)).sum().item()
            metrics["kl"] = kl.sum().item() / max(tokens, 1.0)
        adv, adv_metrics = losses.rloo_advantages(
            rewards, self.reward_weights, group, kl, a.beta, a.reward_clip_range, a.normalize_advantages
        )
        return adv, {**adv_metrics, **metrics}

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The RLOO loss of one micro-batch (already normalised for accumulation and processes)."""
        a = self.args
        out, mode = self._policy_forward(model, inputs, return_outputs, with_entropy=True)
        mask = self._loss_mask(inputs.rollout).to(out.logps.dtype)
        old = inputs.old_logps if inputs.old_logps is not None else out.logps.detach()
        loss, stats = losses.sequence_clipped_loss(
            out.logps, old, inputs.advantages, mask, a.epsilon, self.epsilon_high, inputs.norms
        )
        metrics = self._loss_metrics(out.entropy, mask, stats)
        loss = self._with_aux_loss(loss, out, inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _loss_metrics(
        self, entropy: torch.Tensor, mask: torch.Tensor, stats: dict[str, torch.Tensor]
    ) -> dict[str, float]:
        """``entropy`` (token mean) and the clip ratios of every process's completions
        (``observe.metrics.clip_ratios``: one ratio per completion, so each weighs ``1 / N``)."""
        device = self.accelerator.device
        sums = torch.stack([(entropy.detach() * mask).sum(), mask.sum()]).float().to(device)
        entropy_sum, tokens = gather(sums.unsqueeze(0)).sum(dim=0).tolist()
        local = torch.stack([stats[k].float() for k in ("low", "high", "region")], dim=1).to(device)
        low, high, region = gather(local).cpu().unbind(dim=1)  # [N] each, every process's completions
        weight = torch.full_like(low, 1.0 / max(len(low), 1))
        return {"entropy": entropy_sum / max(tokens, 1.0), **clip_ratios(low, high, region, weight)}
