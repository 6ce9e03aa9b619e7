"""Chunked log-probs and entropy from hidden states (ops/chunked.py) against the full-logits path.

The naive path (``chunk_size=None``) takes ``log_softmax`` over the model's own ``[B, T, V]``
logits; the chunked path must give the same values and the same gradient for every parameter,
while never saving a ``[B, T, V]``-sized tensor for backward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.models import reference as model_options
from posttrain.models.compat import enable_model_checkpointing
from posttrain.ops import chunked, head_forward
from posttrain.ops.logprobs import completion_logps

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

B, P, T = 3, 6, 13  # B * T = 39 token rows: chunk sizes 5, 7 and 16 do not divide it
TEMPERATURE = 0.7
ENTROPY_COEF = 0.3
EXACT = {"rtol": 1e-5, "atol": 1e-5}  # values, float32
GRAD = {"rtol": 1e-5, "atol": 1e-6}  # gradients, float32


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def tiny(tok, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """The conftest Llama, optionally with the LM head tied to the input embeddings."""
    model = build_tiny_model(tok, seed=seed)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def batch(vocab: int, b: int = B, p: int = P, t: int = T, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random ids; left padding in two prompts, right padding in two completions."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(b, p, dtype=torch.long)
    prompt_mask[0, :3] = 0
    prompt_mask[-1, :1] = 0
    completion_mask = torch.ones(b, t, dtype=torch.long)
    completion_mask[1, t // 2 :] = 0
    completion_mask[-1, -2:] = 0
    return {
        "prompt_ids": torch.randint(0, vocab, (b, p), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, vocab, (b, t), generator=g),
        "completion_mask": completion_mask,
    }


def logps_of(model, inputs, chunk_size, **kwargs):
    kwargs.setdefault("temperature", TEMPERATURE)
    return completion_logps(model, **inputs, chunk_size=chunk_size, **kwargs)


def loss_of(out, inputs) -> torch.Tensor:
    """A weighted sum of log-probs plus an entropy term, masked like the GRPO loss."""
    mask = inputs["completion_mask"].float()
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view(mask.shape)  # [B, T], mixed signs
    loss = (out.logps * weights * mask).sum()
    if out.entropy is not None and out.entropy.requires_grad:
        loss = loss + ENTROPY_COEF * (out.entropy * mask).sum()
    return loss


def grads(model, inputs, chunk_size, **kwargs) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient of ``loss_of``."""
    model.zero_grad(set_to_none=True)
    loss_of(logps_of(model, inputs, chunk_size, **kwargs), inputs).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same_grads(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=lambda m, n=name: f"{n}: {m}", **(tol or GRAD))


# ---- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 1024])
def test_values_equal_the_full_logits_path(tok, tied, chunk_size):
    model = tiny(tok, tied)
    inputs = batch(len(tok))
    assert chunked.supports_chunked(model)
    with torch.no_grad():
        want = logps_of(model, inputs, None, with_entropy=True)
        got = logps_of(model, inputs, chunk_size, with_entropy=True)
    torch.testing.assert_close(got.logps, want.logps, **EXACT)
    torch.testing.assert_close(got.entropy, want.entropy, **EXACT)
    assert got.logps.shape == (B, T) and got.logps.dtype == torch.float32


def test_values_by_hand_from_the_logits(tok):
    """log p = log_softmax(lm_head(h) / temperature)[target], H = -sum p log p, from explicit logits."""
    model = tiny(tok)
    inputs = batch(len(tok))
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, P - 1 : -1]
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)  # [B, T, V]
        want = logp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        got = logps_of(model, inputs, 7, with_entropy=True)
    torch.testing.assert_close(got.logps, want, **EXACT)
    torch.testing.assert_close(got.entropy, -(logp.exp() * logp).sum(-1), **EXACT)


def test_entropy_only_when_asked(tok):
    model = tiny(tok)
    inputs = batch(len(tok))
    assert logps_of(model, inputs, 8).entropy is None
    out = logps_of(model, inputs, 8, with_entropy=True)
    assert out.logps.requires_grad and not out.entropy.requires_grad
    assert logps_of(model, inputs, 8, with_entropy=True, entropy_grad=True).entropy.requires_grad


