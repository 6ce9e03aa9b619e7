"""KTOTrainer end to end on the tiny model: the step-1 loss and metrics against a hand computation,
unpaired and paired data (standard and conversational), the KL pairs built inside each batch, the
reference (copy, precomputed), accumulation, TR-DPO with exact resume, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain.data import unpaired
from posttrain.kto.config import KTOConfig
from posttrain.kto.trainer import KTOTrainer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def prompts(n: int) -> list[str]:
    return [f"What is {i} plus {i}?" for i in range(n)]


def completions(n: int) -> list[str]:
    return [
        f" <answer>{2 * i}</answer>" if i % 2 == 0 else f" {2 * i + 1}" + " and more" * (i % 3)
        for i in range(n)
    ]


def examples(n: int = 8, labels: list[bool] | None = None) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": prompts(n),
            "completion": completions(n),
            "label": labels if labels is not None else [i % 2 == 0 for i in range(n)],
        }
    )


def config(tmp_path, **overrides) -> KTOConfig:
    return KTOConfig(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def trainer_for(tmp_path, tok, dataset=None, model=None, ref_model=None, **overrides) -> KTOTrainer:
    return KTOTrainer(
        model if model is not None else build_tiny_model(tok),
        ref_model=ref_model,
        args=config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else examples(),
        processing_class=tok,
    )


def first_batch(trainer: KTOTrainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def summed_logps(model, tok, prompt: str, completion: str) -> float:
    """The completion's summed log-prob under ``model``, from its full logits."""
    p = tok(prompt)["input_ids"]
    full = tok(prompt + completion + tok.eos_token)["input_ids"]
    start = next((k for k, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), len(p))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].double(), dim=-1)
    return sum(logp[t - 1, full[t]].item() for t in range(start, len(full)))


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ---- the loss and the metrics, by hand ------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_step_loss_and_metrics_equal_a_hand_computation(tmp_path, tok, loss_type):
    beta, wd, wu = 0.5, 1.2, 0.95
    reference = build_tiny_model(tok, seed=7)
    trainer = trainer_for(
        tmp_path,
        tok,
        model=build_tiny_model(tok, seed=2),
        ref_model=reference,
        loss_type=loss_type,
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        train_sampling_strategy="sequential",  # the first batch is rows 0-3
    )
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    metrics = trainer._metrics.pop_means("train" if trainer.model.training else "eval")
    P, C, labels = prompts(4), completions(4), [True, False, True, False]

    def ratio(prompt: str, completion: str) -> float:
        return summed_logps(trainer.model, tok, prompt, completion) - summed_logps(
            reference, tok, prompt, completion
        )

    u = [ratio(P[i], C[i]) for i in range(4)]
    z0 = max(0.0, sum(ratio(P[i], C[i - 1]) for i in range(4)) / 4) if loss_type == "kto" else 0.0
    if loss_type == "kto":
        assert z0 > 0.05  # these seeds give a KL estimate that is not clamped
        per = [
            wd * (1 - sig(beta * (x - z0))) if d else wu * (1 - sig(beta * (z0 - x)))
            for x, d in zip(u, labels, strict=True)
        ]
        assert metrics["kl"] == pytest.approx(z0, rel=1e-4)
    else:
        per = [wd * (1 - sig(beta * x)) if d else wu * sig(beta * x) for x, d in zip(u, labels, strict=True)]
        assert metrics["kl"] == 0.0  # no KL term: its z0 is 0, logged as the reference logs it
    assert loss.item() == pytest.approx(sum(per) / 4, rel=1e-5)
    assert metrics["rewards/chosen"] == pytest.approx(beta * (u[0] + u[2]) / 2, rel=1e-4)
    assert metrics["rewards/rejected"] == pytest.approx(beta * (u[1] + u[3]) / 2, rel=1e-4)
    assert metrics["rewards/margins"] == pytest.approx(
        metrics["rewards/chosen"] - metrics["rewards/rejected"]
    )
    chosen_logps = [summed_logps(trainer.model, tok, P[i], C[i]) for i in (0, 2)]
    assert metrics["logps/chosen"] == pytest.approx(sum(chosen_logps) / 2, rel=1e-5)


