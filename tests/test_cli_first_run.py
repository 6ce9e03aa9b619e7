"""The first run as a newcomer sees it: held-out accuracy for ``posttrain grpo``, the reward plot
with its rolling mean, one compact console line per logging step and the run's ``log.jsonl``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import PrinterCallback, ProgressCallback

from posttrain.cli.grpo import _build_grpo, grpo
from posttrain.cli.main import main
from posttrain.data.tasks import (
    ARITHMETIC_SYSTEM_PROMPT,
    HELDOUT_SEED,
    arithmetic_dataset,
    arithmetic_heldout,
    arithmetic_question,
    load_task,
    without_problems,
)
from posttrain.observe import plots
from posttrain.observe.console import (
    RunLogCallback,
    _BarOnlyProgressCallback,
    format_log_line,
    json_log_line,
    use_compact_console,
)

README = Path(__file__).resolve().parent.parent / "README.md"

# A CPU run of the tiny model on the built-in task (short prompts: no worked example).
TINY_BUILTIN = [
    "--task_size", "16",
    "--task_few_shot", "0",
    "--max_steps", "2",
    "--logging_steps", "1",
    "--per_device_train_batch_size", "4",
    "--num_generations", "4",
    "--max_completion_length", "8",
    "--use_cpu",
    "--bf16", "false",
    "--report_to", "none",
    "--save_strategy", "no",
]  # fmt: skip


def questions(dataset):
    return {arithmetic_question(p) for p in dataset["prompt"]}


# ---- the held-out problems ----------------------------------------------------------------------


def test_distinct_heldout_problems_are_different_and_fixed():
    problems = arithmetic_heldout(distinct=True, few_shot=1, max_value=20, system_prompt=None)
    assert len(problems) == 100 and len(questions(problems)) == 100
    again = arithmetic_heldout(distinct=True, few_shot=1, max_value=20, system_prompt=None)
    assert problems["prompt"] == again["prompt"] and problems["solution"] == again["solution"]


def test_the_default_heldout_set_is_the_first_draws_unchanged():
    """The offline commands' measured figures use the first 100 draws, repeats included."""
    assert (
        arithmetic_heldout()["prompt"] == arithmetic_dataset(n=100, seed=HELDOUT_SEED, few_shot=0)["prompt"]
    )


def test_too_few_different_problems_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than the 100 it needs"):
        arithmetic_heldout(distinct=True, max_value=2)


def test_arithmetic_question_reads_both_formats():
    conversational = arithmetic_dataset(n=1, seed=3, few_shot=2)["prompt"][0]
    standard = arithmetic_dataset(n=1, seed=3, few_shot=2, conversational=False)["prompt"][0]
    assert (
        arithmetic_question(standard) == arithmetic_question(conversational) == conversational[-1]["content"]
    )


def test_without_problems_drops_the_held_out_questions_and_keeps_the_order():
    data = arithmetic_dataset(n=400, seed=0, max_value=20, few_shot=1, system_prompt=None)
    problems = arithmetic_heldout(distinct=True, max_value=20)  # other examples and system message
    kept = without_problems(data, problems)
    assert 0 < len(kept) < len(data) and not questions(kept) & questions(problems)
    assert kept["prompt"] == [p for p in data["prompt"] if arithmetic_question(p) not in questions(problems)]


def build(tmp_path, tiny_model_dir, *flags):
    trainer, config = _build_grpo(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--bf16",
            "false",
            *flags,
        ]
    )
    return trainer, config


def test_grpo_heldout_problems_look_like_the_training_prompts_and_never_occur_in_them(
    tmp_path, tiny_model_dir
):
    trainer, config = build(
        tmp_path, tiny_model_dir,
        "--task_few_shot", "2", "--task_max_value", "30", "--task_system_prompt", "true",
        "--max_completion_length", "48",
    )  # fmt: skip
    heldout, train = trainer.heldout.problems, trainer.train_dataset
    assert len(heldout) >= 100 and len(questions(heldout)) == len(heldout)
    assert not questions(heldout) & questions(train)
    # the same system message and worked examples as the training prompts, then the question
    assert heldout["prompt"][0][:-1] == train["prompt"][0][:-1]
    assert heldout["prompt"][0][0] == {"role": "system", "content": ARITHMETIC_SYSTEM_PROMPT}
    assert len(heldout["prompt"][0]) == 1 + 2 * 2 + 1
    operands = [int(n) for p in heldout["prompt"] for n in re.findall(r"\d+", p[-1]["content"])]
    assert max(operands) <= 30 and max(operands) > 20
    assert trainer.heldout.max_new_tokens == config.max_completion_length == 48
    # the training rows are the task's draws without the held-out ones
    drawn = load_task(
        "arithmetic", n=1000, seed=0, few_shot=2, max_value=30, system_prompt=ARITHMETIC_SYSTEM_PROMPT
    )
    assert train["prompt"] == without_problems(drawn, heldout)["prompt"]


