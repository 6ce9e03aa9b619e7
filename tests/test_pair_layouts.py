"""The three layouts that score a batch of preference pairs give the same numbers.

Prompts once (``score_completions``: each pair's prompt through the model once, the default),
packed (``padding_free``: every side end to end in one row, ``unpack_scores``) and the stacked
right-padded rows (``score_rows`` on ``Pairs.stacked``): log-probs, per-token fields and every
parameter's gradient agree, and DPO trains to the same parameters.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import DPOConfig, DPOTrainer
from posttrain.data import packing, preference
from posttrain.ops import shared_prefix
from posttrain.ops.logprobs import score_completions, score_rows, unpack_scores
from posttrain.pairs.trainer import PairTrainer


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def token_rows(vocab: int, n: int = 3, seed: int = 0) -> list[dict[str, list[int]]]:
    """Tokenised pairs of different prompt and completion lengths (what prepare_preference_dataset gives)."""
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    return [
        {"prompt_ids": ids(3 + 2 * i), "chosen_ids": ids(4 + i), "rejected_ids": ids(7 - 2 * i)}
        for i in range(n)
    ]


def grads_of(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def check_same(a, b, model_a_grads, model_b_grads, atol=1e-5):
    torch.testing.assert_close(a.logps, b.logps, rtol=1e-5, atol=atol)
    torch.testing.assert_close(a.lengths, b.lengths)
    for ga, gb in zip(model_a_grads, model_b_grads, strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-4, atol=1e-6)


def masked_tokens(scores) -> list[list[float]]:
    """Each row's target log-probs in order, whatever the layout."""
    return [scores.token_logps[i][scores.mask[i].bool()].tolist() for i in range(scores.mask.shape[0])]


def score_split(model, split, **kwargs):
    """``score_completions`` on a ``PromptRows``."""
    return score_completions(
        model, split.prompt_ids, split.prompt_mask, split.completion_ids, split.completion_mask, **kwargs
    )


def check_fields(a, b, fields) -> None:
    """Each row's per-token ``fields`` agree on the target positions of both layouts."""
    for field in fields:
        x, y = getattr(a.stats, field), getattr(b.stats, field)
        for i in range(a.mask.shape[0]):
            torch.testing.assert_close(x[i][a.mask[i].bool()], y[i][b.mask[i].bool()], rtol=1e-5, atol=1e-5)


