"""RewardTrainer end to end on tiny models: the loss and the metrics against hand computations, the
formats, the length filter, learning, PEFT, accumulation, resume, the trained model as GRPO's
reward model, and bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import TINY_DECODER, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.reward import losses
from posttrain.reward.config import RewardConfig
from posttrain.reward.trainer import RewardTrainer

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()  # no pad token: the trainer pads with EOS


@pytest.fixture(scope="module")
def pad_tok():
    """A tokenizer whose pad token is not its EOS token, so the score is read at the EOS."""
    t = build_tiny_tokenizer()
    t.pad_token = "<|endoftext|>"
    return t


def reward_model(tok, seed: int = 0, num_labels: int = 1) -> LlamaForSequenceClassification:
    """A 2-layer Llama sequence classifier with a large head (so scores differ visibly)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        max_position_embeddings=256,
        num_labels=num_labels,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        **TINY_DECODER,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


def pairs(n: int = 8, margin: list[float] | None = None) -> Dataset:
    data = {
        "prompt": [f"What is {i} plus {i}?" for i in range(n)],
        "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
        "rejected": [f" {2 * i + 1}" + " and more" * (i % 3) for i in range(n)],
    }
    if margin is not None:
        data["margin"] = margin
    return Dataset.from_dict(data)


def config(tmp_path, **overrides) -> RewardConfig:
    return RewardConfig(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def trainer_for(tmp_path, tok, dataset=None, model=None, **overrides) -> RewardTrainer:
    return RewardTrainer(
        model if model is not None else reward_model(tok),
        args=config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else pairs(),
        processing_class=tok,
    )


def first_batch(trainer: RewardTrainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


@torch.no_grad()
def score(model, ids: list[int]) -> float:
    """The reference: one unpadded forward of one sequence."""
    return model(input_ids=torch.tensor([ids])).logits[0, 0].item()


def text_ids(tok, text: str) -> list[int]:
    return tok(text + tok.eos_token)["input_ids"]


def hand_scores(model, tok, data: Dataset) -> tuple[list[float], list[float]]:
    chosen = [score(model, text_ids(tok, r["prompt"] + r["chosen"])) for r in data]
    rejected = [score(model, text_ids(tok, r["prompt"] + r["rejected"])) for r in data]
    return chosen, rejected


def logsigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


# ---- the loss and the metrics, by hand ----------------------------------------------------------


def test_loss_equals_the_formula_with_margin_and_centering(tmp_path, pad_tok):
    margins = [0.5, -0.25, 1.0, 0.0]
    data = pairs(4, margin=margins)
    trainer = trainer_for(tmp_path, pad_tok, dataset=data, center_rewards_coefficient=0.01)
    assert trainer.model.config.pad_token_id == pad_tok.pad_token_id != pad_tok.eos_token_id
    batch = first_batch(trainer)
    last = batch.pairs.chosen.attention_mask.sum(1) - 1
    assert (batch.pairs.chosen.input_ids.gather(1, last[:, None]) == pad_tok.eos_token_id).all()  # EOS scored
    loss = trainer.compute_loss(trainer.model, batch)
    chosen, rejected = hand_scores(trainer.model, pad_tok, data)
    bt = sum(-logsigmoid(c - r - m) for c, r, m in zip(chosen, rejected, margins, strict=True)) / 4
    center = sum((c + r) ** 2 for c, r in zip(chosen, rejected, strict=True)) / 4
    assert loss.item() == pytest.approx(bt + 0.01 * center, rel=1e-5)
    assert 0.01 * center > 1e-3  # the centering term is visible in the total


def test_pure_loss_and_metrics():
    c, r, m = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, -1.0]), torch.tensor([0.5, 0.0, 0.0])
    expected = [-logsigmoid(0.5) + 0.1, -logsigmoid(0.0), -logsigmoid(3.0) + 0.1]
    torch.testing.assert_close(losses.pair_losses(c, r, m, 0.1), torch.tensor(expected))
    assert losses.reward_loss(c, r).item() == pytest.approx(
        sum(-logsigmoid(x) for x in (1.0, 0.0, 3.0)) / 3, rel=1e-6
    )
    got = losses.reward_metrics(c, r)
    assert got == pytest.approx(
        {"accuracy": 2 / 3, "margin": 4 / 3, "min_reward": -1.0, "mean_reward": 1 / 3, "max_reward": 2.0}
    )  # the tie counts as wrong
    assert tuple(got) == losses.METRIC_NAMES
    with pytest.raises(ValueError, match="same N pairs"):
        losses.pair_losses(c, r[:2])