def test_grpo_default_heldout_matches_the_laptop_defaults(tmp_path, tiny_model_dir):
    trainer, config = build(tmp_path, tiny_model_dir)
    heldout = trainer.heldout.problems
    assert len(questions(heldout)) == 100 and not questions(heldout) & questions(trainer.train_dataset)
    assert heldout["prompt"][0][:-1] == trainer.train_dataset["prompt"][0][:-1]  # one worked example
    assert heldout["prompt"][0][0]["role"] == "user"  # no system message
    assert trainer.heldout.max_new_tokens == config.max_completion_length == 64


def test_grpo_evaluate_false_measures_nothing_and_keeps_every_prompt(tmp_path, tiny_model_dir):
    trainer, _ = build(tmp_path, tiny_model_dir, "--evaluate", "false", "--task_size", "50")
    assert trainer.heldout is None and len(trainer.train_dataset) == 50


def test_grpo_user_dataset_measures_nothing(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}?"}) + "\n" for i in range(8)))
    trainer, _ = build(
        tmp_path, tiny_model_dir, "--dataset_name", str(data), "--reward_funcs", "helpers.length_reward"
    )
    assert trainer.heldout is None and len(trainer.train_dataset) == 8


def exit_2(capsys, tmp_path, *flags):
    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", *flags])
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_grpo_task_too_small_for_the_held_out_problems(capsys, tmp_path):
    err = exit_2(capsys, tmp_path, "--task_max_value", "2")
    assert "fewer than the 100 it needs" in err and "Traceback" not in err


def test_grpo_task_without_a_prompt_outside_the_held_out_problems(capsys, tmp_path):
    err = exit_2(capsys, tmp_path, "--task_max_value", "6", "--task_size", "2", "--task_seed", "0")
    assert "every one of the 2 prompts of the built-in task is a held-out problem" in err
    assert "--evaluate false" in err


# ---- the first run, end to end ------------------------------------------------------------------