def test_prompts_once_equals_whole_rows_values_and_gradients(tok, monkeypatch):
    model = build_tiny_model(tok)
    rows = token_rows(len(tok))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    stacked = preference.collate_pairs(rows, pad).stacked()
    whole = score_rows(model, stacked, with_metrics=True)
    whole_grads = grads_of(model, (whole.logps * torch.arange(1.0, 7.0)).sum())

    calls = []
    real = shared_prefix.hidden_states
    monkeypatch.setattr(shared_prefix, "hidden_states", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    split = preference.collate_pair_prompts(rows, pad)
    once = score_split(model, split, with_metrics=True)
    once_grads = grads_of(model, (once.logps * torch.arange(1.0, 7.0)).sum())

    assert len(calls) == 1 and calls[0].ids.shape[0] == 3  # 3 distinct prompts for 6 sides
    check_same(once, whole, once_grads, whole_grads)
    for a, b in zip(masked_tokens(once), masked_tokens(whole), strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    check_fields(once, whole, ("entropy", "top", "logit_mean"))  # the metrics line up with the targets


def test_prompts_once_layout_without_the_shared_path_scores_whole_rows(tok):
    model = build_tiny_model(tok)
    rows = token_rows(len(tok), seed=1)
    pad = tok.eos_token_id
    whole = score_rows(model, preference.collate_pairs(rows, pad).stacked())
    split = preference.collate_pair_prompts(rows, pad)
    naive = score_split(model, split, chunk_size=None)
    torch.testing.assert_close(naive.logps, whole.logps, rtol=1e-5, atol=1e-5)
    assert naive.token_logps.shape == split.completion_ids.shape


def test_packed_sides_equal_padded_rows_values_and_gradients(tok):
    model = build_tiny_model(tok)
    rows = token_rows(len(tok), seed=2)
    pad = tok.eos_token_id
    pairs = preference.collate_pairs(rows, pad)
    stacked = pairs.stacked()
    padded = score_rows(model, stacked, with_metrics=True, with_log_sq_norm=True)
    padded_grads = grads_of(model, (padded.logps * torch.arange(1.0, 7.0)).sum())

    packed = preference.collate_pairs_packed(rows, pad, pad_to_multiple_of=16)
    assert packed.input_ids.shape[0] == 1 and packed.input_ids.shape[1] % 16 == 0
    packed.attention_mask = packing.packed_attention_mask(packed.position_ids)
    lengths = stacked.attention_mask.sum(1)
    unpacked = unpack_scores(score_rows(model, packed, with_metrics=True, with_log_sq_norm=True), lengths)
    unpacked_grads = grads_of(model, (unpacked.logps * torch.arange(1.0, 7.0)).sum())

    check_same(unpacked, padded, unpacked_grads, padded_grads)
    for a, b in zip(masked_tokens(unpacked), masked_tokens(padded), strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    check_fields(unpacked, padded, ("entropy", "log_sq_norm"))


def test_unpack_scores_refuses_several_rows(tok):
    model = build_tiny_model(tok)
    stacked = preference.collate_pairs(token_rows(len(tok)), tok.eos_token_id).stacked()
    with pytest.raises(ValueError, match="one packed row"):
        unpack_scores(score_rows(model, stacked), torch.tensor([3, 4]))


# ---- DPO end to end -----------------------------------------------------------------------------


def pairs_dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" + " Think." * (i % 3) for i in range(n)],
            "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
            "rejected": [f" {2 * i + 1}" + " and more" * (i % 4) for i in range(n)],
        }
    )


def train_dpo(tmp_path, tok, layout: str, monkeypatch, **overrides) -> tuple[DPOTrainer, list[float]]:
    with monkeypatch.context() as m:
        if layout == "packed":  # flash-attention's choice, with the CPU block mask
            m.setattr(PairTrainer, "_packs_pairs", property(lambda self: True))
        if layout == "stacked":
            real = PairTrainer._collate

            def stacked_only(self, rows):
                batch = real(self, rows)
                batch.prompts = None
                return batch

            m.setattr(PairTrainer, "_collate", stacked_only)
        args = DPOConfig(
            **{
                "output_dir": str(tmp_path / layout),
                **CPU_TEST_ARGS,
                "max_steps": 2,
                "per_device_train_batch_size": 4,
                "learning_rate": 1e-2,
                "padding_free": layout == "packed",
                **overrides,
            }
        )
        trainer = DPOTrainer(
            build_tiny_model(tok), args=args, train_dataset=pairs_dataset(), processing_class=tok
        )
        batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        assert (batch.packed is not None) == (layout == "packed")
        assert (batch.prompts is not None) == (layout == "once")
        if layout == "once":  # and the prompts are worth running once
            from posttrain.pairs.trainer import PROMPTS_ONCE_MIN_SHARE, _prompt_share

            assert _prompt_share(batch) >= PROMPTS_ONCE_MIN_SHARE
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return trainer, losses


@pytest.mark.parametrize("overrides", [{}, {"use_weighting": True, "ld_alpha": 0.5}])
def test_dpo_trains_to_the_same_parameters_in_every_layout(tmp_path, tok, monkeypatch, overrides):
    runs = {
        layout: train_dpo(tmp_path, tok, layout, monkeypatch, **overrides)
        for layout in ("stacked", "once", "packed")
    }
    base_trainer, base_losses = runs["stacked"]
    base = dict(base_trainer.model.named_parameters())
    for layout in ("once", "packed"):
        trainer, losses = runs[layout]
        assert losses == pytest.approx(base_losses, rel=1e-5, abs=1e-6), layout
        for name, p in trainer.model.named_parameters():
            torch.testing.assert_close(p, base[name], rtol=1e-4, atol=1e-6, msg=f"{layout}: {name}")


def test_padding_free_with_a_mixing_attention_is_refused(tmp_path, tok):
    model = build_tiny_model(tok)
    model.config._attn_implementation = "flex_attention"
    args = DPOConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, padding_free=True)
    with pytest.raises(ValueError, match="padding_free put several sequences in one row"):
        DPOTrainer(model, args=args, train_dataset=pairs_dataset(), processing_class=tok)


# ---- which layout, and the mask-free causal path ----------------------------------------------


