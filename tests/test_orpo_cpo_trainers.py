"""ORPOTrainer and CPOTrainer end to end on the tiny model: the loss against a hand computation,
the metrics, both data formats, the papers' configurations, accumulation, resume and bad input."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain.cpo.config import CPOConfig
from posttrain.cpo.trainer import CPOTrainer
from posttrain.orpo.config import ORPOConfig
from posttrain.orpo.trainer import ORPOTrainer

FAMILIES = {"orpo": (ORPOTrainer, ORPOConfig), "cpo": (CPOTrainer, CPOConfig)}


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


def chats(n: int = 8) -> Dataset:
    """Conversational pairs with an implicit prompt (the shared user turn)."""

    def chat(i: int, answer: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"What is {i} + {i}?"}, {"role": "assistant", "content": answer}]

    return Dataset.from_dict(
        {"chosen": [chat(i, str(2 * i)) for i in range(n)], "rejected": [chat(i, "no") for i in range(n)]}
    )


def make(kind: str, tmp_path, tok, dataset=None, model=None, **overrides):
    trainer_class, config_class = FAMILIES[kind]
    return trainer_class(
        model if model is not None else build_tiny_model(tok),
        args=config_class(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides}),
        train_dataset=dataset if dataset is not None else pairs(),
        processing_class=tok,
    )


def first_batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def token_logps(model, tok, prompt: str, completion: str) -> list[float]:
    """The completion tokens' log-probs under ``model``, from its full logits."""
    p = tok(prompt)["input_ids"]
    full = tok(prompt + completion + tok.eos_token)["input_ids"]
    start = next((k for k, (a, b) in enumerate(zip(p, full, strict=False)) if a != b), len(p))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([full])).logits[0, :-1].double(), dim=-1)
    return [logp[t - 1, full[t]].item() for t in range(start, len(full))]


def sides(model, tok, data: Dataset) -> list[tuple[list[float], list[float]]]:
    return [
        (
            token_logps(model, tok, r["prompt"], r["chosen"]),
            token_logps(model, tok, r["prompt"], r["rejected"]),
        )
        for r in data
    ]


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def logged(trainer, key: str = "loss") -> list[dict]:
    return [h for h in trainer.state.log_history if key in h and "train_runtime" not in h]


# ---- the loss, by hand, at step 1 ----------------------------------------------------------------


def test_orpo_loss_at_step_one_equals_the_formula(tmp_path, tok):
    """L = -Σℓ_w/Σn_w - β mean log σ(o), o the log odds ratio of the mean token probabilities."""
    beta = 0.3
    trainer = make("orpo", tmp_path, tok, dataset=pairs(4), beta=beta, max_steps=1)
    by_side = sides(trainer.model, tok, pairs(4))

    def odds(mean: float) -> float:
        return mean - math.log(1.0 - math.exp(mean))

    terms = [log_sigmoid(odds(sum(w) / len(w)) - odds(sum(l_) / len(l_))) for w, l_ in by_side]
    nll = -sum(sum(w) for w, _ in by_side) / sum(len(w) for w, _ in by_side)
    expected = nll - beta * sum(terms) / len(terms)
    assert trainer.compute_loss(trainer.model, first_batch(trainer)).item() == pytest.approx(
        expected, rel=1e-5
    )
    trainer.train()
    step = logged(trainer)[0]
    assert step["loss"] == pytest.approx(expected, rel=1e-5)
    assert step["nll_loss"] == pytest.approx(nll, rel=1e-5)
    assert step["log_odds_ratio"] == pytest.approx(sum(terms) / 4, rel=1e-5)


def test_cpo_sigmoid_loss_at_step_one_equals_the_formula(tmp_path, tok):
    """L = mean -log σ(β(ℓ_w - ℓ_l)) + cpo_alpha · (-Σℓ_w/Σn_w), ℓ summed over the completion."""
    beta = 0.5
    trainer = make("cpo", tmp_path, tok, dataset=pairs(4), beta=beta, max_steps=1)
    assert trainer.args.cpo_alpha == 1.0
    by_side = sides(trainer.model, tok, pairs(4))
    pref = sum(-log_sigmoid(beta * (sum(w) - sum(l_))) for w, l_ in by_side) / 4
    nll = -sum(sum(w) for w, _ in by_side) / sum(len(w) for w, _ in by_side)
    assert trainer.compute_loss(trainer.model, first_batch(trainer)).item() == pytest.approx(
        pref + nll, rel=1e-5
    )
    trainer.train()
    assert logged(trainer)[0]["loss"] == pytest.approx(pref + nll, rel=1e-5)