def test_builtin_grpo_run_prints_accuracy_lines_and_writes_plot_log_and_accuracy(
    tmp_path, tiny_model_dir, capsys
):
    out = tmp_path / "run"
    trainer = grpo(["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), *TINY_BUILTIN])
    printed = capsys.readouterr().out
    assert trainer.state.global_step == 2
    # held-out accuracy before and after, printed and written
    figures = json.loads((out / "accuracy.json").read_text())
    assert set(figures) == {"before", "after"}
    for when in figures.values():
        assert set(when) == {"accuracy", "format"} and all(0.0 <= v <= 1.0 for v in when.values())
    assert re.search(r"posttrain grpo: held-out accuracy \d\.\d\d before training, \d\.\d\d after", printed)
    assert re.search(r"posttrain grpo: held-out format \d\.\d\d before training, \d\.\d\d after", printed)
    # the reward plot of the run
    assert (out / "plots" / "reward.png").stat().st_size > 0
    # one compact line per logging step, no metric dict
    lines = [line for line in printed.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2", "step 2/2"]
    assert "answer_accuracy_reward" in lines[0] and "s/step" in lines[0] and "length" in lines[0]
    assert "{'" not in printed and "done at step 2/2 after" in printed
    # every logged dict in log.jsonl, as trainer_state.json has it
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged] == [1, 2, 2]
    assert (
        logged[0]["rewards/answer_accuracy_reward/mean"]
        == trainer.state.log_history[0]["rewards/answer_accuracy_reward/mean"]
    )
    assert "train_runtime" in logged[-1]


def test_user_dataset_run_prints_no_accuracy(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i}?"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    grpo(["--model_name_or_path", tiny_model_dir, "--output_dir", str(out), "--dataset_name", str(data),
          "--reward_funcs", "helpers.length_reward", *TINY_BUILTIN[4:], "--disable_tqdm", "true"])  # fmt: skip
    printed = capsys.readouterr().out
    assert "held-out" not in printed and not (out / "accuracy.json").exists()
    assert re.search(r"^step 2/2 \| reward [\d.]+ \(length_reward [\d.]+\) \|", printed, re.M)
    assert "{'" not in printed
    assert len((out / "log.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("disable_tqdm", [False, True])
def test_the_cli_console_replaces_transformers_printing(tmp_path, tiny_model_dir, disable_tqdm):
    trainer, _ = build(
        tmp_path, tiny_model_dir, "--evaluate", "false", "--disable_tqdm", str(disable_tqdm).lower()
    )
    use_compact_console(trainer, tmp_path / "log.jsonl")
    use_compact_console(trainer, tmp_path / "log.jsonl")  # a second call changes nothing
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert PrinterCallback not in kinds and ProgressCallback not in kinds
    assert kinds.count(RunLogCallback) == 1
    assert kinds.count(_BarOnlyProgressCallback) == (0 if disable_tqdm else 1)


def test_a_library_trainer_keeps_transformers_printing(tmp_path, tiny_model_dir):
    trainer, _ = build(tmp_path, tiny_model_dir, "--evaluate", "false")
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert ProgressCallback in kinds and RunLogCallback not in kinds


# ---- the console line ---------------------------------------------------------------------------

GRPO_LOGS = {
    "loss": 0.0012,
    "grad_norm": 0.5,
    "learning_rate": 1e-6,
    "num_tokens": 1234.0,
    "completions/mean_length": 41.25,
    "completions/max_length": 64.0,
    "rewards/answer_accuracy_reward/mean": 0.375,
    "rewards/answer_accuracy_reward/std": 0.48,
    "rewards/answer_format_reward/mean": 0.875,
    "rewards/answer_format_reward/std": 0.3,
    "reward": 1.25,
    "reward_std": 0.6,
    "kl": 0.0,
    "entropy": 0.9,
    "step_time": 12.34,
    "epoch": 0.05,
}


def test_grpo_line():
    assert format_log_line(GRPO_LOGS, 3, 60) == (
        "step  3/60 | reward 1.250 (answer_accuracy_reward 0.375, answer_format_reward 0.875)"
        " | length 41.2 | 12.3 s/step"
    )


def test_sft_line():
    logs = {
        "loss": 0.43214,
        "grad_norm": 2.0,
        "mean_token_accuracy": 0.8123,
        "entropy": 1.1,
        "step_time": 4.51,
    }
    assert format_log_line(logs, 10, 30) == "step 10/30 | loss 0.4321 | token accuracy 0.81 | 4.5 s/step"


def test_preference_and_reward_model_lines():
    dpo = {"loss": 0.6931, "rewards/chosen": 0.1, "rewards/rejected": -0.1, "rewards/accuracies": 0.625,
           "rewards/margins": 0.2, "logps/chosen": -20.0, "step_time": 3.0}  # fmt: skip
    assert (
        format_log_line(dpo, 5, 30) == "step  5/30 | loss 0.6931 | accuracy 0.62 | margin 0.200 | 3.0 s/step"
    )
    reward_model = {"loss": 0.5, "accuracy": 0.75, "margin": 1.5, "mean_reward": 0.2}
    assert format_log_line(reward_model, 30, 30) == "step 30/30 | loss 0.5000 | accuracy 0.75 | margin 1.500"


def test_eval_and_summary_lines():
    evaluation = {"eval_loss": 0.01, "eval_reward": 0.5, "eval_rewards/f/mean": 0.5, "epoch": 1.0}
    assert format_log_line(evaluation, 20, 60) == "eval at step 20/60 | reward 0.500 (f 0.500)"
    summary = {"train_runtime": 496.4, "train_samples_per_second": 1.0, "train_loss": 0.01, "epoch": 0.5}
    assert format_log_line(summary, 60, 60) == "done at step 60/60 after 8 min 16 s"
    assert format_log_line({"train_runtime": 2.04}, 3, 3) == "done at step 3/3 after 2.0 s"


def test_a_line_without_known_figures_still_shows_the_step():
    assert format_log_line({"learning_rate": 1e-5, "reward": "n/a"}, 7, 0) == "step 7"
    assert format_log_line({"reward": math.nan}, 1, 2) == "step 1/2 | reward nan"


def test_json_log_line_is_strict_json_with_the_step_first():
    line = json_log_line({"loss": math.nan, "reward": 1.5, "note": Path("x")}, 4)
    assert line.startswith('{"step": 4')
    assert json.loads(line) == {"step": 4, "loss": None, "reward": 1.5, "note": "x"}


# ---- the log file -------------------------------------------------------------------------------


def state(step, main=True, max_steps=10):
    return SimpleNamespace(global_step=step, max_steps=max_steps, is_world_process_zero=main)


def test_log_file_gets_every_dict_and_the_console_one_line(tmp_path, capsys):
    path = tmp_path / "run" / "log.jsonl"
    callback = RunLogCallback(path)
    callback.on_train_begin(None, state(0), None)
    callback.on_log(None, state(1), None, logs={"loss": 1.0, "step_time": 2.0})
    callback.on_log(None, state(2), None, logs={"loss": 0.5})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0, "step_time": 2.0},
        {"step": 2, "loss": 0.5},
    ]
    assert capsys.readouterr().out == "step  1/10 | loss 1.0000 | 2.0 s/step\nstep  2/10 | loss 0.5000\n"


