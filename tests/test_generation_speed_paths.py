"""Faster generation paths give the plain path's completions: the shared-prefix prefill and its fallbacks."""

from __future__ import annotations

import helpers
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from posttrain.generation import transformers_backend as backend
from posttrain.generation.transformers_backend import (
    PREPACK_MIN_NEW_TOKENS,
    TransformersGenerator,
    cache_argument,
    group_prompts,
    onednn_linear_available,
    onednn_prepacked_linears,
    packable_linears,
    prefill_shared_prefix,
    sampling_config,
    shared_prefix_blocker,
)
from posttrain.models.compat import returned_cache

PAD = 0
A = [11, 12, 13, 14, 15, 16]  # the batch's longest prompt
B = [21, 22, 23]
C = [31, 32, 33, 34]
D = [41]  # one token: its prefix is all padding


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok).eval()


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return helpers.left_pad(rows, PAD)


# Groups of different sizes and prompt lengths, a prompt of its own (C), a one-token prompt (D),
# and rows out of group order.
MIXED = [A, B, A, C, B, D, A, D]


def config(tok, **overrides) -> GenerationConfig:
    values = dict(
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=PAD,
        eos_token_ids=[tok.eos_token_id],
    )
    values.update(overrides)
    return sampling_config(**values)


def sample(
    model, cfg, rows, share_prefix: bool, seed: int = 0, prepack: bool = False, lean: bool = False
) -> tuple[torch.Tensor, TransformersGenerator]:
    """Sample through the generator; ``generate``'s paths unless ``lean`` (tests/test_lean_decode.py)."""
    gen = TransformersGenerator(
        lambda: model, cfg, share_prefix=share_prefix, prepack_weights=prepack, lean=lean
    )
    ids, mask = left_pad(rows)
    torch.manual_seed(seed)
    return gen.generate(ids, mask).completion_ids, gen


# ---- grouping ------------------------------------------------------------------------------------


def test_group_prompts_finds_distinct_rows():
    ids, mask = left_pad(MIXED)
    groups = group_prompts(ids, mask)
    assert groups.num_unique == 4
    assert torch.equal(groups.unique_ids[groups.inverse], ids)  # every row maps back to itself
    assert torch.equal(groups.unique_mask[groups.inverse], mask)


def test_group_prompts_ignores_ids_under_padding_but_not_padding_length():
    ids = torch.tensor([[7, 5, 6], [9, 5, 6], [0, 5, 6], [5, 6, 0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 0]])
    groups = group_prompts(ids, mask)
    assert groups.inverse[0] == groups.inverse[1] == groups.inverse[2]  # same prompt, other pad ids
    assert groups.inverse[3] != groups.inverse[0]  # same tokens, other layout
    assert groups.num_unique == 2


def test_group_prompts_with_row_keys_keeps_the_same_prompt_apart_under_other_keys():
    """A sweep's shared call: the same prompt under two adapters is two rows to prefill."""
    ids = torch.tensor([[5, 6], [5, 6], [5, 6], [5, 6], [7, 8]])
    mask = torch.ones_like(ids)
    keys = torch.tensor([0, 0, 1, 1, 1])
    groups = group_prompts(ids, mask, keys)
    assert groups.num_unique == 3 and group_prompts(ids, mask).num_unique == 2
    assert torch.equal(groups.unique_keys[groups.inverse], keys)
    assert torch.equal(groups.unique_ids[groups.inverse], ids)


# ---- shared prefix == plain -------------------------------------------------------------------------


def test_shared_prefix_greedy_equals_plain(tok, model):
    cfg = config(tok, generation_kwargs={"do_sample": False})
    plain, _ = sample(model, cfg, MIXED, share_prefix=False)
    shared, gen = sample(model, cfg, MIXED, share_prefix=True)
    assert gen.path.taken == "shared_prefix", gen.path.prefix_blocker
    assert torch.equal(shared, plain)
    assert torch.equal(shared[0], shared[2]) and torch.equal(
        shared[0], shared[6]
    )  # greedy: one answer per prompt


