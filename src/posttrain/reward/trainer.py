"""RewardTrainer: a sequence classifier trained on preference pairs to score texts, on the shared core.

One step, per micro-batch of N pairs:

```
rows    = chosen + rejected sequences stacked into one [2N, L] batch (right padded)
scores  = model(rows).logits[:, 0]                 # the head's logit at each row's last non-pad token
loss    = pair_losses(scores[:N], scores[N:], margin, η)   # reward/losses.py
```

The loss of a micro-batch is its pairs' share of the optimizer step's pairs over every process,
so gradient accumulation and several processes give the update of one large batch.

Data (the contract of TRL 1.16's ``RewardTrainer``): ``chosen`` and ``rejected``, with an
optional ``prompt`` that is put before each (the prompt is not needed: a reward model scores the
whole text), standard (strings; the EOS token is appended) or conversational (messages rendered
with the chat template); or pre-tokenised ``chosen_ids`` / ``rejected_ids`` taken as they are.
An optional ``margin`` column holds a float per pair. A pair with a side longer than
``max_length`` tokens is dropped, not truncated (the score is read at the last token), and the
drops are counted in a warning.

The model is a sequence classifier with one label (``BaseTrainer._model_kind``); a causal LM
given by name gets a new score head. Its ``config.pad_token_id`` is set to the tokenizer's pad
token, which pads the batches, so that the score is read at the last real token; the trained
model, saved with ``save_model``, is a reward model for ``GRPOTrainer(reward_funcs=<folder>)``.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback, set_seed

from posttrain.core.batch import Pairs, Sequences
from posttrain.core.trainer import BaseTrainer, check_offline_datasets, refuse_logit_hooks
from posttrain.data.reward import (
    TEXT_COLUMNS,
    TOKENISED_COLUMNS,
    RewardBatch,
    collate_reward_pairs,
    prepare_reward_dataset,
    tokenize_reward_row,
)
from posttrain.models import loading
from posttrain.models import peft as peft_utils
from posttrain.ops import checkpointing
from posttrain.reward import losses
from posttrain.reward.config import RewardConfig

__all__ = ["RewardBatch", "RewardTrainer", "collate_reward_pairs", "prepare_reward_dataset"]

#: The score heads of transformers' sequence classifiers (decoders: ``score``; encoders: ``classifier``).
HEAD_NAMES = ("score", "classifier")


class RewardTrainer(BaseTrainer):
    """Trains a reward model (a sequence classifier) on preference pairs; a drop-in for ``trl.RewardTrainer``.

    Args:
        model: a hub id, a local path or an embedded name (loaded with
            ``AutoModelForSequenceClassification``, ``num_labels=1``; a causal LM checkpoint gets a
            new score head, with a warning), a sequence-classification ``PreTrainedModel`` with
            one label, or a ``PeftModel`` of one.
        args: a ``RewardConfig``; ``None`` builds the defaults with ``output_dir="<model>-Reward"``.
        data_collator: maps tokenised rows to a ``RewardBatch``; the default right-pads.
        train_dataset: preference pairs (module doc): ``chosen``/``rejected`` with an optional
            ``prompt``, standard or conversational, or ``chosen_ids``/``rejected_ids``; an optional
            float ``margin`` column.
        eval_dataset: the same, or a dict of them.
        processing_class: the tokenizer; loaded from the model when ``None``.
        compute_metrics: needs the evaluation's rewards as predictions: not supported
            (``NotImplementedError``); the metrics are logged instead.
        callbacks: extra ``TrainerCallback`` objects.
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        optimizer_cls_and_kwargs: an optimizer class and its keyword arguments.
        preprocess_logits_for_metrics: not supported (``NotImplementedError``).
        peft_config: a ``peft.PeftConfig``; the adapter and the score head train. Without
            ``task_type="SEQ_CLS"`` the head is added to ``modules_to_save``, with a warning.

    Raises:
        ValueError: no or a bad dataset, a model that is not a one-label sequence classifier, a
            frozen score head, an ``eos_token`` outside the vocabulary, or a PEFT task type
            other than ``SEQ_CLS``.
    """

    _tag_names = ["posttrain", "reward"]
    _model_kind: ClassVar[str] = "sequence_classification"
    loss_is_scaled_for_ga = True  # compute_loss divides by the step's pairs itself

    def __init__(
        self,
        model: str | PreTrainedModel | Any,
        args: RewardConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], RewardBatch] | None = None,
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
        args = args if args is not None else self.default_args(model, RewardConfig, "Reward")
        refuse_logit_hooks(
            "RewardTrainer",
            "accuracy, margin and min_reward / mean_reward / max_reward (eval_-prefixed in evaluation)",
            needs="the rewards as evaluation predictions, which posttrain's RewardTrainer does not return (evaluation "
            "returns the loss)",
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if train_dataset is None:
            raise ValueError("RewardTrainer needs a train_dataset of preference pairs (chosen, rejected).")
        _check_datasets(train_dataset, eval_dataset)
        peft_config = _with_trainable_head(peft_config)
        if isinstance(model, str):
            set_seed(args.seed)  # a new score head is initialised while loading: make it reproducible
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
        self._apply_pad_token(args.pad_token)
        if args.chat_template_path is not None:
            loading.apply_chat_template_path(args.chat_template_path, self._tokenizer, self.model)
        self._eos_token = self._resolve_eos_token(args.eos_token)
        self._set_model_pad_token()
        _check_trainable_head(self.model)
        self._map_datasets(self._prepare)

    # ---- setup ---------------------------------------------------------------------------------

    def _resolve_eos_token(self, eos_token: str | None) -> str | None:
        """The text appended to standard texts: ``eos_token``, else the tokenizer's EOS token."""
        tok = self._tokenizer
        if eos_token is None:
            return tok.eos_token
        if eos_token not in tok.get_vocab():
            raise ValueError(
                f"eos_token={eos_token!r} is not a token of the tokenizer's vocabulary, so appending it would "
                f"not end the texts with one token. Pass one of its tokens (e.g. {tok.eos_token!r}) or leave "
                "eos_token None."
            )
        return eos_token

    def _set_model_pad_token(self) -> None:
        """``config.pad_token_id`` := the tokenizer's: the classifier reads the last token that is not it."""
        pad = self._tokenizer.pad_token_id
        config = self.model.config
        for cfg in {id(c): c for c in (config, config.get_text_config())}.values():
            if cfg.pad_token_id is not None and cfg.pad_token_id != pad:
                warnings.warn(
                    f"model.config.pad_token_id={cfg.pad_token_id} is replaced by the tokenizer's pad token id {pad}: "
                    "batches are padded with it, and the score is read at each row's last token that is not it.",
                    UserWarning,
                    stacklevel=3,
                )
            cfg.pad_token_id = pad

    def _prepare(self, dataset: Any) -> Any:
        a = self.args
        return prepare_reward_dataset(
            dataset,
            self._tokenizer,
            max_length=a.max_length,
            eos_token=self._eos_token,
            num_proc=a.dataset_num_proc,
        )

    # ---- data ----------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        self._signature_columns = [*TOKENISED_COLUMNS, "margin"]

    def _collate(self, rows: list[dict[str, Any]]) -> RewardBatch:
        return collate_reward_pairs(rows, self._tokenizer.pad_token_id, self.args.pad_to_multiple_of)

    def _prepare_inputs(self, inputs: RewardBatch) -> RewardBatch:  # type: ignore[override]
        device = self.accelerator.device

        def move(s: Sequences) -> Sequences:
            return Sequences(s.input_ids.to(device), s.loss_mask.to(device), s.attention_mask.to(device))

        margin = inputs.margin.to(device) if inputs.margin is not None else None
        return RewardBatch(Pairs(move(inputs.pairs.chosen), move(inputs.pairs.rejected)), margin)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """Pairs in the optimizer step's micro-batches, summed over every process."""
        local = sum(b.num_pairs for b in batch_samples)
        return gather(torch.tensor([local], device=device)).sum()

    def _batch_tokens(self, inputs: RewardBatch) -> int:
        return int(inputs.pairs.chosen.input_ids.numel() + inputs.pairs.rejected.input_ids.numel())

    # ---- loss ----------------------------------------------------------------------------------

    def _score(self, model: torch.nn.Module, rows: Sequences, train: bool) -> torch.Tensor:
        """[2N] the head's logit at each row's last non-pad token, in float32."""
        forwards = [(rows.input_ids.shape[0], rows.input_ids.shape[1], rows.input_ids.shape[1])]
        offload = self._offloading() if train else contextlib.nullcontext()
        with offload, checkpointing.within_gradient_budget(model, forwards):
            out = model(input_ids=rows.input_ids, attention_mask=rows.attention_mask, use_cache=False)
        return out.logits[:, 0].float()

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: RewardBatch,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The micro-batch's pairs' share of the step's loss (``reward/losses.py``).

        ``num_items_in_batch`` is the step's pairs over every process; DDP averages gradients
        over processes, so the share is multiplied by their number. Without it (evaluation),
        the mean over the micro-batch's pairs.
        """
        self._refuse_outputs(return_outputs)
        train = model.training
        rows = inputs.pairs.stacked()
        scores = self._score(model, rows, train)
        n = inputs.num_pairs
        per_pair = losses.pair_losses(
            scores[:n], scores[n:], inputs.margin, self.args.center_rewards_coefficient
        )
        if num_items_in_batch is not None and train:
            loss = per_pair.sum() / max(float(num_items_in_batch), 1.0) * self.accelerator.num_processes
        else:
            loss = per_pair.mean()
        self._record("train" if train else "eval", scores.detach(), rows, n)
        return loss

    def _record(self, mode: str, scores: torch.Tensor, rows: Sequences, n: int) -> None:
        """The reference's metrics over every process's pairs; ``num_tokens`` (train) without padding."""
        pairs = self.gather_values(torch.stack([scores[:n], scores[n:]], dim=1).reshape(-1)).view(-1, 2)
        m = losses.reward_metrics(pairs[:, 0], pairs[:, 1])
        if mode == "train":
            tokens = torch.tensor([int(rows.attention_mask.sum())], device=self.accelerator.device)
            self.state.num_input_tokens_seen += int(gather(tokens).sum())
            m["num_tokens"] = float(self.state.num_input_tokens_seen)
        self._metrics.add_all(mode, m)


# ----------------------------------------------------------------------------- PEFT


def _with_trainable_head(peft_config: Any) -> Any:
    """A copy of ``peft_config`` whose ``modules_to_save`` holds the score head (a new head must train).

    ``task_type="SEQ_CLS"`` makes peft train the head itself; with no task type the head names
    are added, with a warning.

    Raises:
        ValueError: a task type other than ``SEQ_CLS``.
    """
    if peft_config is None or not hasattr(peft_config, "modules_to_save"):
        return peft_config
    task_type = getattr(peft_config, "task_type", None)
    if task_type == "SEQ_CLS":
        return peft_config
    if task_type is not None:
        raise ValueError(
            f"peft_config.task_type={str(task_type)!r}, but a reward model is a sequence classifier. Set "
            "task_type='SEQ_CLS' (peft then trains the score head with the adapter), or leave it None."
        )
    saved = list(peft_config.modules_to_save or [])
    if any(name in saved for name in HEAD_NAMES):
        return peft_config
    warnings.warn(
        f"peft_config.modules_to_save={peft_config.modules_to_save!r} lacks the score head, which would stay frozen; "
        f"{list(HEAD_NAMES)} were added so that it trains with the adapter. Set task_type='SEQ_CLS' or "
        "modules_to_save=['score'] to silence this.",
        UserWarning,
        stacklevel=3,
    )
    config = copy.deepcopy(peft_config)
    config.modules_to_save = saved + list(HEAD_NAMES)
    return config


def _check_trainable_head(model: torch.nn.Module) -> None:
    """Refuse a model whose score head would not train (e.g. a PeftModel without it in modules_to_save).

    Raises:
        ValueError: no parameter of the head requires a gradient.
    """
    base = model.get_base_model() if peft_utils.is_peft_model(model) else model
    prefix = getattr(base, "base_model_prefix", "")
    heads = [(name, module) for name, module in base.named_children() if name != prefix]
    params = [p for _, module in heads for p in module.parameters()]
    if params and not any(p.requires_grad for p in params):
        names = [name for name, module in heads if any(True for _ in module.parameters())]
        raise ValueError(
            f"The score head of the model ({', '.join(names)}) is frozen, so the rewards cannot be learnt. With PEFT, "
            f"put it in modules_to_save (peft.LoraConfig(..., modules_to_save={names!r}), or task_type='SEQ_CLS'); "
            "a PeftModel must be loaded with is_trainable=True and its head saved as a module to save."
        )


# ----------------------------------------------------------------------------- data


def _check_datasets(train_dataset: Any, eval_dataset: Any) -> None:
    """The datasets' columns and first rows, before any model is loaded."""

    def first_row(name: str, dataset: Any) -> None:
        columns = list(getattr(dataset, "column_names", None) or dataset[0])
        if not all(c in columns for c in TOKENISED_COLUMNS) and not all(c in columns for c in TEXT_COLUMNS):
            raise ValueError(
                f"{name} has columns {columns}; reward modelling needs 'chosen' and 'rejected' (texts or messages, "
                "optionally with 'prompt'), or pre-tokenised 'chosen_ids' and 'rejected_ids'. Rename yours, e.g. "
                "dataset.rename_column('response_a', 'chosen')."
            )
        tokenize_reward_row(dataset[0], None, None, 0, check_only=True)

    check_offline_datasets("RewardTrainer", train_dataset, eval_dataset, "preference pair", first_row)