def test_the_default_reference_is_a_copy_of_the_model_given(tmp_path, tok):
    model = build_tiny_model(tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # an in-memory change a reload by name would lose
    trainer = trainer_for(tmp_path, tok, model=model, desirable_weight=1.2, undesirable_weight=1.0)
    loss = trainer.compute_loss(trainer.model, first_batch(trainer))
    labels = first_batch(trainer).labels.tolist()
    assert loss.item() == pytest.approx(sum(0.6 if d else 0.5 for d in labels) / 4, rel=1e-6)
    assert trainer._metrics.pop_means("train")["kl"] == 0.0
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


def test_metrics_have_the_reference_names_and_agree(tmp_path, tok):
    trainer = trainer_for(tmp_path, tok, max_steps=4, learning_rate=5e-2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    assert len(logs) == 4
    for h in logs:
        assert h["kl"] >= 0.0 and math.isfinite(h["entropy"])
        for kind in ("chosen", "rejected"):
            if f"rewards/{kind}" in h:
                assert math.isfinite(h[f"logps/{kind}"]) and math.isfinite(h[f"logits/{kind}"])
        if "rewards/margins" in h:
            assert h["rewards/margins"] == pytest.approx(
                h["rewards/chosen"] - h["rewards/rejected"], abs=1e-6
            )
    assert logs[-1]["num_tokens"] > logs[0]["num_tokens"]
    # A batch of desirable examples only has no rejected metrics and no margin.
    only = trainer._prepare_inputs(trainer._collate([r for r in trainer.train_dataset if r["label"]][:3]))
    trainer.compute_loss(trainer.model, only)
    m = trainer._metrics.pop_means("train" if trainer.model.training else "eval")
    assert "rewards/chosen" in m and "rewards/rejected" not in m and "rewards/margins" not in m


# ---- data ------------------------------------------------------------------------------------------


def test_paired_data_is_split_into_desirable_and_undesirable_examples(tmp_path, tok):
    pairs = Dataset.from_dict(
        {"prompt": prompts(4), "chosen": [" yes"] * 4, "rejected": [f" no {i}" for i in range(4)]}
    )
    trainer = trainer_for(tmp_path, tok, dataset=pairs)
    data = trainer.train_dataset
    assert len(data) == 8 and data["label"] == [True] * 4 + [False] * 4
    assert tok.decode(data[0]["prompt_ids"]) == "What is 0 plus 0?"
    assert tok.decode(data[0]["completion_ids"]) == " yes<|im_end|>"
    assert tok.decode(data[5]["completion_ids"]) == " no 1<|im_end|>"
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)


def test_conversational_data_unpaired_and_implicit_pairs_train(tmp_path, tok):
    user = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(4)]
    chats = Dataset.from_dict(
        {
            "prompt": user,
            "completion": [[{"role": "assistant", "content": f"{2 * i}"}] for i in range(4)],
            "label": [True, False, True, False],
        }
    )
    trainer = trainer_for(tmp_path / "unpaired", tok, dataset=chats, max_steps=1)
    row = trainer.train_dataset[1]
    assert tok.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(row["completion_ids"]).startswith("2<|im_end|>")
    trainer.train()
    implicit = Dataset.from_dict(
        {
            "chosen": [u + [{"role": "assistant", "content": f"{2 * i}"}] for i, u in enumerate(user)],
            "rejected": [u + [{"role": "assistant", "content": "no"}] for u in user],
        }
    )
    trainer = trainer_for(tmp_path / "implicit", tok, dataset=implicit, max_steps=1)
    row = trainer.train_dataset[4]
    assert row["label"] is False and tok.decode(row["completion_ids"]).startswith("no<|im_end|>")
    trainer.train()
    assert math.isfinite(trainer.state.log_history[-2]["loss"])


def test_kl_pairs_are_built_inside_the_batch(tok):
    rows = [
        {"prompt_ids": [10 + i] * (i + 1), "completion_ids": [50 + i] * (2 + i), "label": i % 2 == 0}
        for i in range(3)
    ]
    batch = unpaired.collate_unpaired(rows, pad_token_id=0)
    for i in range(3):
        real = batch.kl.attention_mask[i].bool()
        expected = rows[i]["prompt_ids"] + rows[i - 1]["completion_ids"]  # row 0 takes the last row's
        assert batch.kl.input_ids[i][real].tolist() == expected
        assert batch.kl.loss_mask[i].sum().item() == len(rows[i - 1]["completion_ids"])
    assert batch.kl.input_ids.shape == batch.examples.input_ids.shape
    # The same rows in another order pair with their new neighbours: the batch alone decides.
    swapped = unpaired.collate_unpaired([rows[2], rows[0], rows[1]], pad_token_id=0)
    assert swapped.kl.input_ids[1][swapped.kl.attention_mask[1].bool()].tolist() == [10] + [52] * 4
    # A KL pair is cut to max_length; a stored partner (precomputed reference) wins over the rotation.
    cut = unpaired.collate_unpaired(rows, pad_token_id=0, max_length=5)
    assert cut.kl.attention_mask[2].sum().item() == 5  # 3 prompt tokens + 3 completion tokens, cut to 5
    fixed = unpaired.collate_unpaired([{**r, "kl_completion_ids": [99]} for r in rows], pad_token_id=0)
    assert fixed.kl.input_ids[0][fixed.kl.attention_mask[0].bool()].tolist() == [10, 99]
    assert unpaired.kl_partners(5, 2) == [1, 0, 3, 2, 4]
    assert unpaired.collate_unpaired(rows, pad_token_id=0, with_kl=False).kl is None


