"""The lean sampling loop gives ``generate``'s tokens, scores and distribution, and falls back on the rest."""

from __future__ import annotations

import math

import helpers
import pytest
import torch
from conftest import TINY_DECODER, build_tiny_model, build_tiny_tokenizer
from transformers import (
    GenerationConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.cache_utils import DynamicCache

from posttrain.generation.decode import (
    PreallocatedLayer,
    SamplingSettings,
    ScoreProcessor,
    lean_generate,
    lean_settings,
    preallocated_cache,
    sample_tokens,
)
from posttrain.generation.transformers_backend import (
    TransformersGenerator,
    common_prefix_length,
    group_prompts,
    prefill_shared_prefix,
    prefix_first,
    sampling_config,
)

PAD = 0
A = [11, 12, 13, 14, 15, 16]
B = [21, 22, 23]
C = [31, 32, 33, 34]
D = [41]
MIXED = [A, B, A, C, B, D, A, D]  # repeated prompts of different lengths, left-padded


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(tok).eval()


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return helpers.left_pad(rows, PAD)


def config(eos: list[int], **overrides) -> GenerationConfig:
    values = dict(
        max_new_tokens=12,
        temperature=1.0,
        top_p=1.0,
        top_k=1,  # deterministic: the lean loop and generate must agree token for token
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=PAD,
        eos_token_ids=eos,
    )
    values.update(overrides)
    return sampling_config(**values)


def run(model, cfg, rows, *, lean: bool, share_prefix: bool, seed: int = 0):
    gen = TransformersGenerator(
        lambda: model, cfg, share_prefix=share_prefix, prepack_weights=False, lean=lean
    )
    torch.manual_seed(seed)
    return gen.generate(*left_pad(rows)).completion_ids, gen


class CallCounter:
    """Counts the forward calls of a model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, *args) -> None:
        self.calls += 1


# ---- same tokens as generate ---------------------------------------------------------------------


@pytest.mark.parametrize("share_prefix", [False, True])
def test_deterministic_lean_equals_generate(tok, model, share_prefix):
    cfg = config([tok.eos_token_id])
    ref, gen = run(model, cfg, MIXED, lean=False, share_prefix=share_prefix)
    out, lean = run(model, cfg, MIXED, lean=True, share_prefix=share_prefix)
    assert gen.path.taken == ("shared_prefix" if share_prefix else "plain")
    assert lean.path.taken == ("lean+shared_prefix" if share_prefix else "lean"), lean.path.lean_blocker
    assert out.shape == (len(MIXED), 12)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("share_prefix", [False, True])
def test_greedy_lean_equals_generate(tok, model, share_prefix):
    """``do_sample=False``: the argmax of the processed scores, warpers off (a temperature that would
    change nothing greedy, a min_new_tokens and a repetition penalty that do), as ``generate``."""
    options = {"temperature": 0.3, "top_k": 5, "repetition_penalty": 1.3,
               "generation_kwargs": {"do_sample": False, "min_new_tokens": 2}}  # fmt: skip
    greedy, _ = run(model, config([tok.eos_token_id], **options), MIXED, lean=False, share_prefix=False)
    eos = [int(greedy[0, 3])]  # ends row 0 (at least) early
    cfg = config(eos, **options)
    ref, _ = run(model, cfg, MIXED, lean=False, share_prefix=share_prefix, seed=1)
    out, gen = run(model, cfg, MIXED, lean=True, share_prefix=share_prefix, seed=2)
    assert gen.path.taken.startswith("lean"), gen.path.lean_blocker
    assert torch.equal(out, ref)
    assert (out == eos[0]).any()


@pytest.mark.parametrize("share_prefix", [False, True])
def test_early_eos_pads_rows_and_stops_the_loop(tok, model, share_prefix):
    """EOS ids taken from the greedy sequences: some rows end early, then all do."""
    greedy, _ = run(model, config([tok.eos_token_id]), MIXED, lean=False, share_prefix=False)
    assert not (greedy == tok.eos_token_id).any()  # the reference never ends on its own

    # Only the rows of prompt A end (their 3rd token), the others run to max_new_tokens.
    some = [int(greedy[0, 2])]
    assert not any(some[0] in greedy[i].tolist() for i in (1, 3, 5))
    ref, _ = run(model, config(some), MIXED, lean=False, share_prefix=share_prefix)
    out, _ = run(model, config(some), MIXED, lean=True, share_prefix=share_prefix)
    assert torch.equal(out, ref)
    assert out.shape[1] == 12 and out[0, 3:].eq(PAD).all() and out[0, 2] == some[0]

    # Every row's 4th token is an EOS id, and row 0's 2nd too: the loop stops after 4 steps.
    every = sorted(set(greedy[:, 3].tolist()) | {int(greedy[0, 1])})
    ref, _ = run(model, config(every), MIXED, lean=False, share_prefix=share_prefix)
    counter = CallCounter(model)
    try:
        out, _ = run(model, config(every), MIXED, lean=True, share_prefix=share_prefix)
    finally:
        counter.handle.remove()
    assert torch.equal(out, ref)
    assert out.shape[1] <= 4 and out[0, 2:].eq(PAD).all()
    prefill = 1 if share_prefix else 0  # prefill_shared_prefix's forward
    assert counter.calls == out.shape[1] + prefill


def test_min_new_tokens_and_repetition_penalty_equal_generate(tok, model):
    greedy, _ = run(model, config([tok.eos_token_id]), MIXED, lean=False, share_prefix=False)
    eos = [int(greedy[0, 1]), int(greedy[1, 1])]  # would end rows at their 2nd token
    for kwargs in ({"generation_kwargs": {"min_new_tokens": 5}}, {"repetition_penalty": 1.5}):
        cfg = config(eos, max_new_tokens=8, **kwargs)
        ref, _ = run(model, cfg, MIXED, lean=False, share_prefix=True)
        out, gen = run(model, cfg, MIXED, lean=True, share_prefix=True)
        assert gen.path.taken == "lean+shared_prefix"
        assert torch.equal(out, ref)


def tiny_qwen(cls_config, cls_model, tok):
    cfg = cls_config(
        vocab_size=len(tok),
        **TINY_DECODER,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return cls_model(cfg).eval()


@pytest.mark.parametrize(
    ("cls_config", "cls_model"), [(Qwen2Config, Qwen2ForCausalLM), (Qwen3Config, Qwen3ForCausalLM)]
)
def test_qwen_models_equal_generate(tok, cls_config, cls_model):
    model = tiny_qwen(cls_config, cls_model, tok)
    cfg = config([tok.eos_token_id], max_new_tokens=6)
    for share_prefix in (False, True):
        ref, _ = run(model, cfg, MIXED, lean=False, share_prefix=share_prefix)
        out, gen = run(model, cfg, MIXED, lean=True, share_prefix=share_prefix)
        assert gen.path.taken.startswith("lean"), gen.path.lean_blocker
        assert torch.equal(out, ref)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")
def test_lora_model_equals_generate(tok):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(build_tiny_model(tok, seed=1), lora).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    cfg = config([tok.eos_token_id], max_new_tokens=6)
    ref, _ = run(model, cfg, MIXED, lean=False, share_prefix=True)
    out, gen = run(model, cfg, MIXED, lean=True, share_prefix=True)
    assert gen.path.taken == "lean+shared_prefix", gen.path.lean_blocker
    assert torch.equal(out, ref)


def test_seeded_sampling_is_reproducible_and_independent_of_the_prefill(tok, model):
    cfg = config([tok.eos_token_id], top_k=50, temperature=0.9)
    first, _ = run(model, cfg, MIXED, lean=True, share_prefix=False, seed=3)
    again, _ = run(model, cfg, MIXED, lean=True, share_prefix=False, seed=3)
    shared, _ = run(model, cfg, MIXED, lean=True, share_prefix=True, seed=3)
    assert torch.equal(first, again) and torch.equal(first, shared)
    assert not torch.equal(first[0], first[2])  # rows of one prompt are sampled independently


# ---- the cache ----------------------------------------------------------------------------------------


def test_preallocated_layer_writes_in_place():
    layer = PreallocatedLayer(capacity=6)
    k1, v1 = torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5)
    k2, v2 = torch.randn(2, 3, 1, 5), torch.randn(2, 3, 1, 5)
    layer.update(k1, v1)
    buffer = layer._key_buffer.data_ptr()
    keys, values = layer.update(k2, v2)
    assert layer._key_buffer.data_ptr() == buffer and keys.data_ptr() == buffer  # a view, no copy
    assert torch.equal(keys, torch.cat([k1, k2], dim=-2)) and torch.equal(values, torch.cat([v1, v2], dim=-2))
    assert layer.get_seq_length() == 5 and layer.get_mask_sizes(1) == (6, 0)
    layer.crop(-2)
    assert layer.get_seq_length() == 3 and torch.equal(layer.keys, k1[:, :, :3])
    with pytest.raises(ValueError, match="holds 6 positions"):
        layer.update(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5))


def test_preallocated_cache_copies_the_shared_prefix(model):
    ids, mask = left_pad(MIXED)
    prefix = prefill_shared_prefix(model, group_prompts(ids, mask))
    cache = preallocated_cache(model, ids.shape[1] + 4, prefix)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == ids.shape[1] - 1
    for mine, given in zip(cache.layers, prefix.layers, strict=True):
        assert torch.equal(mine.keys, given.keys) and torch.equal(mine.values, given.values)


# ---- logits processing: HF's own processor list ---------------------------------------------------------


#: Whether transformers' repetition penalty leaves the tokens under left padding alone (from 5.20:
#: it takes a per-row prompt_ignore_length); posttrain's never penalises padding.
HF_PENALTY_SKIPS_PADDING = "Tensor" in str(
    __import__("inspect").signature(
        __import__("transformers").generation.logits_process.RepetitionPenaltyLogitsProcessor.__init__
    )
)

PROCESSOR_CASES = [
    {"temperature": 0.7},
    {"top_k": 5},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.8, "min_new_tokens": 3},
    {
        "temperature": 1.3,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "min_new_tokens": 2,
    },
    {"top_k": None},  # generate's default: the top 50
]


@pytest.mark.parametrize("options", PROCESSOR_CASES)
def test_processed_scores_equal_hf(model, options):
    """Against the processor list ``generate`` builds, on random logits, step after step."""
    options = dict(options)
    min_new = options.pop("min_new_tokens", None)
    cfg = GenerationConfig(
        do_sample=True,
        max_new_tokens=5,
        min_new_tokens=min_new,
        pad_token_id=PAD,
        eos_token_id=[2, 7],
        **options,
    )
    settings, reason = lean_settings(model, cfg)
    assert reason is None
    resolved, _ = model._prepare_generation_config(cfg)
    model._prepare_special_tokens(resolved, True, device="cpu")
    torch.manual_seed(0)
    vocab = 300
    ids = torch.randint(1, 40, (4, 7))  # small ids: many repeats for the penalty
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[3, :6] = 0
    if HF_PENALTY_SKIPS_PADDING:
        ids[1, :3] = 9  # under the padding: not penalised
    else:  # transformers < 5.20 penalised the padding too: pad with a token the row holds anyway
        for row in range(ids.shape[0]):
            ids[row][mask[row] == 0] = ids[row][mask[row].bool()][0]
    hf = model._get_logits_processor(
        resolved, input_ids_seq_length=7, device="cpu", model_kwargs={"attention_mask": mask}
    )
    mine = ScoreProcessor(settings, ids, mask, vocab)
    sequence = ids
    for step in range(5):
        logits = torch.randn(4, vocab) * 3
        logits[:, 2] = 10.0  # an EOS id on top: min_new_tokens must remove it
        expected = hf(sequence, logits.clone())
        got = mine(logits, step)
        assert torch.equal(got, expected), (step, options)
        tokens = sample_tokens(got)
        mine.observe(tokens)
        sequence = torch.cat([sequence, tokens[:, None]], dim=1)


# ---- sampling ------------------------------------------------------------------------------------------


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.25, 0.05, 0.0, 0.6, 0.0])
    draws = 20000
    torch.manual_seed(0)
    tokens = sample_tokens(probs.log().expand(draws, -1))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    for p, n in zip(probs.tolist(), counts.tolist(), strict=True):
        if p == 0:
            assert n == 0
        else:
            se = math.sqrt(p * (1 - p) / draws)
            assert abs(n / draws - p) < 4 * se, (p, n / draws)
    torch.manual_seed(0)
    assert torch.equal(sample_tokens(probs.log().expand(draws, -1)), tokens)  # the global RNG, reseeded


def test_sampling_never_picks_a_zero_probability_token(monkeypatch):
    """Even when ``rand * total`` rounds up to the total, and with zero-probability tokens last."""
    scores = torch.tensor([[0.0, -math.inf, 1.0, -math.inf, -math.inf]] * 3)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(*a, 1.0 - 2**-53, dtype=k["dtype"]))
    assert sample_tokens(scores).tolist() == [2, 2, 2]
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(*a, dtype=k["dtype"]))
    assert sample_tokens(scores).tolist() == [0, 0, 0]


# ---- fallbacks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"generation_kwargs": {"num_beams": 2}}, "beam search"),
        ({"generation_kwargs": {"no_repeat_ngram_size": 2}}, "no_repeat_ngram_size=2"),
        ({"generation_kwargs": {"typical_p": 0.9}}, "typical_p=0.9"),
        (
            {"generation_kwargs": {"output_scores": True, "return_dict_in_generate": True}},
            "output_scores=True",
        ),
        ({"generation_kwargs": {"use_cache": False}}, "use_cache=False"),
        ({"cache_implementation": "static"}, "cache_implementation='static'"),
    ],
)
def test_lean_settings_refuse_what_the_loop_lacks(tok, model, overrides, reason):
    settings, blocker = lean_settings(model, config([tok.eos_token_id], **overrides))
    assert settings is None and reason in blocker


def test_model_generation_config_is_resolved_like_generate(tok):
    model = build_tiny_model(tok)
    unset = GenerationConfig(
        do_sample=True, max_new_tokens=4, eos_token_id=tok.eos_token_id, pad_token_id=PAD
    )
    settings, _ = lean_settings(model, unset)
    assert settings.top_k == 50  # unset: generate's default
    model.generation_config.epsilon_cutoff = 3e-4
    assert "epsilon_cutoff" in lean_settings(model, config([tok.eos_token_id]))[1]


def test_sliding_window_model_falls_back(tok):
    cfg = MistralConfig(vocab_size=len(tok), **TINY_DECODER, sliding_window=4)
    assert "sliding-window" in lean_settings(MistralForCausalLM(cfg), config([tok.eos_token_id]))[1]


def test_fallback_runs_generate(tok, model):
    cfg = config([tok.eos_token_id], generation_kwargs={"no_repeat_ngram_size": 2})
    ref, _ = run(model, cfg, MIXED, lean=False, share_prefix=True)
    out, gen = run(model, cfg, MIXED, lean=True, share_prefix=True)
    assert gen.path.taken == "shared_prefix" and "no_repeat_ngram_size" in gen.path.lean_blocker
    assert torch.equal(out, ref)


def test_lean_generate_direct_call(tok, model):
    """The loop alone returns prompt and completion, like generate."""
    ids, mask = left_pad([A, B])
    settings = SamplingSettings(
        max_new_tokens=3, top_k=1, eos_token_ids=(tok.eos_token_id,), pad_token_id=PAD
    )
    out = lean_generate(model, ids, mask, settings)
    ref = model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config([tok.eos_token_id], max_new_tokens=3)
    )
    assert torch.equal(out, ref) and torch.equal(out[:, : ids.shape[1]], ids)


def test_top_k_zero_disables_the_filter(tok, model):
    """GRPOConfig.top_k=0 means every token is a candidate, not generate's fallback of top 50."""
    settings, reason = lean_settings(model, config([tok.eos_token_id], top_k=0))
    assert reason is None and settings.top_k == 0
    processors = model._get_logits_processor(
        generation_config=model._prepare_generation_config(config([tok.eos_token_id], top_k=0))[0],
        input_ids_seq_length=4,
        encoder_input_ids=torch.zeros(1, 4, dtype=torch.long),
        prefix_allowed_tokens_fn=None,
        logits_processor=None,
    )
    assert not any(type(p).__name__ == "TopKLogitsWarper" for p in processors)


# ---- distinct prompts with a common opening ------------------------------------------------------

OPENING = list(range(50, 70))  # 20 tokens every prompt starts with (a system message, an example)
DISTINCT = [OPENING + [71, 72, 73], OPENING + [81], OPENING + [91, 92, 93, 94, 95], OPENING + [101, 102]]


def test_common_prefix_length_counts_from_each_rows_start():
    ids, mask = left_pad(DISTINCT)
    assert common_prefix_length(ids, mask) == 20  # the shortest prompt keeps its last token
    ids, mask = left_pad([OPENING + [71], OPENING[:5]])
    assert common_prefix_length(ids, mask) == 4  # at most the shortest length minus one
    ids, mask = left_pad([[1, 2, 3], [4, 2, 3]])
    assert common_prefix_length(ids, mask) == 0
    right_padded = torch.tensor([[5, 6, 7], [5, 6, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert common_prefix_length(*right_padded) == 0  # not a left padding: no prefix is moved


def test_prefix_first_moves_only_the_padding():
    ids, mask = left_pad([[1, 2, 3, 4], [1, 2, 5]])
    moved_ids, moved_mask = prefix_first(ids, mask, 2)
    assert moved_ids.tolist() == [[1, 2, 3, 4], [1, 2, PAD, 5]]
    assert moved_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 1]]


@pytest.mark.parametrize("do_sample", [False, True])
def test_distinct_prompts_run_their_common_opening_once_with_the_plain_tokens(tok, model, do_sample):
    """Greedy and seeded sampling give the tokens of the path that runs every prompt whole, the
    opening runs once (one forward over 20 tokens, then the rest of each row)."""
    cfg = config([tok.eos_token_id], top_k=0, generation_kwargs={"do_sample": do_sample})
    ids, mask = left_pad(DISTINCT)
    plain_gen = TransformersGenerator(
        lambda: model, cfg, share_prefix=False, prepack_weights=False, lean=True
    )
    torch.manual_seed(4)
    plain = plain_gen.generate(ids, mask)
    shared_gen = TransformersGenerator(
        lambda: model, cfg, share_prefix=True, prepack_weights=False, lean=True
    )
    widths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        torch.manual_seed(4)
        shared = shared_gen.generate(ids, mask)
    finally:
        handle.remove()
    assert shared_gen.path.taken == "lean+common_prefix", shared_gen.path.prefix_blocker
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert widths[0] == (1, 20)  # the opening, once
    assert widths[1] == (len(DISTINCT), ids.shape[1] - 20)  # then every row's rest


def test_a_short_common_opening_takes_the_plain_path(tok, model):
    cfg = config([tok.eos_token_id])
    _, gen = run(model, cfg, [OPENING[:8] + [71], OPENING[:8] + [81, 82]], lean=True, share_prefix=True)
    assert gen.path.taken == "lean" and gen.path.prefix_blocker == "every prompt is distinct"


def test_sampling_reuses_its_buffers_without_changing_a_draw():
    """The kept buffers give the tokens of the inverse CDF computed in fresh tensors, call after
    call, with a narrower batch between (the buffer is then a prefix of the larger one)."""

    def fresh(scores: torch.Tensor) -> torch.Tensor:
        cdf = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:]
        u = torch.rand(total.shape, dtype=torch.float64) * total
        u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
        return torch.searchsorted(cdf, u, right=True).squeeze(-1)

    g = torch.Generator().manual_seed(1)
    for rows in (6, 2, 6):
        scores = torch.randn(rows, 300, generator=g) * 4
        scores[:, ::7] = -math.inf
        torch.manual_seed(rows)
        expected = fresh(scores)
        torch.manual_seed(rows)
        assert torch.equal(sample_tokens(scores), expected)