# ---- gradients ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_gradients_equal_the_full_logits_path(tok, tied, entropy_grad):
    model = tiny(tok, tied)
    inputs = batch(len(tok))
    kwargs = {"with_entropy": True, "entropy_grad": entropy_grad}
    want = grads(model, inputs, None, **kwargs)
    got = grads(model, inputs, 5, **kwargs)
    assert_same_grads(got, want)
    if tied:  # one parameter gets both the embedding's and the head's share
        assert "lm_head.weight" not in got and "model.embed_tokens.weight" in got


def test_the_entropy_term_changes_the_gradient(tok):
    """Guards the test above: with entropy_grad the entropy's gradient is really there."""
    model = tiny(tok)
    inputs = batch(len(tok))
    without = grads(model, inputs, 5, with_entropy=True)
    with_ent = grads(model, inputs, 5, with_entropy=True, entropy_grad=True)
    assert (without["lm_head.weight"] - with_ent["lm_head.weight"]).abs().max() > 1e-4


@pytest.mark.parametrize("with_entropy", [False, True])
def test_kernel_gradcheck_with_bias(with_entropy):
    """Float64 finite differences of the autograd Function itself, bias included, both outputs."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=g)

    def f(h, w, b):
        return chunked.TokenStats.apply(h, w, b, targets, 1.3, 3, with_entropy, with_entropy)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_kernel_with_bias_equals_log_softmax():
    g = torch.Generator().manual_seed(1)
    hidden, weight, bias = torch.randn(2, 5, 4, generator=g), torch.randn(9, 4, generator=g), torch.randn(9)
    targets = torch.randint(0, 9, (2, 5), generator=g)
    logps, entropy = chunked.token_stats(hidden, weight, bias, targets, 0.5, 3, with_entropy=True)
    logp = torch.log_softmax((hidden @ weight.T + bias) / 0.5, dim=-1)  # [2, 5, 9]
    torch.testing.assert_close(logps, logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), **EXACT)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), **EXACT)


def test_bad_chunk_size_is_refused():
    with pytest.raises(ValueError, match="chunk_size"):
        chunked.token_stats(
            torch.zeros(2, 3), torch.zeros(4, 3), None, torch.zeros(2, dtype=torch.long), 1.0, 0
        )


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(tok, reentrant):
    plain, ckpt = tiny(tok), tiny(tok)
    enable_model_checkpointing(ckpt, {"use_reentrant": reentrant})
    ckpt.enable_input_require_grads()
    ckpt.train()
    inputs = batch(len(tok))
    kwargs = {"with_entropy": True, "entropy_grad": True}
    assert_same_grads(grads(ckpt, inputs, 5, **kwargs), grads(plain, inputs, None, **kwargs))


def test_float32_head_on_a_bfloat16_model(tok):
    """cast_lm_head_to_fp32: bf16 hidden states, float32 head; both paths project in float32."""
    model = tiny(tok).to(torch.bfloat16)
    model_options.cast_lm_head_to_fp32(model)
    assert model.lm_head.weight.dtype == torch.float32 and chunked.supports_chunked(model)
    inputs = batch(len(tok))
    kwargs = {"with_entropy": True, "entropy_grad": True}
    with torch.no_grad():
        want, got = logps_of(model, inputs, None, **kwargs), logps_of(model, inputs, 5, **kwargs)
    torch.testing.assert_close(got.logps, want.logps, **EXACT)
    torch.testing.assert_close(got.entropy, want.entropy, **EXACT)
    got_g, want_g = grads(model, inputs, 5, **kwargs), grads(model, inputs, None, **kwargs)
    torch.testing.assert_close(got_g["lm_head.weight"], want_g["lm_head.weight"], **GRAD)
    assert got_g["lm_head.weight"].dtype == torch.float32
    assert_same_grads(got_g, want_g, rtol=1e-2, atol=1e-3)  # at most the bf16 backbone's rounding


# ---- memory: nothing of [B, T, V] size is kept for backward -------------------------------------


def saved_for_backward(model, inputs, chunk_size) -> list[torch.Tensor]:
    """Every tensor autograd saves for backward during the forward pass of the loss."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_of(logps_of(model, inputs, chunk_size, with_entropy=True, entropy_grad=True), inputs)
    return saved


