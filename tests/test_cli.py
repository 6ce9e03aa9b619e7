"""The `posttrain` command line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from posttrain.cli.datasets import load_dataset_split
from posttrain.cli.grpo import LAPTOP_DEFAULTS, _build_grpo, grpo
from posttrain.cli.main import COMMANDS, main
from posttrain.cli.options import CLIError, given_fields, parse_config
from posttrain.cli.training import cpu_precision_defaults

# Flags of a 1-step CPU run of the tiny model.
TINY_RUN = [
    "--max_steps", "1",
    "--per_device_train_batch_size", "4",
    "--num_generations", "4",
    "--max_completion_length", "8",
    "--use_cpu",
    "--bf16", "false",
    "--gradient_checkpointing", "false",
    "--report_to", "none",
    "--save_strategy", "no",
    "--disable_tqdm", "true",
]  # fmt: skip


@pytest.fixture
def recorder(monkeypatch):
    """Replace GRPOTrainer with a recorder of what the command passes; returns the record."""
    captured: dict = {}

    class Recorder:
        def __init__(self, model, reward_funcs, args, train_dataset):
            captured.update(model=model, args=args, dataset=train_dataset, funcs=reward_funcs)

        def train(self, resume_from_checkpoint=None):
            captured["trained"] = True
            captured["resume"] = resume_from_checkpoint

        def save_model(self, path):
            captured["saved"] = path

        def save_state(self):
            pass

        def is_world_process_zero(self):
            return True

        def add_callback(self, callback):
            pass

        def pop_callback(self, callback):
            return None

    monkeypatch.setattr("posttrain.GRPOTrainer", Recorder)
    # the built-in task's held-out accuracy, measured before and after training
    monkeypatch.setattr("posttrain.cli.grpo.builtin_task_accuracy", lambda trainer: None)
    return captured


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def prompts(n, column="prompt"):
    return [{column: f"What is {i} plus one?", "solution": str(i + 1)} for i in range(n)]


def assert_exit_2(capsys, argv, *fragments):
    """`posttrain argv` exits with code 2 and a message (no traceback) holding every fragment."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err
    assert "Traceback" not in err
    return err


# ---- commands and usage ------------------------------------------------------------------------


def test_no_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    out = capsys.readouterr().out
    assert "posttrain grpo" in out
    for name in COMMANDS:
        assert f"  {name}" in out


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "env" in capsys.readouterr().out


def test_unknown_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["grpoo"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'grpoo'" in err and "grpo" in err


# ---- posttrain grpo: flags and recipes ---------------------------------------------------------


DYNAMIC_REFUSAL = (
    "dynamic_sampling=True refills each process's own groups, so the per-process generation batch "
    "(per_device_train_batch_size x steps_per_generation = 2) must be a multiple of num_generations=4"
)


@pytest.fixture
def two_process_refusal(monkeypatch):
    """``build_online_trainer`` as with 2 processes of 2 rows and groups of 4: the config refuses
    dynamic sampling (only reachable with several processes: with one, the group check comes
    first). Records the defaults of each call."""
    calls: list[dict] = []

    def build(argv, command, summary, config_class, trainer_class, defaults, **kwargs):
        calls.append(dict(defaults))
        asked = "--dynamic_sampling" in argv
        if (defaults.get("dynamic_sampling") and not asked) or (
            asked and argv[argv.index("--dynamic_sampling") + 1] == "true"
        ):
            raise ValueError(DYNAMIC_REFUSAL)
        return "trainer", "config"

    monkeypatch.setattr("posttrain.cli.grpo.build_online_trainer", build)
    return calls


def test_the_default_dynamic_sampling_steps_aside_for_a_batch_it_cannot_refill(two_process_refusal):
    """The no-argument run samples dynamically; a user's batch whose processes cannot hold whole
    groups turns that preset off with a note, instead of failing on a setting the user never chose
    (the two-process run of test_cli_accelerate.py goes through this for real)."""
    assert LAPTOP_DEFAULTS["dynamic_sampling"] is True
    # stdout only (not capsys): the first import of the trainer modules may happen here, and a
    # logging handler made then must not hold a stream that capsys closes after the test
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert _build_grpo(["--per_device_train_batch_size", "2"]) == ("trainer", "config")
    assert [c["dynamic_sampling"] for c in two_process_refusal] == [True, False]
    assert "dynamic sampling, a default of the no-argument run, is off" in out.getvalue()


def test_dynamic_sampling_asked_for_with_such_a_batch_is_still_refused(two_process_refusal, tmp_path):
    with pytest.raises(ValueError, match="refills each process's own groups"):
        _build_grpo(["--per_device_train_batch_size", "2", "--dynamic_sampling", "true"])
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dynamic_sampling: true\n")
    with pytest.raises(ValueError, match="refills each process's own groups"):
        _build_grpo(["--config", str(recipe)])
    assert len(two_process_refusal) == 2  # no second try


def test_given_fields_reads_flags_and_the_recipe(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dynamic_sampling: true\nlearning_rate: 1.0e-6\n")
    assert given_fields(["--max_steps", "3", "--beta=0.1"]) == {"max_steps", "beta"}
    assert given_fields(["--config", str(recipe), "--seed", "1"]) == {
        "dynamic_sampling",
        "learning_rate",
        "seed",
    }


def test_grpo_flags_reach_the_config(tmp_path, tiny_model_dir, recorder):
    """Every GRPOConfig field is a flag; the laptop defaults apply when a flag is absent."""
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
            "--evaluate", "false",  # no held-out problem is left out of the 40 prompts
        ]
    )  # fmt: skip
    args = recorder["args"]
    assert recorder["model"] == tiny_model_dir and len(recorder["dataset"]) == 40
    assert args.num_generations == 4 and args.scale_rewards == "batch"
    assert args.generation_kwargs == {"top_k": 5}
    assert args.max_steps == LAPTOP_DEFAULTS["max_steps"]
    assert args.max_completion_length == LAPTOP_DEFAULTS["max_completion_length"]
    assert [f.__name__ for f in recorder["funcs"]] == ["answer_accuracy_reward", "answer_format_reward"]
    assert recorder["trained"] and recorder["saved"] == str(tmp_path)
    assert recorder["resume"] is None


