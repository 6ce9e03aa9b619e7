"""DistillationTrainer and GKDTrainer: the configs' contract, the loss against the divergence of the
two models' full logits, the teacher frozen, GKD's on/off-policy mix, bad inputs, accumulation,
exact resume and two processes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator, standard_dataset, two_processes_against_one
from test_divergence import _textbook
from test_invariance import SCRIPT

from posttrain import DistillationConfig, DistillationTrainer, GKDConfig, GKDTrainer, GRPOConfig
from posttrain.data.distill import dataset_rollout
from posttrain.ops.logprobs import position_ids_from_mask


def conversations(n: int = 16):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": f"What is {i} plus one?"},
                    {"role": "assistant", "content": str(i + 1)},
                ]
                for i in range(n)
            ]
        }
    )


def distill_trainer(
    tmp_path,
    tok=None,
    cls=DistillationTrainer,
    config=DistillationConfig,
    dataset=None,
    scripted=True,
    **overrides,
):
    tok = tok if tok is not None else build_tiny_tokenizer()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS}
    values["max_new_tokens" if config is GKDConfig else "max_completion_length"] = 8
    values.update(overrides)
    trainer = cls(
        model=build_tiny_model(tok, seed=1),
        teacher_model=build_tiny_model(tok, seed=2),
        args=config(**values),
        train_dataset=dataset
        if dataset is not None
        else (conversations() if cls is GKDTrainer else standard_dataset()),
        processing_class=tok,
    )
    if scripted:
        trainer.generator = ScriptedGenerator(SCRIPT, tok.pad_token_id or 0)
    return trainer


# ---- the configs ------------------------------------------------------------------------------------


def test_configs_have_the_reference_fields_and_defaults(tmp_path) -> None:
    d = DistillationConfig(output_dir=str(tmp_path))
    assert (d.beta, d.temperature, d.max_completion_length, d.learning_rate) == (1.0, 1.0, 512, 1e-6)
    assert (d.num_generations, d.disable_dropout, d.top_p, d.top_k) == (1, False, 1.0, 0)
    assert d.teacher_model_name_or_path is None and d.teacher_model_init_kwargs is None
    g = GKDConfig(output_dir=str(tmp_path))
    assert (g.lmbda, g.beta, g.temperature, g.max_new_tokens, g.seq_kd) == (0.5, 0.5, 0.9, 128, False)
    assert (g.disable_dropout, g.learning_rate, g.max_completion_length) == (True, 2e-5, 128)
    rebuilt = dataclasses.replace(g)  # a copy of a built config rebuilds
    assert rebuilt.max_completion_length == 128


@pytest.mark.parametrize(
    "config, overrides, match",
    [
        (DistillationConfig, {"beta": 1.5}, "beta=1.5 is invalid"),
        (DistillationConfig, {"beta": -0.1}, "beta=-0.1 is invalid"),
        (DistillationConfig, {"num_generations": 0}, "num_generations=0 is invalid"),
        (DistillationConfig, {"epsilon": 0.3}, "epsilon=0.3 does not apply to distillation"),
        (DistillationConfig, {"sync_ref_model": True}, "sync_ref_model=True does not apply"),
        (GKDConfig, {"lmbda": 1.2}, "lmbda=1.2 is invalid"),
        (GKDConfig, {"lmbda": -0.5}, "lmbda=-0.5 is invalid"),
        (GKDConfig, {"max_new_tokens": 0}, "max_new_tokens=0 is invalid"),
        (GKDConfig, {"max_completion_length": 64}, "max_completion_length=64 and max_new_tokens=128 differ"),
    ],
    ids=[
        "beta_above_1",
        "beta_below_0",
        "num_generations_0",
        "epsilon",
        "sync_ref_model",
        "lmbda_above_1",
        "lmbda_below_0",
        "max_new_tokens_0",
        "max_completion_length",
    ],
)
def test_configs_reject_bad_values(tmp_path, config, overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        config(output_dir=str(tmp_path), **overrides)


def test_trainer_refuses_another_config(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    with pytest.raises(TypeError, match="needs a DistillationConfig"):
        DistillationTrainer(
            build_tiny_model(tok), build_tiny_model(tok), GRPOConfig(output_dir=str(tmp_path))
        )


# ---- the loss -----------------------------------------------------------------------------------


def _full_logits(model, r) -> torch.Tensor:
    """[B, T, V] logits of the completion positions, the plain way."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    return logits[:, r.prompt_ids.shape[1] - 1 : -1].double()