def test_no_vocabulary_sized_tensor_is_saved(tok):
    """Nothing vocabulary-wide is kept for backward but the head weight itself (a parameter)."""
    model = tiny(tok)
    b, t, vocab = 4, 16, len(tok)
    inputs = batch(vocab, b=b, t=t)
    logits_numel = b * t * vocab  # [B, T, V]

    def vocab_wide(saved):  # tensors with a V-sized dimension, the head weight left out
        weight = model.lm_head.weight
        return [x for x in saved if vocab in x.shape and x.data_ptr() != weight.data_ptr()]

    naive = vocab_wide(saved_for_backward(model, inputs, None))
    assert sum(x.numel() for x in naive) >= logits_numel  # the check does see the naive path's logits
    saved = saved_for_backward(model, inputs, 16)
    assert vocab_wide(saved) == []
    assert max(x.numel() for x in saved) < logits_numel


# ---- which models go where -------------------------------------------------------------------


def test_softcapping_goes_to_the_naive_path(tok):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        final_logit_softcapping=0.5,  # small so it changes the log-probs a lot
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
    )
    model = Gemma2ForCausalLM(config)
    assert not chunked.supports_chunked(model)
    inputs = batch(len(tok))
    with torch.no_grad():
        want, got = logps_of(model, inputs, None), logps_of(model, inputs, 5)
    torch.testing.assert_close(got.logps, want.logps, rtol=0, atol=0)


@pytest.mark.parametrize("field,value", [("logit_scale", 0.25), ("logits_scaling", 4.0)])
def test_known_logit_scalings_are_refused(tok, field, value):
    model = tiny(tok)
    setattr(model.config, field, value)
    assert not chunked.supports_chunked(model)


class ScaledLlama:
    """A Llama whose forward rescales its logits, unknown to supports_chunked."""

    @staticmethod
    def build(tok):
        from transformers import LlamaForCausalLM

        class Scaled(LlamaForCausalLM):
            def forward(self, *args, **kwargs):
                out = super().forward(*args, **kwargs)
                out.logits = out.logits * 3.0
                return out

        base = tiny(tok)
        model = Scaled(base.config)
        model.load_state_dict(base.state_dict())
        return model


