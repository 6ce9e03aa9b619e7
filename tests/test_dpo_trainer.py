"""DPOTrainer end to end on the tiny model: the loss against a hand computation, the metrics,
the reference (copy, PEFT base, precomputed), accumulation, TR-DPO, resume and bad input."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import DPOConfig, DPOTrainer


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def pairs(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
            "rejected": [f" {2 * i + 1}" + " and more" * (i % 3) for i in range(n)],
        }
    )


def config(tmp_path, **overrides) -> DPOConfig:
    return DPOConfig(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def trainer_for(tmp_path, tok, dataset=None, model=None, **overrides) -> DPOTrainer:
    return DPOTrainer(
        model if model is not None else build_tiny_model(tok),
        args=config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else pairs(),
        processing_class=tok,
    )


def first_batch(trainer: DPOTrainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def summed_logps(model, tok, prompt: str, completion: str) -> float:
    """The completion's summed log-prob under ``model``, from its full logits."""
    p = tok(prompt)["input_ids"]
    full = tok(prompt + completion + tok.eos_token)["input_ids"]
    start = next((k for k, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), len(p))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].double(), dim=-1)
    return sum(logp[t - 1, full[t]].item() for t in range(start, len(full)))


def test_training_on_the_cpu_pins_no_memory_and_torch_does_not_warn(tmp_path, tok):
    """``dataloader_pin_memory`` (True by default) is turned off when the trainer's device is the CPU,
    as transformers does for ``use_cpu=True``: pinning only speeds copies to an accelerator, and
    torch warned at the first batch of every default run of the offline families."""
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present: the trainer's device is not the CPU without use_cpu")
    trainer = trainer_for(tmp_path, tok, use_cpu=False)
    assert trainer.accelerator.device.type == "cpu" and not trainer.args.dataloader_pin_memory
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        next(iter(trainer.get_train_dataloader()))
    assert not [w for w in caught if "pin_memory" in str(w.message)]


# ---- the loss, by hand --------------------------------------------------------------------------


