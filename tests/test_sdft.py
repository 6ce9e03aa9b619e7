"""SDFTTrainer: the config's contract, the teacher's prompt, each distillation mode against its
formula on full logits, the three teachers (start, live, EMA), importance weights, bad inputs,
accumulation, exact resume, PEFT and two processes.

Formulas (SDFT, arXiv 2601.19897, and the reference): per completion token, D = JSD_alpha of the
student (after the prompt) and the teacher (after the prompt with the privileged context); the
loss is the mean over samples of each sample's token mean of D.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator, two_processes_against_one
from test_distill import _full_logits
from test_divergence import _textbook
from test_invariance import SCRIPT

from posttrain import SDFTConfig, SDFTTrainer
from posttrain.core.batch import Rollout
from posttrain.data.distill import teacher_prompt
from posttrain.distill import losses


def privileged(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(n)],
            "privileged_context": [f"Worked answer: {i} + 1 = {i + 1}." for i in range(n)],
        }
    )


def sdft_config(tmp_path, **overrides) -> SDFTConfig:
    values = {
        "output_dir": str(tmp_path),
        **CPU_TEST_ARGS,
        "num_generations": 2,
        "max_completion_length": 8,
        "distillation_topk": 6,
    }
    values.update(overrides)
    return SDFTConfig(**values)


def sdft_trainer(
    tmp_path, tok=None, dataset=None, scripted=True, peft_config=None, **overrides
) -> SDFTTrainer:
    tok = tok if tok is not None else build_tiny_tokenizer()
    trainer = SDFTTrainer(
        model=build_tiny_model(tok, seed=1),
        args=sdft_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else privileged(),
        processing_class=tok,
        peft_config=peft_config,
    )
    if scripted:
        trainer.generator = ScriptedGenerator(SCRIPT, tok.pad_token_id or 0)
    return trainer


# ---- the config ---------------------------------------------------------------------------------------


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    c = SDFTConfig(output_dir=str(tmp_path))
    assert (c.teacher_model_kind, c.distillation_alpha, c.distillation_mode, c.distillation_topk) == (
        "base", 0.5, "topk_logits", 100,
    )  # fmt: skip
    assert (c.distillation_is_clip, c.distillation_add_tail, c.num_loss_tokens_to_skip) == (2.0, False, 0)
    assert c.teacher_prompt_template == "{prompt}\n\n{privileged_context}"
    assert (c.generate_from_teacher, c.use_teacher_server, c.teacher_update_rate, c.teacher_sync_steps) == (
        False, False, 0.05, 1,
    )  # fmt: skip
    assert (c.max_prompt_length, c.max_completion_length, c.num_generations) == (512, 256, 8)
    assert (c.disable_dropout, c.learning_rate, c.num_iterations, c.temperature) == (True, 5e-5, 1, 1.0)
    assert dataclasses.replace(c).distillation_topk == 100


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"distillation_mode": "sampled_token"}, ValueError, "needs distillation_alpha=1.0"),
        ({"distillation_topk": None}, ValueError, "needs distillation_topk"),
        ({"distillation_mode": "logits"}, ValueError, "distillation_mode='logits' is invalid"),
        ({"teacher_model_kind": "frozen"}, ValueError, "teacher_model_kind='frozen' is invalid"),
        ({"teacher_prompt_template": "{prompt} only"}, ValueError, "holding both"),
        ({"distillation_alpha": 2.0}, ValueError, "distillation_alpha=2.0 is invalid"),
        ({"teacher_update_rate": 0.0}, ValueError, "teacher_update_rate=0.0 is invalid"),
        ({"beta": 0.1}, ValueError, "beta=0.1 does not apply to SDFT"),
        ({"generate_from_teacher": True}, NotImplementedError, "generate_from_teacher"),
        ({"use_teacher_server": True}, NotImplementedError, "use_teacher_server"),
    ],
    ids=[
        "sampled_token_alpha",
        "topk_none",
        "mode",
        "teacher_kind",
        "template",
        "alpha",
        "update_rate",
        "beta",
        "generate_from_teacher",
        "use_teacher_server",
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        SDFTConfig(output_dir=str(tmp_path), **overrides)


def test_rows_without_privileged_context_are_refused_before_loading(tmp_path) -> None:
    from datasets import Dataset

    with pytest.raises(ValueError, match="no 'privileged_context' column"):
        SDFTTrainer("./no/such/model", sdft_config(tmp_path), Dataset.from_dict({"prompt": ["a"]}))
    with pytest.raises(ValueError, match="empty 'privileged_context'"):
        teacher_prompt("a", "", "{prompt}\n\n{privileged_context}", 3)


def test_a_streamed_dataset_of_unknown_columns_is_checked_row_by_row(tmp_path) -> None:
    from datasets import Dataset, IterableDataset

    from posttrain.data.distill import check_privileged_column

    streamed = Dataset.from_dict({"prompt": ["a"]}).to_iterable_dataset().map(lambda row: row)
    assert streamed.column_names is None
    check_privileged_column(streamed, "train dataset")  # nothing to check before reading it
    known = Dataset.from_dict({"prompt": ["a"]}).to_iterable_dataset()
    with pytest.raises(ValueError, match="no 'privileged_context' column"):
        check_privileged_column(known, "train dataset")
    with pytest.raises(ValueError, match="Row 0 has an empty 'privileged_context'"):
        teacher_prompt("a", None, "{prompt}\n\n{privileged_context}", 0)
    assert isinstance(streamed, IterableDataset)


def test_teacher_prompt_fills_the_template() -> None:
    template = "{prompt}\n\n{privileged_context}"
    assert teacher_prompt("Q?", "Hint.", template, 0) == "Q?\n\nHint."
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?"}]
    out = teacher_prompt(chat, [{"role": "assistant", "content": "A."}], template, 0)
    assert out == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q?\n\nA."}]
    assert chat[1]["content"] == "Q?"  # the student's prompt is left as it was


# ---- the pure losses --------------------------------------------------------------------------------


def test_topk_divergence_by_hand() -> None:
    s = torch.tensor([[math.log(0.5), math.log(0.3)]])  # the rest: 0.2
    t = torch.tensor([[math.log(0.4), math.log(0.4)]])  # the rest: 0.2
    renorm = losses.topk_divergence(s, t, 1.0, add_tail=False).item()
    ps, pt = [0.625, 0.375], [0.5, 0.5]
    assert renorm == pytest.approx(sum(a * math.log(a / b) for a, b in zip(ps, pt, strict=True)), rel=1e-5)
    tail = losses.topk_divergence(s, t, 0.0, add_tail=True).item()
    ps, pt = [0.5, 0.3, 0.2], [0.4, 0.4, 0.2]
    assert tail == pytest.approx(sum(b * math.log(b / a) for a, b in zip(ps, pt, strict=True)), rel=1e-5)


def test_sampled_token_and_importance_weights() -> None:
    s = torch.tensor([-1.0, -2.0], requires_grad=True)
    t = torch.tensor([-1.5, -1.0])
    loss = losses.sampled_token_loss(s, t)
    loss.sum().backward()
    assert loss.tolist() == pytest.approx([0.5 * -1.0, -1.0 * -2.0])
    assert s.grad.tolist() == pytest.approx([0.5, -1.0])  # sg(s - t): the reverse KL's sampled gradient
    w = losses.truncated_is_weights(torch.tensor([0.0, -1.0]), torch.tensor([-2.0, -1.2]), clip=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(0.2)])
    means = losses.per_sample_means(
        torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [0, 0, 0]])
    )
    assert means.tolist() == [2.0, 0.0]


# ---- the loss in the trainer ---------------------------------------------------------------------------


def _scored(trainer: SDFTTrainer):
    rows = [dict(r) for r in privileged(2)]
    rows = [rows[0], rows[0], rows[1], rows[1]]  # two completions per prompt
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    return scored


def _textbook_loss(trainer: SDFTTrainer, scored, mode: str, token_mean: bool = False) -> float:
    """The per-sample token means of D from the two sides' full logits, averaged over samples
    (``token_mean``: D's mean over every loss token instead, the logged metric)."""
    r = scored.rollout
    teacher_rows = Rollout(
        scored.teacher_prompt_ids,
        scored.teacher_prompt_mask,
        r.completion_ids,
        r.completion_mask,
        r.is_terminated,
    )
    mask = trainer._loss_mask(r).bool()
    a = trainer.args
    with torch.no_grad():
        zs = _full_logits(trainer.model, r) / a.temperature  # [n, T, V]
        with trainer._teacher() as teacher:
            zt = _full_logits(teacher, teacher_rows) / a.temperature
    s, t = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    if mode == "full_logits":
        d = _textbook(zs, zt, a.distillation_alpha)
    elif mode == "topk_logits":
        ids = s.topk(a.distillation_topk, dim=-1).indices
        sk, tk = s.gather(-1, ids), t.gather(-1, ids)
        d = _textbook(sk, tk, a.distillation_alpha)  # log_softmax renormalises over the k tokens
    else:
        y = r.completion_ids.unsqueeze(-1)
        d = (s.gather(-1, y) - t.gather(-1, y)).squeeze(-1) * s.gather(-1, y).squeeze(-1)
    if token_mean:
        return ((d * mask).sum() / mask.sum()).item()
    per_sample = (d * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.mean().item()


@pytest.mark.parametrize(
    "overrides",
    [
        {"distillation_mode": "full_logits", "temperature": 0.8},
        {"distillation_mode": "topk_logits", "distillation_alpha": 0.3},
        {"distillation_mode": "sampled_token", "distillation_alpha": 1.0},
        {"distillation_mode": "full_logits", "num_loss_tokens_to_skip": 2},
    ],
)
def test_loss_is_the_mean_of_sample_means_of_the_divergence(tmp_path, overrides) -> None:
    trainer = sdft_trainer(tmp_path, **overrides)
    with torch.no_grad():  # a teacher unlike its student: its start weights perturbed
        for p in trainer.teacher_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scored = _scored(trainer)
    assert scored.teacher_prompt_ids.shape[1] > scored.rollout.prompt_ids.shape[1]  # the context is in it
    loss = trainer.compute_loss(trainer.model, scored).item()
    want = _textbook_loss(trainer, scored, trainer.args.distillation_mode)
    assert loss == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert abs(want) > 1e-6


@pytest.mark.parametrize("mode", ["full_logits", "topk_logits"])
def test_logged_distillation_loss_is_the_token_mean_of_the_divergence(tmp_path, mode) -> None:
    """The reference logs D's mean over every loss token (the loss is the mean of the samples'
    means): they differ when the completions' lengths do (benchmarks/differential_self.py)."""
    trainer = sdft_trainer(tmp_path, distillation_mode=mode, num_loss_tokens_to_skip=1)
    with torch.no_grad():
        for p in trainer.teacher_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    scored = _scored(trainer)
    loss = trainer.compute_loss(trainer.model, scored).item()
    logged = trainer._metrics.pop_means("train")
    want = _textbook_loss(trainer, scored, mode, token_mean=True)
    assert logged["sdft/distillation_loss"] == pytest.approx(want, rel=1e-4, abs=1e-7)
    assert logged["self_distillation/distillation_loss"] == logged["sdft/distillation_loss"]
    assert abs(want - loss) > 1e-4 * abs(want)  # the two reductions differ on these rows


def test_base_teacher_stays_and_ema_teacher_follows(tmp_path) -> None:
    base = sdft_trainer(tmp_path / "base", max_steps=2, **SGD_ARGS)
    start = [p.detach().clone() for p in base.teacher_model.parameters()]
    base.train()
    assert all(torch.equal(a, b) for a, b in zip(start, base.teacher_model.parameters(), strict=True))

    ema = sdft_trainer(
        tmp_path / "ema", max_steps=1, teacher_model_kind="ema", teacher_update_rate=0.25, **SGD_ARGS
    )
    start = [p.detach().clone() for p in ema.teacher_model.parameters()]
    ema.train()
    for s0, teacher, student in zip(
        start, ema.teacher_model.parameters(), ema.model.parameters(), strict=True
    ):
        torch.testing.assert_close(teacher, s0 + 0.25 * (student.detach() - s0))
    assert any(not torch.equal(s0, t) for s0, t in zip(start, ema.teacher_model.parameters(), strict=True))


def test_live_teacher_is_the_model_itself(tmp_path) -> None:
    trainer = sdft_trainer(tmp_path, teacher_model_kind="live", distillation_mode="full_logits")
    assert trainer.teacher_model is None
    with trainer._teacher() as teacher:
        assert teacher is trainer.model
    scored = _scored(trainer)
    loss = trainer.compute_loss(trainer.model, scored).item()
    assert loss == pytest.approx(_textbook_loss(trainer, scored, "full_logits"), rel=1e-4)


def test_peft_base_teacher_is_the_adapters_off_model(tmp_path) -> None:
    from peft import LoraConfig

    trainer = sdft_trainer(
        tmp_path,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    assert trainer.teacher_model is None
    trainer.train()
    assert all(h["loss"] >= 0 for h in trainer.state.log_history if "loss" in h)


def test_off_policy_passes_are_importance_weighted(tmp_path) -> None:
    trainer = sdft_trainer(
        tmp_path, num_iterations=2, distillation_mode="full_logits", distillation_is_clip=1.5
    )
    scored = _scored(trainer)
    assert scored.old_logps is not None
    plain = trainer.compute_loss(trainer.model, scored).item()
    scored.old_logps = scored.old_logps - 5.0  # the sampler thought these far less likely
    weighted = trainer.compute_loss(trainer.model, scored).item()
    assert weighted == pytest.approx(1.5 * plain, rel=1e-5)  # every weight hits the clip


def test_full_logits_gradient_is_built_in_one_pass_for_sample_means_and_is_weights(
    tmp_path, monkeypatch
) -> None:
    """The loss weighs each token by its sample's 1 / length and its importance weight; the trainer
    states those weights to the engine, which then builds the student's gradient in its forward
    pass (one pass over the vocabulary). The gradients equal those of the recompute path."""
    from posttrain.ops import divergence as engine

    trainer = sdft_trainer(
        tmp_path, num_iterations=2, distillation_mode="full_logits", distillation_is_clip=1.5
    )
    scored = _scored(trainer)
    lengths = trainer._loss_mask(scored.rollout).sum(-1)
    assert len(set(lengths.tolist())) > 1  # samples of different lengths: the weights differ
    g = torch.Generator().manual_seed(0)
    scored.old_logps = scored.old_logps + 0.3 * torch.randn(scored.old_logps.shape, generator=g)

    def gradients() -> list[torch.Tensor]:
        trainer.model.zero_grad()
        trainer.compute_loss(trainer.model, scored).backward()
        return [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    passes: list[int] = []
    original = engine._gradient_pass
    monkeypatch.setattr(engine, "_gradient_pass", lambda *a, **k: passes.append(1) or original(*a, **k))
    fused = gradients()
    assert len(passes) == 1
    monkeypatch.setattr(engine, "_common_factor", lambda *a: None)  # never proportional: recompute
    recomputed = gradients()
    assert len(passes) == 3
    assert len(fused) == len(recomputed) > 0
    for a, b in zip(fused, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


# ---- accumulation, resume, two processes -----------------------------------------------------------------


def _sgd_params(path, per_device: int, accumulation: int) -> list[torch.Tensor]:
    trainer = sdft_trainer(
        path, dataset=privileged(8), per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
        max_steps=1, shuffle_dataset=False, distillation_mode="full_logits", **SGD_ARGS,
    )  # fmt: skip
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_same_update(tmp_path) -> None:
    one, four = _sgd_params(tmp_path / "one", 8, 1), _sgd_params(tmp_path / "four", 2, 4)
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_resume_is_exact_with_the_ema_teacher(tmp_path) -> None:
    tok = build_tiny_tokenizer()

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = sdft_trainer(
            out, tok, scripted=False, teacher_model_kind="ema", teacher_update_rate=0.5, max_steps=3,
            save_strategy="steps", save_steps=1, learning_rate=0.05,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.teacher_model.parameters(), resumed.teacher_model.parameters(), strict=True):
        assert torch.equal(a, b)


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> SDFTTrainer:
    """Two SGD steps of SDFT (top-k JSD, EMA teacher) on one repeated prompt (the two-process test)."""
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    args = sdft_config(
        out_dir,
        **{**SGD_ARGS, "per_device_train_batch_size": per_device, "max_steps": 2},
        num_generations=4, teacher_model_kind="ema", teacher_update_rate=0.5, seed=1, **overrides,
    )  # fmt: skip
    rows = Dataset.from_dict(
        {"prompt": ["What is 2 plus 3?"] * 16, "privileged_context": ["2 + 3 = 5."] * 16}
    )
    return SDFTTrainer(build_tiny_model(tok, seed=1), args, rows, processing_class=tok)


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    keys = ("sdft/distillation_loss", "num_tokens")
    two_processes_against_one("test_sdft", ddp_comparable_trainer, SCRIPT, tmp_path, 29583, (2, 4), keys)
