"""ORPOTrainer: Odds Ratio Preference Optimization on the shared core, with no reference model.

Also ``ReferenceFreeTrainer``, what ORPO and CPO share (``CPOTrainer`` extends it). One step,
per micro-batch of N pairs:

```
scores = self._score_pairs(policy, batch)   # the 2N sides in one forward, each prompt once
                                            # (pairs/trainer.py): chunked, no [2N, L, V] logits
out    = the family's loss(PairLogps(ℓ, n), step's pairs and chosen tokens)   # orpo/ or cpo/losses.py
```

The preference term is divided by the optimizer step's pairs and the chosen completions' NLL by
the step's chosen completion tokens, both over every process (``StepCounts``), so gradient
accumulation and several processes give the update of one large batch.

The pair batches, their move to the device, the step's counts and the rewards/logps/logits
metrics are ``pairs/trainer.py``'s (shared with DPO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Sequences
from posttrain.core.trainer import refuse_logit_hooks
from posttrain.ops.logprobs import RowScores
from posttrain.orpo import losses
from posttrain.orpo.config import ORPOConfig, ReferenceFreeConfig
from posttrain.pairs.logps import PairLogps
from posttrain.pairs.trainer import PairBatch, PairTrainer, StepCounts, check_pair_columns

__all__ = ["ORPOTrainer", "ReferenceFreeTrainer"]


class ReferenceFreeTrainer(PairTrainer):
    """Preference pairs trained with no reference model and an NLL on the chosen side (ORPO, CPO).

    A family subclass sets ``_config_class`` and ``_suffix`` and writes ``_pair_loss``.

    Args:
        model: a hub id, a local path, the embedded name, a ``PreTrainedModel`` causal LM or a
            ``PeftModel``.
        args: the family's config; ``None`` builds the defaults with ``output_dir="<model>-<suffix>"``.
        data_collator: maps tokenised rows to a ``PairBatch``; the default right-pads.
        train_dataset: preference pairs: ``prompt``/``chosen``/``rejected`` or implicit-prompt
            ``chosen``/``rejected``, standard or conversational (``data/preference.py``).
        eval_dataset: the same, or a dict of them.
        processing_class: the tokenizer; loaded from the model when ``None``.
        model_init: not supported (``NotImplementedError``): pass the model.
        callbacks: extra ``TrainerCallback`` objects.
        optimizers: ``(optimizer, scheduler)``; AdamW with the config's schedule by default.
        preprocess_logits_for_metrics: needs full logits: not supported (``NotImplementedError``).
        peft_config: a ``peft.PeftConfig``; only the adapter trains.
        compute_metrics: needs full logits: not supported (``NotImplementedError``).
        optimizer_cls_and_kwargs: an optimizer class and its keyword arguments.
    """

    _config_class: ClassVar[type[ReferenceFreeConfig]] = ReferenceFreeConfig
    _suffix: ClassVar[str] = ""

    def __init__(
        self,
        model: str | PreTrainedModel | Any,
        args: ReferenceFreeConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], PairBatch] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
        compute_metrics: Callable | None = None,
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
    ) -> None:
        name = type(self).__name__
        args = args if args is not None else self.default_args(model, self._config_class, self._suffix)
        self._check_arguments(name, model_init, compute_metrics, preprocess_logits_for_metrics)
        check_pair_columns(name, train_dataset, eval_dataset)
        super().__init__(
            model,
            args,
            processing_class,
            peft_config,
            data_collator=data_collator or self._collate,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self._check_decoder_only()
        self._apply_pad_token(args.pad_token)
        self._prepare_pair_datasets()

    # ---- setup ---------------------------------------------------------------------------------

    @staticmethod
    def _check_arguments(
        name: str, model_init: Any, compute_metrics: Any, preprocess_logits_for_metrics: Any
    ) -> None:
        """Refuse the arguments posttrain does not build, before anything loads."""
        if model_init is not None:
            raise NotImplementedError(
                f"{name}(model_init=...) is not supported in posttrain: pass the model (a name, a path or a "
                "PreTrainedModel) as model."
            )
        refuse_logit_hooks(
            name,
            "the loss, the NLL, the rewards, the log-probs and the logits' means",
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )

    def _check_decoder_only(self) -> None:
        """Encoder-decoder models are not built (``is_encoder_decoder``).

        Raises:
            NotImplementedError: the model's config says it is an encoder-decoder model.
        """
        if getattr(self.model.config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"{type(self.model).__name__} is an encoder-decoder model; posttrain's {type(self).__name__} trains "
                "causal language models only. Pass a decoder-only model (AutoModelForCausalLM)."
            )

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: PairBatch,
        return_outputs: bool = False,
        num_items_in_batch: StepCounts | None = None,
    ) -> torch.Tensor:
        """The micro-batch's share of the step's loss.

        With ``num_items_in_batch`` (training) the means run over the step's pairs and chosen
        tokens over every process, and DDP averages gradients over processes, so the share is
        multiplied by their number; without it (evaluation), over the micro-batch.
        """
        self._refuse_outputs(return_outputs)
        rows = inputs.pairs.stacked()
        with self._offloading():
            scores = self._score_pairs(model, inputs, with_metrics=True)
        n = inputs.num_pairs
        logps = PairLogps(
            scores.logps[:n],
            scores.logps[n:],
            chosen_lengths=scores.lengths[:n],
            rejected_lengths=scores.lengths[n:],
        )
        out = self._pair_loss(logps, num_items_in_batch)
        loss = out.loss
        if num_items_in_batch is not None:
            loss = self._as_share_of_step(loss)  # divided by the step's pair count already
        loss = self._plus_aux_loss(loss, scores.stats.aux_loss)
        self._record("train" if model.training else "eval", scores, out, rows, n)
        return loss

    def _pair_loss(self, logps: PairLogps, step: StepCounts | None) -> Any:
        """The family's loss output (``loss``, rewards, the log-probs it used, ``pair_metrics``)."""
        raise NotImplementedError

    def _record(self, mode: str, scores: RowScores, out: Any, rows: Sequences, n: int) -> None:
        """The rewards/logps/logits and token metrics, ``nll_loss`` and the family's per-pair metrics.

        ``logps/*`` are the log-probabilities the loss used (token means for ORPO, SimPO, ...).
        Every value is averaged over every process's pairs (``nll_loss``: over their chosen tokens).
        """
        used = torch.cat([out.chosen_logps, out.rejected_logps])
        m = self._pair_metrics(mode, scores, used, out.chosen_rewards, out.rejected_rewards, rows)
        device = self.accelerator.device
        nll = torch.stack([-scores.logps[:n].detach().sum(), scores.lengths[:n].sum()]).float().to(device)
        nll_sum, tokens = gather(nll.unsqueeze(0)).sum(dim=0).tolist()
        m["nll_loss"] = nll_sum / max(tokens, 1.0)
        for name, values in out.pair_metrics.items():
            m[name] = self.gather_values(values.float()).mean().item()
        self._metrics.add_all(mode, m)