def test_shared_prefix_seeded_sampling_equals_plain(tok, model):
    cfg = config(tok, temperature=0.9, top_k=50)
    for seed in (0, 1):
        plain, _ = sample(model, cfg, MIXED, share_prefix=False, seed=seed)
        shared, gen = sample(model, cfg, MIXED, share_prefix=True, seed=seed)
        assert gen.path.taken == "shared_prefix"
        assert torch.equal(shared, plain)
    assert not torch.equal(shared[0], shared[2])  # sampled rows of one prompt still differ


def test_shared_prefix_with_min_new_tokens_and_group_order(tok, model):
    rows = [A] * 4 + [C] * 4  # the trainer's layout: G consecutive copies per prompt
    cfg = config(tok, max_new_tokens=6, generation_kwargs={"min_new_tokens": 6})
    plain, _ = sample(model, cfg, rows, share_prefix=False)
    shared, _ = sample(model, cfg, rows, share_prefix=True)
    assert torch.equal(shared, plain)
    assert shared.shape == (8, 6)


def test_shared_prefix_cache_matches_plain_prefill(tok, model):
    """The expanded cache holds, row for row, the keys and values of the plain prefill."""
    ids, mask = left_pad(MIXED)
    cache = prefill_shared_prefix(model, group_prompts(ids, mask))
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        plain = model(
            ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1], use_cache=True
        )
    real = mask[:, :-1].bool()  # padded positions are never attended to
    for mine, ref in zip(cache.layers, returned_cache(plain).layers, strict=True):
        assert mine.keys.shape == ref.keys.shape  # [N, heads, P-1, dim]
        keys, ref_keys = mine.keys.transpose(1, 2)[real], ref.keys.transpose(1, 2)[real]
        torch.testing.assert_close(keys, ref_keys, rtol=1e-5, atol=1e-6)


def test_model_is_returned_to_training_mode(tok, model):
    model.train()
    try:
        sample(model, config(tok), [A, A], share_prefix=True)
        assert model.training
    finally:
        model.eval()


# ---- fallbacks ---------------------------------------------------------------------------------------


def blocker(model, cfg, rows) -> str | None:
    return shared_prefix_blocker(model, cfg, group_prompts(*left_pad(rows)))


def test_blocker_none_when_prompts_repeat(tok, model):
    assert blocker(model, config(tok), MIXED) is None
    assert blocker(model, config(tok, cache_implementation="dynamic"), MIXED) is None
    assert cache_argument(model) in ("cache", "past_key_values")


@pytest.mark.parametrize(
    ("overrides", "rows", "reason"),
    [
        ({}, [A, B, C, D], "every prompt is distinct"),
        ({}, [D, D, [42]], "one-token prompts"),
        ({"cache_implementation": "static"}, MIXED, "cache_implementation='static'"),
        ({"generation_kwargs": {"use_cache": False}}, MIXED, "use_cache=False"),
        ({"generation_kwargs": {"num_return_sequences": 2}}, MIXED, "several sequences per row"),
        ({"generation_kwargs": {"num_beams": 2, "do_sample": False}}, MIXED, "beam search"),
    ],
)
def test_blocker_reasons(tok, model, overrides, rows, reason):
    assert reason in blocker(model, config(tok, **overrides), rows)


def test_blocker_sliding_window_model(tok):
    cfg = MistralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
    )
    assert "sliding-window" in blocker(MistralForCausalLM(cfg), config(tok), MIXED)


def test_blocker_model_default_cache_implementation(tok):
    model = build_tiny_model(tok)
    model.generation_config.cache_implementation = "static"
    assert "generation_config sets" in blocker(model, config(tok), MIXED)


def test_fallbacks_give_plain_completions(tok, model):
    """Static cache and all-distinct batches take the plain path, with its results."""
    for cfg, rows in ((config(tok, cache_implementation="static"), MIXED), (config(tok), [A, B, C])):
        plain, _ = sample(model, cfg, rows, share_prefix=False)
        shared, gen = sample(model, cfg, rows, share_prefix=True)
        assert gen.path.taken == "plain" and gen.path.prefix_blocker
        assert torch.equal(shared, plain)


