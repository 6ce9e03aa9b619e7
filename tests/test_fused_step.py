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

from posttrain.generation.cuda_graph import GraphedDecodeStep, cuda_graph_blocker
from posttrain.generation.decode import lean_generate, lean_settings, preallocated_cache
from posttrain.generation.fused_step import FusedDecoder, fused_decoder_blocker
from posttrain.generation.reduced_kernels import backend_blocker as reduced_backend_blocker
from posttrain.generation.transformers_backend import (
    TransformersGenerator,
    group_prompts,
    onednn_linear_available,
    prefill_shared_prefix,
    sampling_config,
)
from posttrain.models.compat import cache_argument

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


#: How each kind of decode step is built for a model and its rows.
STEPS = {
    "onednn": lambda model, rows: FusedDecoder(model, rows),
    "plain": lambda model, rows: FusedDecoder(model, rows, backend="plain"),
    # the CUDA graph's fixed-shape step and buffer bookkeeping, run eagerly (no GPU needed)
    "fixed-shape": lambda model, rows: GraphedDecodeStep(
        FusedDecoder(model, rows, backend="plain"), capture=False
    ),
}


def compare_steps(model, tok, make_step, tolerance=1e-5, autocast=None, steps=5, low_precision=False):
    """Run ``steps`` decode steps with ``make_step`` and with the model's forward; compare them.

    ``low_precision``: bf16 arithmetic, where another attention kernel moves logits by a few bf16
    steps; the logits may then differ by ``tolerance`` times the largest one (a dropped rotation
    or norm moves them by about that largest one).
    """
    ids, mask = helpers.left_pad(MIXED, PAD)
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    rows, width = ids.shape
    context = (
        torch.autocast(device.type, dtype=autocast)
        if autocast is not None
        else torch.autocast("cpu", enabled=False)
    )
    with torch.no_grad():
        fused = make_step(model, rows)
        mine, theirs = preallocated_cache(model, width + steps), preallocated_cache(model, width + steps)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        for cache in (mine, theirs):
            with context:
                model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    **{cache_argument(model): cache},
                    use_cache=True,
                )
        for layer in mine.layers:  # what an allocator may leave in the unwritten positions
            layer._key_buffer[:, :, width:] = float("nan")
            layer._value_buffer[:, :, width:] = float("inf")
        full_mask = torch.cat([mask, mask.new_ones(rows, steps)], dim=1)
        generator = torch.Generator().manual_seed(1)
        for step in range(steps):
            tokens = torch.randint(1, len(tok), (rows,), generator=generator).to(device)
            pos = positions[:, -1] + step + 1
            key_mask = full_mask[:, : width + step + 1]
            with context:
                expected = model(
                    input_ids=tokens[:, None],
                    attention_mask=key_mask,
                    position_ids=pos[:, None],
                    **{cache_argument(model): theirs},
                    use_cache=True,
                ).logits[:, -1]
            got = fused.step(tokens, pos, key_mask, mine.layers)
            scale = float(expected.float().abs().max())
            assert scale > 1.0  # not a trivially flat comparison
            atol = tolerance * (scale if low_precision else max(scale / 10, 1.0))
            torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=atol)
        for a, b in zip(mine.layers, theirs.layers, strict=True):
            assert a.get_seq_length() == b.get_seq_length() == width + steps
            cache_atol = tolerance * (float(b.keys.float().abs().max()) if low_precision else 1.0)
            torch.testing.assert_close(a.keys.float(), b.keys.float(), rtol=tolerance, atol=cache_atol)
            torch.testing.assert_close(a.values.float(), b.values.float(), rtol=tolerance, atol=cache_atol)
    return fused


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("name", FAMILIES)
def test_step_logits_and_cache_equal_the_model_forward(tok, name, kind):
    model = family(name, tok)
    assert fused_decoder_blocker(model) is None
    assert fused_decoder_blocker(model, "plain") is None
    compare_steps(model, tok, STEPS[kind])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_plain_step_in_bf16_weights_follows_the_bf16_model(tok, name):
    """A model loaded in bf16: the plain step computes in its dtype, as its forward does."""
    compare_steps(
        family(name, tok).to(torch.bfloat16), tok, STEPS["plain"], tolerance=3e-2, low_precision=True
    )


@pytest.mark.parametrize("kind", ["plain", "fixed-shape"])
def test_step_under_autocast_follows_the_autocast_forward(tok, kind):
    """The trainer's bf16=True wraps the forward in autocast; autocast_dtype mirrors it."""

    def make(model, rows):
        fused = FusedDecoder(model, rows, backend="plain", autocast_dtype=torch.bfloat16)
        return fused if kind == "plain" else GraphedDecodeStep(fused, capture=False)

    compare_steps(
        family("llama", tok), tok, make, tolerance=3e-2, autocast=torch.bfloat16, low_precision=True
    )