def test_metrics_have_the_reference_names_and_hand_values(tmp_path, tok):
    data = pairs(4)
    trainer = trainer_for(tmp_path, tok, dataset=data, max_steps=1)
    assert trainer.model.config.pad_token_id == tok.eos_token_id  # pad falls back to EOS
    chosen, rejected = hand_scores(trainer.model, tok, data)  # the weights the first step scores with
    trainer.train()
    log = trainer.state.log_history[0]
    every = chosen + rejected
    tokens = sum(len(text_ids(tok, r["prompt"] + r[c])) for r in data for c in ("chosen", "rejected"))
    expected = {
        "accuracy": sum(c > r for c, r in zip(chosen, rejected, strict=True)) / 4,
        "margin": sum(c - r for c, r in zip(chosen, rejected, strict=True)) / 4,
        "min_reward": min(every),
        "mean_reward": sum(every) / 8,
        "max_reward": max(every),
        "num_tokens": float(tokens),
    }
    for name, value in expected.items():
        assert log[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    loss = sum(-logsigmoid(c - r) for c, r in zip(chosen, rejected, strict=True)) / 4
    assert log["loss"] == pytest.approx(loss, rel=1e-5)


# ---- formats ------------------------------------------------------------------------------------


def _chat(user: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


FORMATS = {
    "implicit standard": {"chosen": ["The sky is blue.", "Two."], "rejected": ["Grass is red.", "Three."]},
    "explicit standard": {"prompt": ["Sky?", "1+1="], "chosen": [" blue", " 2"], "rejected": [" red", " 3"]},
    "implicit conversational": {
        "chosen": [_chat("Sky?", "blue"), _chat("1+1?", "2")],
        "rejected": [_chat("Sky?", "red"), _chat("1+1?", "3")],
    },
    "explicit conversational": {
        "prompt": [[{"role": "user", "content": "Sky?"}], [{"role": "user", "content": "1+1?"}]],
        "chosen": [[{"role": "assistant", "content": "blue"}], [{"role": "assistant", "content": "2"}]],
        "rejected": [[{"role": "assistant", "content": "red"}], [{"role": "assistant", "content": "3"}]],
    },
}


def _expected_ids(tok, row: dict, column: str) -> list[int]:
    value = row[column]
    if isinstance(value, str):
        return text_ids(tok, row.get("prompt", "") + value)
    messages = list(row.get("prompt", [])) + list(value)
    return tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", list(FORMATS))
def test_formats_tokenise_the_whole_sequences(tmp_path, tok, name):
    data = Dataset.from_dict(FORMATS[name])
    trainer = trainer_for(tmp_path, tok, dataset=data, per_device_train_batch_size=2, max_steps=1)
    for i, row in enumerate(data):
        for column in ("chosen", "rejected"):
            assert trainer.train_dataset[i][f"{column}_ids"] == _expected_ids(tok, row, column)
    assert math.isfinite(trainer.compute_loss(trainer.model, first_batch(trainer)).item())


def test_pretokenised_pairs_are_taken_as_they_are(tmp_path, tok):
    data = Dataset.from_dict(
        {"chosen_ids": [[5, 6, 7], [8, 9]], "rejected_ids": [[5, 6], [10]], "margin": [1, 0.5]}
    )
    trainer = trainer_for(tmp_path, tok, dataset=data, per_device_train_batch_size=2, max_steps=1)
    assert trainer.train_dataset[0] == {"chosen_ids": [5, 6, 7], "rejected_ids": [5, 6], "margin": 1.0}
    batch = first_batch(trainer)
    assert sorted(batch.margin.tolist()) == [0.5, 1.0]
    assert math.isfinite(trainer.compute_loss(trainer.model, batch).item())


def test_pairs_longer_than_max_length_are_dropped_and_counted(tmp_path, tok):
    data = pairs(6)
    lengths = [max(len(text_ids(tok, r["prompt"] + r[c])) for c in ("chosen", "rejected")) for r in data]
    limit = sorted(lengths)[3]  # the two longest pairs go
    dropped = sum(n > limit for n in lengths)
    with pytest.warns(
        UserWarning, match=rf"{dropped} of 6 pairs have a chosen or rejected sequence longer than"
    ):
        trainer = trainer_for(tmp_path, tok, dataset=data, max_length=limit)
    assert len(trainer.train_dataset) == 6 - dropped > 0
    assert all(max(len(r["chosen_ids"]), len(r["rejected_ids"])) <= limit for r in trainer.train_dataset)
    with pytest.raises(ValueError, match="All 6 pairs"):
        trainer_for(tmp_path, tok, dataset=data, max_length=3)


# ---- learning, PEFT, accumulation, resume -----------------------------------------------------------


def test_accuracy_rises_on_separable_pairs(tmp_path, tok):
    words = ["blue", "bright", "sun", "cat", "story", "two", "three", "four"]
    data = Dataset.from_dict(
        {
            "prompt": [f"Write {w}:" for w in words],
            "chosen": [f" <answer>{w}</answer>" for w in words],
            "rejected": [f" {w} and more" for w in words],
        }
    )
    trainer = RewardTrainer(
        reward_model(tok, seed=3),
        args=config(tmp_path, max_steps=12, per_device_train_batch_size=8, eval_strategy="no"),
        train_dataset=data,
        eval_dataset=data,
        processing_class=tok,
    )
    trainer.evaluate()
    before = trainer.state.log_history[-1]
    assert before["eval_accuracy"] <= 0.5  # this seed starts on the wrong side
    trainer.train()
    trainer.evaluate()
    after = trainer.state.log_history[-1]
    assert after["eval_accuracy"] == 1.0
    assert after["eval_loss"] < before["eval_loss"] and after["eval_margin"] > before["eval_margin"]


def test_peft_trains_the_adapter_and_the_head_only(tmp_path, tok):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.warns(UserWarning, match="lacks the score head"):
        trainer = RewardTrainer(
            reward_model(tok),
            args=config(tmp_path, max_steps=2),
            train_dataset=pairs(),
            processing_class=tok,
            peft_config=lora,
        )
    assert lora.modules_to_save is None  # the user's config is not changed
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert any("lora_B" in n for n in changed) and any("score.modules_to_save" in n for n in changed)
    assert all("lora_" in n or "modules_to_save" in n for n in changed), sorted(changed)


def test_peft_seq_cls_needs_no_warning_and_a_frozen_head_is_refused(tmp_path, tok):
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*score head.*")
        trainer = RewardTrainer(
            reward_model(tok),
            args=config(tmp_path),
            train_dataset=pairs(),
            processing_class=tok,
            peft_config=LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"]),
        )
    assert any("score" in n and p.requires_grad for n, p in trainer.model.named_parameters())
    with pytest.raises(ValueError, match="task_type='SEQ_CLS'"):
        RewardTrainer(
            reward_model(tok),
            args=config(tmp_path),
            train_dataset=pairs(),
            processing_class=tok,
            peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"]),
        )
    frozen_head = get_peft_model(reward_model(tok), LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"score head of the model \(score\) is frozen"):
        RewardTrainer(frozen_head, args=config(tmp_path), train_dataset=pairs(), processing_class=tok)


def test_gradient_accumulation_gives_the_update_of_the_whole_batch(tmp_path, tok):
    common = {
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": 1e-3,
        "max_grad_norm": 1e9,
        "center_rewards_coefficient": 0.1,
    }
    data = pairs(4, margin=[0.5, 0.0, 1.0, -1.0])
    whole = trainer_for(tmp_path / "a", tok, dataset=data, per_device_train_batch_size=4, **common)
    split = trainer_for(
        tmp_path / "b",
        tok,
        dataset=data,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=4,
        **common,
    )
    whole.train()
    split.train()
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
    assert whole.state.log_history[0]["loss"] == pytest.approx(split.state.log_history[0]["loss"], rel=1e-5)


def test_an_interrupted_run_resumes_exactly(tmp_path, tok):
    common = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    full = trainer_for(tmp_path / "full", tok, **common)
    full.train()
    resumed = trainer_for(tmp_path / "resumed", tok, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), (_, b) in zip(
        full.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    tail = [h["loss"] for h in full.state.log_history if "loss" in h][2:]
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h][-2:] == tail
    assert resumed.state.num_input_tokens_seen == full.state.num_input_tokens_seen


# ---- the trained model as GRPO's reward model -----------------------------------------------------


def test_a_saved_reward_model_scores_grpo_rollouts(tmp_path, tok, tiny_model_dir):
    """From a causal LM folder: a new head (warned), 2 steps, save_model, then one GRPO step with it."""
    from helpers import make_config, standard_dataset

    from posttrain import GRPOTrainer
    from posttrain.rewards.models import RewardModel

    with pytest.warns(UserWarning, match="LlamaForCausalLM checkpoint, not a sequence classifier"):
        rm_trainer = RewardTrainer(
            tiny_model_dir, args=config(tmp_path / "rm"), train_dataset=pairs(), processing_class=tok
        )
    assert type(rm_trainer.model).__name__ == "LlamaForSequenceClassification"
    rm_trainer.train()
    saved = str(tmp_path / "my-rm")
    rm_trainer.save_model(saved)
    grpo = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=[saved],
        args=make_config(tmp_path / "grpo", max_steps=1),
        train_dataset=standard_dataset(4),
        processing_class=tok,
    )
    (rm,) = grpo.rewards.funcs
    assert isinstance(rm, RewardModel) and rm.__name__ == "my-rm"
    text = "What is 2 plus 2? <answer>4</answer>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert rm.score_texts([text]) == pytest.approx([score(rm_trainer.model.eval(), ids)], rel=1e-5)
    grpo.train()
    log = grpo.state.log_history[0]
    assert math.isfinite(log["rewards/my-rm/mean"]) and math.isfinite(log["loss"])


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_configs_fail_when_the_config_is_built(tmp_path):
    base = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False}
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        RewardConfig(**base, center_rewards_coefficient=-0.1)
    with pytest.raises(ValueError, match="eos_token"):
        RewardConfig(**base, eos_token="")
    with pytest.raises(NotImplementedError, match="router_aux_loss_coef"):
        RewardConfig(**base, router_aux_loss_coef=0.001)
    assert RewardConfig(**base).learning_rate == 1e-4 and RewardConfig(**base).max_length == 1024