# ---- metrics --------------------------------------------------------------------------------------

SHARED_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "nll_loss",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
)


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("orpo", {"beta": 0.5}), ("cpo", {"loss_type": "simpo", "beta": 2.0})],
)
def test_metrics_have_the_reference_names_and_agree(tmp_path, tok, kind, overrides):
    trainer = make(kind, tmp_path, tok, max_steps=4, **overrides)
    trainer.train()
    logs = logged(trainer, "rewards/margins")
    assert len(logs) == 4
    beta = overrides["beta"]
    for h in logs:
        for name in SHARED_METRICS:
            assert math.isfinite(h[name]), name
        assert h["rewards/margins"] == pytest.approx(
            h["rewards/chosen"] - h["rewards/rejected"], rel=1e-6, abs=1e-6
        )
        assert h["rewards/chosen"] == pytest.approx(beta * h["logps/chosen"], rel=1e-5)
        assert 0.0 <= h["rewards/accuracies"] <= 1.0 and 0.0 <= h["mean_token_accuracy"] <= 1.0
        if kind == "orpo":  # one micro-batch per step: the loss is its two logged parts
            assert h["log_odds_ratio"] <= 0 and math.isfinite(h["log_odds_chosen"])
            assert h["loss"] == pytest.approx(h["nll_loss"] - beta * h["log_odds_ratio"], rel=1e-5)
        else:
            assert "log_odds_ratio" not in h and "log_odds_chosen" not in h
    assert logs[-1]["num_tokens"] > logs[0]["num_tokens"]
    assert logs[-1]["loss"] < logs[0]["loss"]  # it learns
    if overrides.get("loss_type") == "simpo":  # logps/* are the token means the loss uses
        assert logs[0]["logps/chosen"] > -20


def test_evaluation_logs_the_metrics_with_the_eval_prefix(tmp_path, tok):
    trainer = ORPOTrainer(
        build_tiny_model(tok),
        args=ORPOConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS),
        train_dataset=pairs(),
        eval_dataset=pairs(4),
        processing_class=tok,
    )
    trainer.evaluate()
    metrics = trainer.state.log_history[-1]
    assert math.isfinite(metrics["eval_loss"])
    assert metrics["eval_loss"] == pytest.approx(
        metrics["eval_nll_loss"] - 0.1 * metrics["eval_log_odds_ratio"], rel=1e-5
    )
    assert "eval_rewards/margins" in metrics and "eval_num_tokens" not in metrics


# ---- data -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_conversational_implicit_prompt_pairs_use_the_dpo_tokenisation(tmp_path, tok, kind):
    """The completion ends where the template ends the turn: no EOS appended after it (fault 5)."""
    trainer = make(kind, tmp_path, tok, dataset=chats())
    row = trainer.train_dataset[0]
    assert tok.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
    assert tok.decode(row["rejected_ids"]) == "no<|im_end|>\n"
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in logged(trainer))


def test_padding_value_pads_the_batches_without_changing_the_loss(tmp_path, tok):
    plain = make("orpo", tmp_path / "a", tok, model=build_tiny_model(tok, seed=2))
    padded = make("orpo", tmp_path / "b", tok, model=build_tiny_model(tok, seed=2), padding_value=7)
    a, b = first_batch(plain), first_batch(padded)
    pad = b.pairs.rejected.attention_mask == 0
    assert pad.any() and (b.pairs.rejected.input_ids[pad] == 7).all()
    torch.testing.assert_close(plain.compute_loss(plain.model, a), padded.compute_loss(padded.model, b))


# ---- the papers' configurations -------------------------------------------------------------------

PAPER_CONFIGS = {
    "orpo": (
        "orpo",
        {
            "beta": 0.1,
            "learning_rate": 5e-6,
            "lr_scheduler_type": "inverse_sqrt",
            "num_train_epochs": 5,
            "warmup_steps": 200,
            "per_device_train_batch_size": 8,
        },
    ),
    "cpo": (
        "cpo",
        {
            "loss_type": "sigmoid",
            "cpo_alpha": 1.0,
            "beta": 0.1,
            "learning_rate": 1e-4,
            "lr_scheduler_type": "inverse_sqrt",
            "num_train_epochs": 1,
            "warmup_ratio": 0.01,
            "max_length": 512,
        },
    ),
    "simpo": (
        "cpo",
        {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.5, "simpo_gamma": 1.375, "learning_rate": 1e-6},
    ),
    "alphapo": (
        "cpo",
        {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.5, "simpo_gamma": 0.1, "learning_rate": 7e-7},
    ),
}


