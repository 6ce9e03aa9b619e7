"""`posttrain grpo --accelerate_config`: bundled accelerate configs and the relaunch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from posttrain.cli import launch
from posttrain.cli.grpo import grpo
from posttrain.cli.launch import (
    LaunchRequest,
    build_launch_command,
    bundled_accelerate_configs,
    inside_launch,
    resolve_accelerate_config,
    split_launcher_flags,
)
from posttrain.cli.main import main
from posttrain.cli.options import CLIError

EXPECTED = {
    "single": ("NO", None),
    "multi_gpu": ("MULTI_GPU", None),
    "zero1": ("DEEPSPEED", 1),
    "zero2": ("DEEPSPEED", 2),
    "zero3": ("DEEPSPEED", 3),
    "fsdp2": ("FSDP", None),
}


@pytest.fixture
def no_launch_env(monkeypatch):
    """A process environment that no launcher started."""
    for name in launch._LAUNCH_MARKERS + ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_subprocess(monkeypatch):
    """Fail the test if the command tries to relaunch."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected relaunch: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def test_bundled_configs_are_the_expected_ones():
    assert set(bundled_accelerate_configs()) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bundled_config_parses_with_expected_backend(name):
    path = bundled_accelerate_configs()[name]
    values = yaml.safe_load(path.read_text())
    kind, stage = EXPECTED[name]
    assert values["compute_environment"] == "LOCAL_MACHINE"
    assert values["distributed_type"] == kind
    assert values["mixed_precision"] == "bf16"
    assert values["num_processes"] == (1 if name == "single" else 8)
    if stage is not None:
        ds = values["deepspeed_config"]
        assert ds["zero_stage"] == stage
        assert ds["offload_optimizer_device"] == ds["offload_param_device"] == "none"
    if name == "fsdp2":
        fsdp = values["fsdp_config"]
        assert fsdp["fsdp_version"] == 2
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        assert fsdp["fsdp_state_dict_type"] in ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
        assert "fsdp_cpu_ram_efficient_loading" in fsdp and "fsdp_reshard_after_forward" in fsdp
    # accelerate itself accepts the file (it rejects unknown keys)
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(path))
    assert loaded.distributed_type.value == kind


def test_split_launcher_flags_takes_out_only_launcher_flags():
    argv = [
        "--max_steps",
        "3",
        "--accelerate_config",
        "multi_gpu",
        "--accelerate_num_processes=4",
        "--accelerator_config",
        "{}",
        "--accelerate_main_process_port",
        "29555",
        "--accelerate_mixed_precision=no",
    ]
    request, rest = split_launcher_flags(argv)
    assert request == LaunchRequest(
        config="multi_gpu", num_processes=4, main_process_port=29555, mixed_precision="no"
    )
    assert rest == ["--max_steps", "3", "--accelerator_config", "{}"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--accelerate_config"],
        ["--accelerate_num_processes", "0"],
        ["--accelerate_num_processes", "two"],
        ["--accelerate_mixed_precision", "fp8"],
    ],
)
def test_split_launcher_flags_rejects_bad_values(argv):
    with pytest.raises(CLIError):
        split_launcher_flags(argv)


def test_launcher_flags_are_not_grpo_config_fields():
    import dataclasses

    from posttrain import GRPOConfig

    fields = {f"--{f.name}" for f in dataclasses.fields(GRPOConfig)}
    assert not fields & set(launch._LAUNCHER_FLAGS)


def test_build_launch_command():
    path = bundled_accelerate_configs()["multi_gpu"]
    cmd = build_launch_command(
        path, ["--max_steps", "2"], num_processes=4, main_process_port=29600, mixed_precision="no"
    )
    assert cmd == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(path),
        "--num_processes",
        "4",
        "--main_process_port",
        "29600",
        "--mixed_precision",
        "no",
        "-m",
        "posttrain.cli.main",
        "grpo",
        "--max_steps",
        "2",
    ]


def test_build_launch_command_defaults_and_single_promotion():
    cmd = build_launch_command("/x/cfg.yaml", [])
    assert cmd == [
        sys.executable,
        *("-m", "accelerate.commands.launch", "--config_file", "/x/cfg.yaml"),
        *("-m", "posttrain.cli.main", "grpo"),
    ]
    single = build_launch_command(
        "/x/single.yaml", ["--bf16", "false"], num_processes=2, distributed_type="NO"
    )
    assert single[5:8] == ["--num_processes", "2", "--multi_gpu"]
    assert single[-3:] == ["grpo", "--bf16", "false"]
    one = build_launch_command("/x/single.yaml", [], num_processes=1, distributed_type="NO")
    assert "--multi_gpu" not in one


def test_build_launch_command_reruns_the_given_subcommand():
    cmd = build_launch_command("/x/cfg.yaml", ["--max_steps", "2"], command="sft")
    assert cmd[-5:] == ["-m", "posttrain.cli.main", "sft", "--max_steps", "2"]


def test_relaunch_if_requested_reruns_any_subcommand(monkeypatch, no_launch_env, capsys):
    seen = {}

    def fake_run(cmd, env):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 3)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(SystemExit) as exc:
        launch.relaunch_if_requested("sft", ["--accelerate_config", "single", "--max_steps", "1"])
    assert exc.value.code == 3
    assert seen["cmd"][-3:] == ["sft", "--max_steps", "1"]
    assert "posttrain sft: relaunching under accelerate (single.yaml): " in capsys.readouterr().err


