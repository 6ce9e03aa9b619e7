"""vLLM generation (use_vllm=True), tested up to the engine call with a stand-in ``vllm`` module.

vLLM needs a CUDA GPU; here ``tests/vllm_standin.py`` takes its place in ``sys.modules``. What
these tests show: the engine is built with the config's options, the prompts and sampling
parameters reach it under vLLM's names, each generation after an optimizer step runs on the
trainer's current weights (colocated: loaded in process, with sleep mode's wake/load/sleep order;
server: the weight-transfer engine's ``send_weights``), the sampler's log-probs reach the
importance-sampling correction, and bad settings fail before training.
"""

from __future__ import annotations

import math

import pytest
import torch
import vllm_standin
from conftest import build_tiny_tokenizer
from helpers import make_config, standard_dataset
from test_invariance import token_sum_reward
from transformers import AutoModelForCausalLM

from posttrain import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer
from posttrain.generation import vllm_backend
from posttrain.generation.base import build_rollout


@pytest.fixture
def standin(monkeypatch):
    """The stand-in ``vllm`` package, and a clean record of its engines. The variables the
    colocated engine sets for vLLM's launcher (``RANK``, ``WORLD_SIZE``, ...) are undone after
    the test, so later tests do not see a distributed environment."""
    import os

    for name, module in vllm_standin.install().items():
        monkeypatch.setitem(__import__("sys").modules, name, module)
    vllm_standin.LLM.instances.clear()
    vllm_standin.WeightTransferTrainerFactory.engines.clear()
    saved = dict(os.environ)
    yield vllm_standin
    os.environ.clear()
    os.environ.update(saved)


def _trainer(tmp_path, model_dir, trainer_cls=GRPOTrainer, config_cls=GRPOConfig, **overrides):
    tok = build_tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = make_config(tmp_path, use_vllm=True, temperature=0.9, **overrides)
    values = {f: getattr(base, f) for f in ("output_dir", "per_device_train_batch_size", "max_steps", "learning_rate",
                                            "use_cpu", "report_to", "save_strategy", "disable_tqdm", "logging_steps",
                                            "gradient_checkpointing", "num_generations", "max_completion_length",
                                            "use_vllm", "temperature", "bf16")}  # fmt: skip
    values.update(overrides)
    args = config_cls(**values)
    return trainer_cls(
        model=model,
        reward_funcs=token_sum_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


def _same_weights(engine_model: torch.nn.Module, model: torch.nn.Module) -> bool:
    engine = dict(engine_model.named_parameters())
    return all(torch.equal(engine[n], p.detach()) for n, p in model.named_parameters())


def _check_each_generation_sees_the_trainers_weights(monkeypatch, trainer, engine) -> list[bool]:
    seen: list[bool] = []
    generate = engine.generate

    def checked(*args, **kwargs):
        seen.append(_same_weights(engine.engine_model.model, trainer.accelerator.unwrap_model(trainer.model)))
        return generate(*args, **kwargs)

    monkeypatch.setattr(engine, "generate", checked)
    return seen


def test_sampling_kwargs_use_vllms_names(tmp_path) -> None:
    args = make_config(tmp_path, temperature=0.7, top_p=0.9, top_k=5, min_p=None, repetition_penalty=1.1,
                       max_completion_length=12, generation_kwargs={"seed": 3})  # fmt: skip
    kwargs = vllm_backend.sampling_kwargs(args, extra_stop_ids=[7])
    assert set(kwargs) <= set(vllm_standin.SAMPLING_FIELDS)
    assert kwargs == {
        "n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.0, "repetition_penalty": 1.1,
        "max_tokens": 12, "logprobs": 0, "detokenize": False, "stop_token_ids": [7], "seed": 3,
    }  # fmt: skip
    vllm_standin.SamplingParams(**kwargs)  # the real field names: no TypeError


def test_outputs_keep_each_rows_length_when_pad_is_eos(standin, tiny_model_dir) -> None:
    """A completion cut at max_tokens stays unterminated even though its padding is the EOS id."""
    eos = 5
    outputs = [
        standin.RequestOutput([1], [standin.CompletionOutput(0, [3, 4, eos], [{3: standin.Logprob(-0.1)},
                               {4: standin.Logprob(-0.2)}, {eos: standin.Logprob(-0.3)}], "stop")]),
        standin.RequestOutput([1], [standin.CompletionOutput(0, [3], [{3: standin.Logprob(-0.5)}], "length")]),
    ]  # fmt: skip
    samples = vllm_backend.samples_from_outputs(outputs, pad_token_id=eos, device="cpu")
    rollout = build_rollout(
        torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long), samples, [eos], eos
    )
    assert rollout.is_terminated.tolist() == [True, False]
    assert rollout.completion_mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.allclose(rollout.sampler_logps[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert rollout.sampler_logps[1, 0].item() == pytest.approx(-0.5)


def test_colocate_trains_on_the_trainers_weights(standin, tiny_model_dir, tmp_path, monkeypatch) -> None:
    trainer = _trainer(tmp_path, tiny_model_dir, vllm_gpu_memory_utilization=0.5, seed=7)
    (engine,) = standin.LLM.instances  # built with the trainer, before any step
    assert engine.kwargs["model"] == tiny_model_dir
    assert engine.kwargs["gpu_memory_utilization"] == 0.5
    assert engine.kwargs["distributed_executor_backend"] == "external_launcher"
    assert engine.kwargs["logprobs_mode"] == "processed_logprobs"
    assert engine.kwargs["seed"] == 7 and engine.kwargs["tensor_parallel_size"] == 1
    seen = _check_each_generation_sees_the_trainers_weights(monkeypatch, trainer, engine)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert seen == [True, True]  # two steps, two generations, each after the weights were loaded
    assert engine.engine_model.loads == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())  # it trained
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    assert len(logs) == 2
    # the engine sampled from the same float32 model: its log-probs are the trainer's
    assert all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in logs)
    assert all(math.isclose(h["sampling/importance_sampling_ratio/mean"], 1.0, abs_tol=1e-4) for h in logs)