@pytest.mark.parametrize(
    "config, overrides, loss_temperature",
    [
        (DistillationConfig, {"beta": 1.0, "temperature": 0.7}, 0.7),
        (DistillationConfig, {"beta": 0.0}, 1.0),
        (GKDConfig, {"beta": 0.3, "temperature": 0.7, "lmbda": 1.0}, 1.0),  # GKD: sampling temperature only
    ],
)
def test_loss_is_the_token_mean_of_the_divergence_of_full_logits(
    tmp_path, config, overrides, loss_temperature
) -> None:
    cls = GKDTrainer if config is GKDConfig else DistillationTrainer
    trainer = distill_trainer(tmp_path, cls=cls, config=config, **overrides)
    rows = [{"prompt": f"Question {i}: what is {i} plus one?"} for i in range(4)]
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    loss = trainer.compute_loss(trainer.model, scored)
    r = scored.rollout
    keep = r.completion_mask.bool()
    with torch.no_grad():
        zs = _full_logits(trainer.model, r)[keep] / loss_temperature
        zt = _full_logits(trainer.teacher_model, r)[keep] / loss_temperature
    want = _textbook(zs, zt, trainer.args.beta).sum() / keep.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert keep.sum() < keep.numel()  # completions of different lengths: padding is left out


def test_a_student_equal_to_its_teacher_learns_nothing(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    student = build_tiny_model(tok, seed=1)
    trainer = DistillationTrainer(
        student, student, DistillationConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, max_completion_length=8),
        train_dataset=standard_dataset(), processing_class=tok,
    )  # fmt: skip
    assert trainer.teacher_model is not student  # a copy: training the student leaves it as it was
    trainer.generator = ScriptedGenerator(SCRIPT, 0)
    (scored,) = trainer._generate_and_score([{"prompt": "Question 1"}] * 4, "train", num_chunks=1)
    loss = trainer.compute_loss(trainer.model, scored)
    loss.backward()
    assert abs(loss.item()) < 1e-6
    assert max(p.grad.abs().max().item() for p in trainer.model.parameters() if p.grad is not None) < 1e-6


def test_training_moves_the_student_toward_the_frozen_teacher(tmp_path) -> None:
    trainer = distill_trainer(tmp_path, max_steps=12, learning_rate=0.01, lr_scheduler_type="constant")
    before = [p.detach().clone() for p in trainer.teacher_model.parameters()]
    (fixed,) = trainer._generate_and_score(
        [{"prompt": f"Question {i}: what is {i} plus one?"} for i in range(4)], "eval", num_chunks=1
    )
    with torch.no_grad():
        start = trainer.compute_loss(trainer.model.eval(), fixed).item()
    trainer.train()
    with torch.no_grad():
        end = trainer.compute_loss(trainer.model.eval(), fixed).item()
    trainer.model.train()
    assert end < 0.6 * start
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.teacher_model.parameters(), strict=True))
    assert not trainer.teacher_model.training
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    assert "entropy" in trainer.state.log_history[0]


