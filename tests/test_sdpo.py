"""SDPOTrainer: the config's contract, the reprompts decided by hand, the loss against the formula
on full logits, the reward diagnostics, and a group split across two processes.

Formulas (SDPO, arXiv 2601.20802, and the reference): a failed completion's teacher prompt is the
reprompt with the first successful sibling's completion and/or the environment's feedback; the
loss is ``(1 - w) * policy + w * distillation``, the distillation term the mean over samples of
each sample's token mean of D (samples without a reprompt add 0 and still count).
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator, two_processes_against_one
from test_distill import _full_logits
from test_invariance import SCRIPT

from posttrain import SDPOConfig, SDPOTrainer
from posttrain.core.batch import Rollout
from posttrain.distill.reprompt import RepromptSettings, plan_reprompts, strip_thinking


def odd_length(completion_ids, **kwargs):
    """1 for a completion of odd length: in SCRIPT's groups of 4, some succeed and some fail."""
    return [float(len(ids) % 2) for ids in completion_ids]


def sdpo_trainer(tmp_path, reward=odd_length, dataset=None, scripted=True, **overrides) -> SDPOTrainer:
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "num_generations": 4, "max_completion_length": 8}
    values.update(overrides)
    rows = dataset or Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(16)],
            "privileged_context": [f"Your answer to {i} was off by one." for i in range(16)],
        }
    )
    trainer = SDPOTrainer(
        build_tiny_model(tok, seed=1), reward, SDPOConfig(**values), train_dataset=rows, processing_class=tok
    )
    if scripted:
        trainer.generator = ScriptedGenerator(SCRIPT, tok.pad_token_id or 0)
    return trainer


# ---- the config ---------------------------------------------------------------------------------------


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    c = SDPOConfig(output_dir=str(tmp_path))
    assert (c.teacher_model_kind, c.distillation_alpha, c.distillation_mode, c.distillation_topk) == (
        "ema", 1.0, "sampled_token", None,
    )  # fmt: skip
    assert (c.distillation_weight, c.loss_type, c.epsilon, c.epsilon_high, c.beta) == (
        1.0,
        "dapo",
        0.2,
        None,
        0.0,
    )
    assert (c.importance_sampling_level, c.scale_rewards, c.max_reprompt_len) == ("token", "group", 10240)
    assert (c.use_successful_as_teacher, c.success_reward_threshold, c.dont_reprompt_on_self_success) == (
        True,
        1.0,
        True,
    )
    assert c.reprompt_template == "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
    assert c.solution_template == "\nCorrect solution:\n\n{successful_previous_attempt}\n\n"
    assert c.feedback_template == (
        "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"
    )
    assert (c.include_environment_feedback, c.environment_feedback_only_without_solution) == (False, False)
    assert (c.remove_thinking_from_demonstration, c.diagnostics_warning_interval) == (False, 10)
    assert (c.num_generations, c.learning_rate, c.distillation_is_clip, c.teacher_update_rate) == (
        8,
        5e-5,
        2.0,
        0.05,
    )


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"distillation_weight": 1.5}, ValueError, "distillation_weight=1.5 is invalid"),
        (
            {"reprompt_template": "{prompt}{solution}"},
            ValueError,
            "holding '{prompt}', '{solution}' and '{feedback}'",
        ),
        ({"solution_template": "x"}, ValueError, "holding '{successful_previous_attempt}'"),
        ({"feedback_template": "x"}, ValueError, "holding '{feedback_raw}'"),
        ({"loss_type": "ppo"}, ValueError, "loss_type='ppo' is invalid"),
        ({"scale_rewards": "rank"}, ValueError, "scale_rewards='rank' is invalid"),
        ({"distillation_alpha": 0.5}, ValueError, "needs distillation_alpha=1.0"),
        ({"beta": 0.04}, NotImplementedError, "beta"),
    ],
    ids=["weight", "reprompt", "solution", "feedback", "loss_type", "scale", "sampled_alpha", "beta"],
)
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        SDPOConfig(output_dir=str(tmp_path), **overrides)


# ---- the reprompts ------------------------------------------------------------------------------------