# ---- the reference ----------------------------------------------------------------------------------


def test_precomputed_reference_log_probs_give_the_live_reference_loss(tmp_path, tok):
    common = {"train_sampling_strategy": "sequential", "beta": 0.5}
    live = trainer_for(
        tmp_path / "live",
        tok,
        model=build_tiny_model(tok, seed=2),
        ref_model=build_tiny_model(tok, seed=7),
        **common,
    )
    pre = KTOTrainer(
        build_tiny_model(tok, seed=2),
        ref_model=build_tiny_model(tok, seed=7),
        args=config(tmp_path / "pre", precompute_ref_log_probs=True, **common),
        train_dataset=examples(),
        eval_dataset=examples(4),
        processing_class=tok,
    )
    assert pre.ref_model is None
    assert {"ref_logps", "ref_kl_logps", "kl_completion_ids"} <= set(pre.train_dataset.column_names)
    batch_live, batch_pre = first_batch(live), first_batch(pre)
    assert batch_pre.ref_logps is not None and batch_live.ref_logps is None
    torch.testing.assert_close(
        pre.compute_loss(pre.model, batch_pre),
        live.compute_loss(live.model, batch_live),
        rtol=1e-5,
        atol=1e-6,
    )
    kl_live, kl_pre = (t._metrics.pop_means("train")["kl"] for t in (live, pre))
    assert kl_pre == pytest.approx(kl_live, rel=1e-5) and kl_live > 0
    pre.evaluate()  # the eval set's KL pairs and reference log-probs were precomputed too
    assert math.isfinite(pre.state.log_history[-1]["eval_kl"])


def test_precomputing_with_random_batches_warns_that_the_pairs_are_fixed(tmp_path):
    with pytest.warns(UserWarning, match="fixes the KL pairs before training"):
        config(tmp_path, precompute_ref_log_probs=True)


# ---- accumulation and resume -----------------------------------------------------------------------


@pytest.mark.parametrize("loss_type,split", [("kto", 2), ("apo_zero_unpaired", 1)])
def test_gradient_accumulation_gives_the_update_of_the_whole_batch(tmp_path, tok, loss_type, split):
    """kto: with the reference a copy, z₀ = 0 in every micro-batch; apo_zero_unpaired: any reference."""
    common = {
        "max_steps": 1,
        "optim": "sgd",
        "learning_rate": 0.5,
        "max_grad_norm": 1e9,
        "loss_type": loss_type,
    }

    def ref():
        return build_tiny_model(tok, seed=7) if loss_type == "apo_zero_unpaired" else None

    whole = trainer_for(tmp_path / "a", tok, ref_model=ref(), per_device_train_batch_size=4, **common)
    parts = trainer_for(
        tmp_path / "b",
        tok,
        ref_model=ref(),
        per_device_train_batch_size=split,
        gradient_accumulation_steps=4 // split,
        **common,
    )
    whole.train()
    parts.train()
    for (name, a), (_, b) in zip(whole.model.named_parameters(), parts.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)


def test_tr_dpo_sync_and_an_interrupted_run_resume_exactly(tmp_path, tok):
    common = {
        "max_steps": 4,
        "save_strategy": "steps",
        "save_steps": 2,
        "sync_ref_model": True,
        "ref_model_sync_steps": 1,
        "ref_model_mixup_alpha": 0.5,
    }
    full = trainer_for(tmp_path / "full", tok, **common)
    before = {k: v.clone() for k, v in full.ref_model.state_dict().items()}
    full.train()
    after, policy = full.ref_model.state_dict(), full.model.state_dict()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert (
        moved
        and (after[moved[0]] - policy[moved[0]]).abs().max()
        < (before[moved[0]] - policy[moved[0]]).abs().max()
    )
    resumed = trainer_for(tmp_path / "resumed", tok, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), (_, b) in zip(
        full.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    for name, value in full.ref_model.state_dict().items():
        torch.testing.assert_close(value, resumed.ref_model.state_dict()[name], rtol=0, atol=0, msg=name)
    tail = [h["loss"] for h in full.state.log_history if "loss" in h][2:]
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h][-2:] == tail


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            {"loss_type": "sigmoid"},
            "loss_type='sigmoid' is invalid: it must be one of 'kto', 'apo_zero_unpaired'",
        ),
        ({"per_device_train_batch_size": 1}, "needs per_device_train_batch_size >= 2"),
        ({"desirable_weight": 0.0, "undesirable_weight": 0.0}, "nothing is learnt"),
        ({"desirable_weight": -1.0}, "desirable_weight=-1.0 is invalid"),
        ({"sync_ref_model": True, "precompute_ref_log_probs": True}, "Use one of the two"),
    ],
    ids=["loss_type", "batch_of_one", "both_weights_zero", "negative_weight", "sync_and_precompute"],
)
def test_bad_configs_fail_when_the_config_is_built(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)