def test_right_padding_only_recognises_masks_the_causal_mask_can_replace(tok):
    from posttrain.ops.logprobs import right_padding_only

    model = build_tiny_model(tok)
    assert right_padding_only(model, torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert not right_padding_only(model, torch.tensor([[0, 1, 1], [1, 1, 1]]))  # left padding
    assert not right_padding_only(model, torch.tensor([[1, 0, 1]]))  # a hole
    assert not right_padding_only(model, torch.ones(1, 1, 3, 3))  # a 4-D (packed) mask
    model.config.num_local_experts = 4  # MoE: the router loss counts what the mask marks
    assert not right_padding_only(model, torch.tensor([[1, 1, 0]]))


def test_right_padded_rows_are_scored_without_the_mask_and_give_the_masked_targets(tok, monkeypatch):
    from posttrain.ops import sequence_stats  # sequence_token_stats looks right_padding_only up there

    model = build_tiny_model(tok)
    rows = preference.collate_pairs(token_rows(len(tok), seed=3), tok.eos_token_id).stacked()
    assert (rows.attention_mask == 0).any()  # the rows are padded
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: seen.append("attention_mask" in kw), with_kwargs=True
    )
    free = score_rows(model, rows, with_metrics=True)
    free_grads = grads_of(model, free.logps.sum())
    monkeypatch.setattr(sequence_stats, "right_padding_only", lambda model, mask: False)
    masked = score_rows(model, rows, with_metrics=True)
    masked_grads = grads_of(model, masked.logps.sum())
    hook.remove()
    assert seen == [False, True]
    check_same(free, masked, free_grads, masked_grads)
    for a, b in zip(masked_tokens(free), masked_tokens(masked), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_long_completions_after_short_prompts_take_the_stacked_rows(tmp_path, tok, monkeypatch):
    from posttrain.pairs import trainer as pair_trainer

    calls = []
    real = pair_trainer.score_completions
    monkeypatch.setattr(pair_trainer, "score_completions", lambda *a, **k: calls.append(1) or real(*a, **k))
    long_answers = Dataset.from_dict(
        {"prompt": ["1+1?"] * 4, "chosen": [" two" * 60] * 4, "rejected": [" three" * 60] * 4}
    )
    args = DPOConfig(output_dir=str(tmp_path / "long"), **CPU_TEST_ARGS)
    trainer = DPOTrainer(build_tiny_model(tok), args=args, train_dataset=long_answers, processing_class=tok)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert pair_trainer._prompt_share(batch) < pair_trainer.PROMPTS_ONCE_MIN_SHARE
    trainer.compute_loss(trainer.model, batch)
    assert calls == []
    short = trainer._prepare_inputs(trainer._collate([trainer.train_dataset[0]] * 2))
    short.prompts.completion_mask[:, 1:] = 0  # one completion token per side: prompts dominate
    short.prompts.completion_ids = short.prompts.completion_ids[:, :1]
    short.prompts.completion_mask = short.prompts.completion_mask[:, :1]
    trainer._score_pairs(trainer.model, short, with_metrics=False)
    assert calls == [1]


def test_the_head_runs_on_the_target_positions_only_with_the_same_statistics(tok, monkeypatch):
    from posttrain.ops import chunked, logprobs

    model = build_tiny_model(tok)
    rows = preference.collate_pairs(token_rows(len(tok), seed=4), tok.eos_token_id).stacked()
    mask = rows.loss_mask[:, 1:]
    kwargs = {"with_entropy": True, "with_top": True, "with_logit_mean": True, "with_log_sq_norm": True}
    args = (model, rows.input_ids, rows.attention_mask, rows.attention_mask.cumsum(1) - 1)
    head_rows = []
    real = chunked.token_stats
    monkeypatch.setattr(
        chunked, "token_stats", lambda h, *a, **k: head_rows.append(h.shape[:-1].numel()) or real(h, *a, **k)
    )
    every = logprobs.sequence_token_stats(*args, **kwargs)
    every_grads = grads_of(model, (every.logps * mask).sum())
    targets = logprobs.sequence_token_stats(*args, **kwargs, target_mask=mask)
    target_grads = grads_of(model, (targets.logps * mask).sum())

    assert head_rows == [mask.numel(), int(mask.sum())]
    keep = mask.bool()
    for field in ("logps", "entropy", "top", "logit_mean", "log_sq_norm"):
        x, y = getattr(targets, field), getattr(every, field)
        torch.testing.assert_close(x[keep], y[keep], rtol=1e-5, atol=1e-5)
        assert (x[~keep] == 0).all(), field
    for a, b in zip(target_grads, every_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shared", [True, False], ids=["prompts-once", "whole-rows"])
def test_score_completions_runs_the_head_on_completion_tokens_only(tok, monkeypatch, shared):
    """Both paths of ``score_completions`` project only the completions' real tokens (no padding)."""
    from posttrain.ops import chunked, online_logps

    model = build_tiny_model(tok)
    split = preference.collate_pair_prompts(token_rows(len(tok), seed=5), tok.eos_token_id)
    before = score_split(model, split)
    if not shared:  # the whole-rows path, as for a model the shared prefix does not support
        monkeypatch.setattr(online_logps, "_completion_hidden", lambda *a, **k: None)
    head_rows = []
    real = chunked.token_stats
    monkeypatch.setattr(
        chunked, "token_stats", lambda h, *a, **k: head_rows.append(h.shape[:-1].numel()) or real(h, *a, **k)
    )
    scores = score_split(model, split)
    assert head_rows == [int(split.completion_mask.sum())]
    assert head_rows[0] < split.completion_mask.numel()  # the rows' padding is skipped
    torch.testing.assert_close(scores.logps, before.logps, rtol=1e-5, atol=1e-5)
    assert (scores.token_logps[~split.completion_mask.bool()] == 0).all()