def test_a_successful_completion_learns_from_a_successful_sibling() -> None:
    """dont_reprompt_on_self_success only keeps a completion from being its own demonstration (the
    reference and the paper's code): when every rollout succeeds, every one is reprompted (it was
    none); with the flag off the group's first success may be the row itself."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    texts = ["A", "B", "C", "D"]
    plan = plan_reprompts(rewards, texts, [None] * 4, RepromptSettings(group=2))
    assert plan.stats["reprompt_sample_fraction"] == 1.0
    assert ["B" in plan.fills[0]("Q"), "A" in plan.fills[1]("Q")] == [True, True]  # each from the other
    off = plan_reprompts(
        rewards, texts, [None] * 4, RepromptSettings(group=2, dont_reprompt_on_self_success=False)
    )
    assert "\nA\n" in off.fills[0]("Q") and "\nA\n" in off.fills[1]("Q")  # row 0 demonstrates to itself too
    assert off.stats["reprompt_sample_fraction"] == 1.0


def test_reprompt_fractions_are_the_references() -> None:
    """As the reference's (and the paper's code): ``success_sample_fraction`` is the share of rows
    shown a successful sibling's answer, not of rows that succeeded; ``feedback_available_fraction``
    counts the rows with feedback whether or not it is in use (benchmarks/differential_self.py)."""
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0])
    texts = list("ABCDEFGH")
    feedback = ["fb", None, "  ", "fb", None, None, None, "fb"]
    plan = plan_reprompts(rewards, texts, feedback, RepromptSettings(group=4))
    # group 0: every row has a successful sibling; group 1: rows 4-6 learn from row 7, row 7 from none
    assert plan.stats["success_sample_fraction"] == 7 / 8
    assert plan.stats["feedback_available_fraction"] == 3 / 8  # a blank one is none
    assert plan.stats["feedback_used_fraction"] == 0.0
    off = plan_reprompts(rewards, texts, feedback, RepromptSettings(group=4, use_successful_as_teacher=False))
    assert off.stats["success_sample_fraction"] == 0.0 and off.stats["success_group_fraction"] == 1.0


def test_reprompts_by_hand() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, float("nan")])
    texts = ["<think>hm</think>A", "B", "C", "D", "E", "F"]
    feedback = ["fb0", None, "fb2", "fb3", None, "fb5"]
    s = RepromptSettings(group=3)
    plan = plan_reprompts(rewards, texts, feedback, s)
    # row 0 succeeded itself; rows 1 and 2 learn from row 0; group 2 has no success and no feedback in use
    assert [f is None for f in plan.fills] == [True, False, False, True, True, True]
    solution = "\nCorrect solution:\n\n<think>hm</think>A\n\n"
    assert plan.fills[1]("Q?") == "Q?" + solution + "\n\nCorrectly solve the original question.\n"
    assert plan.stats == pytest.approx(
        {
            "success_group_fraction": 0.5,
            "success_sample_fraction": 2 / 6,  # rows 1 and 2 are shown row 0's answer
            "feedback_available_fraction": 4 / 6,  # present, though not in use
            "feedback_used_fraction": 0.0,
            "reprompt_sample_fraction": 2 / 6,
        }
    )

    with_feedback = RepromptSettings(
        group=3, include_environment_feedback=True, remove_thinking_from_demonstration=True
    )
    plan = plan_reprompts(rewards, texts, feedback, with_feedback)
    # row 0 succeeded and has no successful sibling, but its own feedback reprompts it
    assert [f is None for f in plan.fills] == [False, False, False, False, True, False]
    assert "fb0" in plan.fills[0]("Q?") and "Correct solution" not in plan.fills[0]("Q?")
    assert plan.fills[2]("Q?") == (
        "Q?\nCorrect solution:\n\nA\n\n\nThe following is feedback from your unsuccessful earlier attempt:\n\nfb2\n\n"
        "\n\nCorrectly solve the original question.\n"
    )
    assert (
        plan.stats["feedback_available_fraction"] == 4 / 6 and plan.stats["feedback_used_fraction"] == 4 / 6
    )

    only_without = RepromptSettings(
        group=3, include_environment_feedback=True, environment_feedback_only_without_solution=True
    )
    plan = plan_reprompts(rewards, texts, feedback, only_without)
    assert "feedback" not in plan.fills[2]("Q?") and "fb3" in plan.fills[3]("Q?")
    assert strip_thinking("<think>a\nb</think> x") == "x"


# ---- the trainer ------------------------------------------------------------------------------------------


def test_failed_samples_read_a_successful_siblings_answer(tmp_path) -> None:
    trainer = sdpo_trainer(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": "What is 1 plus one?"}], "privileged_context": "fb"}] * 4
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    lengths = scored.rollout.completion_mask.sum(dim=1).tolist()
    success = [n % 2 == 1 for n in lengths]
    assert any(success) and not all(success)
    assert scored.teacher_rows.tolist() == [not s for s in success]  # failures only (self-success: none)
    first = success.index(True)
    demo = trainer._tokenizer.decode(
        scored.rollout.completion_ids[first, : int(lengths[first])], skip_special_tokens=True
    )
    failed = success.index(False)
    text = trainer._tokenizer.decode(
        scored.teacher_prompt_ids[failed][scored.teacher_prompt_mask[failed].bool()]
    )
    assert "Correct solution:" in text and demo in text and "Correctly solve the original question." in text


@pytest.mark.parametrize("weight", [1.0, 0.3])
def test_loss_mixes_the_policy_term_and_the_distillation_term(tmp_path, weight) -> None:
    trainer = sdpo_trainer(tmp_path, distillation_weight=weight)
    with torch.no_grad():  # a teacher unlike its student
        for p in trainer.teacher_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt": [{"role": "user", "content": "What is 1 plus one?"}]}] * 4
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    loss = trainer.compute_loss(trainer.model, scored).item()
    r = scored.rollout
    mask = r.completion_mask.bool()
    y = r.completion_ids.unsqueeze(-1)
    teacher_rows = Rollout(
        scored.teacher_prompt_ids,
        scored.teacher_prompt_mask,
        r.completion_ids,
        r.completion_mask,
        r.is_terminated,
    )
    with torch.no_grad():
        s = torch.log_softmax(_full_logits(trainer.model, r), -1).gather(-1, y).squeeze(-1)
        t = torch.log_softmax(_full_logits(trainer.teacher_model, teacher_rows), -1).gather(-1, y).squeeze(-1)
    d = (s - t) * s  # the sampled token's reverse-KL estimate (its value)
    per_sample = (d * mask).sum(-1) / mask.sum(-1) * scored.teacher_rows  # rows without a teacher: 0
    distillation = per_sample.mean()
    policy = -(scored.advantages.unsqueeze(1) * mask).sum() / mask.sum()  # dapo, on-policy: ratio 1
    assert loss == pytest.approx(((1 - weight) * policy + weight * distillation).item(), rel=1e-4, abs=1e-7)


def test_logged_distillation_loss_is_the_token_mean_over_reprompted_rows(tmp_path) -> None:
    """The reference logs D's mean over the reprompted rows' tokens; the loss is the mean over every
    row of each row's token mean, 0 without a reprompt (benchmarks/differential_self.py)."""
    trainer = sdpo_trainer(tmp_path)
    with torch.no_grad():
        for p in trainer.teacher_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt": [{"role": "user", "content": "What is 1 plus one?"}]}] * 4
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    assert 0 < int(scored.teacher_rows.sum()) < 4
    trainer._metrics.pop_means("train")
    loss = trainer.compute_loss(trainer.model, scored).item()
    logged = trainer._metrics.pop_means("train")["sdpo/distillation_loss"]
    r = scored.rollout
    teacher_rows = Rollout(
        scored.teacher_prompt_ids,
        scored.teacher_prompt_mask,
        r.completion_ids,
        r.completion_mask,
        r.is_terminated,
    )
    y = r.completion_ids.unsqueeze(-1)
    with torch.no_grad():
        s = torch.log_softmax(_full_logits(trainer.model, r), -1).gather(-1, y).squeeze(-1)
        t = torch.log_softmax(_full_logits(trainer.teacher_model, teacher_rows), -1).gather(-1, y).squeeze(-1)
    keep = r.completion_mask.bool() & scored.teacher_rows.unsqueeze(1)
    want = (((s - t) * s) * keep).sum() / keep.sum()
    assert logged == pytest.approx(want.item(), rel=1e-4, abs=1e-7)
    assert abs(logged - loss) > 1e-4 * abs(logged)


