"""The reduced-precision sampler: its decode step follows float32 within a stated tolerance, its
log-probs are those of what it sampled, its copy follows the weights, and GRPO trains with it.

Tolerances (largest |logit difference| over 5 decode steps of 4 rows, relative to the largest
|logit|, on the tiny families of ``test_fused_step``, whose weights are large on purpose): fp16
3e-3, bf16 3e-2 (8-bit mantissa), int8 0.2 (its activations are quantised per tensor in 7 bits;
on SmolLM2 the log-probs move by about 0.2 nats, docs/performance.md). A step that dropped a norm
or a rotation moves the logits by about the largest one, which each bound still catches.
"""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from test_fused_step import FAMILIES, compare_steps, family
from transformers import GPT2Config, GPT2LMHeadModel

from posttrain.generation import reduced_kernels, reduced_precision
from posttrain.generation.decode import (
    PreallocatedLayer,
    lean_generate_with_logps,
    lean_settings,
    preallocated_cache,
)
from posttrain.generation.fused_step import FusedDecoder
from posttrain.generation.reduced_precision import (
    ReducedCopy,
    configure_sampler,
    reduced_sampler_blocker,
    resolve_precision,
)
from posttrain.generation.transformers_backend import TransformersGenerator, sampling_config
from posttrain.models.compat import cache_argument

BACKENDS = [b for b in reduced_precision.REDUCED_BACKENDS if reduced_precision.backend_blocker(b) is None]
TOLERANCE = {"fp16": 3e-3, "bf16": 3e-2, "int8": 0.2}
PAD = 0


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def config(eos: int, new_tokens: int = 8, temperature: float = 1.0, top_k: int = 0):
    return sampling_config(
        max_new_tokens=new_tokens,
        temperature=temperature,
        top_p=1.0,
        top_k=top_k,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=PAD,
        eos_token_ids=[eos],
    )


# ---- the decode step ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", FAMILIES)
def test_reduced_step_logits_close_to_float32(tok, name, backend):
    model = family(name, tok)
    assert reduced_sampler_blocker(model, backend) is None
    compare_steps(
        model,
        tok,
        lambda m, rows: FusedDecoder(m, rows, backend),
        tolerance=TOLERANCE[backend],
        low_precision=True,
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_reduced_step_is_not_the_float32_step(tok, backend):
    """The copy really is reduced: its logits differ from float32's (so the tests above measure it)."""
    model = family("llama", tok)
    with pytest.raises(AssertionError):
        compare_steps(model, tok, lambda m, rows: FusedDecoder(m, rows, backend), tolerance=1e-6)


def test_the_bf16_copy_stacks_its_products_as_the_float32_weights_cast(tok):
    """``[q; k; v]`` and ``[gate; up]`` are cast block by block into one bf16 weight: the same packed
    weight as casting the float32 stack."""
    model = family("llama", tok)
    with torch.no_grad():
        decoder = FusedDecoder(model, 4, "bf16")
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        x = torch.randn(4, qkv.shape[1])
        for ours, stack in ((decoder.layers[1].qkv[0], qkv), (decoder.layers[1].gate_up[0], gate_up)):
            # oneDNN's packed layout is opaque: compare the products (the same kernel, bit for bit)
            expected = reduced_kernels.bf16_linear(x, reduced_kernels.bf16_pack(stack, 4))
            assert torch.equal(reduced_kernels.bf16_linear(x, ours), expected)


def test_auto_resolves_by_cpu_capability(monkeypatch):
    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    assert resolve_precision("auto") == "bf16"
    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: False)
    assert resolve_precision("auto") == "fp16"
    assert resolve_precision("int8") == "int8"
    with pytest.raises(ValueError, match="sampler_precision='int4' is not one of"):
        resolve_precision("int4")


