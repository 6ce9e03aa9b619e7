"""DPOTrainer: Direct Preference Optimization and its published variants on the shared core.

One step, per micro-batch of N pairs:

```
sides  = chosen + rejected, 2N sequences in one forward         # pairs/trainer._score_pairs: each
                                                                 # prompt once, or packed (padding_free)
stats  = chunked completion log-probs                            # ops/logprobs: no [2N, L, V] logits
logps  = sum of completion-token log-probs per side (LD-DPO: ld_logps)
ref    = the same under the reference (a copy, the adapters-off base, or precomputed columns)
loss   = dpo_loss(PairLogps(...), loss_type, ...)                # dpo/losses.py: one pure table
```

The loss of a micro-batch is its pairs' share of the optimizer step's pairs over every process,
so gradient accumulation and several processes give the update of one large batch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Sequences
from posttrain.core.trainer import refuse_logit_hooks
from posttrain.data import preference
from posttrain.dpo import losses
from posttrain.dpo.config import DPOConfig
from posttrain.models import loading
from posttrain.ops.logprobs import RowScores
from posttrain.pairs.trainer import PairBatch, PairTrainer, StepCounts, check_pair_columns

__all__ = ["DPOTrainer"]

BCO_STATE = "bco_running_mean.pt"


class DPOTrainer(PairTrainer):
    """Trains a causal LM on preference pairs with the DPO family of losses; a drop-in for ``trl.DPOTrainer``.

    Args:
        model: a hub id, a local path, the embedded name, a ``PreTrainedModel`` or a ``PeftModel``.
        ref_model: the reference; ``None`` means a frozen copy of ``model`` as given (the
            adapters-off base with PEFT; none at all when the loss uses no reference or the
            reference log-probs are precomputed).
        args: a ``DPOConfig``; ``None`` builds the defaults with ``output_dir="<model>-DPO"``.
        data_collator: maps tokenised rows to a ``PairBatch``; the default right-pads.
        train_dataset: preference pairs: ``prompt``/``chosen``/``rejected`` or implicit-prompt
            ``chosen``/``rejected``, standard or conversational (``data/preference.py``).
        eval_dataset: the same, or a dict of them.
        processing_class: the tokenizer; loaded from the model when ``None``.
        compute_metrics: needs full logits: not supported (``NotImplementedError``).
        callbacks: extra ``TrainerCallback`` objects.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        optimizer_cls_and_kwargs: an optimizer class and its keyword arguments.
        preprocess_logits_for_metrics: needs full logits: not supported.
        peft_config: a ``peft.PeftConfig``; only the adapter trains.
    """

    _tag_names = ["posttrain", "dpo"]

    def __init__(
        self,
        model: str | PreTrainedModel | Any,
        ref_model: str | PreTrainedModel | None = None,
        args: DPOConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], PairBatch] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, DPOConfig, "DPO")
        refuse_logit_hooks(
            "DPOTrainer",
            "the loss, the rewards, the log-probs and the logits' means",
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self._vision = check_pair_columns("DPOTrainer", train_dataset, eval_dataset, args)
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
        loading.check_reads_images(self.model, self.processing_class, self._vision)
        self._apply_pad_token(args.pad_token)
        self.loss_types, self.loss_weights = losses.check_loss_settings(
            args.loss_type,
            args.loss_weights,
            args.f_divergence_type,
            args.label_smoothing,
            args.ld_alpha,
            args.use_weighting,
        )
        self._bco = losses.RunningMean() if "bco_pair" in self.loss_types else None
        if args.padding_free:
            self._check_packable_attention("padding_free")
        self._prepare_pair_datasets()
        # Every loss type keeps a reference, "sft" alone too: the logged rewards are log-ratios
        # against it (rewards/chosen = beta * (log pi - log pi_ref)), as in the reference library.
        needed = not _has_ref_columns(self.train_dataset)
        self.ref_model = self._offline_reference(ref_model) if needed else None
        if args.precompute_ref_log_probs and not _has_ref_columns(self.train_dataset):
            self.train_dataset = self._precompute_reference(self.train_dataset)
            self._map_eval(self._precompute_reference)
            self.ref_model = None  # no longer needed: the columns hold its log-probs

    # ---- setup ---------------------------------------------------------------------------------

    @torch.no_grad()
    def _precompute_reference(self, dataset: Any) -> Any:
        """Score every training pair with the reference once; add ``ref_chosen_logps`` / ``ref_rejected_logps``."""
        a = self.args
        size = a.precompute_ref_batch_size or a.per_device_train_batch_size
        rows = [dataset[i] for i in range(len(dataset))]
        chosen: list[float] = []
        rejected: list[float] = []
        for start in range(0, len(rows), size):
            batch = self._prepare_inputs(self._collate(rows[start : start + size]))
            ref = self._reference_scores(batch)
            n = batch.num_pairs
            chosen += ref[:n].tolist()
            rejected += ref[n:].tolist()
        return dataset.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)

    # ---- scoring -------------------------------------------------------------------------------

    def _score(self, model: torch.nn.Module, inputs: PairBatch, train: bool) -> RowScores:
        """Per-side completion log-probs (chosen sides first), with what the metrics and WPO need."""
        with self._offloading() if train else contextlib.nullcontext():
            scores = self._score_pairs(
                model, inputs, with_metrics=train, with_log_sq_norm=train and self.args.use_weighting
            )
        if self.args.ld_alpha is not None:
            scores.logps = self._ld_logps(scores)
        return scores

    def _ld_logps(self, scores: RowScores) -> torch.Tensor:
        """LD-DPO: the tokens past the shorter completion of each pair weighted by ``ld_alpha``."""
        n = scores.lengths.shape[0] // 2
        public = torch.minimum(scores.lengths[:n], scores.lengths[n:]).repeat(2)
        return losses.ld_logps(scores.token_logps, scores.mask, public, self.args.ld_alpha)

    @torch.no_grad()
    def _reference_scores(self, inputs: PairBatch) -> torch.Tensor:
        """[2N] the reference's completion log-probs (LD-weighted like the policy's)."""
        with self._as_reference() as reference:
            return self._score(reference, inputs, train=False).logps

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: PairBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The micro-batch's pairs' share of the step's DPO loss.

        ``num_items_in_batch`` is the step's pairs over every process; DDP averages gradients
        over processes, so the share is multiplied by their number.
        """
        self._refuse_outputs(return_outputs)
        train = model.training
        rows = inputs.pairs.stacked()
        scores = self._score(model, inputs, train=True)
        n = inputs.num_pairs
        ref = self._reference_for(inputs)
        step: StepCounts | None = num_items_in_batch if train else None
        # sft's share: the micro-batch's chosen log-probs over the step's chosen tokens, once the
        # pair share below (n / step pairs) is applied
        sft_tokens = n * step.chosen_tokens / step.pairs if step is not None else None
        out = losses.dpo_loss(
            losses.PairLogps(
                scores.logps[:n], scores.logps[n:],
                ref[:n] if ref is not None else None, ref[n:] if ref is not None else None,
                scores.lengths[:n], scores.lengths[n:],
            ),
            self.loss_types,
            beta=self.args.beta,
            loss_weights=self.loss_weights,
            label_smoothing=self.args.label_smoothing,
            f_divergence_type=self.args.f_divergence_type,
            f_alpha_divergence_coef=self.args.f_alpha_divergence_coef,
            discopop_tau=self.args.discopop_tau,
            pair_weights=self._wpo_weights(scores, n),
            bco_delta=self._bco.value if self._bco is not None else 0.0,
            sft_tokens=sft_tokens,
        )  # fmt: skip
        loss = out.loss
        if step is not None:
            loss = self._as_share_of_step(loss, n, step.pairs)
        loss = self._plus_aux_loss(loss, scores.stats.aux_loss)
        if self._bco is not None and train:
            self._bco.update(torch.cat([out.chosen_rewards, out.rejected_rewards]))
        self._record("train" if train else "eval", scores, out, rows, n)
        return loss

    def _reference_for(self, inputs: PairBatch) -> torch.Tensor:
        """[2N] reference log-probs: precomputed columns, else scored now (for the loss, and for the
        logged rewards, log-ratios, even when the loss reads none: ``"sft"`` alone)."""
        if inputs.ref_chosen is not None:
            return torch.cat([inputs.ref_chosen, inputs.ref_rejected]).to(torch.float32)
        return self._reference_scores(inputs)

    def _wpo_weights(self, scores: RowScores, n: int) -> torch.Tensor | None:
        """WPO: ``w_chosen * w_rejected`` per pair (no gradient), when ``use_weighting``."""
        if not self.args.use_weighting:
            return None
        w = losses.wpo_weights(scores.token_logps.detach(), scores.stats.log_sq_norm, scores.mask)
        return w[:n] * w[n:]

    def _record(self, mode: str, scores: RowScores, out: Any, rows: Sequences, n: int) -> None:
        """The reference's DPO metrics, averaged over every process's pairs."""
        m = self._pair_metrics(mode, scores, scores.logps, out.chosen_rewards, out.rejected_rewards, rows)
        if len(self.loss_types) > 1:  # each type's mean over every process's pairs
            names = list(out.per_type)
            local = torch.stack([*(out.per_type[k].float() * n for k in names), torch.tensor(float(n))])
            totals = gather(local.to(self.accelerator.device).unsqueeze(0)).sum(dim=0)
            m.update({f"loss/{k}": (totals[i] / totals[-1]).item() for i, k in enumerate(names)})
        self._metrics.add_all(mode, m)

    # ---- per step and checkpoints ---------------------------------------------------------------

    def _after_optimizer_step(self) -> None:
        """TR-DPO's reference sync, once per optimizer step."""
        self._sync_reference(self.ref_model)

    def _save_extra_state(self, folder: str) -> dict[str, Any]:
        """The synced reference (TR-DPO, the core's) and bco_pair's running reward mean."""
        values = super()._save_extra_state(folder)
        if self._bco is not None and self.args.should_save:
            torch.save(self._bco.state_dict(), os.path.join(folder, BCO_STATE))
        return values

    def _load_extra_state(self, folder: str, state: dict[str, Any] | None) -> None:
        super()._load_extra_state(folder, state)
        path = os.path.join(folder, BCO_STATE)
        if self._bco is not None and os.path.isfile(path):
            self._bco.load_state_dict(torch.load(path, map_location="cpu"))


def _has_ref_columns(dataset: Any) -> bool:
    columns = getattr(dataset, "column_names", None)
    if columns is None and isinstance(dataset, list) and dataset:
        columns = list(dataset[0])
    return bool(columns) and all(c in columns for c in preference.REF_COLUMNS)