def test_fixed_shape_step_needs_the_cache_filled_up_to_the_new_position(tok):
    model = family("llama", tok)
    ids, mask = helpers.left_pad(MIXED, PAD)
    rows, width = ids.shape
    with torch.no_grad():
        cache = preallocated_cache(model, width + 3)
        model(input_ids=ids, attention_mask=mask, **{cache_argument(model): cache}, use_cache=True)
        step = STEPS["fixed-shape"](model, rows)
        key_mask = torch.cat([mask, mask.new_ones(rows, 2)], dim=1)  # skips a position
        with pytest.raises(ValueError, match="the cache holds"):
            step.step(ids[:, -1], mask.sum(-1), key_mask, cache.layers)


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


@pytest.mark.parametrize("kind", list(STEPS))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_equal_without_and_with_a_shared_prefix(tok, name, kind):
    model = family(name, tok)
    ids, mask = helpers.left_pad(MIXED, PAD)
    settings, reason = lean_settings(model, greedy(tok.eos_token_id))
    assert reason is None
    with torch.no_grad():
        plain = lean_generate(model, ids, mask, settings)
        fused = lean_generate(model, ids, mask, settings, fused=STEPS[kind](model, len(MIXED)))
        prefix = prefill_shared_prefix(model, group_prompts(ids, mask))
        shared = lean_generate(
            model, ids, mask, settings, prefix_cache=prefix, fused=STEPS[kind](model, len(MIXED))
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
    assert gen.path.taken == "lean+shared_prefix" and gen.path.fused_blocker is None
    assert gen.path.cuda_graph_blocker == "not a CUDA device"
    plain, off = run_generator(model, tok, fused_step=False)
    assert off.path.fused_blocker == "fused_step=False"
    assert torch.equal(fused, plain)
    _, unpacked = run_generator(model, tok, prepack_weights=False)
    assert "prepack_weights=False" in unpacked.path.fused_blocker


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


def adapted(model, b_std=0.5, **lora):
    """``model`` under a PEFT LoRA adapter on every projection, with ``B`` that moves the logits."""
    from peft import LoraConfig, get_peft_model

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(target_modules=every, **lora), adapter_name="wide")
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, b_std)
    return model.eval()


def test_generator_samples_a_lone_lora_model_through_the_merged_step(tok):
    """A lone PEFT run: its adapter merged into the step's copy, the same tokens as peft's forward."""
    model = adapted(family("llama", tok), r=4, lora_dropout=0.1)
    before = {name: param.clone() for name, param in model.named_parameters()}
    out, gen = run_generator(model, tok)
    assert gen.path.taken.startswith("lean") and gen.path.fused_blocker is None
    ref, off = run_generator(model, tok, fused_step=False)
    assert off.path.fused_blocker == "fused_step=False"
    assert torch.equal(out, ref)
    assert all(torch.equal(param, before[name]) for name, param in model.named_parameters())
    with model.disable_adapter():  # the base model's tokens: not the merged step's
        assert "LoRA" in fused_decoder_blocker(model.get_base_model(), None, None, ["wide"])
        base, _ = run_generator(model, tok)
    assert not torch.equal(base, out)


@pytest.mark.parametrize("backend", ["onednn", "bf16", "int8"])
def test_merged_adapter_step_equals_the_adapted_forward(tok, backend):
    if backend != "onednn" and reduced_backend_blocker(backend) is not None:
        pytest.skip(reduced_backend_blocker(backend))
    # a smaller B for the reduced copies: their rounding grows with the activations
    model = adapted(
        family("llama", tok), 0.5 if backend == "onednn" else 0.1, r=4, lora_alpha=8, use_rslora=True
    )
    core = model.get_base_model()
    assert fused_decoder_blocker(core, backend, None, ["wide"]) is None
    make = lambda m, n: FusedDecoder(m, n, backend=backend, adapter_rows=[("wide", n)])  # noqa: E731
    fused = make(core, 2)
    assert fused.merged == "wide" and not fused.segments and not any(layer.lora for layer in fused.layers)
    if backend == "onednn":
        # (W + s B A) x against W x + s B (A x): float32 rounding reassociated; up to 1.1e-5 on an
        # AMD EPYC with AVX-512 (session 26), under 1e-5 on an Intel Xeon, so 5e-5 on every host
        compare_steps(core, tok, make, tolerance=5e-5)
    else:  # a reduced copy of the merged weights: within its own rounding (test_reduced_precision_sampler)
        compare_steps(core, tok, make, tolerance={"bf16": 3e-2, "int8": 0.2}[backend], low_precision=True)
    with pytest.raises(AssertionError):  # the base weights alone are far from the adapted forward
        compare_steps(core, tok, lambda m, n: FusedDecoder(m, n, backend=backend, adapter_rows=[("x", n)]))