# ---- the sampler's log-probs ------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sampler_logps_are_the_reduced_models_log_softmax_of_its_tokens(tok, backend, temperature):
    """Replay the sampled tokens through the same reduced step: the logps are its log-softmax."""
    model = family("llama", tok)
    eos = tok.eos_token_id
    ids, mask = helpers.left_pad([[11, 12, 13, 14], [21, 22, 23], [11, 12, 13, 14], [41, 42]], PAD)
    settings, reason = lean_settings(model, config(eos, temperature=temperature))
    assert reason is None
    fused = ReducedCopy(backend).decoder(model, ids.shape[0])
    torch.manual_seed(0)
    out, logps = lean_generate_with_logps(model, ids, mask, settings, fused=fused)
    completion = out[:, ids.shape[1] :]
    rows, width = ids.shape
    # replay: the prompt's forward gives the first token's logits, the reduced step the rest
    cache = preallocated_cache(model, width + completion.shape[1])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, **{cache_argument(model): cache}
        ).logits[:, -1]
        expected = []
        full = torch.cat([mask, mask.new_ones(rows, completion.shape[1])], dim=1)
        for step in range(completion.shape[1]):
            expected.append(
                torch.log_softmax(logits / temperature, -1).gather(1, completion[:, step, None])[:, 0]
            )
            pos = positions[:, -1] + step + 1
            logits = fused.step(completion[:, step], pos, full[:, : width + step + 1], cache.layers)
    expected = torch.stack(expected, dim=1)
    ended = torch.cumsum((completion == eos).int(), dim=1) - (completion == eos).int()  # after the EOS
    expected = expected.masked_fill(ended > 0, 0.0)
    torch.testing.assert_close(logps, expected, rtol=1e-5, atol=1e-5)
    assert (logps[ended == 0] < 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_generator_returns_sampler_logps_and_refreshes_the_copy(tok, backend):
    model = family("llama", tok)
    generator = TransformersGenerator(lambda: model, config(tok.eos_token_id), sampler_precision=backend)
    ids, mask = helpers.left_pad([[11, 12, 13, 14]] * 4, PAD)
    torch.manual_seed(0)
    first = generator.generate(ids, mask)
    assert first.logps is not None and first.logps.shape == first.completion_ids.shape
    assert generator.path.fused_blocker is None and generator.path.reduced_blocker is None
    assert generator.reduced.refreshes == 1 and generator.reduced.last_refresh_seconds > 0
    torch.manual_seed(0)
    again = generator.generate(ids, mask)  # same weights: the copy is kept, the samples repeat
    assert generator.reduced.refreshes == 1
    torch.testing.assert_close(again.logps, first.logps)
    # an optimizer step: fused AdamW writes the weights without moving their version counters
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model.train()
    logits = model(input_ids=ids, attention_mask=mask).logits
    logits.logsumexp(-1).mean().backward()
    optimizer.step()
    model.eval()
    generator.weights_changed()  # what GRPOTrainer calls after each optimizer step
    torch.manual_seed(0)
    after = generator.generate(ids, mask)
    assert generator.reduced.refreshes == 2
    assert not torch.allclose(after.logps[:, 0], first.logps[:, 0])


def test_copy_follows_weights_written_in_place(tok):
    """A weight changed in place (``load_state_dict``) rebuilds the copy without a signal."""
    model = family("llama", tok)
    copy = ReducedCopy(BACKENDS[0])
    first = copy.decoder(model, 4)
    assert copy.decoder(model, 4) is first
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert copy.decoder(model, 4) is not first and copy.refreshes == 2


def test_call_the_reduced_sampler_cannot_serve_warns_and_samples_float32(tok):
    model = family("llama", tok)
    generator = TransformersGenerator(lambda: model, config(tok.eos_token_id), sampler_precision="bf16")
    model.generate = (
        lambda **kwargs: torch.cat(  # a wrapper set on the instance
            [kwargs["input_ids"], kwargs["input_ids"][:, :2]], dim=1
        )
    )
    ids, mask = helpers.left_pad([[11, 12, 13]] * 2, PAD)
    with pytest.warns(UserWarning, match="sampler_precision='bf16' did not apply"):
        samples = generator.generate(ids, mask)
    assert samples.logps is None
    assert "replaced on the instance" in generator.path.reduced_blocker


# ---- blockers and configuration -------------------------------------------------------------------


def test_models_the_reduced_sampler_cannot_run(tok):
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    assert "model type" in reduced_sampler_blocker(gpt2, BACKENDS[0])
    generator = TransformersGenerator(lambda: gpt2, config(tok.eos_token_id))
    with pytest.raises(ValueError, match="cannot sample from this policy: model type 'gpt2'"):
        configure_sampler(generator, gpt2, BACKENDS[0])
    with pytest.warns(UserWarning, match="sampler_precision='auto' samples in float32 here"):
        assert configure_sampler(generator, gpt2, "auto") == "float32"
    assert generator.reduced is None


@pytest.mark.parametrize("value", ["int4", "fp8", 8, None])
def test_bad_sampler_precision_rejected(tmp_path, value):
    with pytest.raises(ValueError, match=f"sampler_precision={value!r} is invalid"):
        helpers.make_config(tmp_path, sampler_precision=value)


def test_reduced_sampler_with_continuous_batching_rejected(tmp_path):
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True replaces"):
        helpers.make_config(tmp_path, sampler_precision="fp16", use_transformers_continuous_batching=True)


def test_reduced_sampler_without_the_correction_warns(tmp_path):
    with pytest.warns(UserWarning, match="with vllm_importance_sampling_correction=False"):
        helpers.make_config(tmp_path, sampler_precision="fp16", vllm_importance_sampling_correction=False)


def test_reduced_sampler_with_tools_rejected(tmp_path, tok):
    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first.
            b: second.
        """
        return a + b

    args = helpers.make_config(tmp_path, sampler_precision="fp16")
    with pytest.raises(ValueError, match="but tools generate the completions another way"):
        helpers.make_trainer(tok, helpers.length_reward, args, tools=[add])


# ---- GRPO end to end ---------------------------------------------------------------------------------


def first_token_reward(completion_ids, **kwargs):
    """Spread within a group (a length reward is flat at max_completion_length for a tiny model)."""
    return [float(ids[0] % 5) if ids else 0.0 for ids in completion_ids]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_trains_two_steps_with_the_reduced_sampler(tmp_path, tok, backend):
    args = helpers.make_config(tmp_path, sampler_precision=backend, max_completion_length=8)
    trainer = helpers.make_trainer(tok, first_token_reward, args, model=build_tiny_model(tok))
    assert trainer.sampler_precision == backend
    generator = trainer.generator
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert generator.reduced.refreshes == 2  # one copy per optimizer step's weights
    assert generator.path.reduced_blocker is None
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in e]
    assert len(logged) == 2
    for entry in logged:
        assert (
            0.0
            <= entry["sampling/sampling_logp_difference/mean"]
            <= entry["sampling/sampling_logp_difference/max"]
        )
        assert entry["sampling/importance_sampling_ratio/min"] > 0.0
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed


@pytest.mark.parametrize("steps_per_generation", [None, 1])
def test_the_copy_is_freed_before_the_loss_when_an_optimizer_step_follows(
    tmp_path, tok, steps_per_generation
):
    # gradient_accumulation_steps=2: one sampling per optimizer step frees the copy before the loss
    # (the step makes it stale anyway); one per micro-step keeps it for the step's second sampling
    args = helpers.make_config(
        tmp_path,
        sampler_precision="fp16",
        max_completion_length=8,
        max_steps=2,
        gradient_accumulation_steps=2,
        steps_per_generation=steps_per_generation,
    )
    trainer = helpers.make_trainer(tok, first_token_reward, args, model=build_tiny_model(tok))
    copy = trainer.generator.reduced
    held = []
    compute_loss = trainer.compute_loss

    def recording(*a, **k):
        held.append(copy.in_memory)
        return compute_loss(*a, **k)

    trainer.compute_loss = recording
    trainer.train()
    assert len(held) == 4  # 2 optimizer steps x 2 micro-steps
    if steps_per_generation is None:  # steps_per_generation = gradient_accumulation_steps
        assert held == [False] * 4
    else:
        assert held == [True] * 4
    assert copy.refreshes == 2  # one build per optimizer step's weights either way


def test_grpo_default_samples_float32_without_sampler_logps(tmp_path, tok):
    args = helpers.make_config(tmp_path, max_steps=1)
    trainer = helpers.make_trainer(tok, helpers.length_reward, args, model=build_tiny_model(tok))
    assert trainer.sampler_precision == "float32" and trainer.generator.reduced is None
    trainer.train()
    assert not any("sampling/sampling_logp_difference/mean" in e for e in trainer.state.log_history)


# ---- bf16 training: the decode steps sample from a bf16 copy where the CPU has bf16 -----------------


@pytest.mark.parametrize("host_has_bf16", [True, False])
def test_bf16_training_samples_from_a_bf16_copy_where_the_cpu_has_bf16(
    tmp_path, tok, monkeypatch, host_has_bf16
):
    """Under ``bf16=True`` the forward is wrapped in autocast; the fused step used to refuse it and
    generation fell back to ``generate`` (4.6x slower on an AVX512-BF16 host). Now the decode steps
    run a bf16 copy through the fused step, their log-probs feed the IS correction, and on a CPU
    without bf16 instructions nothing changes (the policy itself samples, no sampler log-probs).
    Where the host has no bf16 products, oneDNN's packing is absent and the copy multiplies with
    ``F.linear`` in bf16 (slow but the same arithmetic), so both cases run on every host."""
    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: host_has_bf16)
    args = helpers.make_config(tmp_path, bf16=True, max_completion_length=8)
    trainer = helpers.make_trainer(tok, first_token_reward, args, model=build_tiny_model(tok))
    generator = trainer.generator
    assert generator.autocast_dtype is torch.bfloat16
    assert trainer.sampler_precision == ("bf16" if host_has_bf16 else "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the trainer's own choice: no sampler warning
        warnings.filterwarnings("ignore", message=".*(autocast|bf16|mixed precision).*")
        trainer.train()
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/mean" in e]
    if host_has_bf16:
        assert generator.path.taken.startswith("lean") and generator.path.fused_blocker is None
        assert generator.reduced.refreshes == 2 and generator.path.reduced_blocker is None
        assert len(logged) == 2
        # the bf16 copy against the autocast forward: the same arithmetic in bf16 products (equal
        # on this tiny model where the products' kernels agree; within bf16 rounding elsewhere)
        assert all(0.0 <= e["sampling/sampling_logp_difference/mean"] < 0.1 for e in logged)
    else:
        assert generator.reduced is None and logged == []


def test_the_bf16_samplers_cache_stays_float32_after_an_autocast_prefill(tmp_path, tok, monkeypatch):
    """Under ``bf16=True`` the prompt's prefill runs the model under autocast, whose ``v_proj`` writes
    bf16 values; the cache used to take that dtype, and every decode step then ran the attention's
    value product in bf16 (4x slower for 8 rows here) on values rounded to bf16. The fused step's
    copying backends ask for a float32 cache: the prefill's values are widened exactly, and the
    steps' own keys and values are kept unrounded."""
    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    layer = PreallocatedLayer(6, torch.float32)
    k, v = torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8).bfloat16()
    keys, values = layer.update(k, v)
    assert values.dtype == keys.dtype == torch.float32 and torch.equal(values, v.float())
    seen = set()
    attend = FusedDecoder._attend

    def spy(self, layer, q, keys, values, bias):
        seen.add((self.backend, keys.dtype, values.dtype))
        return attend(self, layer, q, keys, values, bias)

    monkeypatch.setattr(FusedDecoder, "_attend", spy)
    args = helpers.make_config(tmp_path, bf16=True, max_steps=1, max_completion_length=8)
    trainer = helpers.make_trainer(tok, first_token_reward, args, model=build_tiny_model(tok))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(autocast|bf16|mixed precision).*")
        trainer.train()
    assert seen == {("bf16", torch.float32, torch.float32)}


