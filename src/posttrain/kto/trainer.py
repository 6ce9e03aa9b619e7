"""KTOTrainer: Kahneman-Tversky Optimization from unpaired, labelled completions, on the shared core.

One step, per micro-batch of N examples (``data/unpaired.py`` collates them):

```
examples = prompt_i + completion_i                      # [N, L], loss mask on the completions
kl       = prompt_i + completion_(i-1)                  # the mismatched pairs of the same batch
logps    = score_rows(policy, examples)                 # ops/logprobs: chunked, no [N, L, V] logits
z0       = max(0, mean(policy(kl) - reference(kl)))     # no gradient, over every process's pairs
ref      = reference(examples)                          # the copy, the adapters-off base, or precomputed
loss     = kto_loss(logps, ref, labels, z0, ...)        # kto/losses.py: one pure table
```

The loss of a micro-batch is its examples' share of the optimizer step's examples over every
process, so gradient accumulation and several processes weigh every example alike. z₀ is a
property of each micro-batch (the paper's estimate), so a different split of the same examples
into micro-batches changes z₀; the normalisation stays exact.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Sequences
from posttrain.core.trainer import BaseTrainer, check_offline_datasets, refuse_logit_hooks
from posttrain.data import preference_vision, unpaired
from posttrain.data.unpaired import UnpairedBatch
from posttrain.kto import losses
from posttrain.kto.config import KTOConfig
from posttrain.models import loading
from posttrain.ops.logprobs import RowScores, score_rows

__all__ = ["KTOTrainer"]


class KTOTrainer(BaseTrainer):
    """Trains a causal LM on desirable and undesirable completions with KTO; a drop-in for ``trl.KTOTrainer``.

    Args:
        model: a hub id, a local path, the embedded name, a ``PreTrainedModel`` or a ``PeftModel``.
        ref_model: the reference (a model or a name); ``None`` means a frozen copy of ``model`` as
            given (the adapters-off base with PEFT; none at all when the reference log-probs are
            precomputed).
        args: a ``KTOConfig``; ``None`` builds the defaults with ``output_dir="<model>-KTO"``.
        data_collator: maps tokenised rows to an ``UnpairedBatch``; the default right-pads and
            builds the KL pairs inside the batch.
        train_dataset: unpaired ``prompt``/``completion``/``label`` rows, or preference pairs
            (``chosen``/``rejected``, split into examples), standard or conversational
            (``data/unpaired.py``).
        eval_dataset: the same, or a dict of them.
        processing_class: the tokenizer; loaded from the model when ``None``.
        compute_metrics: needs full logits: not supported (``NotImplementedError``).
        callbacks: extra ``TrainerCallback`` objects.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        optimizer_cls_and_kwargs: an optimizer class and its keyword arguments.
        preprocess_logits_for_metrics: needs full logits: not supported.
        peft_config: a ``peft.PeftConfig``; only the adapter trains.
    """

    _tag_names = ["posttrain", "kto"]

    def __init__(
        self,
        model: str | PreTrainedModel | Any,
        ref_model: str | PreTrainedModel | None = None,
        args: KTOConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], UnpairedBatch] | None = None,
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
        args = args if args is not None else self.default_args(model, KTOConfig, "KTO")
        refuse_logit_hooks(
            "KTOTrainer",
            "the loss, kl, the rewards, the log-probs and the logits' means",
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if train_dataset is None:
            raise ValueError(
                "KTOTrainer needs a train_dataset: unpaired prompt/completion/label rows, or chosen/rejected pairs."
            )
        self._vision = _check_datasets(train_dataset, eval_dataset, args)
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
        self.loss_spec = losses.LOSS_TYPES[args.loss_type]
        self._map_datasets(self._prepare)
        self._warn_on_imbalance()
        self.ref_model = self._offline_reference(ref_model)
        if args.precompute_ref_log_probs:
            self._precompute_all()
            self.ref_model = None  # no longer needed: the columns hold its log-probs

    # ---- setup ---------------------------------------------------------------------------------

    def _prepare(self, dataset: Any) -> Any:
        a = self.args
        if self._vision:  # examples with images are encoded batch by batch (data/preference_vision.py)
            columns = list(dataset.column_names)
            paired = unpaired.detect_unpaired_format(columns, dataset[0]) == "paired"
            return unpaired.unpair(dataset) if paired else dataset
        return unpaired.prepare_unpaired_dataset(
            dataset, self._tokenizer, max_length=a.max_length, num_proc=a.dataset_num_proc
        )

    def _warn_on_imbalance(self) -> None:
        """The paper's rule, λ_D n_D / (λ_U n_U) in [1, 4/3], checked on the training set."""
        labels = [bool(v) for v in unpaired.column_values(self.train_dataset, "label")]
        desirable = sum(labels)
        advice = losses.balance_advice(
            desirable, len(labels) - desirable, self.args.desirable_weight, self.args.undesirable_weight
        )
        if advice is not None:
            warnings.warn(advice, UserWarning, stacklevel=3)

    def _precompute_all(self) -> None:
        """Score the train and eval examples (and KL pairs) with the reference, once."""
        a = self.args
        self.train_dataset = self._precompute_reference(self.train_dataset, a.per_device_train_batch_size)
        self._map_eval(lambda dataset: self._precompute_reference(dataset, a.per_device_eval_batch_size))

    @torch.no_grad()
    def _precompute_reference(self, dataset: Any, batch_size: int) -> Any:
        """Add ``ref_logps`` (and, for KL losses, ``kl_completion_ids`` and ``ref_kl_logps``) to a dataset.

        The KL pairs are fixed here: each row with the previous row of its chunk of
        ``batch_size`` rows, the pairs collation gives batches drawn in order.
        """
        if self._vision:  # rows as the dataset gives them (images decoded)
            rows = [dict(dataset[i]) for i in range(len(dataset))]
        else:
            rows = dataset.to_list() if hasattr(dataset, "to_list") else [dict(row) for row in dataset]
        columns: dict[str, list[Any]] = {}
        if self.loss_spec.uses_kl:
            partners = unpaired.kl_partners(len(rows), batch_size)
            completions = [self._completion_ids(row) for row in rows]
            columns[unpaired.KL_COLUMN] = [completions[p] for p in partners]
            for row, completion in zip(rows, columns[unpaired.KL_COLUMN], strict=True):
                row[unpaired.KL_COLUMN] = completion
        size = self.args.precompute_ref_batch_size or batch_size
        ref: list[float] = []
        ref_kl: list[float] = []
        for start in range(0, len(rows), size):
            batch = self._prepare_inputs(self._collate(rows[start : start + size]))
            scores = self._reference_scores(batch.stacked())
            n = batch.num_examples
            ref += scores[:n].tolist()
            ref_kl += scores[n:].tolist()
        columns[unpaired.REF_COLUMNS[0]] = ref
        if self.loss_spec.uses_kl:
            columns[unpaired.REF_COLUMNS[1]] = ref_kl
        if isinstance(dataset, list):
            return [{**row, **{k: v[i] for k, v in columns.items()}} for i, row in enumerate(dataset)]
        for name, values in columns.items():
            dataset = dataset.add_column(name, values)
        return dataset

    # ---- data ----------------------------------------------------------------------------------

    def _completion_ids(self, row: dict[str, Any]) -> list[int]:
        """A row's completion tokens (a row with images is encoded now, as its batch would be)."""
        if self._vision:
            return self._encode_example(row)[0]["completion_ids"]
        return list(row["completion_ids"])

    def _encode_example(self, row: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return preference_vision.encode_example(row, self.processing_class, max_length=self.args.max_length)

    def _set_signature_columns_if_needed(self) -> None:
        if self._vision:
            self._signature_columns = list(preference_vision.VISION_EXAMPLE_COLUMNS)
            return
        self._signature_columns = [*unpaired.OUTPUT_COLUMNS, unpaired.KL_COLUMN, *unpaired.REF_COLUMNS]

    def _collate(self, rows: list[dict[str, Any]]) -> UnpairedBatch:
        if self._vision:
            return preference_vision.collate_examples(
                [self._encode_example(row) for row in rows],
                self._tokenizer.pad_token_id,
                self.args.pad_to_multiple_of,
                with_kl=self.loss_spec.uses_kl,
                max_length=self.args.max_length,
            )
        return unpaired.collate_unpaired(
            rows,
            self._tokenizer.pad_token_id,
            self.args.pad_to_multiple_of,
            with_kl=self.loss_spec.uses_kl,
            max_length=self.args.max_length,
        )

    def _prepare_inputs(self, inputs: UnpairedBatch) -> UnpairedBatch:  # type: ignore[override]
        return inputs.to(self.accelerator.device)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """Examples in the optimizer step's micro-batches, summed over every process."""
        local = sum(b.num_examples for b in batch_samples)
        return gather(torch.tensor([local], device=device)).sum()

    def _batch_tokens(self, inputs: UnpairedBatch) -> int:
        kl = inputs.kl.input_ids.numel() if inputs.kl is not None else 0
        return int(inputs.examples.input_ids.numel() + kl)

    # ---- scoring -------------------------------------------------------------------------------

    def _score(self, model: torch.nn.Module, rows: Sequences, train: bool) -> RowScores:
        """Per-row completion log-probs, with the metrics' per-token statistics when training or evaluating."""
        with self._offloading() if train else contextlib.nullcontext():
            return score_rows(model, rows, with_metrics=train)

    @torch.no_grad()
    def _reference_scores(self, rows: Sequences) -> torch.Tensor:
        """[rows] the reference's summed completion log-probs."""
        with self._as_reference() as reference:
            return self._score(reference, rows, train=False).logps

    def _reference_for(self, inputs: UnpairedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference's log-probs of the examples and of the KL pairs: precomputed, else scored now."""
        if inputs.ref_logps is not None:
            return inputs.ref_logps.float(), inputs.ref_kl_logps
        scores = self._reference_scores(inputs.stacked())
        n = inputs.num_examples
        return scores[:n], (scores[n:] if inputs.kl is not None else None)

    def _kl(
        self, model: torch.nn.Module, inputs: UnpairedBatch, ref_kl: torch.Tensor | None
    ) -> torch.Tensor | None:
        """z₀ from the policy's and the reference's log-probs of the KL pairs, over every process."""
        if not self.loss_spec.uses_kl:
            return None
        with torch.no_grad():
            policy_kl = self._score(model, inputs.kl, train=False).logps
        return losses.kl_estimate(policy_kl, ref_kl, all_reduce=self._sum_over_processes)

    def _sum_over_processes(self, values: torch.Tensor) -> torch.Tensor:
        if self.accelerator.num_processes == 1:
            return values
        return gather(values.to(self.accelerator.device).unsqueeze(0)).sum(dim=0)

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: UnpairedBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The micro-batch's examples' share of the step's KTO loss.

        ``num_items_in_batch`` is the step's examples over every process; DDP averages gradients
        over processes, so the share is multiplied by their number.
        """
        self._refuse_outputs(return_outputs)
        train = model.training
        scores = self._score(model, inputs.examples, train=True)
        ref, ref_kl = self._reference_for(inputs)
        a = self.args
        out = losses.kto_loss(
            scores.logps,
            ref,
            inputs.labels,
            loss_type=a.loss_type,
            beta=a.beta,
            desirable_weight=a.desirable_weight,
            undesirable_weight=a.undesirable_weight,
            kl=self._kl(model, inputs, ref_kl),
        )
        loss = out.loss
        n = inputs.num_examples
        if num_items_in_batch is not None and train:
            loss = self._as_share_of_step(loss, n, float(num_items_in_batch))
        loss = self._plus_aux_loss(loss, scores.stats.aux_loss)
        self._record("train" if train else "eval", scores, out, inputs)
        return loss

    def _record(self, mode: str, scores: RowScores, out: losses.KTOOutput, inputs: UnpairedBatch) -> None:
        """The reference's KTO metrics, each over the examples of its kind on every process."""
        stats = scores.stats
        mask = scores.mask
        logit_sums = (
            (stats.logit_mean * mask).sum(1)
            if stats.logit_mean is not None
            else torch.zeros_like(scores.logps)
        )
        columns = torch.stack(
            [
                inputs.labels.float(),
                out.rewards.float(),
                scores.logps.detach().float(),
                logit_sums.float(),
                scores.lengths.float(),
            ],
            dim=1,
        )  # [N, 5]
        g = self.gather_values(columns.reshape(-1)).view(-1, 5)
        m: dict[str, float] = {}
        for kind, rows in (("chosen", g[:, 0] > 0.5), ("rejected", g[:, 0] <= 0.5)):
            if rows.any():
                m[f"rewards/{kind}"] = g[rows, 1].mean().item()
                m[f"logps/{kind}"] = g[rows, 2].mean().item()
                m[f"logits/{kind}"] = (g[rows, 3].sum() / g[rows, 4].sum().clamp(min=1)).item()
        if "rewards/chosen" in m and "rewards/rejected" in m:
            m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
        # apo_zero_unpaired has no KL term: its z0 is 0, and it is logged as 0, as in the reference
        # (a dashboard reading `kl` finds the key under every loss type)
        m["kl"] = float(out.kl) if out.kl is not None else 0.0
        m.update(self._token_metrics(mode, stats, mask, inputs.examples))
        self._metrics.add_all(mode, m)

    # ---- per step and checkpoints ---------------------------------------------------------------

    def _after_optimizer_step(self) -> None:
        """TR-DPO's reference sync, once per optimizer step."""
        self._sync_reference(self.ref_model)


def _check_datasets(train_dataset: Any, eval_dataset: Any, args: Any) -> bool:
    """The datasets' columns, first rows and labels, before any model is loaded; whether they have images."""

    def first_row(name: str, dataset: Any) -> None:
        columns = list(getattr(dataset, "column_names", None) or dataset[0])
        if unpaired.detect_unpaired_format(columns, dataset[0]) == "unpaired":
            unpaired.check_labels(unpaired.column_values(dataset, "label"), name)

    def images(name: str) -> None:
        preference_vision.check_vision_pair_options(args, name)

    return check_offline_datasets("KTOTrainer", train_dataset, eval_dataset, "example", first_row, images)