@pytest.mark.parametrize("paper", list(PAPER_CONFIGS))
def test_the_papers_configurations_build_and_train(tmp_path, tok, paper):
    kind, values = PAPER_CONFIGS[paper]
    trainer_class, config_class = FAMILIES[kind]
    args = config_class(
        **values,
        output_dir=str(tmp_path),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_steps=2,
        logging_steps=1,
        disable_tqdm=True,
    )
    trainer = trainer_class(build_tiny_model(tok), args=args, train_dataset=pairs(16), processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 2
    assert all(math.isfinite(h["loss"]) for h in logged(trainer))
    if paper == "cpo":  # transformers 5 has no warmup_ratio: it became a fractional warmup_steps
        assert args.warmup_steps == 0.01 and args.get_warmup_steps(100) == 1
    if paper == "alphapo":  # the NLL weight defaults to 0 for AlphaPO, without overriding a given one
        assert args.cpo_alpha == 0.0


# ---- accumulation and resume ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [("orpo", {}), ("cpo", {"loss_type": "alphapo", "alpha": 0.25, "beta": 2.5, "cpo_alpha": 0.5})],
    ids=["orpo", "alphapo"],
)
def test_gradient_accumulation_gives_the_update_of_the_whole_batch(tmp_path, tok, kind, overrides):
    common = {"max_steps": 1, "optim": "sgd", "learning_rate": 0.5, "max_grad_norm": 1e9, **overrides}
    whole = make(kind, tmp_path / "a", tok, per_device_train_batch_size=4, **common)
    split = make(
        kind, tmp_path / "b", tok, per_device_train_batch_size=1, gradient_accumulation_steps=4, **common
    )
    whole.train()
    split.train()
    initial = build_tiny_model(tok).state_dict()
    moved = False
    for (name, a), (_, b) in zip(whole.model.named_parameters(), split.model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=name)
        moved |= not torch.equal(a, initial[name])
    assert moved
    assert logged(whole)[0]["loss"] == pytest.approx(logged(split)[0]["loss"], rel=1e-5)