@pytest.mark.parametrize("host_has_bf16", [True, False])
def test_bf16_lora_training_samples_and_is_evaluated_in_float32(tmp_path, tok, monkeypatch, host_has_bf16):
    """A LoRA policy under ``bf16=True``: accelerate wraps the ``PeftModel``'s forward in autocast,
    not the model under it. The fused step took that inner model for its float32 copy while the
    prompts' prefill ran the wrapped forward and left a bf16 cache, which oneDNN's float32 product
    refused: ``posttrain grpo --use_peft`` failed in its evaluation after training on a bf16 host,
    and in training's sampling where the host has no bf16. Now the wrapped PEFT forward rules the
    float32 step out, and the held-out evaluation sets the wrapper aside (the model in float32,
    as before training, through the fused step)."""
    from datasets import Dataset
    from peft import LoraConfig

    from posttrain.generation.fused_blockers import peft_wrapper_blocker
    from posttrain.ops.padding import left_pad
    from posttrain.rewards import evaluate

    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: host_has_bf16)
    args = helpers.make_config(tmp_path, bf16=True, max_steps=1, max_completion_length=8)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    trainer = helpers.make_trainer(
        tok, first_token_reward, args, model=build_tiny_model(tok), peft_config=lora
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(autocast|bf16|mixed precision).*")
        trainer.train()
    model = trainer.model
    wrapper = model.__dict__["forward"]  # accelerate's autocast around the PEFT model
    assert "PEFT model's forward is wrapped" in peft_wrapper_blocker(model, "onednn", None)
    assert peft_wrapper_blocker(model, "plain", torch.bfloat16) is None  # the step under the same autocast
    ids, mask = left_pad(
        [tok("What is 2 + 2?")["input_ids"], tok("And 3 + 1?")["input_ids"]], tok.pad_token_id
    )
    wrapped = TransformersGenerator(lambda: model, config(tok.eos_token_id, new_tokens=40, top_k=1))
    wrapped.generate(ids, mask)  # no autocast given: the model's forward at each step
    assert "PEFT model's forward is wrapped" in wrapped.path.fused_blocker

    seen, paths = [], []
    monkeypatch.setattr(evaluate, "answer_format_reward", lambda completions: [0.0] * len(completions))
    monkeypatch.setattr(evaluate, "answer_accuracy_reward", lambda c, s: seen.extend(c) or [])
    generate = evaluate.TransformersGenerator.generate

    def spy(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        paths.append((self.path.taken, self.path.fused_blocker))
        return out

    monkeypatch.setattr(evaluate.TransformersGenerator, "generate", spy)
    data = Dataset.from_dict({"prompt": ["What is 2 + 2?", "And 3 + 1?"], "solution": ["4", "4"]})
    evaluate.task_accuracy(model, tok, data, max_new_tokens=40)
    assert paths == [("lean", None)]  # the fused step, float32
    assert model.__dict__["forward"] is wrapper  # the wrapper is back for training
    del model.forward  # the PEFT model's own float32 forward: the same greedy completions
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    assert seen == tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)


def test_bf16_training_with_other_sampling_sources_keeps_the_policy(tok, monkeypatch):
    """Tools, environments and ``rollout_func`` get no bf16 copy: their turns would reach it
    without its log-probs (the IS correction would not see the copy's mismatch)."""
    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    model = family("llama", tok)
    generator = TransformersGenerator(lambda: model, config(tok.eos_token_id), autocast_dtype=torch.bfloat16)
    assert configure_sampler(generator, model, "float32", own_sampling=False) == "float32"
    assert generator.reduced is None
    assert configure_sampler(generator, model, "float32") == "bf16" and generator.reduced.backend == "bf16"
    float32_generator = TransformersGenerator(lambda: model, config(tok.eos_token_id))
    assert configure_sampler(float32_generator, model, "float32") == "float32"  # float32 training


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lora_policy_samples_from_a_copy_with_its_adapter_merged(tok, backend):
    """A PEFT policy (one active LoRA adapter): the copy is the base weights with the adapter
    merged in, so the sampler's log-probs are the adapted model's, not the base model's; an
    optimizer step on the adapter rebuilds it."""
    from test_fused_step import adapted

    model = adapted(family("llama", tok), 0.2, r=4)
    assert reduced_sampler_blocker(model, backend) is None
    generator = TransformersGenerator(lambda: model, config(tok.eos_token_id), sampler_precision=backend)
    ids, mask = helpers.left_pad([[11, 12, 13, 14]] * 4, PAD)
    torch.manual_seed(0)
    out = generator.generate(ids, mask)
    assert generator.path.fused_blocker is None and generator.path.reduced_blocker is None
    completion = out.completion_ids
    eos = (completion == tok.eos_token_id).int()
    live = (eos.cumsum(1) - eos) == 0  # up to and with the EOS

    def gap() -> float:  # the largest distance to the model's own log-probs of the sampled tokens
        with torch.no_grad():
            logits = model(input_ids=torch.cat([ids, completion], 1)).logits[:, ids.shape[1] - 1 : -1]
        own = torch.log_softmax(logits.float(), -1).gather(-1, completion[..., None])[..., 0]
        return float((out.logps - own).abs()[live].max())

    adapted_gap = gap()
    with model.disable_adapter():
        base_gap = gap()
    assert adapted_gap < TOLERANCE[backend] * 10 < base_gap, (adapted_gap, base_gap)
    with torch.no_grad():  # an optimizer step on the adapter, then the trainer's signal
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)
    generator.weights_changed()
    generator.generate(ids, mask)
    assert generator.reduced.refreshes == 2


