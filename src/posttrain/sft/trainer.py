"""SFTTrainer: supervised fine-tuning on the shared core, a drop-in for ``trl.SFTTrainer``.

One training step, top to bottom::

    rows   = prepare_dataset(dataset)              # data/sft.py: input_ids + loss_mask per row
    batch  = collate(rows)                         # data/packing.py: Sequences, padded or packed
    stats  = sequence_token_stats(model, batch)    # ops/logprobs.py: next-token log-probs in chunks
    loss   = LOSS_TYPES[loss_type](stats.logps, mask, num_items)   # sft/losses.py: pure

``num_items`` is the number of target tokens of the whole optimizer step over every process,
so gradient accumulation and several processes give the update of one large batch. The loss,
entropy and accuracy come from the same chunked pass over the hidden states: no ``[N, L, V]``
float32 logits are kept for backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import gather
from transformers import PreTrainedModel, TrainerCallback

from posttrain.core.batch import Sequences
from posttrain.core.trainer import BaseTrainer, refuse_logit_hooks
from posttrain.data import packing, sft, sft_vision, vision
from posttrain.models import loading
from posttrain.ops.logprobs import sequence_token_stats
from posttrain.sft import losses
from posttrain.sft import templates as chat_templates
from posttrain.sft.config import SFTConfig

if TYPE_CHECKING:
    from peft import PeftModel

#: Attention implementations that keep packed sequences apart: by the block mask posttrain
#: builds from the position ids (eager, sdpa), or by the position ids themselves (flash).


class SFTTrainer(BaseTrainer):
    """Trainer for supervised fine-tuning, with TRL's public API.

    Args:
        model: hub id, local path, embedded name (``"smollm2-135m-instruct"``), a
            ``PreTrainedModel`` causal LM or a ``peft.PeftModel``.
        args: the configuration; a default ``SFTConfig`` when ``None``.
        data_collator: a collator returning ``core.batch.Sequences``; by default rows are
            right-padded, or packed with ``packing`` / ``padding_free``.
        train_dataset: a ``Dataset`` in one of the SFT formats (``data/sft.py``): ``text``,
            ``messages``, ``prompt`` + ``completion``, or tokenised ``input_ids``.
        eval_dataset: same formats, or a dict of such datasets.
        processing_class: the tokenizer; loaded from the model when ``None``.
        compute_loss_func, compute_metrics, preprocess_logits_for_metrics: need the model's full
            logits, which posttrain never builds: not supported (``NotImplementedError``).
        callbacks: extra ``TrainerCallback`` s (e.g. ``BEMACallback``).
        optimizers: ``(optimizer, scheduler)``; AdamW with a linear schedule by default.
        optimizer_cls_and_kwargs: an optimizer class and its keyword arguments.
        quantization_config: a transformers quantization config to load ``model`` by name (QLoRA).
        peft_config: a ``peft.PeftConfig``; only the adapter trains.
        formatting_func: maps a row to its training text (language modelling).
    """

    _tag_names = ["posttrain", "sft"]
    loss_is_scaled_for_ga = True  # compute_loss divides by the step's target tokens itself

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel,
        args: SFTConfig | None = None,
        data_collator: Callable[[list[dict[str, Any]]], Sequences] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LambdaLR | None] = (
            None,
            None,
        ),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict], str] | None = None,
    ) -> None:
        args = args if args is not None else self.default_args(model, SFTConfig, "SFT")
        refuse_logit_hooks(
            "SFTTrainer",
            "the loss, entropy and mean_token_accuracy",
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        if train_dataset is None:
            raise ValueError(
                "SFTTrainer needs a train_dataset (text, messages, prompt/completion or input_ids)."
            )
        needs_markers, self._vision = _check_formats(train_dataset, eval_dataset, args, formatting_func)
        self.formatting_func = formatting_func
        super().__init__(
            model,
            args,
            processing_class,
            peft_config,
            quantization_config,
            data_collator=data_collator or self._collate,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
        )
        self._check_attention()
        loading.check_reads_images(self.model, self.processing_class, self._vision)
        self._apply_pad_token(args.pad_token)
        self._set_up_templates(needs_markers)
        self.loss_fn = losses.resolve_loss_type(args.loss_type)
        self.train_dataset = self._prepare(self.train_dataset, args.packing)
        self._map_eval(lambda dataset: self._prepare(dataset, args.eval_packing))

    def _set_up_templates(self, needs_markers: bool) -> None:
        """``chat_template_path`` applied (to the processor too, for rows with images), and the
        ``{% generation %}`` markers ``assistant_only_loss`` reads."""
        args = self.args
        if args.chat_template_path is not None:
            loading.apply_chat_template_path(args.chat_template_path, self._tokenizer, self.model)
            if self._vision:  # rows with images render with the processor's template
                self.processing_class.chat_template = self._tokenizer.chat_template
        if needs_markers:
            chat_templates.ensure_generation_markers(self._tokenizer)
        if self._vision and args.assistant_only_loss:
            sft_vision.check_assistant_markers(self.processing_class)

    # ---- data ------------------------------------------------------------------------------------

    def _prepare(self, dataset: Any, pack: bool) -> Any:
        """Tokenise (unless ``skip_prepare_dataset``), drop rows without targets, pack if asked."""
        a = self.args
        if (a.dataset_kwargs or {}).get("skip_prepare_dataset"):
            return dataset
        if a.shuffle_dataset and dataset is self.train_dataset:
            dataset = dataset.shuffle(seed=a.data_seed or a.seed)
        if self._vision:  # rows with images are encoded batch by batch (sft_vision.encode_row)
            return dataset
        rows = sft.prepare_dataset(
            dataset,
            self._tokenizer,
            dataset_text_field=a.dataset_text_field,
            # bfd truncates each row to max_length (rows left without a target are dropped and counted);
            # bfd_split and wrapped cut rows into pieces later, so nothing is truncated here
            max_length=a.max_length if not pack or a.packing_strategy == "bfd" else None,
            truncation_mode=a.truncation_mode,
            completion_only_loss=a.completion_only_loss,
            assistant_only_loss=a.assistant_only_loss,
            eos_token=a.eos_token,
            formatting_func=self.formatting_func,
            chat_template_kwargs=None,
            num_proc=a.dataset_num_proc,
            # wrapped joins rows into one sequence: a row's first token is predicted from the last
            first_token_target=pack and a.packing_strategy == "wrapped",
        )
        if not pack:
            return rows
        from datasets import Dataset

        return Dataset.from_list(packing.pack(rows, a.max_length, a.packing_strategy))

    def _set_signature_columns_if_needed(self) -> None:
        if self._vision:
            self._signature_columns = list(sft_vision.VISION_SFT_COLUMNS)
            return
        self._signature_columns = [
            "input_ids",
            "loss_mask",
            "seq_lengths",
            "completion_mask",
            "assistant_masks",
        ]

    def _collate(self, rows: list[dict[str, Any]]) -> Sequences:
        """Rows to a batch: packed bins and padding-free batches without padding, else right-padded."""
        a = self.args
        if self._vision:
            encoded = [
                sft_vision.encode_row(
                    r,
                    self.processing_class,
                    a.completion_only_loss,
                    a.max_length,
                    a.truncation_mode,
                    a.eos_token,
                    a.assistant_only_loss,
                )
                for r in rows
            ]
            return sft_vision.collate(encoded, self._tokenizer.pad_token_id)
        rows = [self._as_row(r) for r in rows]
        if a.padding_free or any(len(r.get("seq_lengths") or [0]) > 1 for r in rows):
            flatten = a.padding_free and self._varlen_attention
            return packing.collate_packed(
                rows,
                flatten=flatten,
                pad_token_id=self._tokenizer.pad_token_id,
                pad_to_multiple_of=a.pad_to_multiple_of,
            )
        return packing.collate_padded(rows, self._tokenizer.pad_token_id, a.pad_to_multiple_of)

    @staticmethod
    def _as_row(row: dict[str, Any]) -> dict[str, Any]:
        """A row of an already tokenised dataset (``skip_prepare_dataset``) with its loss mask."""
        if "loss_mask" in row:
            return row
        ids = list(row["input_ids"])
        mask = row.get("completion_mask") or row.get("assistant_masks") or [1] * len(ids)
        return {"input_ids": ids, "loss_mask": [0, *list(mask)[1:]]}

    def _check_attention(self) -> None:
        """Packed rows need an attention that keeps their sequences apart."""
        if self.args.packing or self.args.padding_free:
            self._check_packable_attention("packing/padding_free")

    def _prepare_inputs(self, inputs: Any) -> Sequences:  # type: ignore[override]
        device = self.accelerator.device
        mask = inputs.attention_mask
        if mask is None and not self._varlen_attention:  # packed: a block-diagonal causal mask
            mask = packing.packed_attention_mask(inputs.position_ids, self.model.dtype)
        return Sequences(
            input_ids=inputs.input_ids.to(device),
            loss_mask=inputs.loss_mask.to(device),
            attention_mask=mask.to(device) if mask is not None else None,
            position_ids=inputs.position_ids.to(device),
            vision=inputs.vision,
        )

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """Target tokens of the optimizer step's micro-batches, summed over every process."""
        local = sum(int(b.loss_mask[:, 1:].sum()) for b in batch_samples)
        return gather(torch.tensor([local], device=device)).sum()

    # ---- loss --------------------------------------------------------------------------------------

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Sequences,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> torch.Tensor:
        """The micro-batch's share of the step's loss: its target tokens' loss over the step's count.

        DDP averages gradients over processes, so the share is multiplied by their number.
        """
        self._refuse_outputs(return_outputs)
        mode = "train" if model.training else "eval"
        with self._offloading():
            stats = sequence_token_stats(
                model,
                inputs.input_ids,
                inputs.attention_mask,
                inputs.position_ids,
                with_entropy=True,
                with_top=True,
                target_mask=inputs.loss_mask[:, 1:],  # the head runs on the targets only
                model_inputs=inputs.model_kwargs(inputs.input_ids.device),
            )
        mask = inputs.loss_mask[:, 1:].to(stats.logps.dtype)  # [N, L - 1]: targets 1..L-1
        local = mask.sum()
        count = num_items_in_batch if num_items_in_batch is not None else local
        loss = self.loss_fn(stats.logps, mask, torch.clamp(torch.as_tensor(count, device=mask.device), min=1))
        if num_items_in_batch is not None and mode == "train":
            loss = self._as_share_of_step(loss)  # divided by the step's target count already
        loss = self._plus_aux_loss(loss, stats.aux_loss)
        self._record(mode, stats, mask, inputs)
        return loss

    def _record(self, mode: str, stats: Any, mask: torch.Tensor, inputs: Sequences) -> None:
        """``entropy``, ``mean_token_accuracy`` (over every process's targets), ``num_tokens``, ``aux_loss``."""
        self._metrics.add_all(mode, self._token_metrics(mode, stats, mask, inputs))