def test_a_fresh_run_empties_the_log_file_and_a_resumed_one_keeps_its_past(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text(
        "".join(json_log_line({"loss": 1.0}, step) + "\n" for step in (1, 2, 3, 4)) + "not json\n"
    )
    RunLogCallback(path).on_train_begin(None, state(2), None)  # resumed at step 2
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    RunLogCallback(path).on_train_begin(None, state(0), None)
    assert path.read_text() == ""


def test_only_the_main_process_prints_and_writes(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    callback = RunLogCallback(path)
    callback.on_train_begin(None, state(0, main=False), None)
    callback.on_log(None, state(1, main=False), None, logs={"loss": 1.0})
    assert not path.exists() and capsys.readouterr().out == ""


# ---- the reward plot ----------------------------------------------------------------------------


def test_rolling_window():
    assert [plots.rolling_window(n) for n in (0, 3, 11, 12, 30, 60, 600)] == [1, 1, 1, 2, 5, 10, 10]


def test_rolling_mean_is_centred_and_cut_at_the_ends():
    assert plots.rolling_mean([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert plots.rolling_mean([0.0, 3.0, 6.0, 9.0], 3) == [1.5, 3.0, 6.0, 7.5]
    # even window: one more point before than after
    assert plots.rolling_mean([0.0, 2.0, 4.0, 6.0], 2) == [0.0, 1.0, 3.0, 5.0]
    assert plots.rolling_mean([], 10) == []


def test_rolling_mean_skips_nan():
    smooth = plots.rolling_mean([1.0, math.nan, 3.0, math.nan, math.nan, math.nan], 3)
    assert smooth[:4] == [1.0, 2.0, 3.0, 3.0] and math.isnan(smooth[5])
    with pytest.raises(ValueError, match="window must be at least 1"):
        plots.rolling_mean([1.0], 0)


def reward_history(steps):
    return [
        {
            "step": s,
            "reward": (s % 3) / 2,
            "reward_std": 0.1,
            "rewards/f/mean": (s % 2) * 1.0,
            "rewards/f/std": 0.2,
        }
        for s in range(1, steps + 1)
    ]


def test_the_reward_plots_draw_the_rolling_mean_over_the_raw_values(tmp_path):
    written = plots.write_plots_from_log_history(reward_history(60), tmp_path / "plots")
    assert {p.name for p in written} >= {"reward.png", "rewards.png"}
    assert (tmp_path / "plots" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.figure import Figure

    history = plots.parse_log_history(reward_history(60))
    for family in ("reward", "rewards"):
        panel = dict((f.name, p) for f, p in plots.plan(history))[family][0]
        ax = Figure().subplots()
        plots._draw_panel(ax, panel, history, title=True)
        labels = [line.get_label() for line in ax.get_lines()]
        assert "rolling mean (10 logged steps)" in labels and "mean ± std" in labels
        smooth = ax.get_lines()[labels.index("rolling mean (10 logged steps)")].get_ydata()
        ys = [entry["reward" if family == "reward" else "rewards/f/mean"] for entry in reward_history(60)]
        assert list(smooth) == pytest.approx(plots.rolling_mean(ys, 10))


def test_a_short_run_gets_no_rolling_mean_and_still_its_plot(tmp_path):
    history = plots.parse_log_history(reward_history(3))
    panel = dict((f.name, p) for f, p in plots.plan(history))["reward"][0]
    from matplotlib.figure import Figure

    ax = Figure().subplots()
    plots._draw_panel(ax, panel, history, title=True)
    assert [line.get_label() for line in ax.get_lines()] == ["mean ± std"]
    assert (tmp_path / "p" / "reward.png").name in [
        p.name for p in plots.write_plots_from_log_history(reward_history(3), tmp_path / "p")
    ]


# ---- the README's first command -----------------------------------------------------------------


def test_the_first_command_installs_what_the_plot_needs():
    first = README.read_text().split("```bash\n", 1)[1].splitlines()[0]
    assert '-e ".[embedded,plot]"' in first and first.endswith("posttrain grpo --max_steps 3")