def test_bad_datasets_fail_before_the_model_loads(tmp_path, tok):
    def build(data):
        return RewardTrainer("no/such-model", args=config(tmp_path), train_dataset=data, processing_class=tok)

    with pytest.raises(ValueError, match="'chosen' and 'rejected'"):
        build(Dataset.from_dict({"prompt": ["a"], "answer": ["b"]}))
    with pytest.raises(ValueError, match="empty"):
        build(Dataset.from_dict({"chosen": [], "rejected": []}))
    with pytest.raises(ValueError, match="IterableDataset"):
        build(pairs().to_iterable_dataset())
    with pytest.raises(ValueError, match="'margin' is 'x'"):
        build(Dataset.from_dict({"chosen": ["a b"], "rejected": ["a c"], "margin": ["x"]}))
    with pytest.raises(ValueError, match="mix formats"):
        build([{"chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}])
    with pytest.raises(ValueError, match="train_dataset"):
        RewardTrainer("no/such-model", args=config(tmp_path), processing_class=tok)


def test_bad_rows_are_named(tmp_path, tok):
    data = Dataset.from_dict({"chosen": ["a b", "a c", "d"], "rejected": ["a c", "", "e"]})
    with pytest.raises(ValueError, match="Row 1: column 'rejected' is empty"):
        trainer_for(tmp_path, tok, dataset=data)
    with pytest.raises(ValueError, match="Row 1: 'margin' is None"):
        trainer_for(tmp_path, tok, dataset=pairs(3, margin=[1.0, None, 2.0]))
    tokenised = Dataset.from_dict({"chosen_ids": [[5, 6], []], "rejected_ids": [[5], [7]]})
    with pytest.raises(
        ValueError, match="Row 1: 'chosen_ids' is empty, so there is no token to read a score from"
    ):
        trainer_for(tmp_path, tok, dataset=tokenised)


def test_models_that_cannot_score_are_refused(tmp_path, tok, tiny_model_dir):
    with pytest.raises(ValueError, match="LlamaForCausalLM, which has no score head.*save_pretrained"):
        trainer_for(tmp_path, tok, model=build_tiny_model(tok))
    with pytest.raises(ValueError, match="num_labels=2"):
        trainer_for(tmp_path, tok, model=reward_model(tok, num_labels=2))
    with pytest.raises(ValueError, match="num_labels=3"):
        RewardTrainer(
            tiny_model_dir,
            args=config(tmp_path, model_init_kwargs={"num_labels": 3}),
            train_dataset=pairs(),
            processing_class=tok,
        )


def test_bad_trainer_arguments(tmp_path, tok):
    with pytest.raises(ValueError, match="eos_token='<nope>' is not a token"):
        trainer_for(tmp_path, tok, eos_token="<nope>")
    with pytest.raises(
        NotImplementedError,
        match="compute_metrics, preprocess_logits_for_metrics need the rewards as evaluation predictions",
    ):
        RewardTrainer(
            reward_model(tok),
            args=config(tmp_path),
            train_dataset=pairs(),
            processing_class=tok,
            compute_metrics=lambda p: {},
            preprocess_logits_for_metrics=lambda logits, labels: logits,
        )
    model = reward_model(tok)
    model.config.pad_token_id = 0
    with pytest.warns(UserWarning, match="pad_token_id=0 is replaced"):
        trainer = trainer_for(tmp_path, tok, model=model)
    assert trainer.model.config.pad_token_id == tok.pad_token_id
    with pytest.raises(ValueError, match="does not return model outputs"):
        trainer.compute_loss(trainer.model, first_batch(trainer), return_outputs=True)