def test_evaluation_reports_the_divergence(tmp_path) -> None:
    trainer = distill_trainer(tmp_path, per_device_eval_batch_size=4)
    metrics = trainer.evaluate(standard_dataset(4))
    assert metrics["eval_loss"] > 0
    logged = trainer.state.log_history[-1]
    assert logged["eval_on_policy_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)
    assert logged["eval_entropy"] > 0


# ---- GKD's mix of on- and off-policy steps ----------------------------------------------------------------


def test_lmbda_zero_trains_on_the_dataset_and_one_on_the_students_samples(tmp_path) -> None:
    off = distill_trainer(tmp_path / "off", cls=GKDTrainer, config=GKDConfig, lmbda=0.0, max_steps=3)
    off.train()
    assert off.generator.calls == 0
    assert all("off_policy_loss" in h for h in off.state.log_history if "loss" in h)
    on = distill_trainer(tmp_path / "on", cls=GKDTrainer, config=GKDConfig, lmbda=1.0, max_steps=3)
    on.train()
    assert on.generator.calls == 12
    assert all("on_policy_loss" in h for h in on.state.log_history if "loss" in h)


def test_the_draw_depends_on_seed_and_step_only(tmp_path) -> None:
    def sources(path, seed):
        trainer = distill_trainer(path, cls=GKDTrainer, config=GKDConfig, lmbda=0.5, seed=seed)
        picked = []
        for step in range(40):
            trainer.state.global_step = step
            picked.append(trainer._source([{"prompt": "x", "completion": "y"}], "train"))
        return picked

    first, again, other = sources(tmp_path / "a", 0), sources(tmp_path / "b", 0), sources(tmp_path / "c", 1)
    assert first == again and first != other
    assert 10 < first.count("student") < 30 and set(first) == {"student", "dataset"}


def test_seq_kd_samples_with_the_teacher(tmp_path) -> None:
    trainer = distill_trainer(tmp_path, cls=GKDTrainer, config=GKDConfig, lmbda=0.0, seq_kd=True, max_steps=1)
    seen = []

    class Recording(ScriptedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            seen.append(True)
            return super().generate(prompt_ids, prompt_mask)

    trainer._teacher_generator = Recording(SCRIPT, 0)
    trainer.train()
    assert seen and trainer.generator.calls == 0
    assert trainer.sampler.generator is trainer.generator  # the student's generator is back


def test_dataset_completions_are_tokenised_like_samples(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1 plus one?"}], "completion": [{"role": "assistant", "content": "2"}]},
        {"prompt": "Question 3:", "completion": " four five six seven eight nine ten"},
    ]  # fmt: skip
    r = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=None)
    first = r.completion_ids[0, : int(r.completion_mask[0].sum())].tolist()
    assert first == tok("2<|im_end|>\n", add_special_tokens=False)["input_ids"]  # the template's tail too
    at_eos = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=None, through_end=False)
    assert at_eos.completion_ids[0, : int(at_eos.completion_mask[0].sum())].tolist() == first[:-1]  # GOLD's
    long_prompt = len(tok("Question 3:", add_special_tokens=False)["input_ids"])
    long_completion = tok(" four five six seven eight nine ten", add_special_tokens=False)["input_ids"]
    assert r.is_terminated.tolist() == [True, True]  # no completion budget: whole rows
    assert int(r.completion_mask[1].sum()) == len(long_completion) + 1  # and its EOS
    text = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    assert r.prompt_ids[0, -len(prompt) :].tolist() == list(prompt)
    whole = len(long_completion) + 1  # and its EOS
    # GKD / GOLD (the reference's ChatML collator): the row keeps its last max_length tokens, so the
    # prompt loses its start and the completion stays whole
    cut = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=whole + 1)
    assert int(cut.prompt_mask[1].sum()) == 1 and int(cut.completion_mask[1].sum()) == whole
    assert bool(cut.is_terminated[1])
    # a completion that alone fills max_length keeps its last tokens after the prompt's last one
    tight = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=4)
    assert int(tight.prompt_mask[1].sum()) == 1 and int(tight.completion_mask[1].sum()) == 3
    assert tight.completion_ids[1, :3].tolist() == (long_completion + [tok.eos_token_id])[-3:]
    # IW-OPD's max_prompt_length keeps the prompt's last tokens; the completion fills max_length, cut at its end
    budget = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=5, max_prompt_length=2)
    assert int(budget.prompt_mask[1].sum()) == 2 and int(budget.completion_mask[1].sum()) == 3
    assert budget.completion_ids[1, :3].tolist() == long_completion[:3] and not bool(budget.is_terminated[1])
    # there, a prompt that alone fills max_length keeps its end and leaves one completion token
    full = dataset_rollout(rows, tok, [tok.eos_token_id], max_length=long_prompt, max_prompt_length=64)
    assert int(full.prompt_mask[1].sum()) == long_prompt - 1 and int(full.completion_mask[1].sum()) == 1


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_inputs_fail_before_training(tmp_path) -> None:
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    prompts_only = Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})
    with pytest.raises(ValueError, match="train dataset has none"):
        distill_trainer(tmp_path, tok, cls=GKDTrainer, config=GKDConfig, dataset=prompts_only)
    distill_trainer(tmp_path, tok, cls=GKDTrainer, config=GKDConfig, dataset=prompts_only, lmbda=1.0)  # fine
    with pytest.raises(ValueError, match="last message of 'messages' is 'user'"):
        distill_trainer(
            tmp_path, tok, cls=GKDTrainer, config=GKDConfig,
            dataset=Dataset.from_dict({"messages": [[{"role": "user", "content": "hi"}]]}),
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="data_collator is not built"):
        GKDTrainer(build_tiny_model(tok), build_tiny_model(tok), data_collator=object())
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationTrainer(build_tiny_model(tok), None, DistillationConfig(output_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DistillationTrainer(
            build_tiny_model(tok), "./no/such/teacher", DistillationConfig(output_dir=str(tmp_path))
        )


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    other = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tok) + 7, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2)
    )  # fmt: skip
    with pytest.raises(
        ValueError, match=rf"teacher's vocabulary has {len(tok) + 7} tokens and the student's {len(tok)}"
    ):
        DistillationTrainer(
            build_tiny_model(tok), other, DistillationConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS),
            train_dataset=standard_dataset(), processing_class=tok,
        )  # fmt: skip