def test_explicit_dynamic_cache_takes_the_shared_prefix(tok, model):
    cfg = config(tok, cache_implementation="dynamic", generation_kwargs={"do_sample": False})
    plain, _ = sample(model, cfg, MIXED, share_prefix=False)
    shared, gen = sample(model, cfg, MIXED, share_prefix=True)
    assert gen.path.taken == "shared_prefix"
    assert torch.equal(shared, plain)
    assert cfg.cache_implementation == "dynamic"  # the generator's config is left as it was


def test_share_prefix_off(tok, model):
    _, gen = sample(model, config(tok), MIXED, share_prefix=False)
    assert gen.path.taken == "plain" and gen.path.prefix_blocker == "share_prefix=False"


# ---- wrappers ---------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_shared_prefix_under_peft_equals_plain(tok):
    peft = pytest.importorskip("peft")
    base = build_tiny_model(tok, seed=1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora).eval()
    with torch.no_grad():  # non-zero adapters, so the prefill must go through them
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    cfg = config(tok, generation_kwargs={"do_sample": False})
    plain, _ = sample(model, cfg, MIXED, share_prefix=False)
    shared, gen = sample(model, cfg, MIXED, share_prefix=True)
    assert gen.path.taken == "shared_prefix"
    assert torch.equal(shared, plain)


def test_tied_embeddings_model(tok):
    """A one-layer model with tied embeddings (like SmolLM2) takes the same path."""
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    gcfg = config(tok, generation_kwargs={"do_sample": False})
    plain, _ = sample(model, gcfg, MIXED, share_prefix=False)
    shared, _ = sample(model, gcfg, MIXED, share_prefix=True)
    assert torch.equal(shared, plain)


# ---- prepacked weights ----------------------------------------------------------------------------

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="torch built without oneDNN")


@pytest.fixture
def pack_calls(monkeypatch):
    """Records the row hint of every packing the generator does."""
    calls: list[int] = []
    real = backend.onednn_prepacked_linears

    def spy(model, rows):
        calls.append(rows)
        return real(model, rows)

    monkeypatch.setattr(backend, "onednn_prepacked_linears", spy)
    return calls


LONG = PREPACK_MIN_NEW_TOKENS  # enough new tokens for the generator to pack


@needs_onednn
def test_prepacked_and_shared_prefix_equal_plain(tok, model, pack_calls):
    """The generator's defaults (both speed-ups) against plain generate: greedy and seeded sampling."""
    greedy = config(tok, max_new_tokens=LONG, generation_kwargs={"do_sample": False})
    for cfg in (greedy, config(tok, max_new_tokens=LONG, temperature=0.9)):
        plain, _ = sample(model, cfg, MIXED, share_prefix=False, prepack=False)
        fast, gen = sample(model, cfg, MIXED, share_prefix=True, prepack=True)
        assert gen.path.taken == "shared_prefix"
        assert torch.equal(fast, plain)
    assert pack_calls == [len(MIXED), len(MIXED)]


def test_short_completions_are_not_packed(tok, model, pack_calls):
    sample(model, config(tok, max_new_tokens=LONG - 1), MIXED, share_prefix=True, prepack=True)
    assert pack_calls == []


