"""PEFT adapters (LoRA, DoRA) on the GRPO policy: only the adapter trains, the base is the KL reference."""

from __future__ import annotations

import gc
import math
import sys
import types

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer
from posttrain.models import reference as model_options
from posttrain.models.compat import model_checkpointing

peft = pytest.importorskip("peft")

# peft reads `is_gradient_checkpointing`, which transformers 5 deprecates; nothing to act on here
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "v_proj"]


def varied_reward(completion_ids, **kwargs):
    """Depends on the sampled tokens, so groups have spread and advantages are not all zero."""
    return [float(sum(ids) % 5) for ids in completion_ids]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def lora(**overrides):
    values = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "task_type": "CAUSAL_LM"}
    values.update(overrides)
    return peft.LoraConfig(**values)


def _trainer(tmp_path, tok, model=None, peft_config=None, **config):
    model = model if model is not None else build_tiny_model(tok)
    config.setdefault("learning_rate", 0.05)
    return GRPOTrainer(
        model=model,
        reward_funcs=varied_reward,
        args=make_config(tmp_path, **config),
        train_dataset=standard_dataset(),
        processing_class=tok,
        peft_config=peft_config,
    )


def _train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _adapter_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---- only the adapter trains -------------------------------------------------------------------


def test_lora_trains_only_the_adapter(tmp_path, tok):
    base = build_tiny_model(tok)
    base_before = _snapshot(base)
    # 32 tokens: enough for the fused decode step, which samples with the adapter merged in
    trainer = _trainer(tmp_path, tok, base, lora(), max_steps=2, max_completion_length=32)
    assert isinstance(trainer.model, peft.PeftModel)
    trainable = _adapter_names(trainer.model)
    assert trainable and all("lora_" in n for n in trainable)
    adapter_before = _snapshot(trainer.model)
    trainer.train()

    for name, p in base.named_parameters():  # the base module is the one inside the PeftModel
        if "lora_" not in name:
            assert torch.equal(p, base_before[name.replace(".base_layer", "")]), name
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(adapter_before[n], after[n]) for n in trainable)
    logs = _train_logs(trainer)
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert trainer.generator.path.fused_blocker is None, trainer.generator.path.describe()


def test_dora_trains_only_the_adapter(tmp_path, tok):
    base = build_tiny_model(tok)
    base_before = _snapshot(base)
    trainer = _trainer(tmp_path, tok, base, lora(use_dora=True), max_steps=2, beta=0.1)
    trainable = _adapter_names(trainer.model)
    assert any("lora_magnitude_vector" in n for n in trainable)
    adapter_before = _snapshot(trainer.model)
    trainer.train()

    for name, p in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_before[name.replace(".base_layer", "")]), name
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(adapter_before[n], after[n]) for n in trainable)
    logs = _train_logs(trainer)
    assert trainer.ref_model is None
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # DoRA starts as the base model too
    assert logs[1]["kl"] > 0.0


# ---- gradient checkpointing ---------------------------------------------------------------------


class _GradRecorder:
    """A callback keeping the adapter gradients of the first optimizer step."""

    def __init__(self):
        self.grads = None

    def hook(self, trainer):
        from transformers import TrainerCallback

        recorder = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if recorder.grads is None:
                    recorder.grads = {
                        n: p.grad.detach().clone()
                        for n, p in trainer.model.named_parameters()
                        if p.requires_grad and p.grad is not None
                    }

        trainer.add_callback(Callback())


def _first_step_grads(tmp_path, tok, checkpointing, **config):
    trainer = _trainer(
        tmp_path, tok, peft_config=lora(), max_steps=1, gradient_checkpointing=checkpointing, **config
    )
    recorder = _GradRecorder()
    recorder.hook(trainer)
    trainer.train()
    return trainer, recorder.grads


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradients_flow_through_checkpointed_layers(tmp_path, tok, reentrant):
    """Same adapter gradients with and without checkpointing (the reentrant kind needs input grads)."""
    trainer, with_ckpt = _first_step_grads(
        tmp_path / "on", tok, True, activation_checkpointing_kwargs={"use_reentrant": reentrant}
    )
    assert model_checkpointing(trainer.model.get_base_model())
    _, without = _first_step_grads(tmp_path / "off", tok, False)

    lora_b = [n for n in without if "lora_B" in n]
    assert lora_b and set(with_ckpt) == set(without)
    # LoRA B starts at zero, so A has no gradient at the first step; every B must have one
    assert all(with_ckpt[n].abs().sum() > 0 for n in lora_b)
    for name, grad in without.items():
        torch.testing.assert_close(with_ckpt[name], grad, rtol=1e-4, atol=1e-7)


