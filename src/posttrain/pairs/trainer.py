"""What every trainer on preference pairs shares (DPO, ORPO, CPO).

``PairTrainer`` holds the pair data path (tokenising with ``data/preference.py``, collation into
a ``PairBatch``, the move to the device), the scoring of a batch's two sides in one forward
(``_score_pairs``), the optimizer step's denominators over every process (``StepCounts``: pairs
and chosen completion tokens) and the reference's pair metrics (``rewards/*``, ``logps/*``,
``logits/*`` and the per-token ones). A family adds its loss.

Scoring takes one of three layouts of the same ``2N`` sequences, with equal results:

- prompts once (the default when the prompts hold at least ``PROMPTS_ONCE_MIN_SHARE`` of the
  batch's tokens): ``[2N, P]`` prompts and ``[2N, T]`` completions; where
  ``ops/shared_prefix.py`` supports the model, each pair's prompt runs through the model once
  for both sides (``ops.logprobs.score_completions``); elsewhere the rows are scored whole;
- packed (``padding_free=True`` with a flash-attention kernel): the ``2N`` sequences end to end
  in one ``[1, S]`` row, no padding at all (``ops.logprobs.unpack_scores`` cuts the scores back);
- the stacked right-padded rows ``[2N, L]`` (``Pairs.stacked``), what the metrics count, scored
  with the causal mask alone (``ops.logprobs.right_padding_only``): for short prompts and long
  completions (a 24-token prompt before 1024 tokens saves 1 % of the tokens) the mask-free
  causal attention kernel is worth more than running the prompts once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather

from posttrain.core.batch import Pairs, PromptRows, Sequences, VisionInputs
from posttrain.core.trainer import BaseTrainer, check_offline_datasets
from posttrain.data import packing, preference, preference_vision
from posttrain.ops.logprobs import RowScores, score_completions, score_rows, unpack_scores

#: The share of a batch's tokens its pairs' prompts must hold for the prompts-once layout. Below
#: it the stacked rows run faster: running the prompts once needs an explicit attention mask
#: (the prompts are left padded), and on the CPU SDPA with a mask is about 40 % slower than its
#: mask-free causal path (rows of 1k tokens), which at long lengths costs more than the prompt
#: tokens save.
PROMPTS_ONCE_MIN_SHARE = 0.1


@dataclass
class PairBatch:
    """A collated micro-batch of preference pairs.

    Attributes:
        pairs: the chosen and the rejected rows (prompt + completion, right padded).
        ref_chosen: [N] precomputed reference log-probs of the chosen completions, if any.
        ref_rejected: [N] the same for the rejected completions.
        prompts: the ``2N`` sides split at their prompts (chosen sides first), to score each
            prompt once; ``None`` when the batch is packed.
        packed: the ``2N`` sides end to end in one row (``padding_free``), else ``None``.
        vision: a vision-language model's image inputs of the ``2N`` sides (each pair's prompt
            images on both of its sides; ``data/preference_vision.py``), else ``None``.
    """

    pairs: Pairs
    ref_chosen: torch.Tensor | None = None
    ref_rejected: torch.Tensor | None = None
    prompts: PromptRows | None = None
    packed: Sequences | None = None
    vision: VisionInputs | None = None

    @property
    def num_pairs(self) -> int:
        return self.pairs.num_pairs

    @property
    def chosen_tokens(self) -> int:
        """The chosen completions' target tokens."""
        return self.pairs.chosen.num_targets


@dataclass(frozen=True)
class StepCounts:
    """What one optimizer step holds over every process: the losses' denominators.

    Attributes:
        pairs: preference pairs.
        chosen_tokens: completion tokens of the chosen sides (an NLL term's tokens).
    """

    pairs: float
    chosen_tokens: float