@pytest.mark.parametrize("family", ["rloo", "online_dpo", "a2po"])
@pytest.mark.parametrize("host_has_bf16", [True, False])
def test_other_online_families_sample_from_a_bf16_copy_under_bf16(
    tmp_path, monkeypatch, family, host_has_bf16
):
    """RLOO, online DPO and A*-PO under ``bf16=True``: on a CPU with bf16 instructions the decode
    steps run a bf16 copy through the fused step, as GRPO's do (under autocast they had cast every
    weight at every token: RLOO's bf16 step was 1.34x its float32 step on an AVX512-BF16 host,
    BENCHMARKS.md session 27); elsewhere, and in float32 training, the policy itself samples."""
    from test_a2po import a2po_trainer
    from test_online_dpo import dpo_trainer
    from test_rloo import rloo_trainer

    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: host_has_bf16)
    build = {
        "rloo": lambda bf16: rloo_trainer(tmp_path / str(bf16), script=None, bf16=bf16),
        "online_dpo": lambda bf16: dpo_trainer(tmp_path / str(bf16), script=None, config={"bf16": bf16}),
        "a2po": lambda bf16: a2po_trainer(tmp_path / str(bf16), generator=None, bf16=bf16),
    }[family]
    generator = build(True).generator
    assert generator.autocast_dtype is torch.bfloat16
    if host_has_bf16:
        assert generator.reduced is not None and generator.reduced.backend == "bf16"
    else:
        assert generator.reduced is None
    assert build(False).generator.reduced is None  # float32 training: the policy samples