def test_an_unknown_logit_transform_is_caught_at_the_first_call(tok):
    model = ScaledLlama.build(tok)
    assert chunked.supports_chunked(model)  # the config says nothing
    inputs = batch(len(tok))
    with pytest.warns(UserWarning, match="computes its logits differently"):
        first = logps_of(model, inputs, 5, with_entropy=True)
    want = logps_of(model, inputs, None, with_entropy=True)
    torch.testing.assert_close(first.logps, want.logps, rtol=0, atol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the verdict is remembered
        again = logps_of(model, inputs, 5)
    torch.testing.assert_close(again.logps, want.logps, rtol=0, atol=0)


def test_a_plain_model_passes_the_first_call_check_silently(tok):
    model = tiny(tok)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logps_of(model, batch(len(tok)), 5)
    assert head_forward._VERIFIED[model] is True


def test_bf16_logits_are_judged_at_bf16_precision(tok):
    """Under autocast the model's logits are bf16 from its own GEMM (on a GPU another kernel than
    ours, so other roundings): one bf16 step apart still matches; a transform does not."""
    from types import SimpleNamespace

    model = tiny(tok)
    hidden = torch.randn(4, 3, model.config.hidden_size)
    head = model.get_output_embeddings()
    with torch.no_grad():
        exact = torch.nn.functional.linear(hidden[:, -1], head.weight).mul(40.0)
        head.weight.mul_(40.0)  # logits of tens of units, where bf16's step is 0.125 or more
        bf16 = exact.to(torch.bfloat16)
        one_step_off = torch.nextafter(bf16, torch.full_like(bf16, float("inf")))
    assert chunked.logits_match_head(model, SimpleNamespace(logits=one_step_off[:, None]), hidden)
    scaled = tiny(tok)
    with torch.no_grad():
        scaled.get_output_embeddings().weight.mul_(40.0)
    with pytest.warns(UserWarning, match="computes its logits differently"):
        assert not chunked.logits_match_head(
            scaled, SimpleNamespace(logits=(bf16.float() * 1.5).to(torch.bfloat16)[:, None]), hidden
        )


def bf16_grpo(tmp_path, tok):
    """A one-step GRPOTrainer with ``bf16=True`` on the tiny model."""
    from helpers import make_config, standard_dataset

    from posttrain import GRPOTrainer

    return GRPOTrainer(
        model=tiny(tok),
        reward_funcs=lambda completion_ids, **kw: [float(sum(c) % 3) for c in completion_ids],
        args=make_config(tmp_path, bf16=True, max_steps=1),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


def test_the_trainers_bf16_autocast_keeps_the_chunked_path(tmp_path, tok):
    """bf16=True: accelerate wraps the forward in autocast and casts the logits back to float32;
    the check must still judge them at bf16 precision (it sent every such run to full logits)."""
    trainer = bf16_grpo(tmp_path, tok)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert not [w for w in caught if "computes its logits differently" in str(w.message)]
    assert head_forward._VERIFIED[chunked.causal_lm(trainer.model)] is True


# ---- bf16 head products (bf16=True where bf16 is native) ----------------------------------------


@pytest.mark.parametrize("with_entropy", [False, True])
def test_bf16_products_give_float32_statistics_of_the_bf16_logits(with_entropy):
    """``product_dtype=bf16``: the vocabulary products in bf16, the softmax statistics in float32.

    The values equal float32 log-softmax of the bf16 product's logits; the gradients equal
    autograd's through that same computation (bf16 products there too) within bf16 rounding; the
    gradients come back in the inputs' float32. And the products did run in bf16: the values
    differ from the float32 head's by bf16's rounding, not by float32's.
    """
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 24, generator=g, requires_grad=True)
    weight = torch.randn(300, 24, generator=g).mul_(0.5).requires_grad_()
    targets = torch.randint(0, 300, (37,), generator=g)
    coef = torch.linspace(-1.0, 2.0, 37)

    def loss(logps, entropy):
        return (logps * coef).sum() + (ENTROPY_COEF * entropy.sum() if entropy is not None else 0)

    logps, entropy = chunked.token_stats(
        hidden,
        weight,
        None,
        targets,
        TEMPERATURE,
        16,
        with_entropy,
        with_entropy,
        product_dtype=torch.bfloat16,
    )
    got = torch.autograd.grad(loss(logps, entropy), (hidden, weight))
    z = torch.nn.functional.linear(hidden.bfloat16(), weight.bfloat16()).float() / TEMPERATURE
    logp = torch.log_softmax(z, dim=-1)
    want_logps = logp.gather(1, targets[:, None]).squeeze(1)
    want_entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    want = torch.autograd.grad(loss(want_logps, want_entropy), (hidden, weight))
    torch.testing.assert_close(logps, want_logps, **EXACT)
    if with_entropy:
        torch.testing.assert_close(entropy, want_entropy, **EXACT)
    for ours, theirs in zip(got, want, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2 * theirs.abs().max().item())
    fp32_logps, _ = chunked.token_stats(hidden, weight, None, targets, TEMPERATURE, 16)
    gap = (logps - fp32_logps).abs().max().item()
    assert 1e-4 < gap < 0.2  # bf16's rounding of the logits, not float32's


def test_head_product_dtype_follows_bf16_autocast_where_bf16_is_native(tok, monkeypatch):
    """bf16 only when the model's forward ran under bf16 autocast and the host multiplies bf16 natively."""
    from posttrain.ops import precision

    model = tiny(tok)
    ids = torch.randint(0, model.config.vocab_size, (2, 5))

    def after_forward(autocast: torch.dtype | None) -> torch.dtype | None:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            chunked.run_with_hidden(model, input_ids=ids)
        return chunked.head_product_dtype(model)

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    assert after_forward(torch.bfloat16) is torch.bfloat16
    assert after_forward(None) is None
    assert after_forward(torch.float16) is None  # float16's gradients need the loss scaler's range
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    assert after_forward(torch.bfloat16) is None  # emulated bf16 is slower than float32


def test_the_trainers_bf16_loss_runs_the_head_in_bf16(tmp_path, tok, monkeypatch):
    """GRPO with bf16=True on a (pretended) bf16 host: the chunked head gets bf16 products."""
    from posttrain.ops import precision

    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    seen: list[torch.dtype | None] = []
    original = chunked.token_stats

    def spy(*args, **kwargs):
        seen.append(kwargs.get("product_dtype"))
        return original(*args, **kwargs)

    monkeypatch.setattr(chunked, "token_stats", spy)
    bf16_grpo(tmp_path, tok).train()
    assert seen and set(seen) == {torch.bfloat16}


# ---- PEFT, DDP, Mixture of Experts -----------------------------------------------------------


def test_lora_on_the_lm_head_goes_to_the_naive_path(tok):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny(tok), cfg)
    assert not chunked.supports_chunked(model)
    cfg = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    assert not chunked.supports_chunked(peft.get_peft_model(tiny(tok), cfg))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_on_attention_goes_through_the_chunked_path(tok, checkpointing, monkeypatch):
    peft = pytest.importorskip("peft")
    base = tiny(tok)
    nn_init = torch.Generator().manual_seed(3)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, cfg)
    for name, param in model.named_parameters():  # lora_B starts at zero: give it a gradient path
        if "lora_B" in name:
            param.data = torch.randn(param.shape, generator=nn_init) * 0.1
    if checkpointing:
        enable_model_checkpointing(base, {"use_reentrant": True})
        model.enable_input_require_grads()
        model.train()
    assert chunked.supports_chunked(model)
    calls = []
    real = chunked.TokenStats.apply
    monkeypatch.setattr(chunked.TokenStats, "apply", lambda *a: calls.append(1) or real(*a))
    inputs = batch(len(tok))
    kwargs = {"with_entropy": True, "entropy_grad": True}
    got = grads(model, inputs, 5, **kwargs)
    assert calls
    want = grads(model, inputs, None, **kwargs)
    assert all("lora_" in n for n in got)
    assert_same_grads(got, want)
    with torch.no_grad(), model.disable_adapter():  # the PEFT reference: the base model
        torch.testing.assert_close(
            logps_of(model, inputs, 5).logps, logps_of(tiny(tok), inputs, None).logps, **EXACT
        )