def test_an_interrupted_run_resumes_exactly(tmp_path, tok):
    """ORPO and CPO keep no state of their own: the core's checkpoint is all there is to restore."""
    kind = "cpo"
    common = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "loss_type": "simpo", "beta": 2.0}
    full = make(kind, tmp_path / "full", tok, **common)
    full.train()
    resumed = make(kind, tmp_path / "resumed", tok, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), (_, b) in zip(
        full.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    tail = [h["loss"] for h in logged(full)][2:]
    assert [h["loss"] for h in logged(resumed)][-2:] == tail


# ---- configuration ---------------------------------------------------------------------------------


def config(kind: str, tmp_path, **values):
    return FAMILIES[kind][1](output_dir=str(tmp_path), use_cpu=True, bf16=False, **values)


def test_cpo_alpha_resolves_per_loss_type_and_a_given_value_is_kept(tmp_path):
    assert config("cpo", tmp_path).cpo_alpha == 1.0
    assert config("cpo", tmp_path, loss_type="simpo").cpo_alpha == 1.0
    assert config("cpo", tmp_path, loss_type="alphapo", alpha=0.25).cpo_alpha == 0.0
    assert config("cpo", tmp_path, loss_type="alphapo", alpha=0.25, cpo_alpha=0.5).cpo_alpha == 0.5
    assert config("cpo", tmp_path, loss_type="alphapo", alpha=0.25).loss_type == "alphapo"  # not rewritten
    assert config("cpo", tmp_path, cpo_alpha=0.0).cpo_alpha == 0.0


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_shared_defaults_and_warmup_ratio(tmp_path, kind):
    args = config(kind, tmp_path)
    assert (
        args.learning_rate == 1e-6 and args.max_length == 1024 and args.beta == 0.1 and args.disable_dropout
    )
    assert args.warmup_ratio is None and args.warmup_steps == 0
    with pytest.warns(UserWarning, match="max_length=512"):
        assert config(kind, tmp_path, max_length=None).max_length == 512
    with_ratio = config(kind, tmp_path, warmup_ratio=0.1)
    assert with_ratio.warmup_steps == 0.1
    assert dataclasses.replace(with_ratio, logging_steps=5).warmup_steps == 0.1  # rebuilt from its own values


def test_alpha_warnings(tmp_path):
    with pytest.warns(UserWarning, match="shapes the \\*summed\\* completion log-probability"):
        config("cpo", tmp_path, loss_type="sigmoid", alpha=0.25)
    with pytest.warns(UserWarning, match="alpha=0.0 is SimPO"):
        config("cpo", tmp_path, loss_type="alphapo")


BAD_CONFIGS = [
    (
        "cpo",
        {"loss_type": "kto"},
        ValueError,
        "loss_type='kto' is invalid: it must be one of 'sigmoid', 'hinge', 'ipo', 'simpo', 'alphapo'",
    ),
    (
        "cpo",
        {"label_smoothing": 0.5},
        ValueError,
        r"label_smoothing=0.5 is invalid: it must be a number in \[0, 0.5\)",
    ),
    ("cpo", {"label_smoothing": -0.1}, ValueError, "label_smoothing=-0.1 is invalid"),
    (
        "cpo",
        {"loss_type": "hinge", "label_smoothing": 0.1},
        ValueError,
        "has no effect with loss_type='hinge'",
    ),
    ("cpo", {"loss_type": "ipo", "label_smoothing": 0.1}, ValueError, "has no effect with loss_type='ipo'"),
    ("cpo", {"beta": 0.0}, ValueError, "beta=0.0 is invalid: it must be a finite number > 0"),
    ("cpo", {"cpo_alpha": -1.0}, ValueError, "cpo_alpha=-1.0 is invalid"),
    ("cpo", {"alpha": float("inf")}, ValueError, "alpha=inf is invalid"),
    ("orpo", {"beta": -0.1}, ValueError, "beta=-0.1 is invalid: it must be a finite number >= 0"),
    ("orpo", {"padding_value": -1}, ValueError, "padding_value=-1 is invalid"),
    (
        "orpo",
        {"warmup_ratio": 1.0},
        ValueError,
        r"warmup_ratio=1.0 is invalid: it must be None or a number in \[0, 1\)",
    ),
    (
        "cpo",
        {"warmup_ratio": 0.1, "warmup_steps": 10},
        ValueError,
        "warmup_ratio=0.1 and warmup_steps=10 are both set",
    ),
    (
        "orpo",
        {"generate_during_eval": True},
        NotImplementedError,
        "generate_during_eval=True is not implemented yet",
    ),
    (
        "cpo",
        {"generate_during_eval": True},
        NotImplementedError,
        "generate_during_eval=True is not implemented yet",
    ),
    (
        "orpo",
        {"max_completion_length": 128},
        NotImplementedError,
        "max_completion_length=128 is not implemented yet",
    ),
    (
        "cpo",
        {"is_encoder_decoder": True},
        NotImplementedError,
        "is_encoder_decoder=True is not implemented yet",
    ),
]


@pytest.mark.parametrize(
    ("kind", "values", "error", "message"),
    BAD_CONFIGS,
    ids=[f"{k}-{'-'.join(v)}" for k, v, _, _ in BAD_CONFIGS],
)
def test_bad_configs_fail_when_the_config_is_built(tmp_path, kind, values, error, message):
    with pytest.raises(error, match=message):
        config(kind, tmp_path, **values)


# ---- bad trainer input ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["orpo", "cpo"])
def test_missing_columns_fail_before_the_model_loads(tmp_path, tok, kind):
    trainer_class, _ = FAMILIES[kind]
    bad = Dataset.from_dict({"prompt": ["a"], "answer": ["b"]})
    with pytest.raises(ValueError, match="no 'chosen' or 'rejected' column"):
        trainer_class("no/such-model", args=config(kind, tmp_path), train_dataset=bad, processing_class=tok)
    with pytest.raises(ValueError, match="needs a train_dataset of preference pairs"):
        trainer_class("no/such-model", args=config(kind, tmp_path), processing_class=tok)


@pytest.mark.parametrize("hook", ["compute_metrics", "preprocess_logits_for_metrics", "model_init"])
def test_unsupported_hooks_are_refused_before_the_model_loads(tmp_path, tok, hook):
    with pytest.raises(NotImplementedError, match=hook):
        CPOTrainer(
            "no/such-model",
            args=config("cpo", tmp_path),
            train_dataset=pairs(),
            processing_class=tok,
            **{hook: lambda *a: {}},
        )


def test_an_encoder_decoder_model_is_refused(tmp_path, tok):
    model = build_tiny_model(tok)
    model.config.is_encoder_decoder = True
    with pytest.raises(
        NotImplementedError, match="is an encoder-decoder model; posttrain's ORPOTrainer trains"
    ):
        ORPOTrainer(model, args=config("orpo", tmp_path), train_dataset=pairs(), processing_class=tok)
