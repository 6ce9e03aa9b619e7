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
    sweep = GRPOSweep(
        build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok, shared_generation=False
    )
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


def test_each_run_releases_its_threads_openmp_team_when_it_hands_over(tmp_path, tok, monkeypatch):
    """Each run trains in its own thread, and a docked OpenMP team per thread made every run's
    steps slower (ops/threads.py): the setup's thread releases its team before the runs start,
    and each run releases its own at the end of every turn, in its own thread."""
    import threading

    from posttrain.sweep import runner

    released = []
    monkeypatch.setattr(
        runner, "release_thread_pool", lambda: released.append(threading.current_thread().name) or True
    )
    runs = [
        SweepRun(
            name,
            config(tmp_path, name, max_steps=2),
            reward_funcs=length_reward,
            train_dataset=standard_dataset(),
        )
        for name in ("run-a", "run-b")
    ]
    sweep = GRPOSweep(build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok)
    sweep.train()
    assert released == [threading.main_thread().name] + ["posttrain-sweep-run-a", "posttrain-sweep-run-b"] * 2


def bf16_runs(tmp_path, monkeypatch):
    """Two runs of 2 steps with ``bf16=True`` on a (pretended) CPU with bf16 instructions."""
    from posttrain.generation import reduced_kernels

    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    return [
        SweepRun(
            name,
            config(tmp_path, name, max_steps=2, bf16=True),
            reward_funcs=length_reward,
            train_dataset=standard_dataset(),
        )  # fmt: skip
        for name in ("run-a", "run-b")
    ]


def test_bf16_runs_share_one_sampler_copy_and_one_set_of_scratch_buffers(tmp_path, tok, monkeypatch):
    """Under bf16 on a bf16 CPU each run samples from a bf16 copy with its adapter merged in. The
    runs share one copy, rebuilt at every turn (the other run's step changed the weights), and
    one set of scratch buffers: only the run holding the turn computes."""
    from posttrain.ops import workspace

    runs = bf16_runs(tmp_path, monkeypatch)
    sweep = GRPOSweep(build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok)
    copies = {id(trainer.generator.reduced) for trainer in sweep.trainers.values()}
    assert len(copies) == 1 and sweep.trainers["run-a"].generator.reduced is not None
    pools = []
    entered = sweep._enter
    monkeypatch.setattr(sweep, "_enter", lambda name: (entered(name), pools.append(id(workspace._pool()))))
    sweep.train()
    assert sweep.trainers["run-a"].generator.reduced.refreshes == 4  # one per turn: 2 runs x 2 steps
    assert len(pools) == 4 and set(pools) == {id(sweep._scratch)}  # each turn, in each run's thread
    for trainer in sweep.trainers.values():
        logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in e]
        assert len(logged) == 2 and all(e["sampling/sampling_logp_difference/mean"] < 0.1 for e in logged)


def test_bf16_shared_generation_samples_every_run_from_one_bf16_copy_of_the_base(tmp_path, tok, monkeypatch):
    """With shared generation under bf16 on a bf16 CPU, each round's one call samples every run
    from one bf16 copy of the base plus each run's LoRA terms (one build per call), and each run's
    importance-sampling correction gets the call's sampler log-probs for its own rows."""
    runs = bf16_runs(tmp_path, monkeypatch)
    sweep = GRPOSweep(
        build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok, shared_generation=True
    )
    outcomes = sweep.train()
    assert [o.status for o in outcomes.values()] == ["finished", "finished"]
    assert sweep.generation.calls == 2 and sweep.generation.rows == 2 * 2 * 8
    assert sweep.trainers["run-a"].generator.reduced.refreshes == 2  # one build per shared call
    for trainer in sweep.trainers.values():
        logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in e]
        assert len(logged) == 2 and all(e["sampling/sampling_logp_difference/mean"] < 0.1 for e in logged)


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


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"vllm_enable_sleep_mode": True}, NotImplementedError, "shared engine stays awake"),
        ({"vllm_lora_sync": False}, ValueError, "vllm_lora_sync=False: the runs share one vLLM engine"),
    ],
)
def test_what_one_shared_vllm_engine_cannot_do_is_refused_before_the_model_loads(
    tmp_path, tok, overrides, error, message, monkeypatch
):
    """A sweep's runs share one engine, each run's adapter served alone: sleep mode (it would drop
    the adapters between turns) and merged pushes are refused at once."""
    from posttrain.generation import vllm_backend

    # a platform with sleep mode (vLLM's CPU build, where CI's second environment runs this, has none
    # and its config refuses it first: errors.md C119)
    monkeypatch.setattr(vllm_backend, "sleep_mode_refusal", lambda: None)
    args = config(tmp_path, "one", use_vllm=True, **overrides)
    runs = [SweepRun("one", args, reward_funcs=prefers_token(5))]
    with pytest.raises(error, match=message):
        GRPOSweep("this-model-is-never-loaded", runs, peft_config=lora(), processing_class=tok)


