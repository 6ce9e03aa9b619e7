"""Sweeps: several GRPO runs, each its own LoRA adapter on one shared base model (docs/sweeps.md).

Each run must train as if it were alone: the same adapter weights after the same steps (its
optimizer, scheduler, random generators and data are its own), and nothing of one run reaches
another (gradients, optimizer state, logs, checkpoints).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset
from transformers import set_seed

from posttrain import GRPOTrainer
from posttrain.sweep import GRPOSweep, SweepRun

peft = pytest.importorskip("peft")

G = 4


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def lora(**overrides):
    values = {
        "r": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.1,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    }
    values.update(overrides)
    return peft.LoraConfig(**values)


def scripted_rollout_func(tok):
    """The same completions for a prompt every time (a step's rollouts do not depend on the weights)."""
    eos = tok.eos_token_id

    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            ids = tok(p)["input_ids"]
            for k in range(G):
                completion = [5 + k, 6 + (k * 3) % 7, 9 + len(p) % 5, eos]
                out["prompt_ids"].append(ids)
                out["completion_ids"].append(completion)
                out["logprobs"].append([-5.0] * len(completion))
        return out

    return rollout_func


def prefers_token(token):
    def reward(completion_ids, **kwargs):
        return [float(sum(t == token for t in ids)) for ids in completion_ids]

    reward.__name__ = f"count_{token}"
    return reward


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def config(tmp_path, name, **overrides):
    values = {"per_device_train_batch_size": 8, "num_generations": G, "max_steps": 3, "learning_rate": 5e-2}
    values.update(overrides)
    return make_config(tmp_path / name, **values)


def adapter_weights(model, name):
    """The adapter's tensors by their adapter-free key (as a lone ``default`` adapter names them)."""
    return {
        key: value.detach().clone()
        for key, value in peft.get_peft_model_state_dict(model, adapter_name=name).items()
    }


def lone_run(tmp_path, tok, name, reward, peft_config, **overrides):
    """The same run trained alone: set_seed(seed), then GRPOTrainer(peft_config=...)."""
    extra = {"rollout_func": overrides.pop("rollout_func")} if "rollout_func" in overrides else {}
    args = config(tmp_path / "alone", name, **overrides)
    base = build_tiny_model(tok)
    set_seed(args.seed)
    trainer = GRPOTrainer(
        model=base,
        reward_funcs=reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
        peft_config=peft_config,
        **extra,
    )
    trainer.train()
    return trainer, adapter_weights(trainer.model, "default")


def assert_same_weights(got, want, atol=1e-6):
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(
            got[key], want[key], rtol=0, atol=atol, msg=lambda m, key=key: f"{key}: {m}"
        )


def test_scripted_rollouts_each_run_equals_the_same_run_trained_alone(tmp_path, tok):
    rollout = scripted_rollout_func(tok)
    specs = [
        ("run-a", prefers_token(5), {"learning_rate": 5e-2, "seed": 1}),
        ("run-b", prefers_token(6), {"learning_rate": 2e-2, "seed": 2, "beta": 0.1}),
    ]
    runs = [
        SweepRun(
            name,
            config(tmp_path, name, **values),
            reward_funcs=reward,
            train_dataset=standard_dataset(),
            trainer_kwargs={"rollout_func": rollout},
        )
        for name, reward, values in specs
    ]
    sweep = GRPOSweep(build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok)
    outcomes = sweep.train()
    assert [o.status for o in outcomes.values()] == ["finished", "finished"]
    for name, reward, values in specs:
        _, alone = lone_run(tmp_path, tok, name, reward, lora(), rollout_func=rollout, **values)
        assert_same_weights(adapter_weights(sweep.model, name), alone)


def test_sampled_runs_with_their_own_rewards_each_equal_the_run_trained_alone(tmp_path, tok):
    """With sampling, each run's draws, rewards, logs and weights are its own: no leakage across runs."""
    specs = [
        ("tok5", prefers_token(5), {"seed": 3}),
        ("tok6", prefers_token(6), {"seed": 4, "learning_rate": 2e-2}),
    ]
    runs = [
        SweepRun(
            name,
            config(tmp_path, name, logging_steps=1, **values),
            reward_funcs=reward,
            train_dataset=standard_dataset(),
        )
        for name, reward, values in specs
    ]
    sweep = GRPOSweep(build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok)
    sweep.train()
    for name, reward, values in specs:
        trainer = sweep.trainers[name]
        alone, weights = lone_run(tmp_path, tok, name, reward, lora(), logging_steps=1, **values)
        assert_same_weights(adapter_weights(sweep.model, name), weights)
        logged = [entry for entry in trainer.state.log_history if "reward" in entry]
        assert logged == [entry for entry in alone.state.log_history if "reward" in entry] or _close_logs(
            logged, [entry for entry in alone.state.log_history if "reward" in entry]
        )
        assert all(f"rewards/{reward.__name__}/mean" in entry for entry in logged)
        other = "count_6" if name == "tok5" else "count_5"
        assert not any(f"rewards/{other}/mean" in entry for entry in logged)


def _close_logs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            if key in ("step_time",) or "runtime" in key or "per_second" in key:
                continue
            assert x[key] == pytest.approx(y[key], rel=1e-5, abs=1e-7), key
    return True


def test_a_run_that_raises_stops_alone(tmp_path, tok):
    def breaks_at_second_call(completion_ids, **kwargs):
        breaks_at_second_call.calls += 1
        if breaks_at_second_call.calls == 2:
            raise RuntimeError("reward server unreachable")
        return [0.0] * len(completion_ids)

    breaks_at_second_call.calls = 0
    runs = [
        SweepRun(
            "steady", config(tmp_path, "x"), reward_funcs=prefers_token(5), train_dataset=standard_dataset()
        ),
        SweepRun(
            "broken",
            config(tmp_path, "y"),
            reward_funcs=breaks_at_second_call,
            train_dataset=standard_dataset(),
        ),
    ]
    sweep = GRPOSweep(
        build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok, output_dir=str(tmp_path / "sw")
    )
    outcomes = sweep.train()
    assert outcomes["steady"].status == "finished" and outcomes["steady"].global_step == 3
    assert outcomes["broken"].status == "failed" and outcomes["broken"].global_step == 1
    assert "reward server unreachable" in outcomes["broken"].error
    assert "reward server unreachable" in (tmp_path / "sw" / "broken" / "error.txt").read_text()
    summary = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [(r["name"], r["status"], r["output_dir"]) for r in summary["runs"]] == [
        ("steady", "finished", "steady"),
        ("broken", "failed", "broken"),
    ]
    # the steady run saved only its own adapter, loadable as a lone one
    saved = tmp_path / "sw" / "steady"
    assert sorted(p.name for p in saved.iterdir() if p.name.startswith("adapter_")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    loaded = peft.PeftModel.from_pretrained(build_tiny_model(tok), str(saved))
    assert_same_weights(adapter_weights(loaded, "default"), adapter_weights(sweep.model, "steady"), atol=0)


def test_resuming_a_sweep_equals_the_uninterrupted_sweep(tmp_path, tok):
    def sweep_of(folder, max_steps):
        runs = [
            SweepRun(
                name,
                config(
                    tmp_path,
                    name,
                    max_steps=max_steps,
                    save_strategy="steps",
                    save_steps=1,
                    seed=seed,
                    lr_scheduler_type="constant",
                ),
                reward_funcs=prefers_token(token),
                train_dataset=standard_dataset(),
            )
            for name, token, seed in [("p", 5, 1), ("q", 6, 2)]
        ]
        return GRPOSweep(
            build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok, output_dir=str(folder)
        )

    whole = sweep_of(tmp_path / "whole", 3)
    whole.train()
    sweep_of(tmp_path / "cut", 2).train()
    assert (tmp_path / "cut" / "q" / "checkpoint-2").is_dir()
    resumed = sweep_of(tmp_path / "cut", 3)
    outcomes = resumed.train(resume_from_checkpoint=True)
    assert {name: o.global_step for name, o in outcomes.items()} == {"p": 3, "q": 3}
    for name in ("p", "q"):
        assert_same_weights(adapter_weights(resumed.model, name), adapter_weights(whole.model, name), atol=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"names": ["same", "same"]}, "repeated"),
        ({"names": ["a.b", "c"]}, "not usable"),
        ({"second": {"gradient_checkpointing": True}}, "differ in gradient_checkpointing"),
        ({"peft": None}, "no LoRA config"),
    ],
)
def test_a_sweep_that_cannot_run_is_refused_before_loading(tmp_path, tok, change, message):
    names = change.get("names", ["one", "two"])
    runs = [
        SweepRun(names[0], config(tmp_path, "one"), reward_funcs=prefers_token(5)),
        SweepRun(
            names[1], config(tmp_path, "two", **change.get("second", {})), reward_funcs=prefers_token(5)
        ),
    ]
    with pytest.raises(ValueError, match=message):
        GRPOSweep(
            "this-model-is-never-loaded",
            runs,
            peft_config=change.get("peft", lora()),
            processing_class=tok,
            output_dir=str(tmp_path / "sw"),
        )