def test_sigmoid_loss_equals_the_formula_with_a_moved_reference(tmp_path, tok):
    reference = build_tiny_model(tok, seed=1)
    trainer = DPOTrainer(
        build_tiny_model(tok, seed=0),
        ref_model=reference,
        args=config(tmp_path, beta=0.5),
        train_dataset=pairs(4),
        processing_class=tok,
    )
    batch = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    data = pairs(4)
    expected = 0.0
    for i in range(4):
        row = data[i]
        u_w = summed_logps(trainer.model, tok, row["prompt"], row["chosen"]) - summed_logps(
            reference, tok, row["prompt"], row["chosen"]
        )
        u_l = summed_logps(trainer.model, tok, row["prompt"], row["rejected"]) - summed_logps(
            reference, tok, row["prompt"], row["rejected"]
        )
        expected += -math.log(1 / (1 + math.exp(-0.5 * (u_w - u_l)))) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_the_default_reference_is_a_copy_of_the_model_given_in_memory_changes_included(tmp_path, tok):
    """The reference reloads the model by name (fault 2); posttrain copies the instance given."""
    model = build_tiny_model(tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # an in-memory change a reload would lose
    trainer = trainer_for(tmp_path, tok, model=model)
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_metrics_have_the_reference_names_and_agree(tmp_path, tok):
    trainer = trainer_for(tmp_path, tok, max_steps=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/margins" in h]
    assert len(logs) == 4
    for h in logs:
        for name in ("logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected", "entropy"):
            assert math.isfinite(h[name])
        assert h["rewards/margins"] == pytest.approx(h["rewards/chosen"] - h["rewards/rejected"], abs=1e-6)
        assert 0.0 <= h["rewards/accuracies"] <= 1.0
        assert 0.0 <= h["mean_token_accuracy"] <= 1.0
    assert logs[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)  # policy = reference at step 1
    assert logs[-1]["rewards/margins"] > 0 and logs[-1]["loss"] < math.log(2)  # it learns the preference
    assert logs[-1]["num_tokens"] > logs[0]["num_tokens"]


def test_token_metrics_are_the_references_entropy_over_both_accuracy_over_chosen(tmp_path, tok):
    """entropy: the token mean over both completions; mean_token_accuracy: the share of the chosen
    completions' tokens that are the model's argmax (the reference's definition). The chosen
    completions are the model's own greedy ones, so the two sides' accuracies differ."""
    model = build_tiny_model(tok)
    prompts = [f"What is {i} plus {i}?" for i in range(4)]
    greedy = []
    for p in prompts:
        ids = tok(p, return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.eos_token_id)
        greedy.append(tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    data = Dataset.from_dict({"prompt": prompts, "chosen": greedy, "rejected": [" no" * 3] * 4})
    trainer = trainer_for(tmp_path, tok, dataset=data, model=model, max_steps=1, learning_rate=0.0)
    batch = first_batch(trainer)
    totals = {}
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            rows = getattr(batch.pairs, side)
            logits = trainer.model(input_ids=rows.input_ids, attention_mask=rows.attention_mask).logits[
                :, :-1
            ]
            logp = torch.log_softmax(logits.double(), dim=-1)
            mask = rows.loss_mask[:, 1:].double()
            hits = (logits.argmax(-1) == rows.input_ids[:, 1:]).double()
            entropy = -(logp.exp() * logp).sum(-1)
            totals[side] = ((hits * mask).sum().item(), (entropy * mask).sum().item(), mask.sum().item())
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    c, r = totals["chosen"], totals["rejected"]
    assert log["mean_token_accuracy"] == pytest.approx(c[0] / c[2], rel=1e-6)
    assert c[0] / c[2] != pytest.approx((c[0] + r[0]) / (c[2] + r[2]))  # the chosen side alone counts
    assert log["entropy"] == pytest.approx((c[1] + r[1]) / (c[2] + r[2]), rel=1e-5)


def test_conversational_and_implicit_prompt_pairs_train(tmp_path, tok):
    chats = Dataset.from_dict(
        {
            "chosen": [
                [
                    {"role": "user", "content": f"What is {i} + {i}?"},
                    {"role": "assistant", "content": f"{2 * i}"},
                ]
                for i in range(8)
            ],
            "rejected": [
                [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": "no"}]
                for i in range(8)
            ],
        }
    )
    trainer = trainer_for(tmp_path, tok, dataset=chats)
    row = trainer.train_dataset[0]
    assert tok.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(row["rejected_ids"]).startswith("no<|im_end|>")
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-2]["loss"])


# ---- the reference ------------------------------------------------------------------------------


def test_precomputed_reference_log_probs_give_the_live_reference_loss(tmp_path, tok):
    live = trainer_for(tmp_path / "live", tok, model=build_tiny_model(tok, seed=3))
    live.ref_model = build_tiny_model(tok, seed=4)  # a reference that differs from the policy
    pre = DPOTrainer(
        build_tiny_model(tok, seed=3),
        ref_model=build_tiny_model(tok, seed=4),
        args=config(tmp_path / "pre", precompute_ref_log_probs=True),
        train_dataset=pairs(),
        eval_dataset=pairs(4),
        processing_class=tok,
    )
    assert pre.ref_model is None and "ref_chosen_logps" in pre.train_dataset.column_names
    batch_live, batch_pre = first_batch(live), first_batch(pre)
    assert batch_pre.ref_chosen is not None
    torch.testing.assert_close(
        pre.compute_loss(pre.model, batch_pre),
        live.compute_loss(live.model, batch_live),
        rtol=1e-5,
        atol=1e-6,
    )


def test_an_sft_only_run_logs_its_rewards_against_the_given_reference(tmp_path, tok):
    """loss_type=["sft"] with a ref_model: the reference is kept and rewards/* are log-ratios, as in
    the reference library (the given reference used to be dropped and the rewards read
    beta * log pi: accuracies 0.75 where the reference logs 0.5)."""
    reference, policy = build_tiny_model(tok, seed=5), build_tiny_model(tok)
    expected = {"chosen": [], "rejected": []}
    for row in pairs():  # before the step: the logged rewards are the step's forward's
        for side in expected:
            gap = summed_logps(policy, tok, row["prompt"], row[side]) - summed_logps(
                reference, tok, row["prompt"], row[side]
            )
            expected[side].append(0.1 * gap)
    args = config(tmp_path, loss_type="sft", beta=0.1, per_device_train_batch_size=8, max_steps=1)
    trainer = DPOTrainer(policy, ref_model=reference, args=args, train_dataset=pairs(), processing_class=tok)
    assert trainer.ref_model is not None
    trainer.train()
    (logged,) = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    for side, values in expected.items():
        assert logged[f"rewards/{side}"] == pytest.approx(sum(values) / len(values), rel=1e-4, abs=1e-6)
    wins = sum(c > r for c, r in zip(expected["chosen"], expected["rejected"], strict=True)) / 8
    assert logged["rewards/accuracies"] == pytest.approx(wins)
    assert trainer_for(tmp_path / "copy", tok, loss_type="sft").ref_model is not None  # without one: a copy


def test_peft_reference_is_the_adapters_off_base(tmp_path, tok):
    from peft import LoraConfig

    trainer = DPOTrainer(
        build_tiny_model(tok),
        args=config(tmp_path, max_steps=2),
        train_dataset=pairs(),
        processing_class=tok,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    assert trainer.ref_model is None
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    assert abs(loss.item() - math.log(2)) > 1e-4  # random adapters: the policy differs from its base
    trainer.train()


def test_tr_dpo_moves_the_reference_toward_the_policy(tmp_path, tok):
    trainer = trainer_for(
        tmp_path, tok, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5
    )
    before = {k: v.clone() for k, v in trainer.ref_model.state_dict().items()}
    trainer.train()
    after = trainer.ref_model.state_dict()
    policy = trainer.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved
    k = moved[0]
    assert (after[k] - policy[k]).abs().max() < (before[k] - policy[k]).abs().max()


# ---- accumulation, processes and resume ------------------------------------------------------------


def test_gradient_accumulation_gives_the_update_of_the_whole_batch(tmp_path, tok):
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 1e9}
    whole = trainer_for(tmp_path / "a", tok, per_device_train_batch_size=4, **common)
    split = trainer_for(
        tmp_path / "b", tok, per_device_train_batch_size=1, gradient_accumulation_steps=4, **common
    )
    whole.train()
    split.train()
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_an_interrupted_run_resumes_exactly(tmp_path, tok):
    common = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "loss_type": ["sigmoid", "bco_pair"]}
    full = trainer_for(tmp_path / "full", tok, **common)
    full.train()
    resumed = trainer_for(tmp_path / "resumed", tok, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), (_, b) in zip(
        full.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert resumed._bco.value == pytest.approx(full._bco.value, rel=1e-12)
    tail = [h["loss"] for h in full.state.log_history if "loss" in h][2:]
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h][-2:] == tail


# ---- variants ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        {"loss_type": "ipo"},
        {"use_weighting": True},
        {"ld_alpha": 0.5},
        {"f_divergence_type": "js_divergence"},
        {"loss_type": "apo_zero"},
    ],
)
def test_variants_train_with_finite_losses(tmp_path, tok, overrides):
    trainer = trainer_for(tmp_path, tok, **overrides)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    if isinstance(overrides.get("loss_type"), list):
        assert "loss/sft" in trainer.state.log_history[0]