def test_ddp_wrapped_model(tok, tmp_path):
    """Through DistributedDataParallel (one gloo process): chunked, same gradients."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        plain = tiny(tok)
        ddp = torch.nn.parallel.DistributedDataParallel(tiny(tok))
        assert chunked.supports_chunked(ddp) and chunked.causal_lm(ddp) is ddp.module
        inputs = batch(len(tok))
        kwargs = {"with_entropy": True, "entropy_grad": True}
        got = grads(ddp, inputs, 5, **kwargs)
        want = grads(plain, inputs, None, **kwargs)
        assert_same_grads({n.removeprefix("module."): g for n, g in got.items()}, want)
    finally:
        dist.destroy_process_group()


def test_mixture_of_experts_keeps_its_router_loss(tok):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
    )
    model = MixtralForCausalLM(config)
    assert chunked.supports_chunked(model)
    inputs = batch(len(tok))
    want = logps_of(model, inputs, None, with_entropy=True)
    got = logps_of(model, inputs, 5, with_entropy=True)
    assert got.aux_loss is not None and got.aux_loss.requires_grad
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **EXACT)
    torch.testing.assert_close(got.logps, want.logps, **EXACT)
    torch.testing.assert_close(got.entropy, want.entropy, **EXACT)


def vocabulary_sized_temporaries(model, inputs, share_prompts: bool) -> int:
    """[V, H] blocks the backward of ``loss_of`` builds beside the head's gradient (profiled): the
    embedding's dense gradients and out-of-place sums into the head's."""
    from torch.profiler import profile

    model.zero_grad(set_to_none=True)
    loss = loss_of(logps_of(model, inputs, 16, share_prompts=share_prompts), inputs)
    shape = list(model.get_input_embeddings().weight.shape)
    with profile(record_shapes=True) as prof:
        loss.backward()
    dense = [e for e in prof.events() if e.name == "aten::embedding_dense_backward"]
    return len(dense) + sum(1 for e in prof.events() if e.name == "aten::add" and shape in e.input_shapes)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_tied_embedding_adds_its_rows_into_the_heads_gradient(tok, monkeypatch, share_prompts):
    """The lookups add their rows into the head's gradient in place: same ``.grad``, dense, and no
    [V, H] sum built (autograd summed a sparse gradient into the head's out of place, once per
    lookup, two with a shared prompt prefix; the embedding's own backward builds a dense one per
    lookup)."""
    import contextlib

    from posttrain.ops import online_logps  # completion_logps looks tied_embedding_grad up there

    model = tiny(tok, tied=True)
    embed = model.get_input_embeddings()
    inputs = batch(len(tok))
    if share_prompts:  # rows 0 and 1 share a prompt
        inputs["prompt_ids"][1], inputs["prompt_mask"][1] = inputs["prompt_ids"][0], inputs["prompt_mask"][0]
    got = grads(model, inputs, chunk_size=16, share_prompts=share_prompts)
    assert not embed.weight.grad.is_sparse and "forward" not in vars(embed)  # the lookup restored after
    assert vocabulary_sized_temporaries(model, inputs, share_prompts) == 0
    monkeypatch.setattr(online_logps, "tied_embedding_grad", lambda model: contextlib.nullcontext())
    want = grads(model, inputs, chunk_size=16, share_prompts=share_prompts)
    assert_same_grads(got, want)
    assert vocabulary_sized_temporaries(model, inputs, share_prompts) == 1 + share_prompts


def test_whole_rows_of_a_tied_model_get_the_full_logits_gradient(tok):
    """``sequence_token_stats`` (SFT, DPO's scores) on a tied model: the chunked path, whose lookups
    add into the head's gradient, gives the full-logits path's gradient."""
    from posttrain.ops.logprobs import sequence_token_stats

    model = tiny(tok, tied=True)
    ids = torch.randint(0, len(tok), (3, 11), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    weights = mask[:, 1:].float()
    found = {}
    for chunk_size in (4, None):
        model.zero_grad(set_to_none=True)
        stats = sequence_token_stats(model, ids, mask, positions, chunk_size=chunk_size)
        (stats.logps * weights).sum().backward()
        found[chunk_size] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert_same_grads(found[4], found[None])


def test_a_tied_students_distillation_gradient_takes_the_lookups_rows_in_place(tok, monkeypatch):
    """The distillation engine's head gradient is handed over too (``TokenDivergence``)."""
    import contextlib

    from posttrain.ops import online_logps
    from posttrain.ops.divergence import token_divergence
    from posttrain.ops.online_logps import completion_head_inputs

    student, teacher = tiny(tok, tied=True), tiny(tok, seed=1)
    inputs = batch(len(tok))
    with torch.no_grad():
        teacher_side, _ = completion_head_inputs(teacher, **inputs)
    mask = inputs["completion_mask"].reshape(-1).bool()

    def backward() -> dict[str, torch.Tensor]:
        student.zero_grad(set_to_none=True)
        side, _ = completion_head_inputs(student, **inputs)
        flat = type(side)(side.hidden.reshape(-1, side.hidden.shape[-1])[mask], side.weight, side.bias)
        teacher_flat = type(teacher_side)(teacher_side.hidden.reshape(-1, side.hidden.shape[-1])[mask],
                                          teacher_side.weight, teacher_side.bias)  # fmt: skip
        token_divergence(flat, teacher_flat, beta=0.5, chunk_size=16)[0].mean().backward()
        return {n: p.grad.clone() for n, p in student.named_parameters()}

    from posttrain.ops import tied_embedding

    handed, hand_over = [], tied_embedding.hand_over

    def spy(weight, grad):
        result = hand_over(weight, grad)
        handed.append(result is None)
        return result

    monkeypatch.setattr(tied_embedding, "hand_over", spy)
    got = backward()
    assert handed == [True]  # the student's head gradient went to the lookups
    weight = student.get_input_embeddings().weight
    monkeypatch.setattr(online_logps, "tied_embedding_grad", lambda model: contextlib.nullcontext())
    assert_same_grads(got, backward())
    assert not weight.grad.is_sparse


def test_tied_embedding_gradient_through_autograd_grad_and_accumulation(tok):
    """``torch.autograd.grad`` gets the whole gradient (the last lookup returns it), and a second
    backward accumulates into ``.grad`` as autograd would."""
    import contextlib

    from posttrain.ops import online_logps

    model = tiny(tok, tied=True)
    weight = model.get_input_embeddings().weight
    first, second = batch(len(tok), seed=1), batch(len(tok), seed=2)

    def two_backwards() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        for inputs in (first, second):
            loss_of(logps_of(model, inputs, 16), inputs).backward()
        return weight.grad.clone()

    (through_grad,) = torch.autograd.grad(loss_of(logps_of(model, first, 16), first), [weight])
    accumulated = two_backwards()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(online_logps, "tied_embedding_grad", lambda model: contextlib.nullcontext())
        (want_grad,) = torch.autograd.grad(loss_of(logps_of(model, first, 16), first), [weight])
        want_accumulated = two_backwards()
    torch.testing.assert_close(through_grad, want_grad, **GRAD)
    torch.testing.assert_close(accumulated, want_accumulated, **GRAD)


def test_tied_lookup_without_the_chunked_head_returns_its_own_sparse_rows(tok):
    """Through the model's own logits nothing is handed over: each lookup returns its sparse
    gradient, and ``.grad`` equals the plain model's."""
    from posttrain.ops.tied_embedding import tied_embedding_grad

    model = tiny(tok, tied=True)
    ids = batch(len(tok))["completion_ids"]
    with tied_embedding_grad(model):
        model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    got = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids).logits.logsumexp(-1).sum().backward()
    torch.testing.assert_close(got, model.get_input_embeddings().weight.grad, **GRAD)