def test_sleep_mode_wakes_loads_generates_and_sleeps(standin, tiny_model_dir, tmp_path) -> None:
    trainer = _trainer(tmp_path, tiny_model_dir, vllm_enable_sleep_mode=True, max_steps=1)
    (engine,) = standin.LLM.instances
    assert engine.calls == ["sleep(2)"]  # asleep until the first generation
    trainer.train()  # level 2 discarded the weights: without loading them again, sampling would fail
    assert engine.calls == [
        "sleep(2)", "wake_up(weights)", "apply_model", "reset_prefix_cache", "wake_up(kv_cache)", "generate(4)",
        "sleep(2)",
    ]  # fmt: skip


def test_server_mode_generates_and_sends_weights(standin, tiny_model_dir, tmp_path, monkeypatch) -> None:
    server = standin.StandInServer(tiny_model_dir)
    try:
        trainer = _trainer(
            tmp_path,
            tiny_model_dir,
            vllm_mode="server",
            vllm_server_base_url=server.base_url,
            vllm_group_port=51299,
        )
        seen = _check_each_generation_sees_the_trainers_weights(monkeypatch, trainer, server.engine)
        trainer.train()
    finally:
        server.close()
    assert seen == [True, True]
    (sync,) = standin.WeightTransferTrainerFactory.engines
    assert sync.sends == 2
    assert (sync.info.master_address, sync.info.master_port, sync.info.world_size, sync.info.rank) == (
        "127.0.0.1", 51299, 2, 0,
    )  # fmt: skip
    request = server.requests[0]
    assert request["model"] == "served-model" and request["return_token_ids"] is True
    assert request["logprobs"] == 0 and request["max_tokens"] == 8 and len(request["prompt"]) == 4
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/max" in h]
    assert len(logs) == 2 and all(h["sampling/sampling_logp_difference/max"] < 1e-4 for h in logs)


def test_rloo_generates_with_vllm(standin, tiny_model_dir, tmp_path) -> None:
    trainer = _trainer(tmp_path, tiny_model_dir, trainer_cls=RLOOTrainer, config_cls=RLOOConfig, max_steps=1)
    trainer.train()
    (engine,) = standin.LLM.instances
    assert engine.calls.count("generate(4)") == 1 and engine.engine_model.loads == 1


def test_unreachable_server_fails_before_training(standin, tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ConnectionError, match=r"127\.0\.0\.1:9.*vllm_server_timeout=0\.5"):
        _trainer(tmp_path, tiny_model_dir, vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port=9,
                 vllm_server_timeout=0.5)  # fmt: skip