def test_ld_alpha_one_equals_plain_dpo(tmp_path, tok):
    plain = trainer_for(tmp_path / "a", tok, model=build_tiny_model(tok, seed=5))
    ld = trainer_for(tmp_path / "b", tok, model=build_tiny_model(tok, seed=5), ld_alpha=1.0)
    plain.ref_model = ld.ref_model = build_tiny_model(tok, seed=6)
    torch.testing.assert_close(
        plain.compute_loss(plain.model, first_batch(plain)), ld.compute_loss(ld.model, first_batch(ld))
    )


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_configs_fail_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match="loss_type"):
        DPOConfig(output_dir=str(tmp_path), loss_type="nope", use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="loss_weights"):
        DPOConfig(
            output_dir=str(tmp_path),
            loss_type=["sigmoid", "sft"],
            loss_weights=[1.0],
            use_cpu=True,
            bf16=False,
        )
    with pytest.raises(ValueError, match="ld_alpha"):
        DPOConfig(output_dir=str(tmp_path), ld_alpha=1.5, use_cpu=True, bf16=False)
    # an sft-only run keeps a reference for its logged rewards, so its log-probs may be precomputed
    DPOConfig(
        output_dir=str(tmp_path), loss_type="sft", precompute_ref_log_probs=True, use_cpu=True, bf16=False
    )


def test_missing_columns_fail_before_the_model_loads(tmp_path, tok):
    bad = Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError, match="chosen"):
        DPOTrainer("no/such-model", args=config(tmp_path), train_dataset=bad, processing_class=tok)


def test_logit_hooks_are_refused(tmp_path, tok):
    with pytest.raises(NotImplementedError, match="compute_metrics"):
        DPOTrainer(
            build_tiny_model(tok),
            args=config(tmp_path),
            train_dataset=pairs(),
            processing_class=tok,
            compute_metrics=lambda p: {},
        )
