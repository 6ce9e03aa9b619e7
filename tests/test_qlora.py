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


@pytest.fixture(scope="module")
def blockwise_model_dir(tmp_path_factory):
    """A tiny Llama whose linear layers' input sizes are multiples of NF4's block of 64, the shapes
    of real models: on an AVX512-BF16 CPU bitsandbytes would repack these for its fused kernel
    (the hidden size 32 of the shared tiny model it cannot repack, so that one would not show it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama-64")
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@needs_bitsandbytes
def test_qlora_trains_only_the_adapter_on_a_4bit_base(tmp_path, blockwise_model_dir):
    """Every adapter trains, layer 0's included, after generations and reference passes in eval mode.

    On an AVX512-BF16 CPU bitsandbytes repacks a 4-bit weight at its first eval-mode call into a
    kernel with no backward; left on, layer 0's adapters got no gradient (posttrain turns it off).
    """
    import bitsandbytes as bnb

    trainer = _trainer(
        tmp_path, blockwise_model_dir, peft_config=_lora(), quantization_config=_nf4(), beta=0.1, max_steps=2,
        learning_rate=1e-2,
    )  # fmt: skip
    quantized = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 14  # every linear layer of the 2 decoder layers, the LM head excepted
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {name for name in before if not torch.equal(before[name], after[name].detach())}
    assert changed == {name for name in before if "lora_" in name}  # every adapter, and nothing else
    assert {name for name, p in after.items() if p.requires_grad} == {n for n in after if "lora_" in n}
    still = [m for m in trainer.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(still) == 14
    assert all(isinstance(m.weight, bnb.nn.Params4bit) and m.weight.dtype == torch.uint8 for m in still)
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in still)
    assert trainer.ref_model is None  # the reference is the 4-bit base, adapters disabled
    logs = [h for h in trainer.state.log_history if "kl" in h]
    assert logs[0]["kl"] == 0.0 and logs[1]["kl"] > 0.0


@needs_bitsandbytes
def test_a_4bit_layer_run_in_eval_mode_still_passes_the_gradient_back(blockwise_model_dir):
    """The model a user loads quantized, generates with, then trains: every adapter gets a gradient."""
    import bitsandbytes as bnb
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from posttrain.models.peft import keep_4bit_layers_differentiable

    model = AutoModelForCausalLM.from_pretrained(blockwise_model_dir, quantization_config=_nf4())
    model = get_peft_model(model, _lora())
    x = torch.randint(0, 300, (2, 10))
    model.eval()
    with torch.no_grad():
        model(x)  # a generation: where bitsandbytes repacks, it has now
    assert keep_4bit_layers_differentiable(model) == 14
    model.train()
    for p in model.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)  # lora_B starts at 0, which would stop lora_A's gradient
    model(x).logits.pow(2).mean().backward()
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert len(adapters) == 8 and all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in adapters.values()
    )
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in layers)


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


def test_the_hub_kernel_notices_of_bitsandbytes_are_dropped_and_others_pass():
    """The two import-time lines about bitsandbytes' hub kernel (AVX512-BF16 hosts) never reach a
    user's output; any other notice from the same loggers still does."""
    import logging

    import posttrain  # noqa: F401  (installs the filter)

    def passes(logger_name: str, message: str) -> bool:
        logger = logging.getLogger(logger_name)
        record = logger.makeRecord(logger_name, logging.WARNING, __file__, 1, message, (), None)
        return logger.filter(record)

    kernels = "kernels._internals.hf_hub"
    bnb = "bitsandbytes.backends.cpu.ops"
    assert not passes(bnb, "Failed to load CPU gemm_4bit_forward from kernels-community: %s.")
    assert not passes(
        kernels,
        "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes' "
        "because Hugging Face Hub is in offline mode.",
    )
    assert passes(
        kernels,
        "Skipping publisher trust check for 'someone/flash-attn' because Hugging Face Hub is in "
        "offline mode.",
    )
    assert passes(bnb, "Some other bitsandbytes warning")