def test_gradient_checkpointing_trains_every_adapter_weight(tmp_path, tok):
    base = build_tiny_model(tok)
    base_before = _snapshot(base)
    trainer = _trainer(tmp_path, tok, base, lora(), max_steps=2, gradient_checkpointing=True, beta=0.1)
    adapter_before = _snapshot(trainer.model)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(adapter_before[n], after[n]) for n in _adapter_names(trainer.model))
    for name, p in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_before[name.replace(".base_layer", "")]), name


# ---- the KL reference is the base model, not a second copy ------------------------------------


def _reachable_parameters(root):
    """Every ``nn.Parameter`` reachable from ``root`` through object references."""
    skip = (type, types.ModuleType, types.FunctionType, types.FrameType, types.CodeType)
    seen, found, todo = {id(root)}, {}, [root]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.nn.Parameter):
            found[id(obj)] = obj
            continue
        if isinstance(obj, torch.Tensor):
            continue
        for ref in gc.get_referents(obj):
            if id(ref) not in seen and not isinstance(ref, skip):
                seen.add(id(ref))
                todo.append(ref)
    return list(found.values())


def _storages(params):
    return {p.untyped_storage().data_ptr() for p in params}


def test_kl_uses_the_base_model_without_a_second_copy(tmp_path, tok, monkeypatch):
    def no_copy(policy):
        raise AssertionError("a reference copy was made")

    monkeypatch.setattr(model_options, "create_reference", no_copy)
    trainer = _trainer(tmp_path, tok, peft_config=lora(), beta=0.1, max_steps=2)
    assert trainer.ref_model is None
    trainer.train()

    logs = _train_logs(trainer)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # the adapter starts as a no-op
    assert logs[1]["kl"] > 0.0
    own = list(trainer.model.parameters())
    reachable = _reachable_parameters(trainer)
    assert _storages(reachable) == _storages(own)
    assert sum(p.numel() for p in reachable) == sum(p.numel() for p in own)


def test_the_reachable_parameter_count_sees_a_reference_copy(tmp_path, tok):
    """The check above is not vacuous: without PEFT, beta > 0 keeps a second copy, and it is found."""
    trainer = _trainer(tmp_path, tok, beta=0.1, max_steps=1)
    own = list(trainer.model.parameters())
    reachable = _reachable_parameters(trainer)
    assert sum(p.numel() for p in reachable) == 2 * sum(p.numel() for p in own)


def test_reference_log_probs_are_the_base_model_s(tmp_path, tok):
    """After training, the ref log-probs equal a plain base model's, and the adapter is back on."""
    base = build_tiny_model(tok)
    trainer = _trainer(tmp_path, tok, base, lora(), beta=0.1, max_steps=1)
    trainer.train()
    scored = trainer._generate_and_score(
        [{"prompt": p} for p in standard_dataset(4)["prompt"]], "train", num_chunks=1
    )[0]
    untouched = build_tiny_model(tok)
    expected = trainer._frozen_logps(untouched.eval(), scored.rollout)
    torch.testing.assert_close(scored.ref_logps, expected)
    assert trainer.model.training  # the train mode came back after the reference pass
    with_adapter = trainer._frozen_logps(trainer.model, scored.rollout)
    assert not torch.allclose(with_adapter, expected)  # the adapter is enabled again


# ---- saving and reloading --------------------------------------------------------------------


def test_saved_adapter_reloads_with_identical_logits(tmp_path, tok):
    trainer = _trainer(tmp_path / "run", tok, peft_config=lora(), max_steps=2)
    trainer.train()
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter only, not the full weights

    reloaded = peft.PeftModel.from_pretrained(build_tiny_model(tok), str(out)).eval()
    trained = trainer.model.eval()
    ids = torch.tensor([tok("Question 3: what is 3 plus one?")["input_ids"]])
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        with trained.disable_adapter():
            base_logits = trained(input_ids=ids).logits
    assert torch.equal(got, expected)
    assert not torch.allclose(expected, base_logits)  # the adapter did learn something