def test_missing_vllm_names_the_extra(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # import vllm -> ImportError
    with pytest.raises(ImportError, match=r"posttrain\[vllm\]"):
        _trainer(tmp_path, tiny_model_dir)


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_gpu_memory_utilization_outside_0_1_is_refused(tmp_path, value) -> None:
    with pytest.raises(ValueError, match="vllm_gpu_memory_utilization"):
        make_config(tmp_path, vllm_gpu_memory_utilization=value)


def test_tensor_parallel_must_divide_the_processes(standin, tiny_model_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="vllm_tensor_parallel_size=2 does not divide the 1 training"):
        _trainer(tmp_path, tiny_model_dir, vllm_tensor_parallel_size=2)


def test_tensor_parallel_rows_are_sliced_back() -> None:
    assert vllm_backend.tensor_parallel_slice([4, 4], 1) == slice(4, 8)
    assert vllm_backend.tensor_parallel_slice([3, 5, 2], 2) == slice(8, 10)


def test_trainers_that_do_not_generate_through_the_shared_sampler_still_refuse(tmp_path) -> None:
    from posttrain import DistillationConfig, GKDConfig

    for config in (DistillationConfig, GKDConfig):
        with pytest.raises(NotImplementedError, match="use_vllm"):
            config(output_dir=str(tmp_path), use_vllm=True)


def test_a2po_stage_1_samples_the_reference_and_stage_2_the_policy(
    standin, tiny_model_dir, tmp_path, monkeypatch
):
    from test_a2po import odd_sum

    from posttrain import A2POConfig, A2POTrainer

    args = A2POConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, num_value_samples=2,
        max_steps=1, use_vllm=True, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=1e-2,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = A2POTrainer(model=model, reward_funcs=odd_sum, args=args, train_dataset=standard_dataset(),
                          processing_class=build_tiny_tokenizer())  # fmt: skip
    with torch.no_grad():  # the policy leaves its reference before training, so the two differ
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    (engine,) = standin.LLM.instances
    reference, policy = _digest(trainer.ref_model), _digest(trainer.model)
    served: list[str] = []
    generate = engine.generate

    def record(*a, **k):
        served.append(_digest(engine.engine_model.model))
        return generate(*a, **k)

    monkeypatch.setattr(engine, "generate", record)
    trainer.train()
    assert reference != policy
    # stage 1's value samples from the reference's weights, then stage 2's one completion per prompt
    assert len(served) >= 2 and set(served[:-1]) == {reference} and served[-1] == policy


def test_online_dpo_generates_its_pairs_with_vllm(standin, tiny_model_dir, tmp_path) -> None:
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_new_tokens=8, max_steps=1, use_vllm=True,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    trainer = OnlineDPOTrainer(
        model=model, reward_funcs=token_sum_reward, args=args, train_dataset=standard_dataset(),
        processing_class=build_tiny_tokenizer(),
    )  # fmt: skip
    trainer.train()
    (engine,) = standin.LLM.instances
    assert engine.calls.count("generate(4)") == 1  # 2 prompts x 2 completions
    assert any("rewards/margins" in h for h in trainer.state.log_history)


def test_peft_weights_go_out_merged_under_the_base_names(tiny_model_dir) -> None:
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [n for n, _ in base.named_parameters()]
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    )
    with vllm_backend.merged_adapters(model) as merged:
        items = dict(vllm_backend.weight_items(merged))
        q = items["model.layers.0.self_attn.q_proj.weight"].clone()
    assert list(items) == names
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    assert torch.allclose(q, layer.base_layer.weight + delta, atol=1e-6)  # merged in
    assert not torch.allclose(layer.base_layer.weight, q)  # and unmerged again after the block


def test_vllm_serve_command_has_what_server_mode_needs() -> None:
    from posttrain.cli.vllm_serve import serve_command

    command, env = serve_command(
        ["--model", "m", "--port", "8123", "--tensor_parallel_size", "2", "--enforce-eager"]
    )
    assert command[:3] == ["vllm", "serve", "m"] and env == {"VLLM_SERVER_DEV_MODE": "1"}
    joined = " ".join(command)
    assert '--weight-transfer-config {"backend": "nccl"}' in joined
    assert "--logprobs-mode processed_logprobs --max-logprobs -1" in joined
    assert "--port 8123" in joined and "--tensor-parallel-size 2" in joined
    assert command[-1] == "--enforce-eager"  # unknown flags go to vllm serve unchanged


def test_vllm_serve_without_vllm_names_the_extra(monkeypatch) -> None:
    import contextlib
    import io

    import posttrain.cli.vllm_serve as serve
    from posttrain.cli.main import main

    monkeypatch.setattr(serve.shutil, "which", lambda name: None)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(["vllm-serve", "--model", "m"])
    assert exit_info.value.code == 2
    assert 'pip install "posttrain[vllm]"' in err.getvalue()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        main(["vllm-serve", "--model", "m", "--gpu_memory_utilization", "1.5"])
    assert "--gpu_memory_utilization=1.5" in err.getvalue()