def test_lora_terms_of_equal_blocks_batched_equal_one_pair_per_block():
    """Blocks of equal rows and rank run as two batched products; the same terms as block by block."""
    from posttrain.generation.fused_step import _LoraTerms

    torch.manual_seed(0)
    blocks = [(slice(3 * i, 3 * i + 3), torch.randn(4, 10), torch.randn(7, 4)) for i in range(3)]
    x = torch.randn(9, 10)
    batched, each = _LoraTerms.build(blocks, 9), _LoraTerms(blocks)
    assert batched.a_t is not None and each.a_t is None
    want = torch.cat([(x[rows] @ a.t()) @ b.t() for rows, a, b in blocks])
    torch.testing.assert_close(batched.term(x), want)
    torch.testing.assert_close(each.term(x), want)
    out = torch.ones(9, 7)
    batched.add_to(out, x)
    torch.testing.assert_close(out, want + 1)
    # unequal blocks, or blocks that leave rows without an adapter: one pair per block
    assert _LoraTerms.build(blocks[:2], 9).a_t is None
    assert _LoraTerms.build([blocks[0], (slice(3, 5), *blocks[1][1:])], 5).a_t is None


# ---- on a GPU (run on the device machine; skipped elsewhere) -------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("name", FAMILIES)
def test_cuda_graph_step_equals_the_model_forward(tok, name):
    model = family(name, tok).cuda()
    fused = FusedDecoder(model, len(MIXED))
    assert fused.backend == "plain" and cuda_graph_blocker(fused, torch.device("cuda")) is None
    step = compare_steps(model, tok, lambda m, rows: GraphedDecodeStep(FusedDecoder(m, rows)), tolerance=1e-4)
    assert step.graph is not None and step.replays == 5


@cuda
def test_cuda_graph_under_autocast_follows_the_autocast_forward(tok):
    make = lambda m, rows: GraphedDecodeStep(FusedDecoder(m, rows, autocast_dtype=torch.bfloat16))  # noqa: E731
    compare_steps(
        family("llama", tok).cuda(), tok, make, tolerance=3e-2, autocast=torch.bfloat16, low_precision=True
    )


@cuda
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_cuda_generator_replays_a_graph_with_the_eager_loop_tokens(tok, name):
    model = family(name, tok).cuda()
    gen = TransformersGenerator(lambda: model, greedy(tok.eos_token_id, new_tokens=40))
    ids, mask = helpers.left_pad(MIXED, PAD)
    graphed = gen.generate(ids.cuda(), mask.cuda()).completion_ids
    assert gen.path.fused_blocker is None and gen.path.cuda_graph_blocker is None
    eager = TransformersGenerator(lambda: model, greedy(tok.eos_token_id, new_tokens=40), fused_step=False)
    want = eager.generate(ids.cuda(), mask.cuda()).completion_ids
    assert want.shape[1] > 3
    assert torch.equal(graphed, want)


@cuda
@pytest.mark.parametrize("bf16", [False, True])
def test_cuda_trainer_samples_through_the_graphed_step(tmp_path, tok, bf16):
    from posttrain import GRPOTrainer

    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=lambda completion_ids, **kw: [float(len(c)) for c in completion_ids],
        args=helpers.make_config(tmp_path, use_cpu=False, bf16=bf16, max_steps=1, max_completion_length=40),
        train_dataset=helpers.standard_dataset(),
        processing_class=tok,
    )
    trainer.train()
    gen = trainer.generator
    assert gen.path.fused_blocker is None, gen.path.fused_blocker
    assert gen.path.cuda_graph_blocker is None, gen.path.cuda_graph_blocker
    assert gen.autocast_dtype == (torch.bfloat16 if bf16 else None)


@pytest.mark.parametrize("kind", ["onednn", "plain", "bf16"])
def test_step_with_lora_terms_per_row_block_equals_the_mixed_adapter_forward(tok, kind):
    """A sweep's shared call: base products once for every row, each row block's adapter added
    (on a bf16 copy: the base products in bf16, the adapters' terms in float32)."""
    if kind == "bf16" and reduced_backend_blocker(kind) is not None:
        pytest.skip(reduced_backend_blocker(kind))
    from peft import LoraConfig, get_peft_model

    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(family("llama", tok), LoraConfig(r=4, target_modules=every), adapter_name="wide")
    model.add_adapter("narrow", LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)  # adapters that move the logits
    model.eval()
    core = model.get_base_model()
    rows = len(MIXED)
    blocks = [("wide", rows // 2), ("narrow", rows - rows // 2)]
    names = [name for name, count in blocks for _ in range(count)]
    backend = None if kind == "onednn" else kind
    assert fused_decoder_blocker(core, backend, None, ["wide", "narrow"]) is None
    # a bf16 copy: within its own rounding (test_merged_adapter_step_equals_the_adapted_forward)
    close = {"tolerance": 3e-2, "low_precision": True} if kind == "bf16" else {}
    with model._enable_peft_forward_hooks(adapter_names=names):
        compare_steps(
            core, tok, lambda m, n: FusedDecoder(m, n, backend=backend, adapter_rows=blocks), **close
        )
    # without the terms the step is the base model's: far from the adapted forward
    with model._enable_peft_forward_hooks(adapter_names=names), pytest.raises(AssertionError):
        compare_steps(
            core, tok, lambda m, n: FusedDecoder(m, n, backend=backend, adapter_rows=[("other", n)])
        )