def test_checkpoint_and_resume_with_an_adapter(tmp_path, tok):
    trainer = _trainer(tmp_path, tok, peft_config=lora(), max_steps=2, save_strategy="steps", save_steps=1)
    trainer.train()
    assert (tmp_path / "checkpoint-2" / "adapter_model.safetensors").is_file()
    resumed = _trainer(tmp_path, tok, peft_config=lora(), max_steps=3, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 3


# ---- a PeftModel passed in ---------------------------------------------------------------------


def test_a_peft_model_is_trained_as_is(tmp_path, tok):
    base = build_tiny_model(tok)
    base_before = _snapshot(base)
    model = peft.get_peft_model(base, lora())
    adapter_before = _snapshot(model)
    trainer = _trainer(tmp_path, tok, model, beta=0.1, max_steps=2)
    assert trainer.model is model and trainer.ref_model is None
    trainer.train()
    after = dict(model.named_parameters())
    assert all(not torch.equal(adapter_before[n], after[n]) for n in _adapter_names(model))
    for name, p in base.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_before[name.replace(".base_layer", "")]), name
    assert _train_logs(trainer)[1]["kl"] > 0.0


def test_a_frozen_peft_model_is_refused(tmp_path, tok):
    saved = tmp_path / "adapter"
    peft.get_peft_model(build_tiny_model(tok), lora()).save_pretrained(str(saved))
    frozen = peft.PeftModel.from_pretrained(build_tiny_model(tok), str(saved))  # is_trainable=False
    with pytest.raises(ValueError, match="is_trainable=True"):
        _trainer(tmp_path, tok, frozen)


def test_a_peft_model_with_a_peft_config_is_refused(tmp_path, tok):
    model = peft.get_peft_model(build_tiny_model(tok), lora())
    with pytest.raises(ValueError, match="already a PeftModel"):
        _trainer(tmp_path, tok, model, lora())


def test_peft_config_without_peft_installed(tmp_path, tok, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now fails
    with pytest.raises(ImportError, match=r"needs the peft library.*pip install"):
        _trainer(tmp_path, tok, peft_config=object())


def test_peft_config_must_be_a_peft_config(tmp_path, tok):
    with pytest.raises(TypeError, match="peft_config must be a peft.PeftConfig"):
        _trainer(tmp_path, tok, peft_config={"r": 4})


# ---- options that meet PEFT --------------------------------------------------------------------


@pytest.mark.parametrize("as_peft_model", [False, True])
def test_sync_ref_model_with_peft_raises(tmp_path, tok, as_peft_model):
    base = build_tiny_model(tok)
    model, config = (peft.get_peft_model(base, lora()), None) if as_peft_model else (base, lora())
    with pytest.raises(ValueError, match="sync_ref_model=True cannot be used with a PEFT adapter"):
        _trainer(tmp_path, tok, model, config, beta=0.1, sync_ref_model=True)


def test_disable_dropout_reaches_the_adapter_dropout(tmp_path, tok):
    trainer = _trainer(tmp_path, tok, peft_config=lora(lora_dropout=0.2), disable_dropout=True, max_steps=1)
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    trainer.train()


def test_adapter_dropout_draws_through_the_cpu_dropout(tmp_path, tok):
    """LoRA dropout keeps its probability and draws its masks with ops/dropout.py (3x faster)."""
    from posttrain.ops.dropout import CpuDropout

    trainer = _trainer(tmp_path, tok, peft_config=lora(lora_dropout=0.2), max_steps=1)
    dropouts = [m for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    adapters = [m for m in dropouts if type(m) is CpuDropout]
    assert len(adapters) == 2 * len(trainer.model.get_base_model().model.layers)  # q_proj, v_proj
    assert all(m.p == 0.2 for m in adapters)
    trainer.train()


def test_cast_lm_head_to_fp32_with_an_adapter(tmp_path, tok):
    base = build_tiny_model(tok).to(torch.bfloat16)
    trainer = _trainer(tmp_path, tok, base, lora(), cast_lm_head_to_fp32=True, beta=0.1, max_steps=2)
    assert base.lm_head.weight.dtype == torch.float32
    assert base.model.embed_tokens.weight.dtype == torch.bfloat16
    trainer.train()
    logs = _train_logs(trainer)
    assert all(math.isfinite(h["loss"]) for h in logs) and logs[1]["kl"] > 0.0