def test_relaunch_if_requested_inside_a_launch_drops_the_launcher_flags(
    monkeypatch, no_launch_env, no_subprocess
):
    assert launch.relaunch_if_requested("sft", ["--max_steps", "1"]) == ["--max_steps", "1"]
    monkeypatch.setenv(launch.RELAUNCHED_ENV, "1")
    argv = ["--accelerate_config", "single", "--accelerate_num_processes", "2", "--max_steps", "1"]
    assert launch.relaunch_if_requested("sft", argv) == ["--max_steps", "1"]


def test_resolve_user_file(tmp_path):
    user = tmp_path / "mine.yaml"
    user.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert resolve_accelerate_config(str(user)) == user


def test_inside_launch_markers():
    assert not inside_launch({})
    assert inside_launch({"LOCAL_RANK": "0"})
    assert inside_launch({"ACCELERATE_MIXED_PRECISION": "no"})
    assert inside_launch({launch.RELAUNCHED_ENV: "1"})


def test_relaunch_runs_accelerate_and_exits_with_its_code(monkeypatch, no_launch_env):
    seen = {}

    def fake_run(cmd, env):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 7)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(SystemExit) as exc:
        main(["grpo", "--accelerate_config", "multi_gpu", "--max_steps", "1"])
    assert exc.value.code == 7
    assert seen["cmd"][-3:] == ["grpo", "--max_steps", "1"]
    assert seen["cmd"][1:5] == ["-m", "accelerate.commands.launch", "--config_file", seen["cmd"][4]]
    assert seen["cmd"][4].endswith("multi_gpu.yaml")
    assert "--accelerate_config" not in seen["cmd"]
    assert seen["env"][launch.RELAUNCHED_ENV] == "1"


def test_inside_a_launch_the_flag_is_ignored(monkeypatch, no_launch_env, no_subprocess, recorder_like):
    monkeypatch.setenv(launch.RELAUNCHED_ENV, "1")  # what a relaunched process sees
    grpo(["--accelerate_config", "multi_gpu", "--max_steps", "1", "--report_to", "none"])
    assert recorder_like["trained"]


@pytest.fixture
def recorder_like(monkeypatch):
    captured: dict = {}

    class Recorder:
        def __init__(self, model, reward_funcs, args, train_dataset):
            captured["args"] = args

        def train(self, resume_from_checkpoint=None):
            captured["trained"] = True

        def save_model(self, path):
            pass

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


def _exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_unknown_name_exits_2_listing_bundled(no_launch_env, no_subprocess, capsys):
    err = _exit_2(["grpo", "--accelerate_config", "zer3"], capsys)
    assert "unknown accelerate config 'zer3'" in err
    for name in EXPECTED:
        assert name in err


def test_missing_path_exits_2(tmp_path, no_launch_env, no_subprocess, capsys):
    missing = str(tmp_path / "nope.yaml")
    err = _exit_2(["grpo", "--accelerate_config", missing], capsys)
    assert "does not exist" in err and missing in err


def _relaunched_command(monkeypatch, config: str) -> list[str]:
    seen = {}

    def fake_run(cmd, env):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(SystemExit) as exc:
        main(["grpo", "--accelerate_config", config, "--max_steps", "1"])
    assert exc.value.code == 0
    return seen["cmd"]


@pytest.mark.parametrize("name", ["zero1", "zero2", "zero3", "fsdp2"])
def test_sharded_backends_relaunch(name, monkeypatch, no_launch_env):
    cmd = _relaunched_command(monkeypatch, name)
    assert cmd[4].endswith(f"{name}.yaml")


def test_user_file_with_deepspeed_relaunches(tmp_path, monkeypatch, no_launch_env):
    user = tmp_path / "ds.yaml"
    user.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n")
    assert _relaunched_command(monkeypatch, str(user))[4] == str(user)


def test_user_file_that_is_not_an_accelerate_config_exits_2(tmp_path, no_launch_env, no_subprocess, capsys):
    user = tmp_path / "bad.yaml"
    user.write_text("- a\n- b\n")
    err = _exit_2(["grpo", "--accelerate_config", str(user)], capsys)
    assert "distributed_type" in err


REWARD_MODULE = """
import os


def rank_reward(completions, **kwargs):
    rank = os.environ.get("RANK", "none")
    world = os.environ.get("WORLD_SIZE", "none")
    with open(f"rank-{rank}-of-{world}.txt", "w") as f:
        f.write("seen")
    return [0.0 for _ in completions]
"""


@pytest.mark.slow
def test_single_with_two_processes_relaunches_and_trains(tmp_path, tiny_model_dir, monkeypatch):
    (tmp_path / "rank_rewards.py").write_text(REWARD_MODULE)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in launch._LAUNCH_MARKERS}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [
        *(sys.executable, "-m", "posttrain.cli.main", "grpo"),
        *("--accelerate_config", "single", "--accelerate_num_processes", "2"),
        *("--accelerate_main_process_port", "29547"),
        *("--accelerate_mixed_precision", "no"),
        *("--model_name_or_path", tiny_model_dir, "--output_dir", str(out)),
        *("--reward_funcs", "rank_rewards:rank_reward"),
        *("--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "4"),
        *("--max_completion_length", "8", "--use_cpu", "--bf16", "false"),
        *("--gradient_checkpointing", "false", "--report_to", "none", "--save_strategy", "no"),
        *("--task_size", "16", "--ddp_backend", "gloo", "--disable_tqdm", "true"),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "relaunching under accelerate" in proc.stderr
    assert sorted(p.name for p in tmp_path.glob("rank-*.txt")) == ["rank-0-of-2.txt", "rank-1-of-2.txt"]
    assert (out / "model.safetensors").is_file()
    assert (out / "config.json").is_file()