class PairTrainer(BaseTrainer):
    """The pair data path, the step's denominators and the pair metrics, for the pair families."""

    loss_is_scaled_for_ga = True  # the families divide by the step's pairs and tokens themselves
    #: the datasets have images: rows are encoded at collation (``data/preference_vision.py``)
    _vision = False

    # ---- data ----------------------------------------------------------------------------------

    def _prepare_pair_datasets(self) -> None:
        """Tokenise the train and eval datasets (``data/preference.py``) with the config's limits."""
        self._map_datasets(self._prepare_pairs)

    def _prepare_pairs(self, dataset: Any) -> Any:
        a = self.args
        if self._vision:  # pairs with images are encoded batch by batch, with the processor
            return dataset
        return preference.prepare_preference_dataset(
            dataset,
            self._tokenizer,
            max_length=a.max_length,
            truncation_mode=getattr(a, "truncation_mode", "keep_start"),
            num_proc=a.dataset_num_proc,
        )

    def _set_signature_columns_if_needed(self) -> None:
        if self._vision:
            self._signature_columns = list(preference_vision.VISION_PAIR_COLUMNS)
            return
        self._signature_columns = [*preference.OUTPUT_COLUMNS, *preference.REF_COLUMNS]

    def _pad_token_id(self) -> int:
        """The token that pads the batches (the tokenizer's)."""
        return self._tokenizer.pad_token_id

    @property
    def _packs_pairs(self) -> bool:
        """``padding_free`` with a flash-attention kernel: the batch's sequences in one row.

        With eager or SDPA attention one packed row would need a block-diagonal mask over all its
        tokens, costlier than the padding it saves; those keep the prompts-once layout (same
        results).
        """
        return bool(getattr(self.args, "padding_free", False)) and self._varlen_attention

    def _collate(self, rows: list[dict[str, Any]]) -> PairBatch:
        pad = self._pad_token_id()
        images = None
        if self._vision:
            rows, images = self._encode_vision_rows(rows)
        pairs = preference.collate_pairs(rows, pad, self.args.pad_to_multiple_of)
        ref = preference.collate_ref_logps(rows)
        batch = PairBatch(pairs, *(ref if ref is not None else (None, None)))
        if images is not None:  # every side reads its prompt's images: the chosen sides, then the rejected
            batch.vision = VisionInputs(images + images)
            batch.prompts = preference.collate_pair_prompts(rows, pad)
        elif self._packs_pairs:
            batch.packed = preference.collate_pairs_packed(rows, pad, self.args.pad_to_multiple_of)
        else:
            batch.prompts = preference.collate_pair_prompts(rows, pad)
        return batch

    def _encode_vision_rows(
        self, rows: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
        """Pairs with images as tokenised pairs (``preference_vision.encode_pair``) and their image inputs."""
        a = self.args
        encoded = [
            preference_vision.encode_pair(
                row, self.processing_class, max_length=a.max_length, eos_token=getattr(a, "eos_token", None)
            )
            for row in rows
        ]
        return [pair for pair, _ in encoded], [inputs for _, inputs in encoded]

    def _prepare_inputs(self, inputs: PairBatch) -> PairBatch:  # type: ignore[override]
        device = self.accelerator.device

        def move(s: Sequences) -> Sequences:
            return Sequences(s.input_ids.to(device), s.loss_mask.to(device), s.attention_mask.to(device))

        ref = [t.to(device) if t is not None else None for t in (inputs.ref_chosen, inputs.ref_rejected)]
        out = PairBatch(
            Pairs(move(inputs.pairs.chosen), move(inputs.pairs.rejected)), *ref, vision=inputs.vision
        )
        if inputs.prompts is not None:
            out.prompts = inputs.prompts.to(device)
        if inputs.packed is not None:
            p = inputs.packed
            mask = p.attention_mask
            if mask is None and not self._varlen_attention:  # the sequences kept apart by a block mask
                mask = packing.packed_attention_mask(p.position_ids, self.model.dtype)
            out.packed = Sequences(
                p.input_ids.to(device), p.loss_mask.to(device), mask.to(device) if mask is not None else None,
                p.position_ids.to(device),
            )  # fmt: skip
        return out

    # ---- scoring -------------------------------------------------------------------------------

    def _score_pairs(
        self, model: torch.nn.Module, inputs: PairBatch, *, with_metrics: bool, with_log_sq_norm: bool = False
    ) -> RowScores:
        """``RowScores`` of the batch's ``2N`` sides (chosen first) in the batch's layout.

        The per-token fields' layout depends on it (completion columns, or whole-row columns);
        every use goes through ``mask``, so the sums, LD-DPO, WPO and the metrics do not.
        """
        kwargs = {"with_metrics": with_metrics, "with_log_sq_norm": with_log_sq_norm}
        if inputs.vision is not None:  # the rows whole, with their prompts' images
            p = inputs.prompts
            images = inputs.vision.model_kwargs(
                p.prompt_ids.shape[1], p.completion_ids.shape[1], p.prompt_ids.device
            )
            return score_completions(
                model,
                p.prompt_ids,
                p.prompt_mask,
                p.completion_ids,
                p.completion_mask,
                model_inputs=images,
                **kwargs,
            )
        if inputs.packed is not None:
            lengths = torch.cat(
                [inputs.pairs.chosen.attention_mask, inputs.pairs.rejected.attention_mask]
            ).sum(1)
            return unpack_scores(score_rows(model, inputs.packed, **kwargs), lengths)
        if inputs.prompts is not None and _prompt_share(inputs) >= PROMPTS_ONCE_MIN_SHARE:
            p = inputs.prompts
            return score_completions(
                model, p.prompt_ids, p.prompt_mask, p.completion_ids, p.completion_mask, **kwargs
            )
        return score_rows(model, inputs.pairs.stacked(), **kwargs)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> StepCounts:
        """The pairs and chosen completion tokens of the optimizer step's micro-batches, over every process."""
        local = torch.tensor(
            [sum(b.num_pairs for b in batch_samples), sum(b.chosen_tokens for b in batch_samples)],
            device=device,
        )
        pairs, tokens = gather(local.unsqueeze(0)).sum(dim=0).tolist()
        return StepCounts(float(pairs), float(tokens))

    def _batch_tokens(self, inputs: PairBatch) -> int:
        return int(inputs.pairs.chosen.input_ids.numel() + inputs.pairs.rejected.input_ids.numel())

    # ---- metrics -------------------------------------------------------------------------------

    def _pair_metrics(
        self,
        mode: str,
        scores: Any,
        logps: torch.Tensor,
        chosen_rewards: torch.Tensor,
        rejected_rewards: torch.Tensor,
        rows: Sequences,
    ) -> dict[str, float]:
        """The reference's pair metrics, averaged over every process's pairs (``entropy`` over both
        completions' tokens, ``mean_token_accuracy`` over the chosen ones').

        Args:
            mode: ``"train"`` or ``"eval"``.
            scores: the stacked batch's ``RowScores`` (chosen rows first).
            logps: [2N] the log-probs the loss used (summed or per-token means), for ``logps/*``.
            chosen_rewards, rejected_rewards: [N] the family's implicit rewards.
            rows: the stacked batch.
        """
        n = chosen_rewards.shape[0]
        chosen_r, rejected_r = chosen_rewards.detach().float(), rejected_rewards.detach().float()
        logps = logps.detach().float()
        mask, stats = scores.mask, scores.stats
        per_row_logit = (
            (stats.logit_mean * mask).sum(1) if stats.logit_mean is not None else torch.zeros_like(logps)
        )
        columns = torch.stack(
            [chosen_r, rejected_r, (chosen_r > rejected_r).float(), chosen_r - rejected_r, logps[:n], logps[n:],
             per_row_logit[:n].float(), per_row_logit[n:].float(), scores.lengths[:n].float(),
             scores.lengths[n:].float()],
            dim=1,
        )  # fmt: skip
        g = self.gather_values(columns.reshape(-1)).view(-1, columns.shape[1])
        m = {
            "rewards/chosen": g[:, 0].mean().item(),
            "rewards/rejected": g[:, 1].mean().item(),
            "rewards/accuracies": g[:, 2].mean().item(),
            "rewards/margins": g[:, 3].mean().item(),
            "logps/chosen": g[:, 4].mean().item(),
            "logps/rejected": g[:, 5].mean().item(),
            "logits/chosen": (g[:, 6].sum() / g[:, 8].sum().clamp(min=1)).item(),
            "logits/rejected": (g[:, 7].sum() / g[:, 9].sum().clamp(min=1)).item(),
        }
        # mean_token_accuracy counts the chosen completions' tokens, as the reference's DPO does
        chosen = mask.clone()
        if chosen.shape[0] == 2 * n:  # rows: the chosen completions, then the rejected
            chosen[n:] = 0
        m.update(self._token_metrics(mode, stats, mask, rows, accuracy_mask=chosen))
        return m


def check_pair_columns(trainer: str, train_dataset: Any, eval_dataset: Any, args: Any = None) -> bool:
    """The datasets' columns and first rows, before any model is loaded.

    Args:
        trainer: the trainer's name, for the messages.
        train_dataset, eval_dataset: as given to the trainer.
        args: the config of a family that takes images (DPO); ``None``: images are refused.

    Returns:
        Whether a dataset has images (``preference_vision.check_vision_pair_options`` passed).

    Raises:
        ValueError: no train dataset, a streamed or empty one, columns that hold no pairs, or
            options that pairs with images cannot take.
        NotImplementedError: images given to a family without ``args``.
    """
    if train_dataset is None:
        raise ValueError(f"{trainer} needs a train_dataset of preference pairs (chosen, rejected).")

    def first_row(name: str, dataset: Any) -> None:
        columns = list(getattr(dataset, "column_names", None) or dataset[0])
        preference.detect_preference_format(columns, dataset[0])

    def images(name: str) -> None:
        preference_vision.check_vision_pair_options(args, name)

    checked = images if args is not None else None
    return check_offline_datasets(trainer, train_dataset, eval_dataset, "preference pair", first_row, checked)


def _prompt_share(batch: PairBatch) -> float:
    """The share of the stacked rows' real tokens that running each pair's prompt once saves."""
    prompts = batch.prompts
    saved = float(prompts.prompt_mask.sum()) / 2  # each prompt appears on both sides
    total = float(prompts.prompt_mask.sum() + prompts.completion_mask.sum())
    return saved / max(total, 1.0)