def test_use_vllm_in_a_sweep_is_not_built_yet(tmp_path, tok):
    runs = [SweepRun("one", config(tmp_path, "one", use_vllm=True), reward_funcs=prefers_token(5))]
    with pytest.raises(NotImplementedError, match="use_vllm"):
        GRPOSweep("this-model-is-never-loaded", runs, peft_config=lora(), processing_class=tok)


def write_sweep_file(path, model_dir, runs=None, **extra):
    import yaml

    spec = {
        "output_dir": str(path.parent / "sweep-out"),
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "shared": {
            "model_name_or_path": model_dir,
            "max_steps": 2,
            "per_device_train_batch_size": 4,
            "num_generations": 4,
            "max_completion_length": 8,
            "task_size": 40,
            "dynamic_sampling": False,
            "save_strategy": "no",
            "use_cpu": True,
            "report_to": "none",
        },
        "runs": runs
        if runs is not None
        else {"slow": {"learning_rate": 1e-3}, "fast": {"learning_rate": 1e-1, "seed": 1}},
        **extra,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_posttrain_sweep_trains_each_run_and_the_report_compares_them(tmp_path, tiny_model_dir, capsys):
    from posttrain.cli.main import main

    sweep_file = write_sweep_file(tmp_path / "sweep.yaml", tiny_model_dir)
    main(["sweep", str(sweep_file)])
    out = capsys.readouterr().out
    folder = tmp_path / "sweep-out"
    summary = json.loads((folder / "sweep.json").read_text())
    assert [(r["name"], r["status"], r["global_step"]) for r in summary["runs"]] == [
        ("slow", "finished", 2),
        ("fast", "finished", 2),
    ]
    for name in ("slow", "fast"):
        assert f"[{name}] step 1/2" in out and f"[{name}] step 2/2" in out
        assert f"posttrain sweep [{name}]: held-out accuracy" in out
        logged = [json.loads(line) for line in (folder / name / "log.jsonl").read_text().splitlines()]
        assert [entry["step"] for entry in logged if "reward" in entry] == [1, 2]
        accuracy = json.loads((folder / name / "accuracy.json").read_text())
        assert set(accuracy) == {"before", "after"}
        assert (folder / name / "adapter_model.safetensors").is_file()
    rates = {
        name: json.loads((folder / name / "log.jsonl").read_text().splitlines()[0])["learning_rate"]
        for name in ("slow", "fast")
    }
    assert rates["fast"] > 10 * rates["slow"]
    main(["report", str(folder)])
    page = (folder / "report.html").read_text()
    assert page.count("<img") >= 2 and "slow" in page and "fast" in page and "finished" in page


@pytest.mark.parametrize(
    ("runs", "extra", "message"),
    [
        ({"a1": {"learning_rate": 1e-3, "model_name_or_path": "x"}}, {}, "every run shares"),
        ({"a1": {"learnin_rate": 1e-3}}, {}, "did you mean learning_rate"),
        ({"a1": {}}, {"shard": {}}, "unknown keys"),
        ({}, {}, "needs 'runs'"),
    ],
)
def test_a_bad_sweep_file_is_named_before_training(tmp_path, tiny_model_dir, capsys, runs, extra, message):
    from posttrain.cli.main import main

    sweep_file = write_sweep_file(tmp_path / "sweep.yaml", tiny_model_dir, runs=runs, **extra)
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", str(sweep_file)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_shipped_sweep_recipe_parses_into_grpo_runs():
    """recipes/sweeps/lora-rates.yaml: its runs' flags are posttrain grpo's, checked without loading the model."""
    from pathlib import Path

    from posttrain import GRPOConfig
    from posttrain.cli.grpo import LAPTOP_DEFAULTS
    from posttrain.cli.online import OnlineScriptArguments
    from posttrain.cli.options import parse_config
    from posttrain.cli.sweep import read_sweep_file

    spec = read_sweep_file(
        str(Path(__file__).resolve().parent.parent / "recipes" / "sweeps" / "lora-rates.yaml")
    )
    assert len(spec["runs"]) == 4
    for flags in spec["runs"].values():
        _, config = parse_config(
            [],
            OnlineScriptArguments,
            GRPOConfig,
            command="grpo",
            summary="",
            defaults=LAPTOP_DEFAULTS,
            values={**spec["shared"], **flags},
        )
        assert config.learning_rate == flags["learning_rate"] and config.max_steps == 40