def test_reduced_precision_sampler_with_vllm_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="which use_vllm=True replaces"):
        make_config(tmp_path, use_vllm=True, sampler_precision="int8")


def test_repetition_penalty_with_the_correction_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="vLLM applies the penalty to the log-probs it returns"):
        make_config(tmp_path, use_vllm=True, repetition_penalty=1.2)
    make_config(tmp_path, use_vllm=True, repetition_penalty=1.2, vllm_importance_sampling_correction=False)


@pytest.mark.slow
def test_tensor_parallel_engines_share_the_groups_prompts(tmp_path, tiny_model_dir) -> None:
    """Two processes, one engine group of 2: each engine generates for both processes' prompts, the
    two engines agree, and each process trains on its own slice; the parameters stay identical."""
    import json
    from pathlib import Path

    from helpers import run_torchrun

    script = str(Path(__file__).parent / "scripts" / "vllm_tensor_parallel.py")
    proc = run_torchrun(script, str(tmp_path), 29561, tiny_model_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["calls"] == ["generate(8)", "generate(8)"]  # the group's 2 x 4 prompts per step
    assert ranks[0]["made"] == ranks[1]["made"]  # same seed, weights and prompts: the engines agree
    for r, rank in enumerate(ranks):
        for made, seen in zip(rank["made"], rank["seen"], strict=True):
            assert [ids[: len(s)] for ids, s in zip(made[4 * r : 4 * r + 4], seen, strict=True)] == seen
    assert ranks[0]["params"] == ranks[1]["params"]


# ---- asynchronous GRPO sampling through a vLLM server -------------------------------------------


def _digest(model: torch.nn.Module) -> str:
    import hashlib

    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().float().numpy().tobytes())
    return h.hexdigest()


def _async_config(tmp_path, **overrides):
    from posttrain import AsyncGRPOConfig

    values = {
        "output_dir": str(tmp_path), "per_device_train_batch_size": 4, "num_generations": 4, "max_steps": 4,
        "learning_rate": 1e-2, "bf16": False, "use_cpu": True, "report_to": "none", "save_strategy": "no",
        "disable_tqdm": True, "logging_steps": 1, "max_completion_length": 8, "num_sampler_logprobs": 3,
        "max_staleness": 1,
    }  # fmt: skip
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def test_async_grpo_samples_batch_k_from_the_server_with_step_k_minus_staleness_weights(
    standin, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    from transformers import TrainerCallback

    from posttrain import AsyncGRPOTrainer

    server = standin.StandInServer(tiny_model_dir)
    try:
        args = _async_config(
            tmp_path,
            use_vllm=True,
            vllm_mode="server",
            vllm_server_base_url=server.base_url,
            request_timeout=60,
        )
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        trainer = AsyncGRPOTrainer(
            model, token_sum_reward, args, standard_dataset(), processing_class=build_tiny_tokenizer()
        )
        versions = [_digest(trainer.model)]  # version k: the weights after k optimizer steps

        class Record(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                versions.append(_digest(trainer.model))

        trainer.add_callback(Record())
        served: list[str] = []
        generate = server.engine.generate

        def record(*a, **k):
            served.append(_digest(server.engine.engine_model.model))
            return generate(*a, **k)

        monkeypatch.setattr(server.engine, "generate", record)
        trainer.train()
    finally:
        server.close()
    assert len(served) == 4 and len(set(versions)) == 5  # every step moved the weights
    # batch k came from the server holding the weights of step max(0, k - 1), exactly
    assert served == [versions[max(0, k - 1)] for k in range(4)]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["batch/sampler_version"] for h in logs] == [0.0, 0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param({"use_vllm": True}, "set vllm_mode='server'", id="colocate"),
        pytest.param({"vllm_server_base_url": "http://10.0.0.1:8000"}, "only apply to sampling from a vLLM server",
                     id="url_without_vllm"),
        pytest.param({"request_timeout": 30}, "request_timeout=30 only apply", id="timeout_without_vllm"),
    ],
)  # fmt: skip
def test_async_grpo_vllm_settings_that_cannot_work_are_refused(tmp_path, overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        _async_config(tmp_path, **overrides)


def test_async_grpo_with_vllm_refuses_an_eval_dataset(standin, tiny_model_dir, tmp_path) -> None:
    from posttrain import AsyncGRPOTrainer

    args = _async_config(tmp_path, use_vllm=True, vllm_mode="server", eval_strategy="steps", eval_steps=1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match="one training process without an eval_dataset"):
        AsyncGRPOTrainer(model, token_sum_reward, args, standard_dataset(), standard_dataset(),
                         processing_class=build_tiny_tokenizer())  # fmt: skip
