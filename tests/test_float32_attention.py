"""Short attention in float32 under CPU bf16 autocast (ops/float32_attention.py)."""

from __future__ import annotations

import warnings

import helpers
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from posttrain.ops import float32_attention
from posttrain.ops.float32_attention import MAX_KEYS, float32_short_attention, wrap


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


class _Attention(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def _inputs(keys: int, queries: int = 3) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    query = torch.randn(2, 4, queries, 8)
    key = torch.randn(2, 2, keys, 8)
    value = torch.randn(2, 2, keys, 8).to(torch.bfloat16)  # v_proj's output under autocast
    mask = torch.ones(2, 1, queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
    return query, key, value, mask


def test_short_attention_runs_in_float32_and_long_attention_as_autocast_does():
    module, attention = _Attention(), wrap(sdpa_attention_forward)
    query, key, value, mask = _inputs(keys=7)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = attention(module, query, key, value, mask, scaling=0.3)
        autocast, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    exact, _ = sdpa_attention_forward(module, query, key, value.float(), mask, scaling=0.3)
    assert ours.dtype == torch.float32 and autocast.dtype == torch.bfloat16
    assert torch.equal(ours, exact)
    assert not torch.equal(ours, autocast.float())  # autocast rounded the inputs to bf16

    query, key, value, mask = _inputs(keys=MAX_KEYS + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = attention(module, query, key, value, mask, scaling=0.3)
        autocast, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, autocast)


def test_outside_bf16_autocast_the_wrapper_changes_nothing():
    module, attention = _Attention(), wrap(sdpa_attention_forward)
    query, key, value, mask = _inputs(keys=7)
    value = value.float()
    assert torch.equal(
        attention(module, query, key, value, mask)[0],
        sdpa_attention_forward(module, query, key, value, mask)[0],
    )
    with torch.autocast("cpu", dtype=torch.float16):
        ours, _ = attention(module, query, key, value, mask)
        theirs, _ = sdpa_attention_forward(module, query, key, value, mask)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def test_gradients_reach_the_bf16_inputs_in_their_dtype():
    module, attention = _Attention(), wrap(sdpa_attention_forward)
    query, key, value, mask = _inputs(keys=7)
    value = value.requires_grad_()
    query.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(module, query, key, value, mask)
    out.sum().backward()
    assert value.grad.dtype == torch.bfloat16 and query.grad.dtype == torch.float32
    assert value.grad.abs().sum() > 0 and query.grad.abs().sum() > 0


@pytest.mark.parametrize("masked", [True, False])
def test_grouped_heads_folded_give_transformers_output_and_gradients(masked):
    """Query heads stacked per key head (``_folded``) against transformers' repeated keys and
    values: the same output and gradients to float32 rounding (the kernel's blocks of query rows
    differ; at the anchor's shapes the output was equal bit for bit); without a mask
    (a causal flag instead) the wrapper leaves the call to transformers."""
    module, attention = _Attention(), wrap(sdpa_attention_forward)
    query, key, value, mask = _inputs(keys=9, queries=5)
    mask = mask if masked else None
    value = value.float()
    inputs = [t.clone().requires_grad_() for t in (query, key, value)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = attention(module, *inputs, mask, scaling=0.3)
    ours.pow(2).sum().backward()
    plain = [t.clone().requires_grad_() for t in (query, key, value)]
    theirs, _ = sdpa_attention_forward(module, *plain, mask, scaling=0.3)
    theirs.pow(2).sum().backward()
    assert ours.shape == theirs.shape == (2, 5, 4, 8)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    for mine, reference in zip(inputs, plain, strict=True):
        torch.testing.assert_close(mine.grad, reference.grad, rtol=1e-6, atol=1e-6)
    folded = float32_attention._foldable(query, key, value, mask, (), {"scaling": 0.3})
    assert folded == masked
    assert not float32_attention._foldable(query, key, value, mask, (), {"dropout": 0.1})
    assert not float32_attention._foldable(query[:, :2], key, value, mask, (), {})  # no groups


def test_the_wrapper_is_installed_once_and_restored():
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with float32_short_attention():
        installed = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert installed.wrapped is original
        with float32_short_attention():  # nested (a second trainer): not wrapped twice
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is installed
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is installed
    assert (
        ALL_ATTENTION_FUNCTIONS["sdpa"] is original and "sdpa" not in ALL_ATTENTION_FUNCTIONS._local_mapping
    )
    with pytest.raises(RuntimeError, match="boom"), float32_short_attention():
        raise RuntimeError("boom")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original


def _reward(completion_ids, **kwargs):
    return [float(ids[0] % 7) if len(ids) else 0.0 for ids in completion_ids]


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_bf16_trainer_attends_in_float32_while_it_trains(tok, tmp_path, monkeypatch, switch):
    """The training forwards (checkpointed, so the recomputation too) reach torch's attention
    with float32 inputs and autocast off (grouped heads folded, ``_folded``); with the switch at 0,
    transformers' function in autocast as before."""
    monkeypatch.setenv(float32_attention.ENV, switch)
    seen: list[tuple[torch.dtype, bool, bool]] = []
    kernel = torch.nn.functional.scaled_dot_product_attention

    def spy_kernel(query, key, value, *args, **kwargs):
        seen.append((value.dtype, torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
        return kernel(query, key, value, *args, **kwargs)

    def spy(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_kernel)
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", spy)
    model = build_tiny_model(tok)
    assert model.config._attn_implementation == "sdpa"
    args = helpers.make_config(tmp_path, bf16=True, max_steps=1, gradient_checkpointing=True)
    trainer = helpers.make_trainer(tok, _reward, args, model=model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(autocast|bf16|mixed precision).*")
        trainer.train()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is spy  # restored after training
    training = [(dtype, autocast) for dtype, autocast, grad in seen if grad]
    assert training
    if switch == "1":
        assert all(dtype == torch.float32 and not autocast for dtype, autocast in training)
    else:
        assert all(autocast for _, autocast in training)
