"""OnlineDPOTrainer: online DPO on the shared online core.

One training step, top to bottom; the sampling, the reference's log-probs and the buffer are
``sampling.OnlineTrainer``'s, shared with GRPO and RLOO::

    rollout, rewards = sampler.sample(rows)          # two completions of each prompt, scored
    first_chosen     = scores or judge, per pair     # _advantages: +1 chosen, -1 rejected
    loss             = DPO loss table on the pairs   # online_dpo/losses.py -> dpo/losses.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from accelerate.utils import broadcast_object_list, gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Rollout
from posttrain.models import loading
from posttrain.online_dpo import losses
from posttrain.online_dpo.config import OnlineDPOConfig
from posttrain.sampling.rollout import ScoredRollout
from posttrain.sampling.trainer import OnlineTrainer

if TYPE_CHECKING:
    from peft import PeftModel

RewardFunc = Callable[..., list[float | None]]


class PairwiseJudge(Protocol):
    """What ``OnlineDPOTrainer(judge=...)`` calls: the reference's pairwise-judge interface.

    ``judge(prompts, completions)`` gets the prompts (text: a conversation is rendered with the
    policy's chat template) and, for each, its two completions as texts; it returns, for each
    prompt, the index (0 or 1) of the better completion. A judge is called on the main process
    with every process's pairs, and its answer is shared with the others.
    """

    def judge(self, prompts: list[str], completions: list[list[str]]) -> list[int]: ...


_NOT_BUILT = ("data_collator", "compute_metrics", "preprocess_logits_for_metrics")


class OnlineDPOTrainer(OnlineTrainer):
    """Trainer for online DPO: two completions per prompt from the policy, judged, then DPO.

    The reference's public API (``trl.experimental.online_dpo.OnlineDPOTrainer``). See
    ``docs/online.md``.

    Args:
        model: hub id, local path, embedded name, a ``PreTrainedModel`` causal LM or a
            ``peft.PeftModel``.
        ref_model: the reference: a model, a name to load, or ``None`` for a frozen copy of the
            policy (the base with the adapters off under PEFT).
        reward_funcs: reward functions or reward models scoring each completion (as in GRPO); the
            higher score is chosen. ``args.reward_model_path`` is used when this is ``None``.
        judge: a pairwise judge (``PairwiseJudge``) choosing within each pair, instead of rewards.
        args: an ``OnlineDPOConfig``; defaults to one with ``output_dir="<model name>-OnlineDPO"``.
        data_collator, compute_metrics, preprocess_logits_for_metrics: the reference's arguments;
            not built (they raise ``NotImplementedError`` when given).
        train_dataset, eval_dataset: datasets with a ``prompt`` column (text or messages).
        processing_class: the policy's tokenizer; reward_processing_classes: the reward models'.
        peft_config, callbacks, optimizers, quantization_config: as ``GRPOTrainer``.
    """

    _bf16_sampler_copy = True  # its loss never reads the sampler's log-probs

    _tag_names = ["posttrain", "online-dpo"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the accumulated batch itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        ref_model: str | PreTrainedModel | None = None,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        judge: PairwiseJudge | None = None,
        args: OnlineDPOConfig | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        peft_config: Any = None,
        compute_metrics: Any = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        preprocess_logits_for_metrics: Any = None,
        quantization_config: Any = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, OnlineDPOConfig, "OnlineDPO")
        reward_funcs = self._check_sources(args, reward_funcs, judge)
        given = {"data_collator": data_collator, "compute_metrics": compute_metrics}
        given["preprocess_logits_for_metrics"] = preprocess_logits_for_metrics
        for name in _NOT_BUILT:
            if given[name] is not None:
                raise NotImplementedError(
                    f"OnlineDPOTrainer({name}=...) is not built in posttrain: the pairs are collated from the "
                    f"sampled completions and the metrics are the reference's. Leave {name}=None."
                )
        self.judge = judge
        self._given_ref_model = ref_model
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
        )

    @staticmethod
    def _check_sources(args: Any, reward_funcs: Any, judge: Any) -> Any:
        """Exactly one way to order a pair: reward functions (or ``reward_model_path``), or a judge."""
        if not isinstance(args, OnlineDPOConfig):
            raise TypeError(f"args is a {type(args).__name__}; OnlineDPOTrainer needs an OnlineDPOConfig.")
        has_rewards = reward_funcs is not None and reward_funcs != []
        if judge is not None and (has_rewards or args.reward_model_path is not None):
            raise ValueError(
                "OnlineDPOTrainer got both a judge and rewards (reward_funcs or reward_model_path); each pair is "
                "ordered one way: pass the judge alone, or the rewards alone."
            )
        if judge is not None and not callable(getattr(judge, "judge", None)):
            raise TypeError(
                f"judge is a {type(judge).__name__} without a judge(prompts, completions) method; pass an object "
                "whose judge() returns, for each prompt, the index (0 or 1) of the better completion."
            )
        if not has_rewards and args.reward_model_path is not None:
            return [args.reward_model_path]
        if not has_rewards and judge is None:
            raise ValueError(
                "OnlineDPOTrainer needs a way to order each pair of completions: pass reward_funcs (callables or "
                "reward models), set OnlineDPOConfig(reward_model_path=...), or pass judge=... ."
            )
        return reward_funcs

    @property
    def _judged(self) -> bool:
        """A ``judge`` given to the trainer orders each pair instead of rewards."""
        return self.judge is not None  # set before OnlineTrainer.__init__, which reads this

    @property
    def _loss_temperature(self) -> float:
        """1: DPO compares the policy's and the reference's own log-probs, as the reference library
        and the paper do; ``temperature`` shapes the sampling only (DPO has no importance ratio
        for it to belong to)."""
        return 1.0

    def _setup_reference(self) -> torch.nn.Module | None:
        """The given ``ref_model`` (or one loaded by name), else a frozen copy (PEFT: the base)."""
        return self._offline_reference(self._given_ref_model)

    # ---- data: per_device_train_batch_size counts prompts, each sampled twice ---------------------

    def get_train_dataloader(self) -> Any:
        """Per-process batches of ``per_device_train_batch_size`` prompts, each repeated twice."""
        a = self.args
        return self._dataloader(
            self.train_dataset, 2 * a.per_device_train_batch_size, 2, 1, a.shuffle_dataset
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Evaluation batches of ``per_device_eval_batch_size`` prompts, each sampled twice, in order."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._dataloader(dataset, 2 * self.args.per_device_eval_batch_size, 2, 1, False)

    def _sample(self, batch: list[dict[str, Any]], mode: str) -> tuple[Rollout, torch.Tensor]:
        """The shared sampling, then each prompt cut on the left to fit ``max_length`` when scored."""
        rollout, rewards = super()._sample(batch, mode)
        limit = self.args.max_length
        keep = max(limit - rollout.completion_ids.shape[1], 1) if limit is not None else None
        if keep is not None and rollout.prompt_ids.shape[1] > keep:
            if rollout.vision is not None:
                _check_images_kept(rollout, keep, loading.image_placeholder_ids(self.model), limit)
            rollout = replace(
                rollout, prompt_ids=rollout.prompt_ids[:, -keep:], prompt_mask=rollout.prompt_mask[:, -keep:]
            )
        return rollout, rewards

    # ---- which completion of each pair is chosen ---------------------------------------------------

    def _advantages(
        self, scored: ScoredRollout, rewards: torch.Tensor, group: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """[N] +1 on each pair's chosen completion and -1 on its rejected one, from the scores or the judge."""
        a, device = self.args, self.accelerator.device
        _check_pairs(scored.rollout)
        terminated = gather(scored.rollout.is_terminated.to(device)).cpu()  # [N]
        metrics = {
            "val/contain_eos_token": terminated.float().mean().item(),
            "beta": a.beta_at(self.state.epoch),
        }
        if self.judge is not None:
            first = self._judge_pairs()
        else:
            scores = losses.completion_scores(rewards, self.reward_weights, terminated, a.missing_eos_penalty)
            first = losses.first_is_chosen(scores)
            pairs = scores.view(-1, 2)
            margin = torch.where(first, pairs[:, 0] - pairs[:, 1], pairs[:, 1] - pairs[:, 0])
            metrics.update(
                {"objective/scores": scores.mean().item(), "objective/scores_margin": margin.mean().item()}
            )
            n, start = scored.rewards.shape[0], self.accelerator.process_index * scored.rewards.shape[0]
            scored.extra["scores"] = scores[start : start + n]
        labels = torch.stack([first, ~first], dim=1).flatten().float() * 2.0 - 1.0  # [N]
        return labels, metrics

    def _judge_pairs(self) -> torch.Tensor:
        """[N / 2] bool: the judge's choice of every process's pairs, made on the main process."""
        prompts, completions, _ = self.sampler.gathered_texts()
        answer: list[Any] = [None]
        if self.accelerator.is_main_process:
            texts = [self._prompt_text(p) for p in prompts[0::2]]
            pairs = [
                [_completion_text(x), _completion_text(y)]
                for x, y in zip(completions[0::2], completions[1::2], strict=True)
            ]
            answer = [list(self.judge.judge(texts, pairs))]
            bad = [(i, v) for i, v in enumerate(answer[0]) if v not in (0, 1)]
            if len(answer[0]) != len(pairs) or bad:
                raise ValueError(
                    f"{type(self.judge).__name__}.judge returned {len(answer[0])} answers for {len(pairs)} pairs"
                    f"{f', and {bad[0][1]!r} for pair {bad[0][0]}' if bad else ''}; it must return 0 or 1 (the index "
                    "of the better completion) for each prompt."
                )
        broadcast_object_list(answer)
        return torch.tensor(answer[0]) == 0

    def _prompt_text(self, prompt: Any) -> str:
        if isinstance(prompt, str):
            return prompt
        kwargs = self.args.chat_template_kwargs or {}
        return self._tokenizer.apply_chat_template(
            prompt, tokenize=False, add_generation_prompt=True, **kwargs
        )

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: ScoredRollout,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The DPO loss of the micro-batch's pairs (its share of the step's mean over pairs)."""
        a = self.args
        out, mode = self._policy_forward(model, inputs, return_outputs)
        mask = self._loss_mask(inputs.rollout).to(out.logps.dtype)
        seq = (out.logps * mask).sum(dim=1)  # [B]
        ref = (inputs.ref_logps.to(out.logps.dtype) * mask).sum(dim=1)  # [B]
        first = inputs.advantages.view(-1, 2)[:, 0] > 0  # [B / 2]
        beta = a.beta_at(self.state.epoch)
        pairs = losses.pair_logps(seq, ref, first)
        result = losses.online_dpo_loss(pairs, a.loss_type, beta)
        loss = result.loss * seq.shape[0] / inputs.norms.sequences  # mean over the step's pairs
        metrics = self._pair_metrics(pairs, seq.detach(), seq.detach() - ref, inputs, beta)
        loss = self._with_aux_loss(loss, out, inputs, metrics)
        self._metrics.add_all(mode, metrics)
        return loss

    def _pair_metrics(
        self, pairs: Any, seq: torch.Tensor, kl: torch.Tensor, inputs: ScoredRollout, beta: float
    ) -> dict[str, float]:
        """The reference's metrics over every process's pairs, the log-probs over the real tokens only.

        Per completion: ``objective/kl`` (summed log-ratio to the reference), ``objective/entropy``
        (minus the summed log-prob), ``objective/non_score_reward`` (``-beta * kl``) and, with
        rewards, ``objective/rlhf_reward`` (score + non-score reward). Per pair: ``rewards/*`` and
        ``logps/*`` of the chosen and rejected completions.
        """
        chosen = beta * (pairs.chosen - pairs.ref_chosen).detach()
        rejected = beta * (pairs.rejected - pairs.ref_rejected).detach()
        per_completion = {
            "objective/kl": kl,
            "objective/entropy": -seq,
            "objective/non_score_reward": -beta * kl,
        }
        if "scores" in inputs.extra:
            per_completion["objective/rlhf_reward"] = inputs.extra["scores"].to(kl) - beta * kl
        per_pair = {
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            "rewards/accuracies": (chosen > rejected).to(kl),
            "rewards/margins": chosen - rejected,
            "logps/chosen": pairs.chosen.detach(),
            "logps/rejected": pairs.rejected.detach(),
        }
        values = [v.sum() for v in per_completion.values()] + [v.sum() for v in per_pair.values()]
        local = torch.stack([*values, torch.tensor(float(kl.numel())).to(kl)]).float()
        totals = gather(local.to(self.accelerator.device).unsqueeze(0)).sum(dim=0).tolist()
        completions = totals[-1]
        names = [*per_completion, *per_pair]
        return {
            name: total / (completions if name in per_completion else completions / 2)
            for name, total in zip(names, totals[:-1], strict=False)
        }


def _check_images_kept(rollout: Rollout, keep: int, image_ids: list[int], limit: int) -> None:
    """Refuse a left cut of the prompts (to ``keep`` tokens) that would remove image tokens."""
    cut = rollout.prompt_ids[:, :-keep][rollout.prompt_mask[:, :-keep].bool()]
    if image_ids and torch.isin(cut, torch.tensor(image_ids, device=cut.device)).any():
        raise ValueError(
            f"max_length={limit} leaves room for {keep} prompt tokens before the {rollout.completion_ids.shape[1]} "
            "completion tokens, and cutting the prompts on the left to fit would remove image tokens of a prompt "
            "with images. Raise max_length (or set it to None), or use smaller images."
        )


def _check_pairs(rollout: Rollout) -> None:
    """Rows ``2k`` and ``2k + 1`` must be two completions of one prompt (the data plan's promise)."""
    ids, mask = rollout.prompt_ids, rollout.prompt_mask
    if ids.shape[0] % 2 or not (torch.equal(ids[0::2] * mask[0::2], ids[1::2] * mask[1::2])):
        raise RuntimeError(
            "online DPO's rows are not pairs of completions of one prompt; please report this."
        )


def _completion_text(completion: Any) -> str:
    """A completion as text: a string as is, an assistant message list by its contents."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion)
