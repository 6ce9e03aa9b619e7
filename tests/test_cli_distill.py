"""``posttrain distill``: self-distillation (SDFT) from the command line, and its built-in task."""

from __future__ import annotations

import json

import pytest

from posttrain.cli.distill import LAPTOP_DEFAULTS, _build_distill, distill
from posttrain.cli.main import COMMANDS, main
from posttrain.data.tasks import (
    arithmetic_distill_dataset,
    arithmetic_heldout,
    arithmetic_question,
    load_task,
)

# A CPU run of the tiny model (short prompts: no worked example).
TINY_RUN = [
    "--max_steps", "2",
    "--logging_steps", "1",
    "--per_device_train_batch_size", "4",
    "--num_generations", "2",
    "--max_completion_length", "8",
    "--use_cpu",
    "--bf16", "false",
    "--report_to", "none",
    "--save_strategy", "no",
    "--disable_tqdm", "true",
]  # fmt: skip


def questions(dataset) -> set[str]:
    return {arithmetic_question(p) for p in dataset["prompt"]}


def assert_exit_2(capsys, argv: list[str], *fragments: str) -> str:
    """``posttrain argv`` exits with code 2 and a one-paragraph message holding every fragment."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "posttrain distill: " in err and "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


@pytest.fixture
def no_trainer(monkeypatch):
    """Building the trainer (and so loading the model) fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the trainer was built")

    monkeypatch.setattr("posttrain.distill.self_distillation.SDFTTrainer.__init__", refuse)


# ---- the built-in task ---------------------------------------------------------------------------


def test_distill_task_gives_each_problem_its_worked_answer():
    rows = arithmetic_distill_dataset(n=200, seed=0, few_shot=1, max_value=20, system_prompt=None)
    assert set(rows.column_names) == {"prompt", "privileged_context", "solution"}
    for row in rows:
        question = row["prompt"][-1]["content"]
        expression = question[len("What is ") : question.index("?")]
        solution = row["solution"]
        assert row["privileged_context"] == f"{expression} = {solution}. <answer>{solution}</answer>"
    assert [m["role"] for m in rows[0]["prompt"]] == ["user", "assistant", "user"]  # one worked example
    assert (
        load_task("arithmetic_distill", n=200, seed=0, few_shot=1, max_value=20, system_prompt=None)[
            "privileged_context"
        ]
        == rows["privileged_context"]
    )


def test_distill_task_leaves_the_held_out_problems_out():
    drawn = {"max_value": 20, "system_prompt": None}
    rows = arithmetic_distill_dataset(n=1000, seed=0, few_shot=1, **drawn)
    online = arithmetic_heldout(distinct=True, **drawn)  # what posttrain distill measures
    assert 0 < len(rows) < 1000
    assert not questions(rows) & questions(online)
    assert not questions(rows) & questions(arithmetic_heldout())  # the offline commands' set
    # options that allow fewer than 100 different problems: the first draws are left out
    few = arithmetic_distill_dataset(n=50, seed=0, max_value=3, operations=("+",))
    assert not questions(few) & questions(arithmetic_heldout(max_value=3, operations=("+",)))


# ---- the command ---------------------------------------------------------------------------------


def test_cli_trains_and_saves_on_the_builtin_task(tmp_path, tiny_model_dir, capsys):
    """``posttrain distill`` on the built-in task: two real SDFT steps, rewards logged, saved."""
    from posttrain import SDFTTrainer

    assert COMMANDS["distill"] is distill
    out = tmp_path / "run"
    trainer = distill(
        ["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--task_size", "16",
         "--task_few_shot", "0", "--distillation_alpha", "1.0", *TINY_RUN]
    )  # fmt: skip
    assert isinstance(trainer, SDFTTrainer) and trainer.state.global_step == 2
    assert trainer.args.distillation_alpha == 1.0 and trainer.args.teacher_model_kind == "base"
    logs = [h for h in trainer.state.log_history if "sdft/distillation_loss" in h]
    assert len(logs) == 2
    assert all(0.0 <= h["rewards/answer_accuracy_reward/mean"] <= 1.0 for h in logs)
    assert (out / "config.json").exists() and (out / "log.jsonl").exists()
    assert set(json.loads((out / "accuracy.json").read_text())) == {"before", "after"}
    printed = capsys.readouterr().out
    assert "posttrain distill: held-out accuracy" in printed
    assert f"posttrain distill: saved the trained model to {out}" in printed


def test_cli_on_a_user_dataset_logs_no_reward_by_default(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"What is {i} plus one?", "privileged_context": f"It is {i + 1}."}) + "\n"
            for i in range(8)
        )
    )
    trainer = distill(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data),
         "--output_dir", str(tmp_path / "run"), *TINY_RUN]
    )  # fmt: skip
    assert trainer.state.global_step == 2 and trainer.heldout is None
    assert not any(k.startswith("rewards/") for h in trainer.state.log_history for k in h)


def test_default_run_settings(tmp_path, tiny_model_dir):
    """The no-flag run's settings reach the config; its task is the distill task without the held-out set."""
    trainer, config = _build_distill(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--bf16",
            "false",
        ]
    )
    for name, value in LAPTOP_DEFAULTS.items():
        if name != "output_dir":
            assert getattr(config, name) == value, name
    rows = trainer.train_dataset
    assert "privileged_context" in rows.column_names
    assert len(questions(trainer.heldout.problems)) == 100
    assert not questions(trainer.heldout.problems) & questions(rows)
    assert trainer.heldout.max_new_tokens == config.max_completion_length


def test_a_bad_flag_is_a_clear_cli_error(tmp_path, capsys, no_trainer):
    assert_exit_2(capsys, ["distill", "--output_dir", str(tmp_path), "--distillation_alpah", "1.0"],
                  "--distillation_alpah", "did you mean --distillation_alpha?")  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [(["--distillation_mode", "top_k"], "distillation_mode"),
     (["--distillation_mode", "sampled_token"], "distillation_alpha=1.0"),
     (["--teacher_model_kind", "frozen"], "teacher_model_kind")],
)  # fmt: skip
def test_a_bad_setting_is_a_clear_cli_error(tmp_path, capsys, no_trainer, flags, fragment):
    assert_exit_2(capsys, ["distill", "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", *flags],
                  fragment)  # fmt: skip


def test_a_dataset_without_privileged_context_is_a_clear_cli_error(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1 plus one?"}) + "\n")
    assert_exit_2(capsys, ["distill", "--model_name_or_path", tiny_model_dir, "--dataset_name", str(data),
                           "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"],
                  "no 'privileged_context' column")  # fmt: skip