@pytest.mark.parametrize("host_bf16", [True, False])
def test_grpo_trains_in_bf16_where_the_cpu_has_bf16_instructions(
    tmp_path, tiny_model_dir, recorder, monkeypatch, host_bf16
):
    """The measured CPU default: bf16 on a GPU-less host with bf16 instructions, float32 elsewhere;
    a precision or device the user chose wins, and the run says which it took."""
    import torch

    monkeypatch.setattr("posttrain.ops.precision.native_bf16", lambda: host_bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    base = ["grpo", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path),
            "--task_size", "40", "--evaluate", "false"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as out:
        main(base)
    args = recorder["args"]
    assert (args.bf16, args.use_cpu) == ((True, True) if host_bf16 else (False, False))
    assert ("training in bf16, since this CPU" in out.getvalue()) is host_bf16
    for chosen, bf16 in ((["--bf16", "false"], False), (["--fp16", "false"], False), (["--use_cpu"], True)):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            main(base + chosen)
        assert recorder["args"].bf16 is bf16, chosen  # --use_cpu: GRPOConfig's own bf16=None rule
        assert "training in bf16, since this CPU" not in out.getvalue()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_precision_defaults([]) == {}  # a GPU: the trainer's own bf16=None rule


def test_resume_from_checkpoint_true_means_the_latest(tmp_path, recorder):
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--resume_from_checkpoint", "true"])
    assert recorder["resume"] is True


@pytest.fixture
def process_group(tmp_path):
    """A live one-process gloo group, as under a launcher; destroyed afterwards if still alive."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield dist
    if dist.is_initialized():
        dist.destroy_process_group()


def test_grpo_ends_the_process_group_after_saving(tmp_path, recorder, process_group, monkeypatch):
    """A gloo group left alive can abort the process at exit and fail the launch (docs/distributed.md)."""
    seen_at_save = []
    monkeypatch.setattr(
        "posttrain.GRPOTrainer.save_model",
        lambda self, path: seen_at_save.append(process_group.is_initialized()),
    )
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu"])
    assert seen_at_save == [True]  # the group is still there for the final save
    assert not process_group.is_initialized()


def test_grpo_keeps_the_process_group_when_training_fails(tmp_path, recorder, process_group, monkeypatch):
    """After a failure the other ranks may never reach a barrier, so the group is left alone."""

    def fail(self, resume_from_checkpoint=None):
        raise RuntimeError("boom")

    monkeypatch.setattr("posttrain.GRPOTrainer.train", fail)
    with pytest.raises(RuntimeError, match="boom"):
        main(["grpo", "--output_dir", str(tmp_path), "--use_cpu"])
    assert process_group.is_initialized()


def test_yaml_config_sets_defaults_and_flags_win(tmp_path, tiny_model_dir, recorder):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epsilon: 0.1\nepsilon_high: 0.28\nscale_rewards: batch\nmax_steps: 7\n")
    main(["grpo", "--config", str(recipe), "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path),
          "--use_cpu", "--max_steps", "3"])  # fmt: skip
    args = recorder["args"]
    assert (args.epsilon, args.epsilon_high, args.scale_rewards) == (0.1, 0.28, "batch")
    assert args.max_steps == 3  # the command line wins over the file


def test_yaml_config_sets_script_arguments(tmp_path, recorder):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "reward_funcs: [helpers.length_reward, answer_format_reward]\ntask_size: 24\nevaluate: false\n"
    )
    main(["grpo", f"--config={recipe}", "--output_dir", str(tmp_path), "--use_cpu"])
    assert [f.__name__ for f in recorder["funcs"]] == ["length_reward", "answer_format_reward"]
    assert len(recorder["dataset"]) == 24


# ---- posttrain grpo: local datasets ------------------------------------------------------------


def test_local_csv_file(tmp_path, recorder):
    data = tmp_path / "data.csv"
    data.write_text("prompt,solution\n" + "".join(f"What is {i} plus one?,{i + 1}\n" for i in range(6)))
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", str(data)])
    assert len(recorder["dataset"]) == 6 and recorder["dataset"][0]["prompt"] == "What is 0 plus one?"


def test_local_parquet_file(tmp_path, recorder):
    from datasets import Dataset

    data = tmp_path / "data.parquet"
    Dataset.from_list(prompts(5)).to_parquet(str(data))
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", str(data)])
    assert len(recorder["dataset"]) == 5


def test_local_folder_picks_the_split_by_file_name(tmp_path, recorder):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", prompts(8))
    write_jsonl(folder / "test.jsonl", prompts(3))
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", str(folder)])
    assert len(recorder["dataset"]) == 8
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", str(folder),
          "--dataset_train_split", "test"])  # fmt: skip
    assert len(recorder["dataset"]) == 3


def test_local_folder_without_split_names_is_the_train_split(tmp_path, recorder):
    folder = tmp_path / "shards"
    (folder / ".cache").mkdir(parents=True)
    write_jsonl(folder / "part-0.jsonl", prompts(4))
    write_jsonl(folder / "part-1.json", prompts(5))
    write_jsonl(folder / ".cache" / "ignored.jsonl", prompts(7))
    (folder / "README.md").write_text("not data\n")
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", str(folder)])
    assert len(recorder["dataset"]) == 9


def test_local_jsonl_one_training_step(tmp_path, tiny_model_dir, capsys):
    """A jsonl file, a dotted-path reward and the tiny model: one real step, then the model is saved."""
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts(8))
    out = tmp_path / "run"
    trainer = grpo(["--model_name_or_path", tiny_model_dir, "--dataset_name", data, "--output_dir", str(out),
                    "--reward_funcs", "helpers.length_reward", *TINY_RUN])  # fmt: skip
    assert trainer.state.global_step == 1
    assert any("rewards/length_reward/mean" in h for h in trainer.state.log_history)
    assert (out / "config.json").exists()
    assert f"saved the trained model to {out}" in capsys.readouterr().out


# ---- posttrain grpo: rewards -------------------------------------------------------------------


def test_dotted_reward_from_a_module_in_tmp_path(tmp_path, recorder, monkeypatch):
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(
        "def short(completions, **kwargs):\n    return [-float(len(c)) for c in completions]\n\n"
        "class Scores:\n    @staticmethod\n    def long(completions, **kwargs):\n"
        "        return [float(len(c)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--reward_funcs",
          "my_rewards_pkg.scoring.short", "my_rewards_pkg.scoring:Scores.long", "think_format_reward"])  # fmt: skip
    assert [f.__name__ for f in recorder["funcs"]] == ["short", "long", "think_format_reward"]


def test_reward_model_is_appended(tmp_path, recorder):
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--reward_funcs", "helpers.length_reward",
          "--reward_model_name_or_path", "some/reward-model"])  # fmt: skip
    funcs = recorder["funcs"]
    assert funcs[0].__name__ == "length_reward" and funcs[1] == "some/reward-model"


def test_reward_model_alone_replaces_the_default_rewards(tmp_path, recorder):
    main(["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--reward_model_name_or_path", "rm"])
    assert recorder["funcs"] == ["rm"]


def test_reward_model_one_training_step(tmp_path, tiny_model_dir):
    """A tiny sequence-classification model folder scores completions next to a reward function."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.eos_token_id,
    )
    rm_dir = tmp_path / "tiny-rm"
    LlamaForSequenceClassification(config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    data = write_jsonl(tmp_path / "prompts.jsonl", prompts(8))
    trainer = grpo(["--model_name_or_path", tiny_model_dir, "--dataset_name", data,
                    "--output_dir", str(tmp_path / "run"), "--reward_funcs", "helpers.length_reward",
                    "--reward_model_name_or_path", str(rm_dir), *TINY_RUN])  # fmt: skip
    assert trainer.state.global_step == 1
    logged = [k for h in trainer.state.log_history for k in h]
    assert "rewards/length_reward/mean" in logged and "rewards/tiny-rm/mean" in logged


# ---- the shared pieces serve any training subcommand ------------------------------------------


@dataclass
class OtherScriptArguments:
    """The script arguments of a second subcommand."""

    model_name_or_path: str = "some-model"


def parse_other(argv, tmp_path):
    from transformers import TrainingArguments

    defaults = {"output_dir": str(tmp_path), "use_cpu": True, "max_steps": 9}
    return parse_config(argv, OtherScriptArguments, TrainingArguments, command="sft",
                        summary="Train with SFT.", defaults=defaults)  # fmt: skip


def test_parse_config_builds_another_commands_arguments(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model_name_or_path: from-recipe\nlearning_rate: 0.5\nmax_steps: 7\n")
    script, config = parse_other(["--config", str(recipe), "--max_steps", "3"], tmp_path)
    assert isinstance(script, OtherScriptArguments) and script.model_name_or_path == "from-recipe"
    assert (config.learning_rate, config.max_steps, config.output_dir) == (0.5, 3, str(tmp_path))


def test_parse_config_names_the_command_in_its_messages(tmp_path):
    with pytest.raises(
        CLIError, match=r"did you mean --max_steps\?\)\. `posttrain sft --help` lists every flag"
    ):
        parse_other(["--max_stepz", "3"], tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("num_generations: 4\n")
    with pytest.raises(CLIError, match=r"not flags of posttrain sft: \['num_generations'\]"):
        parse_other(["--config", str(recipe)], tmp_path)


def test_dataset_folder_without_the_split_names_the_given_flag(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", prompts(4))
    with pytest.raises(CLIError, match="Choose one with --dataset_test_split"):
        load_dataset_split(str(tmp_path), None, "test", split_flag="--dataset_test_split")


# ---- posttrain env -----------------------------------------------------------------------------


def test_env_prints_versions_and_hardware(capsys):
    import torch
    import transformers

    main(["env"])
    out = capsys.readouterr().out
    assert f"- torch: {torch.__version__}" in out
    assert f"- transformers: {transformers.__version__}" in out
    for key in ("Python", "posttrain", "datasets", "accelerate", "peft", "vllm", "deepspeed", "math-verify",
                "gguf", "Platform", "CPU count", "CPU vector instructions", "CPU bf16 instructions",
                "posttrain grpo and sft precision", "CUDA available", "GPUs", "bf16 supported"):  # fmt: skip
        assert f"- {key}: " in out


def test_env_reports_missing_packages(capsys, monkeypatch):
    monkeypatch.setattr("posttrain.cli.main.ENV_PACKAGES", ("posttrain", "surely-not-a-package"))
    main(["env"])
    assert "- surely-not-a-package: not installed" in capsys.readouterr().out


def test_env_rejects_arguments(capsys):
    assert_exit_2(capsys, ["env", "--verbose"], "unrecognized arguments: --verbose")


# ---- bad input: exit code 2, a message, no traceback -------------------------------------------


def test_unknown_flag_names_the_flag(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--max_stepz", "3"],
                  "--max_stepz", "did you mean --max_steps?")  # fmt: skip


def test_stray_positional_argument(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "oops"], "unexpected argument", "oops")


def test_bad_flag_value(tmp_path, capsys):
    assert_exit_2(
        capsys, ["grpo", "--output_dir", str(tmp_path), "--max_steps", "many"], "--max_steps", "many"
    )


def test_config_without_a_path(capsys):
    assert_exit_2(capsys, ["grpo", "--config"], "--config needs the path")


def test_missing_recipe_file(tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    assert_exit_2(capsys, ["grpo", "--config", str(missing)], str(missing), "No such file")


def test_recipe_that_is_not_a_mapping(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("- epsilon\n- 0.1\n")
    assert_exit_2(capsys, ["grpo", "--config", str(recipe)], "must hold a mapping", "not a list")


def test_recipe_with_a_yaml_syntax_error(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epsilon: 0.1\nbeta: [0.0\n")
    assert_exit_2(capsys, ["grpo", "--config", str(recipe)], "is not valid YAML at line")


def test_yaml_config_with_unknown_key(tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("epsilonn: 0.1\n")
    assert_exit_2(capsys, ["grpo", "--config", str(recipe), "--output_dir", str(tmp_path), "--use_cpu"],
                  "not flags of posttrain grpo", "epsilonn", "did you mean epsilon?")  # fmt: skip


def test_unknown_reward_function(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--reward_funcs", "nope"],
                  "unknown reward function 'nope'", "answer_accuracy_reward")  # fmt: skip


def test_unimportable_reward_path(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--reward_funcs", "no_such_pkg.rewards.f"],
                  "'no_such_pkg.rewards.f'", "No module named 'no_such_pkg'")  # fmt: skip


def test_reward_path_to_a_missing_attribute(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--reward_funcs", "helpers:no_such_reward"],
                  "'helpers:no_such_reward'", "has no attribute 'no_such_reward'")  # fmt: skip


def test_reward_path_to_something_not_callable(tmp_path, capsys):
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--reward_funcs", "posttrain.cli.grpo.LAPTOP_DEFAULTS"],
                  "is a dict, not a callable")  # fmt: skip


@pytest.mark.parametrize("name", ["missing.jsonl", "missing_folder/"])
def test_dataset_that_does_not_exist(tmp_path, capsys, name):
    path = str(tmp_path / name)
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--dataset_name", path],
                  f"dataset {path!r} does not exist")  # fmt: skip


def test_dataset_folder_without_the_split(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", prompts(4))
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--dataset_name", str(folder),
                           "--dataset_train_split", "validation"], "split 'validation'", "['train']")  # fmt: skip


def test_dataset_folder_without_data_files(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--dataset_name", str(tmp_path / "empty")],
                  "holds no .json/.jsonl/.csv/.parquet files")  # fmt: skip


def test_malformed_data_file(tmp_path, capsys):
    data = tmp_path / "broken.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": \n')
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--dataset_name", str(data)],
                  f"cannot read the dataset {str(data)!r}")  # fmt: skip


def test_dataset_without_a_prompt_column(tmp_path, tiny_model_dir, capsys):
    data = write_jsonl(tmp_path / "questions.jsonl", prompts(8, column="question"))
    assert_exit_2(capsys, ["grpo", "--model_name_or_path", tiny_model_dir, "--dataset_name", data,
                           "--output_dir", str(tmp_path), "--reward_funcs", "helpers.length_reward", *TINY_RUN],
                  "train_dataset has no 'prompt' column", "'question'")  # fmt: skip


def test_invalid_config_value_is_a_clear_error(tmp_path, capsys):
    """A ValueError of GRPOConfig's validation becomes exit code 2 with its message."""
    assert_exit_2(capsys, ["grpo", "--output_dir", str(tmp_path), "--use_cpu", "--loss_type", "luspo",
                           "--importance_sampling_level", "token"], "importance_sampling_level='sequence'")  # fmt: skip


def test_errors_during_training_are_not_swallowed(tmp_path, recorder, monkeypatch):
    import posttrain

    def fail(self, resume_from_checkpoint=None):
        raise ValueError("boom in step 3")

    monkeypatch.setattr(posttrain.GRPOTrainer, "train", fail)
    with pytest.raises(ValueError, match="boom in step 3"):
        main(["grpo", "--output_dir", str(tmp_path), "--use_cpu"])


def test_grpo_raises_cli_error_for_callers():
    with pytest.raises(CLIError, match="unknown reward function"):
        grpo(["--reward_funcs", "nope"])


def test_python_dash_m_exits_2_without_traceback(tmp_path):
    """`python -m posttrain.cli.main` (the torchrun / accelerate entry) reports bad input cleanly."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", "grpo", "--output_dir", str(tmp_path),
         "--reward_funcs", "no_such_pkg.rewards:f"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "posttrain grpo: cannot import reward function 'no_such_pkg.rewards:f'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1  # one paragraph


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


def test_default_task_and_its_flags(tmp_path, tiny_model_dir, recorder):
    """The default run's task: one worked example, operands up to 20, no system message; flags change it."""
    base = ["grpo", "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path), "--use_cpu"]
    main([*base, "--task_size", "30"])
    rows = recorder["dataset"]
    assert [m["role"] for m in rows[0]["prompt"]] == ["user", "assistant", "user"]
    operands = [int(v) for row in rows for v in re.findall(r"\d+", row["prompt"][-1]["content"])]
    assert max(operands) <= 20
    main(
        [
            *base,
            "--task_size",
            "30",
            "--task_few_shot",
            "0",
            "--task_system_prompt",
            "true",
            "--task_max_value",
            "9",
        ]
    )
    rows = recorder["dataset"]
    assert [m["role"] for m in rows[0]["prompt"]] == ["system", "user"]
    assert max(int(v) for row in rows for v in re.findall(r"\d+", row["prompt"][-1]["content"])) <= 9
