"""One bf16 cast per linear weight per training micro-step under CPU autocast (ops/weight_casts.py).

The shared casts must change nothing but the number of casts: the forward values and every
gradient equal autocast's own casting at each use, bit for bit, with the passes a trainer's
micro-step makes (two forwards through the same weights, gradient checkpointing's recomputation).
"""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from torch import nn

from posttrain.generation.fused_step import FusedDecoder
from posttrain.ops import weight_casts
from posttrain.ops.weight_casts import WeightCasts


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _linears(model: nn.Module) -> list[nn.Linear]:
    head = model.get_output_embeddings()
    return [m for m in model.modules() if type(m) is nn.Linear and m is not head]


def _two_passes(model: nn.Module, ids: torch.Tensor, casts: WeightCasts | None) -> tuple[float, dict]:
    """A prompt-like pass and a completion-like pass through the same weights, then backward."""
    model.zero_grad(set_to_none=True)
    if casts is not None:
        casts.attach(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # accelerate wraps each forward call in
            first = model(input_ids=ids[:, :5]).logits  # its own autocast region
        with torch.autocast("cpu", dtype=torch.bfloat16):
            second = model(input_ids=ids).logits
        loss = first.float().logsumexp(-1).mean() + second.float().log_softmax(-1)[..., 3].mean()
        loss.backward()  # gradient checkpointing recomputes each layer here, hooks still attached
    finally:
        if casts is not None:
            casts.release()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_shared_casts_give_autocasts_values_and_gradients_bit_for_bit(tok, reentrant):
    model = build_tiny_model(tok).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, len(tok), (3, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notes on caches under checkpointing
        loss, grads = _two_passes(model, ids, None)
        casts = WeightCasts()
        shared_loss, shared_grads = _two_passes(model, ids, casts)
    assert shared_loss == loss
    assert grads.keys() == shared_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(shared_grads[name], grad), name
        assert shared_grads[name].dtype == torch.float32


def test_each_weight_is_cast_once_per_micro_step_and_again_after_an_update(tok):
    model = build_tiny_model(tok).train()
    linears = _linears(model)
    casts = WeightCasts()
    casts.attach(model)
    ids = torch.randint(0, len(tok), (2, 8))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids).logits.float().mean().backward()
        model(input_ids=ids).logits.float().mean().backward()
    assert casts.casts == len(linears)  # 2 layers x 7 projections; the head casts its own
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # in place: the version counters move
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids).logits
    assert casts.casts == 2 * len(linears)
    casts.release()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(input_ids=ids).logits, out)  # the new weights, as autocast casts them


def test_outside_bf16_autocast_the_parameters_are_used_and_nothing_is_cast(tok):
    model = build_tiny_model(tok).eval()
    ids = torch.randint(0, len(tok), (2, 8))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        casts = WeightCasts()
        casts.attach(model)
        assert torch.equal(model(input_ids=ids).logits, expected)
    assert casts.casts == 0
    casts.release()


def test_release_restores_the_parameters_after_a_forward_that_raised(tok):
    model = build_tiny_model(tok).train()
    layer = _linears(model)[0]
    casts = WeightCasts()
    casts.attach(model)
    assert casts.attached and not model.get_output_embeddings()._forward_pre_hooks
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError):
        layer(torch.randn(2, layer.in_features + 1))  # raises inside F.linear, after the pre-hook
    assert layer.__dict__.get("weight") is not None  # the cast is still in the module's dictionary
    casts.release()
    assert "weight" not in layer.__dict__ and layer.weight is layer._parameters["weight"]
    assert not casts.attached and not layer._forward_pre_hooks and not layer._forward_hooks


def first_token_reward(completion_ids, **kwargs):
    return [float(ids[0] % 7) if len(ids) else 0.0 for ids in completion_ids]


def _trained(tok, tmp_path, monkeypatch, switch: str) -> dict:
    monkeypatch.setenv(weight_casts.ENV, switch)
    args = helpers.make_config(tmp_path / switch, bf16=True, max_steps=2, gradient_checkpointing=True)
    trainer = helpers.make_trainer(tok, first_token_reward, args, model=build_tiny_model(tok))
    assert (trainer._weight_casts is not None) == (switch == "1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(autocast|bf16|mixed precision).*")
        trainer.train()
    if trainer._weight_casts is not None:
        assert not trainer._weight_casts.attached  # released after each micro-step
    assert all("weight" not in m.__dict__ for m in trainer.model.modules())
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_grpo_under_bf16_trains_the_same_parameters_with_shared_casts(tok, tmp_path, monkeypatch):
    """Generation, the loss's passes and checkpointed backward, two optimizer steps: the trained
    parameters equal those of autocast's own casting, bit for bit."""
    shared = _trained(tok, tmp_path, monkeypatch, "1")
    plain = _trained(tok, tmp_path, monkeypatch, "0")
    assert shared.keys() == plain.keys()
    for name, value in plain.items():
        assert torch.equal(shared[name], value), name


def test_the_bf16_sampler_copy_is_built_from_the_micro_steps_casts(tok):
    """A sampler copy rebuilt inside a micro-step casts no weight the micro-step cast already,
    and multiplies exactly as a copy built from its own casts."""
    model = build_tiny_model(tok).eval()
    ids = torch.randint(0, len(tok), (2, 8))
    with torch.no_grad():
        own = FusedDecoder(model, 2, "bf16")  # outside a micro-step: casts its own weights
        casts = WeightCasts()
        casts.attach(model)
        try:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids)  # the generation's prompt forward casts every decoder weight
            assert casts.casts == len(_linears(model))
            shared = FusedDecoder(model, 2, "bf16")
            assert casts.casts == len(_linears(model))  # nothing cast again
            assert weight_casts.shared_cast(_linears(model)[0].weight, torch.float16) is None
        finally:
            casts.release()
        assert weight_casts.shared_cast(_linears(model)[0].weight) is None  # outside a micro-step
        for mine, theirs in zip(own.layers, shared.layers, strict=True):
            for name in ("qkv", "o", "gate_up", "down"):
                weight, other = getattr(mine, name), getattr(theirs, name)
                weight, other = (weight[0], other[0]) if isinstance(weight, tuple) else (weight, other)
                x = torch.randn(2, _inputs(own, name))
                assert torch.equal(own._linear(x, weight), shared._linear(x, other)), name


def _inputs(decoder: FusedDecoder, product: str) -> int:
    """The input width of one of the fused step's products."""
    hidden = decoder.embed.shape[1]
    return {"qkv": hidden, "o": decoder.q_width, "gate_up": hidden, "down": decoder.intermediate}[product]
