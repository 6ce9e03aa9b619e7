"""The `posttrain` command line."""

from __future__ import annotations

import json

import pytest

from posttrain.cli.main import LAPTOP_DEFAULTS, grpo, main


def test_no_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "posttrain grpo" in capsys.readouterr().out


def test_unknown_command(capsys):
    with pytest.raises(SystemExit):
        main(["dpo"])
    assert "unknown command 'dpo'" in capsys.readouterr().err


def test_unknown_reward_function(tmp_path):
    with pytest.raises(SystemExit, match="unknown reward function"):
        main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--reward_funcs", "nope"])


def test_grpo_flags_reach_the_config(tmp_path, tiny_model_dir, monkeypatch):
    """Every GRPOConfig field is a flag; the laptop defaults apply when a flag is absent."""
    captured = {}

    class Recorder:
        def __init__(self, model, reward_funcs, args, train_dataset):
            captured.update(model=model, args=args, n=len(train_dataset), funcs=reward_funcs)

        def train(self):
            captured["trained"] = True

        def save_model(self, path):
            captured["saved"] = path

    monkeypatch.setattr("posttrain.GRPOTrainer", Recorder)
    main(
        [
            "grpo",
            "--model_name_or_path", tiny_model_dir,
            "--output_dir", str(tmp_path),
            "--use_cpu",
            "--num_generations", "4",
            "--per_device_train_batch_size", "4",
            "--scale_rewards", "batch",
            "--generation_kwargs", json.dumps({"top_k": 5}),
            "--task_size", "40",
        ]
    )  # fmt: skip
    args = captured["args"]
    assert captured["model"] == tiny_model_dir and captured["n"] == 40
    assert args.num_generations == 4 and args.scale_rewards == "batch"
    assert args.generation_kwargs == {"top_k": 5}
    assert args.max_steps == LAPTOP_DEFAULTS["max_steps"]
    assert args.max_completion_length == LAPTOP_DEFAULTS["max_completion_length"]
    assert [f.__name__ for f in captured["funcs"]] == ["answer_accuracy_reward", "answer_format_reward"]
    assert captured["trained"] and captured["saved"] == str(tmp_path)


@pytest.mark.slow
def test_default_job_on_the_embedded_model(tmp_path):
    """`posttrain grpo` on the embedded SmolLM2 and the arithmetic task, 2 short steps."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    trainer = grpo(
        [
            "--output_dir", str(out),
            "--max_steps", "2",
            "--per_device_train_batch_size", "4",
            "--num_generations", "4",
            "--max_completion_length", "24",
            "--save_strategy", "no",
            "--disable_tqdm", "true",
        ]
    )  # fmt: skip
    assert trainer.state.global_step == 2
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for log in logs:
        assert 0.0 <= log["rewards/answer_accuracy_reward/mean"] <= 1.0
        assert 0.0 <= log["rewards/answer_format_reward/mean"] <= 1.0
        assert 1 <= log["completions/mean_length"] <= 24
    saved = AutoModelForCausalLM.from_pretrained(out)
    assert saved.config.model_type == "llama"
    assert sum(p.numel() for p in saved.parameters()) > 100_000_000


def test_yaml_config_sets_defaults_and_flags_win(tmp_path, tiny_model_dir, monkeypatch):
    captured = {}

    class Recorder:
        def __init__(self, model, reward_funcs, args, train_dataset):
            captured["args"] = args

        def train(self):
            pass

        def save_model(self, path):
            pass

    monkeypatch.setattr("posttrain.GRPOTrainer", Recorder)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epsilon: 0.1\nepsilon_high: 0.28\nscale_rewards: batch\nmax_steps: 7\n")
    main(["grpo", "--config", str(recipe), "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path),
          "--use_cpu", "--max_steps", "3"])  # fmt: skip
    args = captured["args"]
    assert (args.epsilon, args.epsilon_high, args.scale_rewards) == (0.1, 0.28, "batch")
    assert args.max_steps == 3  # the command line wins over the file


def test_yaml_config_with_unknown_key(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epsilonn: 0.1\n")
    with pytest.raises(SystemExit, match="epsilonn"):
        main(["grpo", "--config", str(recipe), "--output_dir", str(tmp_path), "--use_cpu"])
