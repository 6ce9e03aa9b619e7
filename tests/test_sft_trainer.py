"""SFTTrainer end to end on the tiny model: the losses against hand computations, packing,
accumulation, resuming, the metrics, and bad input."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import SFTConfig, SFTTrainer
from posttrain.data import packing


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def config(tmp_path, **overrides) -> SFTConfig:
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS}
    values.update(overrides)
    return SFTConfig(**values)


def prompt_completion(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "completion": [f" <answer>{2 * i}</answer>" for i in range(n)],
        }
    )


def trainer_for(tmp_path, tok, dataset, seed: int = 0, **overrides) -> SFTTrainer:
    return SFTTrainer(
        model=build_tiny_model(tok, seed=seed),
        args=config(tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tok,
    )


def first_batch(trainer: SFTTrainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


# ---- the losses, by hand -----------------------------------------------------------------------


def test_completion_only_loss_is_the_cross_entropy_of_the_completion_tokens(tmp_path, tok):
    trainer = trainer_for(tmp_path, tok, prompt_completion(4))
    batch = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    # by hand: the model's own logits, cross-entropy over exactly the completion tokens + EOS
    total, count = 0.0, 0
    for i in range(4):
        prompt = tok(f"What is {i} plus {i}?")["input_ids"]
        full = tok(f"What is {i} plus {i}? <answer>{2 * i}</answer>")["input_ids"] + [tok.eos_token_id]
        start = next(k for k, (a, b) in enumerate(zip(prompt + [-1], full, strict=False)) if a != b)
        with torch.no_grad():
            logits = trainer.model(torch.tensor([full])).logits[0].float()  # [L, V]
        logp = torch.log_softmax(logits[:-1], dim=-1)  # position t predicts token t + 1
        targets = torch.tensor(full[1:])
        picked = logp[torch.arange(len(targets)), targets]
        total += -picked[start - 1 :].sum().item()
        count += len(full) - start
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


def test_dft_loss_is_the_probability_weighted_cross_entropy(tmp_path, tok):
    nll = trainer_for(tmp_path, tok, prompt_completion(4))
    dft = trainer_for(tmp_path, tok, prompt_completion(4), loss_type="dft")
    batch = first_batch(dft)
    with torch.no_grad():
        logits = dft.model(batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(2, batch.input_ids[:, 1:, None]).squeeze(2)
    mask = batch.loss_mask[:, 1:].float()
    expected = -(logp.exp() * logp * mask).sum() / mask.sum()
    assert dft.compute_loss(dft.model, batch).item() == pytest.approx(expected.item(), rel=1e-5)
    assert nll.compute_loss(nll.model, batch).item() == pytest.approx(
        (-(logp * mask).sum() / mask.sum()).item(), rel=1e-5
    )


def test_language_modelling_rows_train_on_every_token_but_the_first(tmp_path, tok):
    texts = Dataset.from_dict({"text": ["one two three", "the sky is blue"]})
    trainer = trainer_for(tmp_path, tok, texts, per_device_train_batch_size=2)
    batch = first_batch(trainer)
    lengths = [len(tok(t)["input_ids"]) + 1 for t in texts["text"]]  # EOS appended
    assert sorted(batch.loss_mask.sum(dim=1).tolist()) == sorted(n - 1 for n in lengths)
    assert batch.loss_mask[:, 0].sum() == 0


# ---- packing -------------------------------------------------------------------------------------


def test_packed_rows_give_the_loss_of_the_same_sequences_unpacked(tmp_path, tok):
    data = prompt_completion(8)
    plain = trainer_for(tmp_path, tok, data, per_device_train_batch_size=8)
    packed = trainer_for(tmp_path, tok, data, per_device_train_batch_size=8, packing=True, max_length=64)
    rows = list(plain.train_dataset)
    unpacked = plain._prepare_inputs(plain._collate(rows))
    bins = packed._prepare_inputs(packed._collate(list(packed.train_dataset)))
    assert bins.input_ids.shape[0] < 8  # several sequences share a row
    a = plain.compute_loss(plain.model, unpacked)
    b = packed.compute_loss(packed.model, bins)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("data", ["text", "prompt_completion"])
def test_wrapped_packing_trains_each_cut_as_one_causal_sequence(tmp_path, tok, data):
    """The reference's wrapped packing: rows laid end to end, cut every max_length, each cut one
    causal sequence whose targets are its tokens after the first, the format's mask applied. A
    language-modelling row's first token is then predicted from the previous row's EOS."""
    texts = ["one two three four", "the sky is blue", "hello there", "a cat who learns arithmetic"]
    if data == "text":
        dataset = Dataset.from_dict({"text": texts})
    else:
        dataset = prompt_completion(4)
    trainer = trainer_for(
        tmp_path, tok, dataset, packing=True, packing_strategy="wrapped", max_length=7,
        per_device_train_batch_size=64,
    )  # fmt: skip
    # the stream by hand: each row's tokens (EOS appended) and, for prompt-completion, its completion
    stream, targets = [], []
    for i in range(4):
        if data == "text":
            ids = tok(texts[i])["input_ids"] + [tok.eos_token_id]
            kept = [1] * len(ids)
        else:
            prompt = tok(f"What is {i} plus {i}?")["input_ids"]
            ids = tok(f"What is {i} plus {i}? <answer>{2 * i}</answer>")["input_ids"] + [tok.eos_token_id]
            kept = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
        stream += ids
        targets += kept
    cuts = [(stream[s : s + 7], targets[s : s + 7]) for s in range(0, len(stream), 7)]
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, kept in cuts:
            logp = torch.log_softmax(trainer.model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
            picked = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
            weights = torch.tensor(kept[1:], dtype=torch.float32)
            total += -(picked * weights).sum().item()
            count += int(weights.sum())
    batch = first_batch(trainer)
    assert batch.input_ids.shape[0] == len(cuts)
    assert trainer.compute_loss(trainer.model, batch).item() == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_every_packing_strategy_trains(tmp_path, tok, strategy):
    trainer = trainer_for(
        tmp_path, tok, prompt_completion(8), packing=True, max_length=24, packing_strategy=strategy
    )
    trainer.train()
    assert all(h["loss"] == h["loss"] for h in trainer.state.log_history if "loss" in h)


def test_padding_free_gives_the_padded_loss(tmp_path, tok):
    padded = trainer_for(tmp_path, tok, prompt_completion(4))
    free = trainer_for(tmp_path, tok, prompt_completion(4), padding_free=True)
    rows = list(padded.train_dataset)
    a = padded.compute_loss(padded.model, padded._prepare_inputs(padded._collate(rows)))
    b = free.compute_loss(free.model, free._prepare_inputs(free._collate(rows)))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_packing_with_an_attention_that_mixes_sequences_is_refused(tmp_path, tok):
    model = build_tiny_model(tok)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="attention implementation 'flex_attention' would let them attend"):
        SFTTrainer(
            model=model,
            args=config(tmp_path, packing=True),
            train_dataset=prompt_completion(),
            processing_class=tok,
        )


# ---- optimisation: accumulation, learning, resuming ------------------------------------------------


def _params(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_update_of_one_large_batch(tmp_path, tok):
    data = Dataset.from_dict({"text": ["one two three four five", "hi", "the sky is blue and the sun", "ok"]})
    one = trainer_for(
        tmp_path / "a", tok, data, per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3
    )
    four = trainer_for(
        tmp_path / "b", tok, data, per_device_train_batch_size=1, gradient_accumulation_steps=4, max_steps=1,
        learning_rate=1e-3,
    )  # fmt: skip
    one.train()
    four.train()
    for a, b in zip(_params(one), _params(four), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_loss_falls_on_memorisable_data(tmp_path, tok):
    data = Dataset.from_dict({"text": ["the sky is blue and the sun is bright"] * 16})
    trainer = trainer_for(tmp_path, tok, data, max_steps=20, learning_rate=3e-2)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0]
    accuracy = [h["mean_token_accuracy"] for h in trainer.state.log_history if "mean_token_accuracy" in h]
    assert accuracy[-1] > accuracy[0]


def test_an_interrupted_run_resumes_exactly(tmp_path, tok):
    data = prompt_completion(16)
    whole = trainer_for(tmp_path / "whole", tok, data, max_steps=4)
    whole.train()
    first = trainer_for(tmp_path / "cut", tok, data, max_steps=4, save_strategy="steps", save_steps=2)
    first.train()  # writes checkpoint-2 and checkpoint-4; resume from 2 as if killed after it
    resumed = trainer_for(tmp_path / "cut", tok, data, max_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    for a, b in zip(_params(whole), _params(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_metrics_have_the_reference_names(tmp_path, tok):
    trainer = trainer_for(tmp_path, tok, prompt_completion(8))
    trainer.train()
    log = trainer.state.log_history[0]
    assert {"loss", "grad_norm", "learning_rate", "entropy", "mean_token_accuracy", "num_tokens"} <= set(log)
    assert 0.0 <= log["mean_token_accuracy"] <= 1.0


def test_eval_dataset_dict_is_evaluated_by_name(tmp_path, tok):
    trainer = SFTTrainer(
        model=build_tiny_model(tok),
        args=config(tmp_path, eval_strategy="steps", eval_steps=2),
        train_dataset=prompt_completion(8),
        eval_dataset={"a": prompt_completion(4), "b": Dataset.from_dict({"text": ["one two", "three four"]})},
        processing_class=tok,
    )
    trainer.train()
    keys = set().union(*trainer.state.log_history)
    assert {"eval_a_loss", "eval_b_loss", "eval_a_mean_token_accuracy"} <= keys


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"question": ["a"], "answer": ["b"]}, "no column SFT can train on"),
        ({"text": ["a"], "messages": [[{"role": "user", "content": "b"}]]}, "text"),
    ],
)
def test_a_dataset_without_one_format_is_refused_before_the_model_loads(tmp_path, tok, columns, message):
    with pytest.raises(ValueError, match=message):
        SFTTrainer(
            model="no/such-model-is-loaded", args=config(tmp_path), train_dataset=Dataset.from_dict(columns)
        )


def test_unknown_packing_strategy_and_loss_type_name_the_parameter(tmp_path):
    with pytest.raises(ValueError, match="packing_strategy='best'"):
        config(tmp_path, packing_strategy="best")
    with pytest.raises(ValueError, match="loss_type='mse'"):
        config(tmp_path, loss_type="mse")


def test_logit_hooks_are_refused(tmp_path, tok):
    with pytest.raises(NotImplementedError, match="compute_metrics"):
        SFTTrainer(
            model=build_tiny_model(tok),
            args=config(tmp_path),
            train_dataset=prompt_completion(),
            processing_class=tok,
            compute_metrics=lambda p: {},
        )


def test_activation_offloading_without_an_accelerator_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="nothing to offload"):
        config(tmp_path, activation_offloading=True)


def test_packed_attention_mask_keeps_sequences_apart():
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    mask = packing.packed_attention_mask(positions)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def test_lora_trains_only_the_adapter(tmp_path, tok):
    from peft import LoraConfig

    trainer = SFTTrainer(
        model=build_tiny_model(tok),
        args=config(tmp_path),
        train_dataset=prompt_completion(8),
        processing_class=tok,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all("lora_" in n for n in changed)


def test_the_deprecated_pad_token_sets_the_tokenizers_pad_token(tmp_path):
    tok = build_tiny_tokenizer()
    with pytest.warns(FutureWarning, match="pad_token is deprecated"):
        trainer = trainer_for(tmp_path, tok, prompt_completion(4), pad_token="<|im_start|>")
    assert trainer._tokenizer.pad_token == "<|im_start|>"
    batch = trainer._collate(
        [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [5], "loss_mask": [0]}]
    )
    assert batch.input_ids[1, 1:].tolist() == [tok.convert_tokens_to_ids("<|im_start|>")] * 2
    with pytest.raises(ValueError, match="not a token of the tokenizer's vocabulary"):
        trainer_for(tmp_path, build_tiny_tokenizer(), prompt_completion(4), pad_token="<no such token>")