def test_untied_embedding_keeps_the_plain_lookup(tok):
    model = tiny(tok, tied=False)
    seen = []
    embed = model.get_input_embeddings()
    embed.register_forward_pre_hook(lambda m, args: seen.append("forward" in vars(m)))
    grads(model, batch(len(tok)), chunk_size=16)
    assert seen == [False] and not embed.weight.grad.is_sparse


def test_bf16_reference_scores_in_the_policys_precision(tmp_path, tok):
    """bf16=True with a KL: the reference model runs under the policy's autocast, so the first
    step's KL (the policy still equals its reference) is exactly 0, not bf16's rounding."""
    from helpers import make_config, standard_dataset

    from posttrain import GRPOTrainer

    trainer = GRPOTrainer(
        model=tiny(tok),
        reward_funcs=lambda completion_ids, **kw: [float(sum(c) % 3) for c in completion_ids],
        args=make_config(tmp_path, bf16=True, beta=0.1, max_steps=2),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train()
    kls = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kls[0] == 0.0 and kls[1] > 0.0


@pytest.mark.parametrize("block_bytes", [1, 4 * 7 * 3, 1 << 20])
def test_a_narrower_product_is_added_in_blocks_of_rows_exactly(block_bytes, monkeypatch):
    """``add_in_blocks`` gives what one mixed-dtype ``add_`` gives, element for element, whether a
    block holds part of a row's bytes (one row at a time), three rows, or the whole product."""
    monkeypatch.setattr(chunked, "ADD_BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(5)
    total = torch.randn(10, 7, generator=g)
    part = torch.randn(10, 7, generator=g).bfloat16()
    want = total.clone().add_(part)
    got = chunked.add_in_blocks(total, part)
    assert got is total and torch.equal(got, want)