def test_teacher_loads_by_path_with_its_init_kwargs(tmp_path, tiny_model_dir) -> None:
    tok = build_tiny_tokenizer()
    trainer = DistillationTrainer(
        build_tiny_model(tok),
        args=DistillationConfig(
            output_dir=str(tmp_path), **CPU_TEST_ARGS, teacher_model_name_or_path=tiny_model_dir,
            teacher_model_init_kwargs={"dtype": "bfloat16"},
        ),
        train_dataset=standard_dataset(), processing_class=tok,
    )  # fmt: skip
    assert trainer.teacher_model.dtype == torch.bfloat16  # the teacher in its own dtype
    assert next(trainer.model.parameters()).dtype == torch.float32
    trainer.generator = ScriptedGenerator(SCRIPT, 0)
    trainer.train()
    assert all(h["loss"] > 0 for h in trainer.state.log_history if "loss" in h)


# ---- accumulation, resume, two processes ---------------------------------------------------------------


def _sgd_params(path, per_device: int, accumulation: int) -> list[torch.Tensor]:
    from datasets import Dataset

    trainer = distill_trainer(
        path, dataset=Dataset.from_dict({"prompt": [f"Question {i}" for i in range(8)]}),
        per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation, max_steps=1,
        shuffle_dataset=False, **SGD_ARGS,
    )  # fmt: skip
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_same_update(tmp_path) -> None:
    """The step's token mean, whether its 8 completions come in one micro-batch or four."""
    one, four = _sgd_params(tmp_path / "one", 8, 1), _sgd_params(tmp_path / "four", 2, 4)
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_resume_is_exact(tmp_path) -> None:
    tok = build_tiny_tokenizer()

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = distill_trainer(
            out, tok, cls=GKDTrainer, config=GKDConfig, scripted=False, max_steps=4, save_strategy="steps",
            save_steps=1, learning_rate=0.05,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-2"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> DistillationTrainer:
    """Two SGD steps of on-policy distillation (JSD) on one repeated prompt (the two-process test)."""
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    args = DistillationConfig(
        output_dir=out_dir,
        **{**CPU_TEST_ARGS, **SGD_ARGS, "per_device_train_batch_size": per_device, "max_steps": 2},
        max_completion_length=8, beta=0.5, seed=1, **overrides,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 16})
    return DistillationTrainer(
        build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2), args, prompts, processing_class=tok
    )


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """2 processes x 2 completions give the parameters and metrics of 1 process x 4."""
    keys = ("on_policy_loss", "entropy", "num_tokens")
    two_processes_against_one("test_distill", ddp_comparable_trainer, SCRIPT, tmp_path, 29571, (2, 4), keys)


