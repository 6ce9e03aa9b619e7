"""The fused decode step equals the model's own forward, and the generator uses it only where it applies."""

from __future__ import annotations

import helpers
import pytest
import torch
from conftest import TINY_DECODER, build_tiny_model, build_tiny_tokenizer
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from posttrain.generation.decode import lean_generate, lean_settings, preallocated_cache
from posttrain.generation.fused_step import FusedDecoder, fused_decoder_blocker
from posttrain.generation.transformers_backend import (
    TransformersGenerator,
    group_prompts,
    onednn_linear_available,
    prefill_shared_prefix,
    sampling_config,
)

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="needs oneDNN's linear product")

PAD = 0
MIXED = [[11, 12, 13, 14, 15, 16], [21, 22, 23], [11, 12, 13, 14, 15, 16], [41]]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def family(name: str, tok, seed: int = 0) -> torch.nn.Module:
    """A tiny model of one supported family, with weights large enough to give peaked logits."""
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tok), **TINY_DECODER, max_position_embeddings=256, tie_word_embeddings=False)
    if name == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif name == "llama_rope_scaled":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    elif name == "qwen2":  # biases on the query, key and value projections
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif name == "qwen3":  # per-head query and key norms
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=8))
    elif name == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(name)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if param_name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:  # weights and the projections' biases
                p.normal_(0.0, 0.3 if p.dim() == 2 else 0.2)
    return model.eval()


FAMILIES = ["llama", "llama_rope_scaled", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("name", FAMILIES)
def test_step_logits_and_cache_equal_the_model_forward(tok, name):
    model = family(name, tok)
    assert fused_decoder_blocker(model) is None
    ids, mask = helpers.left_pad(MIXED, PAD)
    rows, width = ids.shape
    steps = 5
    with torch.no_grad():
        fused = FusedDecoder(model, rows)
        mine, theirs = preallocated_cache(model, width + steps), preallocated_cache(model, width + steps)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for cache in (mine, theirs):
            model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        full_mask = torch.cat([mask, mask.new_ones(rows, steps)], dim=1)
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            tokens = torch.randint(1, len(tok), (rows,), generator=generator)
            pos = positions[:, -1] + step + 1
            key_mask = full_mask[:, : width + step + 1]
            expected = model(
                input_ids=tokens[:, None],
                attention_mask=key_mask,
                position_ids=pos[:, None],
                cache=theirs,
                use_cache=True,
            ).logits[:, -1]
            got = fused.step(tokens, pos, key_mask, mine.layers)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
            assert got.abs().max() > 1.0  # not a trivially flat comparison
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-5)


def greedy(eos: int, new_tokens: int = 10):
    return sampling_config(
        max_new_tokens=new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=1,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=PAD,
        eos_token_ids=[eos],
    )


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_without_and_with_a_shared_prefix(tok, name):
    model = family(name, tok)
    ids, mask = helpers.left_pad(MIXED, PAD)
    settings, reason = lean_settings(model, greedy(tok.eos_token_id))
    assert reason is None
    with torch.no_grad():
        plain = lean_generate(model, ids, mask, settings)
        fused = lean_generate(model, ids, mask, settings, fused=FusedDecoder(model, len(MIXED)))
        prefix = prefill_shared_prefix(model, group_prompts(ids, mask))
        shared = lean_generate(
            model, ids, mask, settings, prefix_cache=prefix, fused=FusedDecoder(model, len(MIXED))
        )
    assert plain.shape[1] > ids.shape[1] + 3
    assert torch.equal(fused, plain)
    assert torch.equal(shared, plain)


def run_generator(model, tok, **kwargs):
    gen = TransformersGenerator(lambda: model, greedy(tok.eos_token_id, new_tokens=40), **kwargs)
    ids, mask = helpers.left_pad(MIXED, PAD)
    torch.manual_seed(0)
    return gen.generate(ids, mask).completion_ids, gen


def test_generator_runs_the_fused_step_and_matches_the_unfused_loop(tok):
    model = family("llama", tok)
    fused, gen = run_generator(model, tok)
    assert gen.last_path == "lean+shared_prefix" and gen.last_fused_blocker is None
    plain, off = run_generator(model, tok, fused_step=False)
    assert off.last_fused_blocker == "fused_step=False"
    assert torch.equal(fused, plain)
    _, unpacked = run_generator(model, tok, prepack_weights=False)
    assert "prepack_weights=False" in unpacked.last_fused_blocker


def test_generator_leaves_packed_linears_untouched(tok):
    model = family("llama", tok)
    run_generator(model, tok)
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_blockers_name_what_the_step_does_not_cover(tok):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(family("llama", tok), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    assert "wrapped" in fused_decoder_blocker(lora)
    assert "LoRA" in fused_decoder_blocker(lora.get_base_model())
    windowed = MistralForCausalLM(MistralConfig(vocab_size=len(tok), **TINY_DECODER, sliding_window=4))
    assert "sliding-window" in fused_decoder_blocker(windowed)
    wrapped = family("llama", tok)
    plain_forward = wrapped.forward
    wrapped.forward = lambda *a, **k: plain_forward(*a, **k)
    assert "forward is wrapped" in fused_decoder_blocker(wrapped)
    model = build_tiny_model(tok)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_decoder_blocker(model) == "CPU autocast"
    with pytest.raises(ValueError, match="FusedDecoder cannot run this model"):
        FusedDecoder(lora, 4)


def test_generator_falls_back_for_a_lora_model_with_the_same_tokens(tok):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(family("llama", tok), LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).eval()
    out, gen = run_generator(model, tok)
    assert gen.last_path.startswith("lean") and gen.last_fused_blocker is not None
    ref, _ = run_generator(model, tok, lean=False)
    assert torch.equal(out, ref)