def test_runs_of_a_sweep_agree_on_use_vllm_and_the_engine_settings(tmp_path, tok):
    for field, mine, theirs in [("use_vllm", True, False), ("vllm_gpu_memory_utilization", 0.3, 0.2)]:
        one = config(tmp_path, "one", **{"use_vllm": True, field: mine})
        two = config(tmp_path, "two", **{"use_vllm": True, field: theirs})
        runs = [
            SweepRun("one", one, reward_funcs=prefers_token(5)),
            SweepRun("two", two, reward_funcs=prefers_token(6)),
        ]
        with pytest.raises(ValueError, match=f"differ in {field}"):
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


@pytest.mark.parametrize("host_bf16", [True, False])
def test_sweep_runs_take_posttrain_grpos_cpu_precision(
    tmp_path, tiny_model_dir, monkeypatch, capsys, host_bf16
):
    """Each run starts from `posttrain grpo`'s no-argument settings, its CPU precision included:
    bf16 on a GPU-less host with bf16 instructions (the separate runs a sweep replaces train so);
    a precision the file sets wins, for every run alike."""
    import torch
    import yaml

    from posttrain.cli.sweep import _build

    monkeypatch.setattr("posttrain.ops.precision.native_bf16", lambda: host_bf16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sweep_file = write_sweep_file(tmp_path / "sweep.yaml", tiny_model_dir)
    spec = yaml.safe_load(sweep_file.read_text())
    del spec["shared"]["use_cpu"]
    sweep_file.write_text(yaml.safe_dump(spec))
    built, _ = _build(str(sweep_file), None)
    assert {(t.args.bf16, t.args.use_cpu) for t in built.trainers.values()} == {(host_bf16, host_bf16)}
    assert ("posttrain sweep: training in bf16, since this CPU" in capsys.readouterr().out) is host_bf16
    spec["runs"]["fast"]["bf16"] = False  # one run's choice: no default for any run
    sweep_file.write_text(yaml.safe_dump(spec))
    built, _ = _build(str(sweep_file), None)
    assert {t.args.bf16 for t in built.trainers.values()} == {False}


@pytest.mark.parametrize(
    ("runs", "extra", "message"),
    [
        ({"a1": {"learning_rate": 1e-3, "model_name_or_path": "x"}}, {}, "every run shares"),
        ({"a1": {"learnin_rate": 1e-3}}, {}, "did you mean learning_rate"),
        ({"a1": {}}, {"shard": {}}, "unknown keys"),
        ({}, {}, "needs 'runs'"),
        ({"a1": {}}, {"shared_generation": "yes"}, "must be true or false"),
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


def two_adapters(tok, new_tokens, prompts=None):
    """A PEFT model with adapters "plain" and "skewed", a greedy config, a batch of prompts for each
    (``prompts``: {adapter: texts}), and each adapter's own completions (sampled alone)."""
    if tok.pad_token is None:  # as a trainer sets it
        tok.pad_token = tok.eos_token
    from transformers import GenerationConfig

    from posttrain.generation.transformers_backend import TransformersGenerator

    model = peft.get_peft_model(build_tiny_model(tok), lora(lora_dropout=0.0), adapter_name="plain")
    model.add_adapter("skewed", lora(lora_dropout=0.0))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B.skewed" in name:
                param.normal_(0, 2.0)  # an adapter that changes the greedy completions
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, pad_token_id=tok.pad_token_id or 0, eos_token_id=None
    )
    prompts = prompts or {
        "plain": ["Question 1: what is", "one two three four five"],
        "skewed": ["The sky is", "Write a short story about a cat"],
    }
    encoded = {name: tok(texts, return_tensors="pt", padding=True) for name, texts in prompts.items()}
    alone = {}
    for name, batch in encoded.items():
        model.set_adapter(name)
        alone[name] = TransformersGenerator(lambda: model, config).generate(
            batch["input_ids"], batch["attention_mask"]
        )
    assert not torch.equal(alone["plain"].completion_ids, alone["skewed"].completion_ids)
    return model, config, encoded, alone


def serve_shared(model, config, encoded, precision="float32"):
    """One shared call for both adapters' requests; the requests, served."""
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.sweep.generation import Request, SharedGeneration

    shared = SharedGeneration(hand_over=lambda name: None)
    requests = []
    for name, batch in encoded.items():
        generator = TransformersGenerator(lambda: model, config)
        generator.set_sampler_precision(precision, asked=False)
        requests.append(Request(name, generator, batch["input_ids"], batch["attention_mask"], None))
    shared.pending.extend(requests)
    shared.serve()
    assert shared.calls == 1 and shared.rows == sum(r.prompt_ids.shape[0] for r in requests)
    return requests


def assert_each_row_is_its_adapters(requests, alone):
    for request in requests:
        want = alone[request.name].completion_ids
        got = request.result.completion_ids[:, : want.shape[1]]
        assert torch.equal(got, want), request.name


@pytest.mark.parametrize("new_tokens", [6, 40])
def test_one_shared_call_samples_each_row_with_its_own_runs_adapter(tok, new_tokens):
    """The shared call's rows of each run equal that run's adapter sampling alone (greedy: no draws).

    40 new tokens repay packing the weights: the shared call then runs the fused step with each
    row block's low-rank terms; 6 run the model's own modules with peft's mixed-adapter batches.
    """
    model, config, encoded, alone = two_adapters(tok, new_tokens)
    requests = serve_shared(model, config, encoded)
    fused = requests[0].generator.path.fused_blocker
    assert (fused is None) == (new_tokens >= 32), fused
    assert_each_row_is_its_adapters(requests, alone)


def test_a_shared_call_prefills_each_prompt_once_per_adapter(tok, monkeypatch):
    """GRPO groups: each run's prompt repeated, and both runs on the same prompt. The prompts'
    forward runs one row per distinct (prompt, adapter), each through its adapter: the same
    prompt under two adapters has two caches, and every row still equals its adapter's own."""
    from posttrain.generation import transformers_backend

    group = ["Question 1: what is"] * 3
    model, config, encoded, alone = two_adapters(tok, 40, {"plain": group, "skewed": group})
    prefilled = []
    own = transformers_backend.prefill_shared_prefix
    monkeypatch.setattr(
        transformers_backend,
        "prefill_shared_prefix",
        lambda m, groups: prefilled.append(groups.num_unique) or own(m, groups),
    )
    requests = serve_shared(model, config, encoded)
    assert prefilled == [2]
    assert requests[0].generator.path.taken == "lean+shared_prefix"
    assert_each_row_is_its_adapters(requests, alone)


def teacher_forced_logps(model, adapter, request):
    """The float32 log-probs of a request's completion tokens under ``adapter``: [N, T]."""
    completion = request.result.completion_ids
    ids = torch.cat([request.prompt_ids, completion], dim=1)
    mask = torch.cat([request.prompt_mask, torch.ones_like(completion)], dim=1)
    model.set_adapter(adapter)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, request.prompt_ids.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1).gather(2, completion[..., None])[..., 0]


def test_a_shared_call_under_bf16_samples_from_the_bf16_base_with_each_rows_adapter_terms(tok, monkeypatch):
    """Under bf16 training on a bf16 CPU a lone run samples from a bf16 copy with its adapter merged
    in. A shared call of several runs samples from one bf16 copy of the base weights, each row
    block adding its own adapter's low-rank terms, and returns the sampler's log-probs: they match
    the float32 policy under the row's own adapter (bf16 rounding), not the other adapter."""
    from posttrain.generation import reduced_kernels

    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    model, config, encoded, _ = two_adapters(tok, 12)
    requests = serve_shared(model, config, encoded, precision="bf16")
    path = requests[0].generator.path
    assert path.reduced_blocker is None and path.fused_blocker is None, path.describe()
    for request in requests:
        other = "skewed" if request.name == "plain" else "plain"
        own_gap = (request.result.logps - teacher_forced_logps(model, request.name, request)).abs().mean()
        other_gap = (request.result.logps - teacher_forced_logps(model, other, request)).abs().mean()
        # measured: 7e-4 and 0.019 (the skewed adapter's large terms) against 0.37 and 0.34
        assert own_gap < 0.05 and other_gap > 5 * own_gap, (request.name, float(own_gap), float(other_gap))


def test_a_sweep_samples_all_its_runs_in_one_call_per_round(tmp_path, tok):
    specs = [
        ("tok5", prefers_token(5), {"seed": 3}),
        ("tok6", prefers_token(6), {"seed": 4, "temperature": 0.7}),
    ]
    runs = [
        SweepRun(
            name, config(tmp_path, name, **values), reward_funcs=reward, train_dataset=standard_dataset()
        )
        for name, reward, values in specs
    ]
    sweep = GRPOSweep(
        build_tiny_model(tok), runs, peft_config=lora(), processing_class=tok, shared_generation=True
    )
    calls = []
    for trainer in sweep.trainers.values():
        own = type(trainer.generator).generate
        type(trainer.generator).generate = lambda self, *a, _own=own, **k: (
            calls.append(a[0].shape[0]) or _own(self, *a, **k)
        )
        break
    try:
        outcomes = sweep.train()
    finally:
        type(sweep.trainers["tok5"].generator).generate = own
    assert [o.status for o in outcomes.values()] == ["finished", "finished"]
    # different temperatures: one call per run and round; the same settings share one call
    assert calls == [8, 8] * 3 and sweep.generation.calls == 6
    same = [
        SweepRun(
            name,
            config(tmp_path / "same", name, seed=seed),
            reward_funcs=prefers_token(5),
            train_dataset=standard_dataset(),
        )
        for name, seed in (("s1", 1), ("s2", 2))
    ]
    together = GRPOSweep(
        build_tiny_model(tok), same, peft_config=lora(), processing_class=tok, shared_generation=True
    )
    together.train()
    assert together.generation.calls == 3 and together.generation.rows == 3 * 16
    for name in ("s1", "s2"):
        logged = [e for e in together.trainers[name].state.log_history if "reward" in e]
        assert len(logged) == 3 and all("rewards/count_5/mean" in e for e in logged)


def test_a_shared_call_that_raises_fails_its_caller_and_the_others_are_served_next(tok):
    from transformers import GenerationConfig

    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.sweep.generation import Request, SharedGeneration

    class Broken(TransformersGenerator):
        def generate(self, *args, **kwargs):
            raise RuntimeError("out of memory while sampling")

    model = peft.get_peft_model(build_tiny_model(tok), lora(lora_dropout=0.0), adapter_name="one")
    model.add_adapter("two", lora(lora_dropout=0.0))
    config = GenerationConfig(
        do_sample=False, max_new_tokens=4, pad_token_id=0, eos_token_id=tok.eos_token_id
    )
    hot = GenerationConfig(
        do_sample=True, temperature=0.5, max_new_tokens=4, pad_token_id=0, eos_token_id=tok.eos_token_id
    )
    batch = tok(["Question 1: what is"], return_tensors="pt")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    requests = [
        Request("one", Broken(lambda: model, config), ids, mask, None),
        Request("two", TransformersGenerator(lambda: model, hot), ids, mask, None),
    ]
    shared = SharedGeneration(hand_over=lambda name: None)
    shared.pending.extend(requests)
    with pytest.raises(RuntimeError, match="out of memory"):
        shared.serve("one")
    assert shared.pending == [requests[1]]  # the caller's own request is dropped: its run fails
    shared.serve("two")
    assert requests[1].result is not None and requests[1].result.completion_ids.shape[0] == 1


def test_posttrain_grpo_use_peft_trains_and_saves_a_lora_adapter(tmp_path, tiny_model_dir):
    """`posttrain grpo --use_peft` with TRL's LoRA flags: only the adapter trains, and the folder holds it."""
    from posttrain.cli.main import main

    out = tmp_path / "lora-run"
    main(["grpo", "--model_name_or_path", tiny_model_dir, "--use_peft", "true", "--lora_r", "4",
          "--lora_target_modules", "q_proj", "v_proj", "--max_steps", "1", "--per_device_train_batch_size", "4",
          "--num_generations", "4", "--max_completion_length", "8", "--task_size", "40", "--evaluate", "false",
          "--dynamic_sampling", "false", "--use_cpu", "true", "--report_to", "none", "--output_dir", str(out),
          "--save_strategy", "no"])  # fmt: skip
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()


def test_lora_flags_without_use_peft_are_refused(tmp_path, tiny_model_dir, capsys):
    from posttrain.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["grpo", "--model_name_or_path", tiny_model_dir, "--lora_r", "8", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--lora_r describe a LoRA adapter" in capsys.readouterr().err


@pytest.mark.parametrize("shared_generation", [False, True])
def test_vision_language_runs_each_equal_the_run_trained_alone(tmp_path, shared_generation):
    """Runs on prompts with images (a Qwen2-VL base): each samples and trains with its own adapter
    and its rows' images, as it would alone (with shared generation, a call with image inputs is
    the run's own)."""
    from vision_models import build_qwen2_vl, image_dataset

    _, processor = build_qwen2_vl()
    specs = [
        ("five", prefers_token(5), {"seed": 3}),
        ("six", prefers_token(6), {"seed": 4, "learning_rate": 2e-2}),
    ]
    overrides = {"max_steps": 2, "per_device_train_batch_size": 4, "gradient_checkpointing": False}

    def run_config(root, name, values):
        return config(root, name, **overrides, **values)

    runs = [
        SweepRun(
            name, run_config(tmp_path, name, values), reward_funcs=reward, train_dataset=image_dataset(4)
        )
        for name, reward, values in specs
    ]
    sweep = GRPOSweep(
        build_qwen2_vl()[0], runs, peft_config=lora(target_modules=["q_proj", "v_proj"]), processing_class=processor,
        shared_generation=shared_generation,
    )  # fmt: skip
    sweep.train()
    for name, reward, values in specs:
        args = run_config(tmp_path / "alone", name, values)
        base = build_qwen2_vl()[0]  # before set_seed: the builder seeds the weights itself
        set_seed(args.seed)
        alone = GRPOTrainer(
            model=base, reward_funcs=reward, args=args, train_dataset=image_dataset(4),
            processing_class=processor, peft_config=lora(target_modules=["q_proj", "v_proj"]),
        )  # fmt: skip
        alone.train()
        assert_same_weights(adapter_weights(sweep.model, name), adapter_weights(alone.model, "default"))