def _check_formats(
    train_dataset: Any, eval_dataset: Any, args: SFTConfig, formatting_func: Any
) -> tuple[bool, bool]:
    """Check the datasets' formats from their columns and first rows, before any model is loaded.

    Returns:
        Whether ``assistant_only_loss`` applies to chat messages, so the template needs markers;
        and whether the rows have images (``image`` / ``images``: a vision-language model's SFT).
    """
    chats = images = False
    skip = (args.dataset_kwargs or {}).get("skip_prepare_dataset")
    evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("eval_dataset", eval_dataset)]
    for name, dataset in [("train_dataset", train_dataset), *evals]:
        if dataset is None:
            continue
        if formatting_func is not None:
            if vision.image_column(getattr(dataset, "column_names", None)) is not None:
                raise ValueError(
                    f"{name} has images, but formatting_func turns each row into plain text, which would leave them "
                    "out; give 'messages' or 'prompt' and 'completion' columns with the images instead."
                )
            continue
        if skip and vision.image_column(getattr(dataset, "column_names", None)) is None:
            continue  # tokenised by the user: used as given
        if not hasattr(dataset, "__len__"):
            raise ValueError(
                f"{name} is an IterableDataset; SFTTrainer tokenises and packs the whole dataset first. Materialise "
                "it (datasets.Dataset.from_list(list(stream))) or tokenise it yourself and pass "
                "dataset_kwargs={'skip_prepare_dataset': True}."
            )
        if len(dataset) == 0:
            raise ValueError(f"{name} is empty; pass a dataset with at least one row.")
        columns = list(getattr(dataset, "column_names", None) or dataset[0])
        fmt = sft.detect_format(columns, dataset[0], dataset_text_field=args.dataset_text_field)
        if vision.image_column(columns) is not None:
            sft_vision.check_vision_options(fmt, args, name, dataset[0])
            images = True
        chats |= fmt == "conversational" or (
            fmt == "prompt_completion" and not isinstance(dataset[0]["prompt"], str)
        )
    return chats and args.assistant_only_loss and not images, images
