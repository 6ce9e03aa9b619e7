"""``posttrain sft``: flags, local datasets, the built-in task's accuracy before and after."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import sft as sft_cli
from posttrain.cli.main import COMMANDS, main
from posttrain.data.tasks import arithmetic_heldout, arithmetic_sft_dataset

TINY = ["--use_cpu", "--bf16", "false", "--max_steps", "1", "--per_device_train_batch_size", "2",
        "--max_length", "64", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip


def test_sft_is_a_command():
    assert "sft" in COMMANDS


def test_local_jsonl_prompt_completion_one_step(tmp_path, tiny_model_dir, capsys):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "\n".join(json.dumps({"prompt": f"What is {i}?", "completion": f" {i}"}) for i in range(4))
    )
    out = tmp_path / "run"
    trainer = sft_cli.sft(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out), *TINY]
    )
    assert trainer.state.global_step == 1
    assert (out / "config.json").exists()
    printed = capsys.readouterr().out
    assert f"saved the trained model to {out}" in printed
    assert "held-out" not in printed  # a user's dataset: no built-in task to measure
    assert not (out / "accuracy.json").exists()


def test_the_built_in_task_is_measured_before_and_after(tmp_path, tiny_model_dir, capsys, monkeypatch):
    calls = []

    def fake_accuracy(model, tokenizer, dataset, **kwargs):
        calls.append(len(dataset))
        return {"accuracy": 0.25 * len(calls), "format": 1.0}

    monkeypatch.setattr("posttrain.rewards.evaluate.task_accuracy", fake_accuracy)
    out = tmp_path / "run"
    sft_cli.sft(
        [
            "--model_name_or_path",
            tiny_model_dir,
            "--task_size",
            "16",
            "--output_dir",
            str(out),
            *TINY,
            "--max_length",
            "512",
        ]
    )
    assert calls == [100, 100]
    assert json.loads((out / "accuracy.json").read_text()) == {
        "before": {"accuracy": 0.25, "format": 1.0},
        "after": {"accuracy": 0.5, "format": 1.0},
    }
    assert "held-out accuracy 0.25 before training, 0.50 after" in capsys.readouterr().out


@pytest.mark.parametrize("host_bf16", [True, False])
def test_sft_trains_in_bf16_where_the_cpu_has_bf16_instructions(
    tmp_path, tiny_model_dir, monkeypatch, capsys, host_bf16
):
    """`posttrain grpo`'s measured CPU rule: bf16 on a GPU-less host with bf16 instructions, float32
    elsewhere; a precision or device the user chose wins, and the run says which it took."""
    import torch

    monkeypatch.setattr("posttrain.ops.precision.native_bf16", lambda: host_bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--task_size", "16"]
    _, config = sft_cli._build_sft(base)
    assert (config.bf16, config.use_cpu) == ((True, True) if host_bf16 else (False, False))
    assert ("posttrain sft: training in bf16, since this CPU" in capsys.readouterr().out) is host_bf16
    for chosen in (["--bf16", "false"], ["--fp16", "false"]):
        _, config = sft_cli._build_sft(base + chosen)
        assert config.bf16 is False and "training in bf16" not in capsys.readouterr().out, chosen


def test_a_bad_flag_is_a_clear_cli_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sft", "--output_dir", str(tmp_path), "--use_cpu", "--packing_strategy", "best"])
    assert exit_info.value.code == 2
    assert "packing_strategy='best' is invalid" in capsys.readouterr().err


def test_the_sft_task_never_contains_a_held_out_problem():
    held_out = {p[-1]["content"] for p in arithmetic_heldout()["prompt"]}
    rows = arithmetic_sft_dataset(n=3000)
    assert not held_out & {p[-1]["content"] for p in rows["prompt"]}
    row = rows[0]
    expression = row["prompt"][-1]["content"][len("What is ") : row["prompt"][-1]["content"].index("?")]
    assert row["completion"] == [
        {
            "role": "assistant",
            "content": f"{expression} = {row['solution']}. <answer>{row['solution']}</answer>",
        }
    ]