@needs_onednn
def test_prepacked_logits_match_f_linear(model):
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    with torch.no_grad():
        ref = model(ids).logits
        with onednn_prepacked_linears(model, rows=2) as swapped:
            packed = model(ids).logits
    assert swapped == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    torch.testing.assert_close(packed, ref, rtol=0, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("lean", [False, True])
def test_prepacked_layers_under_bf16_autocast_run_like_unpacked(tok, model, lean):
    """bf16=True on the CPU: accelerate runs the forward under autocast, so bf16 activations reach
    the packed layers; they must take F.linear (with autocast's cast) and give the same tokens."""
    cfg = config(tok, max_new_tokens=LONG, top_k=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        unpacked, _ = sample(model, cfg, MIXED, share_prefix=True, prepack=False, lean=lean)
        packed, _ = sample(model, cfg, MIXED, share_prefix=True, prepack=True, lean=lean)
    assert torch.equal(packed, unpacked)


@needs_onednn
def test_prepacked_layers_are_restored_even_on_error(model):
    with pytest.raises(RuntimeError, match="boom"):
        with onednn_prepacked_linears(model, rows=2):
            assert "forward" in model.lm_head.__dict__
            raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_packable_linears_skips_other_dtypes_and_subclasses():
    class QuantLinear(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).double(), QuantLinear(4, 4))
    expected = [model[0]] if onednn_linear_available() else []
    assert packable_linears(model) == expected


@needs_onednn
def test_prepacked_weights_follow_the_training_weights(tok, pack_calls):
    """Weights are packed per call: an update between two calls is seen by the second."""
    model = build_tiny_model(tok).eval()
    cfg = config(tok, max_new_tokens=LONG, generation_kwargs={"do_sample": False})
    first, _ = sample(model, cfg, [A, A], share_prefix=True, prepack=True)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    second, _ = sample(model, cfg, [A, A], share_prefix=True, prepack=True)
    reference, _ = sample(model, cfg, [A, A], share_prefix=False, prepack=False)
    assert not torch.equal(first, second)
    assert torch.equal(second, reference)
    assert len(pack_calls) == 2


# ---- in the trainer -----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_trainer_generates_through_the_fast_paths(tok, tmp_path, pack_calls):
    """A training step (gradient checkpointing on) samples via the shared prefix, then trains as before."""
    from helpers import length_reward, make_config, make_trainer

    args = make_config(tmp_path, max_steps=1, gradient_checkpointing=True, max_completion_length=LONG)
    trainer = make_trainer(tok, length_reward, args)
    trainer.train()
    gen = trainer.generator
    assert gen.path.taken == "lean+shared_prefix", (gen.path.prefix_blocker, gen.path.lean_blocker)
    if onednn_linear_available():  # the fused decode step packs its own copies; no layer is swapped
        assert gen.path.fused_blocker is None and len(pack_calls) == 0
    else:
        assert len(pack_calls) == 1  # one generation, "packed" (a no-op without oneDNN)
    assert all("forward" not in m.__dict__ for m in trainer.model.modules() if type(m) is torch.nn.Linear)
    assert trainer.model.training


# ---- continuous batching -------------------------------------------------------------------------


def test_continuous_batching_greedy_equals_plain(tok, model):
    from posttrain.generation.continuous_batching import ContinuousBatchingGenerator

    cfg = config(tok, generation_kwargs={"do_sample": False})
    plain, _ = sample(model, cfg, MIXED, share_prefix=False)
    ids, mask = left_pad(MIXED)
    cb = ContinuousBatchingGenerator(lambda: model, cfg).generate(ids, mask).completion_ids
    # plain pads finished rows with the pad id too; trim the common right padding before comparing
    width = max(cb.shape[1], plain.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=PAD)  # noqa: E731
    assert torch.equal(pad(cb), pad(plain))


def test_continuous_batching_seeded_sampling_is_reproducible(tok, model):
    from posttrain.generation.continuous_batching import ContinuousBatchingGenerator

    gen = ContinuousBatchingGenerator(lambda: model, config(tok, temperature=0.8, top_p=0.9, top_k=20))
    ids, mask = left_pad(MIXED)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append((gen.generate(ids, mask).completion_ids, torch.rand(1)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1])  # the global generator continues the same way after a call
    assert runs[0][0].shape[0] == len(MIXED)


def test_continuous_batching_refuses_options_it_would_drop(tok, model):
    from posttrain.generation.continuous_batching import ContinuousBatchingGenerator

    with pytest.raises(ValueError, match="repetition_penalty=1.2.*min_new_tokens=4"):
        ContinuousBatchingGenerator(
            lambda: model, config(tok, repetition_penalty=1.2, generation_kwargs={"min_new_tokens": 4})
        )


def test_continuous_batching_config_defaults():
    from posttrain.generation.continuous_batching import batch_sized_cb_config

    cpu = batch_sized_cb_config(None, [6, 3, 300], 20, torch.device("cpu"))
    assert cpu["num_blocks"] == 1 + 1 + 2 + 1  # pages of 256 tokens per request, plus one
    assert cpu["max_batch_tokens"] == 309 and cpu["max_memory_percent"] == 0.5
    user = batch_sized_cb_config({"num_blocks": 64, "page_size": 16}, [6, 3], 20, torch.device("cpu"))
    assert user["num_blocks"] == 64 and user["page_size"] == 16
    gpu = batch_sized_cb_config(None, [6, 3], 20, torch.device("meta"))
    assert "num_blocks" not in gpu and gpu["max_memory_percent"] == 0.5


def test_continuous_batching_rejects_unknown_config_keys(tok, model):
    from posttrain.generation.continuous_batching import ContinuousBatchingGenerator

    with pytest.raises(TypeError, match="max_memory_pct"):
        ContinuousBatchingGenerator(lambda: model, config(tok), cb_config={"max_memory_pct": 0.4})


# ---- continuous batching in the trainer ---------------------------------------------------------


def test_trainer_trains_with_continuous_batching(tok, tmp_path):
    from helpers import length_reward, make_config, make_trainer

    from posttrain.generation.continuous_batching import ContinuousBatchingGenerator

    args = make_config(tmp_path, max_steps=1, use_transformers_continuous_batching=True)
    trainer = make_trainer(tok, length_reward, args)
    assert isinstance(trainer.generator, ContinuousBatchingGenerator)
    trainer.train()
    assert any("completions/mean_length" in e for e in trainer.state.log_history)


def test_trainer_refuses_an_option_continuous_batching_would_drop(tok, tmp_path):
    from helpers import length_reward, make_config, make_trainer

    args = make_config(
        tmp_path, use_transformers_continuous_batching=True, generation_kwargs={"min_new_tokens": 4}
    )
    with pytest.raises(ValueError, match="min_new_tokens"):
        make_trainer(tok, length_reward, args)


def test_generate_takes_a_tighter_budget(tok, model):
    """The tool loop passes its remaining budget; min_new_tokens is clipped to it."""
    config = GenerationConfig(
        max_new_tokens=12,
        min_new_tokens=12,
        do_sample=False,
        pad_token_id=tok.pad_token_id or 0,
        eos_token_id=[],
    )
    gen = backend.TransformersGenerator(get_model=lambda: model, config=config)
    ids = torch.tensor([tok("hello world")["input_ids"]])
    assert gen.generate(ids, torch.ones_like(ids), max_new_tokens=5).completion_ids.shape[1] == 5
    assert gen.generate(ids, torch.ones_like(ids)).completion_ids.shape[1] == 12
    assert config.max_new_tokens == 12  # the generator's own config is untouched


def test_the_path_record_names_each_blocker(tok, model):
    """One typed record per call: the path taken, and why each faster path did not apply."""
    gen = TransformersGenerator(lambda: model, config(tok), share_prefix=False, fused_step=False)
    gen.generate(*left_pad(MIXED))
    path = gen.path
    assert isinstance(path, backend.GenerationPath)
    assert (path.taken, path.prefix_blocker, path.fused_blocker) == (
        "lean",
        "share_prefix=False",
        "fused_step=False",
    )
    assert path.lean_blocker is None and path.reduced_blocker is None
    assert path.describe() == (
        "lean; no prefix prefill: share_prefix=False; no fused step: fused_step=False; "
        "no CUDA graph: no fused decode step"
    )
    with pytest.raises(AttributeError):  # a record, not state to edit
        path.taken = "plain"


def test_the_trainer_logs_each_generation_path_once(tmp_path, caplog):
    from posttrain import GRPOTrainer

    tok = build_tiny_tokenizer()
    trainer = GRPOTrainer(
        model=build_tiny_model(tok, seed=1),
        reward_funcs=lambda completion_ids, **kw: [float(len(ids)) for ids in completion_ids],
        args=helpers.make_config(tmp_path, max_steps=2),
        train_dataset=helpers.standard_dataset(),
        processing_class=tok,
    )
    with caplog.at_level("INFO", logger="posttrain.sampling.pipeline"):
        trainer.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generation path:")]
    assert lines == [f"Generation path: {trainer.generator.path.describe()}"]
    assert trainer.generator.path.taken.startswith("lean")
