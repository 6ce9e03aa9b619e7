"""``posttrain kto|orpo|cpo|reward``: flags, local datasets, the built-in pairs, figures before and after."""

from __future__ import annotations

import json

import pytest

from posttrain.cli import cpo as cpo_cli
from posttrain.cli import kto as kto_cli
from posttrain.cli import orpo as orpo_cli
from posttrain.cli import reward as reward_cli
from posttrain.cli.main import COMMANDS, main, usage
from posttrain.data.tasks import arithmetic_preference_dataset

TINY = ["--use_cpu", "--bf16", "false", "--max_steps", "1", "--per_device_train_batch_size", "2",
        "--max_length", "512", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]  # fmt: skip

#: Each command's function, by name.
CLIS = {"kto": kto_cli.kto, "orpo": orpo_cli.orpo, "cpo": cpo_cli.cpo, "reward": reward_cli.reward}
#: The commands measured by greedy generation on the held-out problems (the reward model is not).
GENERATING = ["kto", "orpo", "cpo"]


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """Skip the PNG curves written at the end of training (about 2 s of matplotlib per run)."""
    monkeypatch.setattr("posttrain.core.trainer.BaseTrainer._write_plots", lambda self: None)


def pairs_file(tmp_path):
    """A local JSONL file of four standard preference pairs."""
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"What is {i}?", "chosen": f" {i}", "rejected": f" {i + 1}"} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return data


def test_the_commands_are_registered_and_in_the_usage_text():
    text = usage()
    for name in CLIS:
        assert COMMANDS[name] is CLIS[name]
        assert f"  {name} " in text


@pytest.mark.parametrize("name", sorted(CLIS))
def test_local_jsonl_pairs_one_step(name, tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    trainer = CLIS[name](
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(pairs_file(tmp_path)),
         "--output_dir", str(out), *TINY]
    )  # fmt: skip
    assert trainer.state.global_step == 1
    assert (out / "config.json").exists()
    assert f"saved the trained model to {out}" in capsys.readouterr().out
    assert not (out / "accuracy.json").exists()  # no built-in task, nothing measured


def test_kto_takes_unpaired_rows(tmp_path, tiny_model_dir):
    data = tmp_path / "unpaired.jsonl"
    rows = [{"prompt": f"What is {i}?", "completion": f" {i}", "label": i % 2 == 0} for i in range(4)]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    trainer = kto_cli.kto(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir",
         str(tmp_path / "run"), *TINY]
    )  # fmt: skip
    assert trainer.state.global_step == 1 and len(trainer.train_dataset) == 4


@pytest.mark.parametrize("name", GENERATING)
def test_the_built_in_pairs_are_measured_before_and_after(
    name, tmp_path, tiny_model_dir, capsys, monkeypatch
):
    calls = []

    def fake_accuracy(model, tokenizer, dataset, **kwargs):
        calls.append(len(dataset))
        return {"accuracy": 0.25 * len(calls), "format": 1.0}

    monkeypatch.setattr("posttrain.rewards.evaluate.task_accuracy", fake_accuracy)
    out = tmp_path / "run"
    trainer = CLIS[name](
        ["--model_name_or_path", tiny_model_dir, "--task_size", "16", "--output_dir", str(out), *TINY]
    )
    assert calls == [100, 100]
    assert json.loads((out / "accuracy.json").read_text())["after"] == {"accuracy": 0.5, "format": 1.0}
    assert "held-out accuracy 0.25 before training, 0.50 after" in capsys.readouterr().out
    assert trainer.args.learning_rate == 5e-6 and trainer.args.lr_scheduler_type == "constant"


def test_kto_splits_the_built_in_pairs(tmp_path, tiny_model_dir):
    trainer = kto_cli.kto(
        ["--model_name_or_path", tiny_model_dir, "--task_size", "8", "--output_dir", str(tmp_path / "run"),
         *TINY, "--evaluate", "false"]
    )  # fmt: skip
    pairs = arithmetic_preference_dataset(n=8, seed=2)
    assert sorted(trainer.train_dataset["label"]) == [False] * len(pairs) + [True] * len(pairs)


