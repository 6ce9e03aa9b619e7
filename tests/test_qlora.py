"""QLoRA: the policy loaded in 4-bit NF4 (bitsandbytes, on CPU here), a LoRA adapter trains on it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer

pytest.importorskip("peft", reason="peft is not installed: pip install 'posttrain[peft]'")
# peft reads `is_gradient_checkpointing`, which transformers 5 deprecates; nothing to act on here
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="bitsandbytes is not installed: pip install 'posttrain[qlora]'",
)


def varied_reward(completion_ids, **kwargs):
    """Depends on the sampled tokens, so groups have spread and advantages are not all zero."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _nf4():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )


def _trainer(tmp_path, model, **kwargs) -> GRPOTrainer:
    trainer_kwargs = {k: kwargs.pop(k) for k in ("peft_config", "quantization_config") if k in kwargs}
    return GRPOTrainer(
        model=model,
        reward_funcs=varied_reward,
        args=make_config(tmp_path / "out", **kwargs),
        train_dataset=standard_dataset(),
        **trainer_kwargs,
    )


@needs_bitsandbytes
def test_qlora_trains_only_the_adapter_on_a_4bit_base(tmp_path, tiny_model_dir):
    import bitsandbytes as bnb

    trainer = _trainer(
        tmp_path, tiny_model_dir, peft_config=_lora(), quantization_config=_nf4(), beta=0.1, max_steps=2
    )
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14  # every linear layer of the 2 decoder layers, the LM head excepted
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {name for name in before if not torch.equal(before[name], after[name].detach())}
    assert changed and all("lora_" in name for name in changed)
    assert {name for name, p in after.items() if p.requires_grad} == {n for n in after if "lora_" in n}
    still = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(still) == 14
    assert all(isinstance(m.weight, bnb.nn.Params4bit) and m.weight.dtype == torch.uint8 for m in still)
    assert trainer.ref_model is None  # the reference is the 4-bit base, adapters disabled
    logs = [h for h in trainer.state.log_history if "kl" in h]
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0


def test_quantization_config_needs_an_adapter(tmp_path, tiny_model_dir):
    from transformers import BitsAndBytesConfig

    with pytest.raises(ValueError, match="pass a peft_config as well"):
        _trainer(tmp_path, tiny_model_dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True))


def test_quantization_config_of_the_wrong_type(tmp_path, tiny_model_dir):
    with pytest.raises(TypeError, match="quantization_config must be a transformers quantization config"):
        _trainer(tmp_path, tiny_model_dir, peft_config=_lora(), quantization_config={"load_in_4bit": True})


def test_quantization_config_is_ignored_for_a_built_model(tmp_path):
    from transformers import BitsAndBytesConfig

    tok = build_tiny_tokenizer()
    with pytest.warns(UserWarning, match="quantization_config is ignored"):
        trainer = GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=varied_reward,
            args=make_config(tmp_path),
            train_dataset=standard_dataset(),
            processing_class=tok,
            peft_config=_lora(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )
    assert not any(type(m).__name__ == "Linear4bit" for m in trainer.model.modules())


def test_missing_bitsandbytes_gives_the_install_command(tmp_path, tiny_model_dir, monkeypatch):
    from transformers import BitsAndBytesConfig

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"pip install 'posttrain\[qlora\]'"):
        _trainer(
            tmp_path,
            tiny_model_dir,
            peft_config=_lora(),
            quantization_config=BitsAndBytesConfig(load_in_4bit=True),
        )