def test_training_logs_the_reference_metrics_and_warns_on_flat_rewards(tmp_path) -> None:
    trainer = sdpo_trainer(tmp_path, max_steps=2, include_environment_feedback=True)
    trainer.train()
    logged = trainer.state.log_history[0]
    for key in (
        "self_distillation/distillation_loss", "sdpo/distillation_loss", "self_distillation/policy_loss",
        "self_distillation/reward_mean", "self_distillation/reward_std", "self_distillation/reward_min",
        "self_distillation/reward_max", "self_distillation/group_reward_std_mean", "self_distillation/flat_group_fraction",
        "self_distillation/rewards/odd_length", "self_distillation/success_group_fraction",
        "self_distillation/success_sample_fraction", "self_distillation/feedback_available_fraction",
        "self_distillation/feedback_used_fraction", "self_distillation/reprompt_sample_fraction",
    ):  # fmt: skip
        assert key in logged, key
    assert logged["self_distillation/feedback_available_fraction"] == 1.0

    flat = sdpo_trainer(
        tmp_path / "flat", reward=lambda completion_ids, **kw: [0.0] * len(completion_ids), max_steps=1
    )
    with pytest.warns(UserWarning, match="every group's rewards are flat"):
        flat.train()


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> SDPOTrainer:
    """Two SGD steps of SDPO on groups of 4 (a group spans both processes at 2 rows each)."""
    from datasets import Dataset

    rows = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 16})
    return sdpo_trainer(
        out_dir, dataset=rows, per_device_train_batch_size=per_device, max_steps=2, seed=1, distillation_weight=0.5,
        **SGD_ARGS, **overrides,
    )  # fmt: skip


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """The reprompts need the sibling on the other process: gathered, the result is one process's."""
    keys = (
        "sdpo/distillation_loss",
        "self_distillation/reprompt_sample_fraction",
        "self_distillation/reward_mean",
    )
    logs = two_processes_against_one(
        "test_sdpo", ddp_comparable_trainer, SCRIPT, tmp_path, 29587, (2, 4), keys
    )
    assert 0 < logs[0]["self_distillation/reprompt_sample_fraction"] < 1


def test_resume_is_exact_with_an_off_policy_pass(tmp_path) -> None:
    """num_iterations=2 (the second pass importance-weighted) and the EMA teacher, stopped and resumed."""

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = sdpo_trainer(
            out, scripted=False, num_iterations=2, distillation_weight=0.5, teacher_update_rate=0.5, max_steps=3,
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