# ---- teachers served elsewhere, several teachers (MOPD) --------------------------------------------------


def test_a_served_teacher_gives_the_sampled_reverse_kl(tmp_path) -> None:
    from posttrain.distill.teachers import LocalTeacherServer

    tok = build_tiny_tokenizer()
    teacher = build_tiny_model(tok, seed=2)
    server = LocalTeacherServer(teacher, pad_token_id=tok.eos_token_id)
    trainer = DistillationTrainer(
        build_tiny_model(tok, seed=1), server,
        DistillationConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, max_completion_length=8, temperature=0.7),
        train_dataset=standard_dataset(), processing_class=tok,
    )  # fmt: skip
    trainer.generator = ScriptedGenerator(SCRIPT, 0)
    (scored,) = trainer._generate_and_score(
        [{"prompt": f"Question {i}"} for i in range(4)], "train", num_chunks=1
    )
    loss = trainer.compute_loss(trainer.model, scored).item()
    r = scored.rollout
    keep, y = r.completion_mask.bool(), r.completion_ids.unsqueeze(-1)
    with torch.no_grad():
        s = torch.log_softmax(_full_logits(trainer.model, r) / 0.7, -1).gather(-1, y).squeeze(-1)[keep]
        t = torch.log_softmax(_full_logits(teacher, r) / 0.7, -1).gather(-1, y).squeeze(-1)[keep]
    assert loss == pytest.approx(((s - t) * s).mean().item(), rel=1e-4)
    assert server.calls == 1
    with pytest.raises(ValueError, match="sampled tokens only"):
        DistillationTrainer(
            "./no/such/student", server, DistillationConfig(output_dir=str(tmp_path), beta=0.5)
        )


def test_iwopd_with_a_served_teacher_equals_the_loaded_teacher(tmp_path) -> None:
    from posttrain import IWOPDConfig, IWOPDTrainer
    from posttrain.distill.teachers import LocalTeacherServer

    tok = build_tiny_tokenizer()
    losses = []
    for served in (False, True):
        teacher = build_tiny_model(tok, seed=2)
        trainer = IWOPDTrainer(
            build_tiny_model(tok, seed=1), LocalTeacherServer(teacher, tok.eos_token_id) if served else teacher,
            IWOPDConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, max_completion_length=8, max_length=64),
            train_dataset=conversations(), processing_class=tok,
        )  # fmt: skip
        trainer.generator = ScriptedGenerator(SCRIPT, 0)
        (scored,) = trainer._generate_and_score([{"prompt": f"Question {i}"} for i in range(4)], "train", 1)
        losses.append(trainer.compute_loss(trainer.model, scored).item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_several_teachers_each_score_their_rows(tmp_path) -> None:
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    math_t, code_t = build_tiny_model(tok, seed=2), build_tiny_model(tok, seed=3)
    rows = Dataset.from_dict(
        {"prompt": [f"Question {i}" for i in range(8)], "teacher_id": ["math", "code"] * 4}
    )
    trainer = DistillationTrainer(
        build_tiny_model(tok, seed=1), {"math": math_t, "code": code_t},
        DistillationConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, max_completion_length=8),
        train_dataset=rows, processing_class=tok,
    )  # fmt: skip
    assert trainer.teacher_model == {"math": math_t, "code": code_t}
    trainer.generator = ScriptedGenerator(SCRIPT, 0)
    batch = [dict(rows[i]) for i in range(4)]
    (scored,) = trainer._generate_and_score(batch, "train", num_chunks=1)
    assert scored.teacher_index.tolist() == [0, 1, 0, 1]
    loss = trainer.compute_loss(trainer.model, scored).item()
    r = scored.rollout
    keep = r.completion_mask.bool()
    with torch.no_grad():
        zs = _full_logits(trainer.model, r)
        zt = torch.stack([_full_logits(m, r)[i] for i, m in enumerate([math_t, code_t, math_t, code_t])])
    want = _textbook(zs[keep], zt[keep], 1.0).sum() / keep.sum()
    assert loss == pytest.approx(want.item(), rel=1e-5)
    with pytest.raises(ValueError, match="teacher_id='bio', which names none of the teachers"):
        trainer._generate_and_score(
            [{"prompt": "Question 1", "teacher_id": "bio"}] * 4, "train", num_chunks=1
        )