class ORPOTrainer(ReferenceFreeTrainer):
    """Trains a causal LM with ORPO (no reference model); a drop-in for ``trl.experimental.orpo.ORPOTrainer``.

    The loss is ``orpo/losses.orpo_loss``: the chosen completions' NLL minus λ times the mean
    log-sigmoid of the log odds ratio of the length-normalised completion probabilities. Logs
    ``rewards/*`` (β·ℓ̄), ``logps/*`` (ℓ̄), ``logits/*``, ``nll_loss``, ``log_odds_ratio``,
    ``log_odds_chosen``, ``entropy``, ``mean_token_accuracy`` and ``num_tokens``.

    Arguments as ``ReferenceFreeTrainer``'s, with ``args`` an ``ORPOConfig`` (default output
    folder ``<model>-ORPO``); ``args.padding_value`` (when set) pads the batches.
    """

    _tag_names = ["posttrain", "orpo"]
    _config_class = ORPOConfig
    _suffix = "ORPO"

    def _pad_token_id(self) -> int:
        value = self.args.padding_value
        return value if value is not None else super()._pad_token_id()

    def _pair_loss(self, logps: PairLogps, step: StepCounts | None) -> losses.ORPOLossOutput:
        return losses.orpo_loss(
            logps,
            self.args.beta,
            num_pairs=step.pairs if step is not None else None,
            num_tokens=step.chosen_tokens if step is not None else None,
        )