def test_the_reward_model_is_measured_on_held_out_pairs(tmp_path, tiny_model_dir, capsys, monkeypatch):
    seen = []
    measure = reward_cli.heldout_pairwise_accuracy

    def spy(trainer):
        seen.append(measure(trainer))
        return seen[-1]

    monkeypatch.setattr(reward_cli, "heldout_pairwise_accuracy", spy)
    out = tmp_path / "run"
    trainer = reward_cli.reward(
        ["--model_name_or_path", tiny_model_dir, "--task_size", "16", "--output_dir", str(out), *TINY]
    )
    figures = json.loads((out / "accuracy.json").read_text())
    assert seen == [figures["before"], figures["after"]]
    kinds = ["pairwise_accuracy", "pairwise_accuracy_untagged", "pairwise_accuracy_wrong_result"]
    for when in ("before", "after"):
        assert sorted(figures[when]) == kinds and all(0.0 <= v <= 1.0 for v in figures[when].values())
    printed = capsys.readouterr().out
    assert (
        f"held-out pairwise_accuracy {figures['before']['pairwise_accuracy']:.2f} before training" in printed
    )
    assert trainer.args.learning_rate == 1e-5 and trainer.model.config.num_labels == 1
    # the held-out pairs: their own seed, none on a training problem, 100 of them
    held_out = trainer.heldout_pairs
    train_problems = {p[-1]["content"] for p in arithmetic_preference_dataset(n=16, seed=2)["prompt"]}
    assert len(held_out) == reward_cli.HELDOUT_PAIRS_SIZE
    assert sorted(set(held_out["kind"])) == ["untagged", "wrong_result"]
    for row in held_out.select(range(4)):
        tagged = "<answer>" in row["rejected"][0]["content"]
        assert row["kind"] == ("wrong_result" if tagged else "untagged")
    assert not train_problems & {p[-1]["content"] for p in held_out["prompt"]}


def test_pairwise_accuracy_counts_the_pairs_the_model_orders_right(tmp_path, tiny_model_dir, monkeypatch):
    """A model whose score is the sequence length: the longer chosen side wins, a tie is a miss."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset

    trainer, _ = reward_cli._build_reward(
        ["--model_name_or_path", tiny_model_dir, "--task_size", "8", "--output_dir", str(tmp_path / "run"),
         *TINY, "--evaluate", "false"]
    )  # fmt: skip
    assert trainer.heldout_pairs is None and reward_cli.heldout_pairwise_accuracy(trainer) is None

    class LengthScore(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask, use_cache=False):
            return SimpleNamespace(logits=attention_mask.sum(-1, keepdim=True).float() + self.w)

    monkeypatch.setattr(trainer, "model", LengthScore())
    trainer.heldout_pairs = Dataset.from_dict(
        {
            "chosen": ["one two three four five", "one", "one two"],
            "rejected": ["one", "one two three four five", "one two"],
        }
    )
    assert reward_cli.heldout_pairwise_accuracy(trainer) == {"pairwise_accuracy": pytest.approx(1 / 3)}
    assert trainer.model.training  # its mode is restored


def test_no_held_out_pairs_left_is_a_configuration_error():
    every_problem = {p[-1]["content"] for p in arithmetic_preference_dataset(n=50, seed=3)["prompt"]}
    with pytest.raises(ValueError, match="--task_size"):
        reward_cli.heldout_pairs(exclude=every_problem, n=5, seed=3)


@pytest.mark.parametrize(
    ("name", "flag", "value"),
    [("kto", "--loss_type", "ktoo"), ("orpo", "--betta", "0.1"), ("cpo", "--loss_type", "simpoo"),
     ("reward", "--center_reward_coefficient", "0.01")],
)  # fmt: skip
def test_a_bad_flag_is_a_clear_cli_error(name, flag, value, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--output_dir", str(tmp_path), "--use_cpu", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"posttrain {name}: ") and (value in err or flag in err)
