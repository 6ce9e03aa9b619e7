"""``posttrain dpo``: flags, local datasets, the built-in preference pairs, accuracy before and after."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import dpo as dpo_cli
from posttrain.cli.main import COMMANDS, main
from posttrain.data.tasks import arithmetic_heldout, arithmetic_preference_dataset

TINY = ["--use_cpu", "--bf16", "false", "--max_steps", "1", "--per_device_train_batch_size", "2",
        "--max_length", "512", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip


def test_dpo_is_a_command():
    assert "dpo" in COMMANDS


def test_local_jsonl_pairs_one_step(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"What is {i}?", "chosen": f" {i}", "rejected": f" {i + 1}"} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "run"
    trainer = dpo_cli.dpo(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out), *TINY]
    )
    assert trainer.state.global_step == 1
    assert (out / "config.json").exists()
    printed = capsys.readouterr().out
    assert f"saved the trained model to {out}" in printed
    assert not (out / "accuracy.json").exists()


def test_the_built_in_pairs_are_measured_before_and_after(tmp_path, tiny_model_dir, capsys, monkeypatch):
    calls = []

    def fake_accuracy(model, tokenizer, dataset, **kwargs):
        calls.append(len(dataset))
        return {"accuracy": 0.25 * len(calls), "format": 1.0}

    monkeypatch.setattr("posttrain.rewards.evaluate.task_accuracy", fake_accuracy)
    out = tmp_path / "run"
    trainer = dpo_cli.dpo(
        ["--model_name_or_path", tiny_model_dir, "--task_size", "16", "--output_dir", str(out), *TINY]
    )
    assert calls == [100, 100]
    assert json.loads((out / "accuracy.json").read_text())["after"] == {"accuracy": 0.5, "format": 1.0}
    assert "held-out accuracy 0.25 before training, 0.50 after" in capsys.readouterr().out
    assert trainer.args.loss_type == ["sigmoid"] and trainer.args.beta == 0.1


def test_loss_types_as_flags(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    trainer = dpo_cli.dpo(
        ["--model_name_or_path", tiny_model_dir, "--task_size", "8", "--output_dir", str(out), *TINY,
         "--loss_type", "sigmoid", "sft", "--loss_weights", "1.0", "0.5", "--evaluate", "false"]
    )  # fmt: skip
    assert trainer.loss_types == ["sigmoid", "sft"] and trainer.loss_weights == [1.0, 0.5]


def test_a_bad_flag_is_a_clear_cli_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["dpo", "--output_dir", str(tmp_path), "--use_cpu", "--loss_type", "sigmoidd"])
    assert exit_info.value.code == 2
    assert "sigmoidd" in capsys.readouterr().err


def test_the_preference_pairs_never_contain_a_held_out_problem_and_prefer_the_tagged_right_answer():
    held_out = {p[-1]["content"] for p in arithmetic_heldout()["prompt"]}
    rows = arithmetic_preference_dataset(n=400)
    assert not held_out & {p[-1]["content"] for p in rows["prompt"]}
    for row in rows.select(range(20)):
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert chosen.endswith(f"<answer>{row['solution']}</answer>")
        assert chosen != rejected
        assert "<answer>" not in rejected or f"<answer>{row['solution']}</answer>" not in rejected