def test_a_batch_of_one_is_fine_without_the_kl_term(tmp_path):
    assert config(tmp_path, loss_type="apo_zero_unpaired", per_device_train_batch_size=1).uses_kl is False


@pytest.mark.parametrize(
    "columns,match",
    [
        ({"prompt": ["a"], "completion": ["b"]}, "no 'label' column"),
        ({"completion": ["b"], "label": [True]}, "no 'prompt' column"),
        ({"prompt": ["a"], "chosen": ["b"]}, "It has 'chosen' without 'rejected'"),
        ({"chosen": ["a b"], "rejected": ["a c"], "label": [True]}, "both preference-pair columns"),
        (
            {"prompt": ["a", "b"], "completion": ["c", "d"], "label": [1, 0]},
            r"train_dataset, row 0: 'label' is 1 \(int\)",
        ),
        (
            {"prompt": ["a", "b"], "completion": ["c", "d"], "label": [True, None]},
            "train_dataset, row 1: 'label' is None",
        ),
        (
            {"prompt": ["a"], "completion": [[{"role": "assistant", "content": "b"}]], "label": [True]},
            "use text in both",
        ),
        ({"prompt": ["a"], "completion": [""], "label": [True]}, "column 'completion' is empty"),
    ],
    ids=[
        "no_label",
        "no_prompt",
        "chosen_only",
        "both_formats",
        "int_label",
        "none_label",
        "mixed_formats",
        "empty",
    ],
)
def test_bad_datasets_fail_before_the_model_loads(tmp_path, tok, columns, match):
    with pytest.raises(ValueError, match=match):
        KTOTrainer(
            "no/such-model",
            args=config(tmp_path),
            train_dataset=Dataset.from_dict(columns),
            processing_class=tok,
        )


def test_imbalanced_data_warns_with_the_counts_and_a_weight(tmp_path, tok):
    with pytest.warns(
        UserWarning, match=r"6 desirable and 2 undesirable .* desirable_weight between 0.333 and 0.444"
    ):
        trainer_for(tmp_path, tok, dataset=examples(8, [True] * 6 + [False] * 2))


def test_logit_hooks_are_refused(tmp_path, tok):
    with pytest.raises(NotImplementedError, match="compute_metrics"):
        KTOTrainer(
            build_tiny_model(tok),
            args=config(tmp_path),
            train_dataset=examples(),
            processing_class=tok,
            compute_metrics=lambda p: {},
        )


def test_missing_empty_and_streamed_datasets_fail_before_the_model_loads(tmp_path, tok):
    with pytest.raises(ValueError, match="KTOTrainer needs a train_dataset"):
        KTOTrainer("no/such-model", args=config(tmp_path), processing_class=tok)
    with pytest.raises(ValueError, match="train_dataset is empty"):
        KTOTrainer("no/such-model", args=config(tmp_path), train_dataset=examples(0), processing_class=tok)
    stream = examples(4).to_iterable_dataset()
    with pytest.raises(ValueError, match="train_dataset is an IterableDataset"):
        KTOTrainer("no/such-model", args=config(tmp_path), train_dataset=stream, processing_class=tok)


def test_examples_whose_prompt_fills_max_length_are_dropped(tok):
    data = examples(4).to_list()
    data[2]["prompt"] = "one two three four five six seven eight nine ten" * 3
    with pytest.warns(UserWarning, match=r"1 of 4 examples have a prompt of max_length=16 tokens or more"):
        kept = unpaired.prepare_unpaired_dataset(data, tok, max_length=16)
    assert len(kept) == 3 and all(len(r["prompt_ids"]) + len(r["completion_ids"]) <= 16 for r in kept)
    with pytest.raises(ValueError, match="All 4 examples of the KTO dataset have a prompt of max_length=2"):
        unpaired.prepare_unpaired_dataset(data, tok, max_length=2)
