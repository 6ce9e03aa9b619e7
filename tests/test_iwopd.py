"""IWOPDTrainer: the config's contract, the position weights worked by hand, the loss against the
formula on full logits (``-sum_t w_t a_t log p_S(y_t) / N``), the reduced JSD objective, and the
prompt-only dataset the reference turns into NaN parameters.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator
from test_distill import _full_logits, conversations
from test_divergence import _textbook
from test_invariance import SCRIPT

from posttrain import IWOPDConfig, IWOPDTrainer
from posttrain.distill import losses


def iwopd_trainer(tmp_path, dataset=None, **overrides) -> IWOPDTrainer:
    tok = build_tiny_tokenizer()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "max_completion_length": 8, "max_length": 128}
    values.update(overrides)
    trainer = IWOPDTrainer(
        model=build_tiny_model(tok, seed=1),
        teacher_model=build_tiny_model(tok, seed=2),
        args=IWOPDConfig(**values),
        train_dataset=dataset if dataset is not None else conversations(),
        processing_class=tok,
    )
    trainer.generator = ScriptedGenerator(SCRIPT, tok.pad_token_id or 0)
    return trainer


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    c = IWOPDConfig(output_dir=str(tmp_path))
    assert (c.distillation_objective, c.iw_opd_gamma, c.iw_opd_epsilon, c.lmbda, c.beta) == (
        "iw_opd",
        0.5,
        1e-8,
        1.0,
        1.0,
    )
    assert (c.reverse_kl_top_1_mode, c.loss_top_k, c.loss_add_tail, c.top_p, c.top_k) == (
        "sampled",
        1,
        True,
        0.95,
        0,
    )
    assert (c.max_length, c.max_completion_length, c.max_prompt_length) == (1024, 512, 512)  # 1024 - 512
    assert (c.temperature, c.disable_dropout, c.num_generations, c.use_teacher_server) == (
        1.0,
        True,
        1,
        False,
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"lmbda": 0.5}, ValueError, "needs lmbda=1.0"),
        ({"max_completion_length": 1024}, ValueError, "must be below max_length=1024"),
        ({"iw_opd_gamma": -1.0}, ValueError, "iw_opd_gamma=-1.0 is invalid"),
        ({"loss_top_k": -1}, ValueError, "loss_top_k=-1 is invalid"),
        ({"distillation_objective": "kl"}, ValueError, "distillation_objective='kl' is invalid"),
        ({"log_completions_steps": 0}, ValueError, "log_completions_steps=0 is invalid"),
    ],
    ids=[
        "lmbda",
        "lengths",
        "gamma",
        "loss_top_k",
        "objective",
        "log_completions_steps",
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        IWOPDConfig(output_dir=str(tmp_path), **overrides)


def test_log_completions_steps_logs_the_completions_of_every_that_many_steps(tmp_path) -> None:
    assert IWOPDConfig(output_dir=str(tmp_path)).log_completions_steps == 100  # the reference's default
    trainer = iwopd_trainer(tmp_path, max_steps=3, log_completions=True, log_completions_steps=2)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [0, 2]


@pytest.mark.parametrize(
    "overrides, teacher, match",
    [
        ({}, None, "needs teacher_model_server_url"),
        ({"teacher_model_server_url": "http://127.0.0.1:1", "temperature": 0.7}, None, "temperature=0.7"),
        ({"teacher_model_server_url": "http://127.0.0.1:1"}, "a teacher", r"a teacher_model \(or teacher_model_name_or_path\)"),
    ],
    ids=["no-address", "temperature", "two-teachers"],
)  # fmt: skip
def test_a_served_teacher_needs_its_address_temperature_one_and_no_other_teacher(
    tmp_path, overrides, teacher, match
) -> None:
    """use_teacher_server=True (tests/test_vllm_engine.py trains through a real vLLM server)."""
    tok = build_tiny_tokenizer()
    args = IWOPDConfig(output_dir=str(tmp_path), use_teacher_server=True, **CPU_TEST_ARGS, **overrides)
    given = build_tiny_model(tok, seed=2) if teacher else None
    with pytest.raises(ValueError, match=match):
        IWOPDTrainer(
            model=build_tiny_model(tok), teacher_model=given, args=args, train_dataset=conversations(),
            processing_class=tok,
        )  # fmt: skip


def test_position_weights_by_hand() -> None:
    a = torch.tensor([[0.5, -0.5, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])  # the last token does not count, even in the totals
    w = losses.iw_opd_weights(a * mask, mask, gamma=0.5, epsilon=0.0)
    # total |a| = 2; the prefix shares before each token: 0, 0.25, 0.5
    assert w[0, :3].tolist() == pytest.approx([1.5, 1.375, 1.25])


def test_loss_is_the_weighted_sampled_token_policy_gradient(tmp_path) -> None:
    trainer = iwopd_trainer(tmp_path, iw_opd_gamma=0.8)
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} plus one?"}]} for i in range(4)]
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    assert scored.extra["source"] == "student"
    for p in trainer.model.parameters():
        p.grad = None
    loss = trainer.compute_loss(trainer.model, scored)
    loss.backward()
    r = scored.rollout
    mask = r.completion_mask.bool()
    y = r.completion_ids.unsqueeze(-1)
    logits = _full_logits(trainer.model, r).requires_grad_()
    s = torch.log_softmax(logits, -1).gather(-1, y).squeeze(-1)
    with torch.no_grad():
        t = torch.log_softmax(_full_logits(trainer.teacher_model, r), -1).gather(-1, y).squeeze(-1)
    a = (t - s.detach()) * mask
    prefix = torch.cumsum(a.abs(), -1) - a.abs()
    w = 1 + 0.8 * (1 - prefix / (a.abs().sum(-1, keepdim=True) + 1e-8))
    want = -(s * w * a * mask).sum() / mask.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert trainer.state.global_step == 0 and trainer._metrics  # the metrics were recorded


def test_reduced_jsd_over_the_sampled_token_and_the_tail(tmp_path) -> None:
    """The reverse KL (beta=1, the default) over the sampled token and the tail."""
    trainer = iwopd_trainer(tmp_path, distillation_objective="jsd", beta=1.0, loss_top_k=1)
    (scored,) = trainer._generate_and_score([{"prompt": "Question 1"}] * 4, "train", num_chunks=1)
    loss = trainer.compute_loss(trainer.model, scored).item()
    r = scored.rollout
    mask = r.completion_mask.bool()
    y = r.completion_ids.unsqueeze(-1)
    with torch.no_grad():
        s = torch.log_softmax(_full_logits(trainer.model, r), -1).gather(-1, y).squeeze(-1)[mask]
        t = torch.log_softmax(_full_logits(trainer.teacher_model, r), -1).gather(-1, y).squeeze(-1)[mask]
    two = lambda lp: torch.stack([lp, torch.log1p(-lp.exp())], -1)  # noqa: E731  (the token, the rest)
    want = _textbook(two(s), two(t), 1.0).mean()
    assert loss == pytest.approx(want.item(), rel=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_reduced_jsd_adds_the_teachers_top_token_below_beta_1(tmp_path, beta) -> None:
    """The reference's support with loss_top_k=1: the teacher's argmax for the forward KL (beta=0);
    for the JSD its argmax and the sampled token (once where they are the same); each with the tail."""
    trainer = iwopd_trainer(tmp_path, distillation_objective="jsd", beta=beta, loss_top_k=1)
    (scored,) = trainer._generate_and_score([{"prompt": "Question 1"}] * 4, "train", num_chunks=1)
    loss = trainer.compute_loss(trainer.model, scored).item()
    r = scored.rollout
    mask = r.completion_mask.bool()
    y = r.completion_ids[mask]
    with torch.no_grad():
        s_all = torch.log_softmax(_full_logits(trainer.model, r), -1)[mask]
        t_all = torch.log_softmax(_full_logits(trainer.teacher_model, r), -1)[mask]
    top = t_all.argmax(-1)
    assert (top != y).any()  # the two supports differ somewhere

    def reduced(lp: torch.Tensor, i: int) -> torch.Tensor:
        ids = [int(top[i])] if beta == 0.0 or top[i] == y[i] else [int(top[i]), int(y[i])]
        kept = lp[i, ids]
        return torch.cat([kept, torch.log1p(-kept.exp().sum()).unsqueeze(0)])

    want = torch.stack(
        [_textbook(reduced(s_all, i)[None], reduced(t_all, i)[None], beta)[0] for i in range(len(y))]
    ).mean()
    assert loss == pytest.approx(want.item(), rel=1e-4)


def test_mean_advantage_is_the_weighted_advantage(tmp_path) -> None:
    """``iw_opd/mean_advantage`` is the token mean of ``w_t a_t`` (the reference's), ``mean_abs_advantage``
    that of ``|a_t|``."""
    trainer = iwopd_trainer(tmp_path, iw_opd_gamma=2.0)
    (scored,) = trainer._generate_and_score([{"prompt": "Question 1"}] * 4, "train", num_chunks=1)
    trainer.compute_loss(trainer.model, scored)
    r = scored.rollout
    mask = r.completion_mask.bool()
    y = r.completion_ids.unsqueeze(-1)
    with torch.no_grad():
        s = torch.log_softmax(_full_logits(trainer.model, r), -1).gather(-1, y).squeeze(-1)
        t = torch.log_softmax(_full_logits(trainer.teacher_model, r), -1).gather(-1, y).squeeze(-1)
    a = (t - s) * mask
    prefix = torch.cumsum(a.abs(), -1) - a.abs()
    w = 1 + 2.0 * (1 - prefix / (a.abs().sum(-1, keepdim=True) + 1e-8))
    values = trainer._metrics.pop_means("train")
    assert values["iw_opd/mean_advantage"] == pytest.approx((w * a)[mask].mean().item(), rel=1e-4)
    assert values["iw_opd/mean_abs_advantage"] == pytest.approx(a.abs()[mask].mean().item(), rel=1e-4)


def test_prompt_only_messages_train_without_nan(tmp_path) -> None:
    """The reference's IWOPD divides by the dataset's completion tokens: 0 here, so its loss is inf
    and its parameters NaN after one step. Here the loss counts the sampled tokens."""
    from datasets import Dataset

    prompts = Dataset.from_dict(
        {"messages": [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(8)]}
    )
    trainer = iwopd_trainer(tmp_path, dataset=prompts, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert {"iw_opd/mean_advantage", "iw_opd/mean_weight", "iw_opd/min_weight", "iw_opd/max_weight"} <= logs[
        0
    ].keys()
    assert 1.0 <= logs[0]["iw_opd/min_weight"] <= logs[0]["iw_opd/max_weight"] <= 1.5


def test_resume_is_exact(tmp_path) -> None:
    def train(out, resume=None):
        torch.manual_seed(0)
        tok = build_tiny_tokenizer()
        trainer = IWOPDTrainer(
            build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2),
            IWOPDConfig(
                output_dir=str(out),
                **{**CPU_TEST_ARGS, "max_steps": 3, "learning_rate": 0.05, "save_strategy": "steps", "save_steps": 1},
                max_completion_length=8, max_length=64,
            ),
            train_dataset=conversations(), processing_class=tok,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = train(tmp_path / "straight")
    train(tmp_path / "stopped")
    resumed = train(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> IWOPDTrainer:
    """Two SGD steps of IW-OPD on one repeated prompt (the two-process test)."""
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    args = IWOPDConfig(
        output_dir=out_dir,
        **{**CPU_TEST_ARGS, **SGD_ARGS, "per_device_train_batch_size": per_device, "max_steps": 2},
        max_completion_length=8, max_length=64, seed=1, **overrides,
    )  # fmt: skip
    rows = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 16})
    return IWOPDTrainer(
        build_tiny_model(tok, seed=1),
        build_tiny_model(tok, seed=2),
        args,
        train_dataset=rows,
        processing_class=tok,
    )


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    from helpers import two_processes_against_one

    keys = (
        "on_policy_loss",
        "iw_opd/mean_advantage",
        "iw_opd/mean_weight",
        "iw_opd/max_weight",
        "num_tokens",
    )
    two_processes_against_one("test_iwopd", ddp_comparable_trainer, SCRIPT, tmp_path, 29593, (2, 4), keys)


def test_the_jsd_objective_trains_on_dataset_completions_too(tmp_path) -> None:
    """lmbda=0 with the reduced JSD: every step is off-policy, on the conversations' answers."""
    trainer = iwopd_trainer(tmp_path, distillation_objective="jsd", lmbda=0.0, max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert trainer.generator.calls == 0
    assert all("off_policy_loss" in h and math.isfinite(h["loss"]) for h in logs)