def test_teachers_of_two_kinds_are_refused(tmp_path) -> None:
    from posttrain.distill.teachers import LocalTeacherServer

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=2)
    with pytest.raises(ValueError, match="mixes served teachers"):
        DistillationTrainer(
            "./no/such/student",
            {"a": model, "b": LocalTeacherServer(model, 0)},
            DistillationConfig(output_dir=str(tmp_path)),
        )
    with pytest.raises(TypeError, match="teacher_model\\['a'\\] is a int"):
        DistillationTrainer("./no/such/student", {"a": 3}, DistillationConfig(output_dir=str(tmp_path)))


def test_distillation_resume_is_exact(tmp_path) -> None:
    tok = build_tiny_tokenizer()

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = distill_trainer(
            out,
            tok,
            scripted=False,
            max_steps=3,
            save_strategy="steps",
            save_steps=1,
            learning_rate=0.05,
            beta=0.5,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_dataset_completion_is_tokenised_as_sft_tokenises_it() -> None:
    """GKD's off-policy rows train on every token SFT trains on, the chat template's "\\n" after
    <|im_end|> included (it used to be cut at the first EOS; the reference and SFT keep it)."""
    from posttrain.data import distill as distill_data
    from posttrain.data import sft

    tok = build_tiny_tokenizer()
    rows = [
        {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": [{"role": "assistant", "content": "5"}]},
        {"prompt": [{"role": "user", "content": "Say hi."}], "completion": [{"role": "assistant", "content": "hi there"}]},
    ]  # fmt: skip
    rollout = distill_data.dataset_rollout(rows, tok, [tok.eos_token_id], None)
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    for i, row in enumerate(rows):
        out = sft.tokenize_row(
            row, tok, "prompt_completion", max_length=None, completion_only_loss=True, index=i
        )
        trained = [t for t, m in zip(out["input_ids"], out["loss_mask"], strict=True) if m]
        mine = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        assert mine == trained
        assert mine[-len(newline) :] == newline and tok.eos_token_id in mine  # the template's tail after EOS
    assert rollout.is_terminated.all()


def test_gkd_in_bf16_multiplies_the_heads_in_bf16(tmp_path, monkeypatch) -> None:
    """bf16=True on a (pretended) bf16 host: the teacher's forward runs under the student's
    autocast (as the reference's prepared teacher does), and both heads' vocabulary products in
    bf16, as the rest of each forward did (ops/divergence_head.py)."""
    import posttrain.distill.distillation as module
    from posttrain.ops import precision

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    seen: list[tuple] = []
    original = module.token_divergence

    def spy(student, teacher, *args, **kwargs):
        seen.append((student.product_dtype, teacher.product_dtype))
        return original(student, teacher, *args, **kwargs)

    monkeypatch.setattr(module, "token_divergence", spy)
    distill_trainer(tmp_path, cls=GKDTrainer, config=GKDConfig, bf16=True, max_steps=1).train()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}