def test_rloo_trains_under_bf16_on_the_bf16_copy(tmp_path, monkeypatch):
    from test_rloo import rloo_trainer

    monkeypatch.setattr(reduced_kernels, "native_bf16", lambda: True)
    trainer = rloo_trainer(tmp_path, script=None, bf16=True, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    generator = trainer.generator
    assert generator.path.taken.startswith("lean") and generator.path.fused_blocker is None
    assert generator.reduced.refreshes == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_under_bf16_autocast_the_bf16_copy_computes_the_mlp_middle_as_autocast(tok, name, monkeypatch):
    """Trained under bf16 autocast, the model's MLP applies its activation to the bf16 gate and
    multiplies by the bf16 up in bf16; the bf16 copy does the same (and skips two casts), where
    float32 training's copy keeps the middle in float32. With the products in the kernel autocast
    runs (plain bf16 ``F.linear``, no oneDNN packing) the MLP equals autocast's bit for bit."""
    monkeypatch.setattr(reduced_kernels, "onednn_bf16_packable", lambda: False)
    model = family(name, tok)
    layer = model.model.layers[1].mlp
    x = torch.randn(4, layer.gate_proj.in_features)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = layer(x).float()
        trained_bf16 = FusedDecoder(model, 4, "bf16", autocast_dtype=torch.bfloat16)
        trained_float32 = FusedDecoder(model, 4, "bf16")
        assert trained_bf16.bf16_middle and not trained_float32.bf16_middle
        # the bf16 copy's MLP output is bf16 (the residual addition widens it)
        assert torch.equal(trained_bf16._mlp(x, trained_bf16.layers[1]).float(), expected)
        middle_in_float32 = trained_float32._mlp(x, trained_float32.layers[1]).float()
    assert not torch.equal(middle_in_float32, expected)
    torch.testing.assert_close(
        middle_in_float32, expected, rtol=0.05, atol=0.05 * expected.abs().max().item()
    )
