"""``ops/dropout.py``: CPU dropout from NumPy's random bits, F.dropout's distribution, faster."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.models.loading import disable_dropout
from posttrain.ops.dropout import CpuDropout, cpu_dropout, faster_lora_dropout


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5])
def test_each_element_is_kept_with_probability_one_minus_p_and_scaled(p):
    torch.manual_seed(0)
    x = torch.full((1000, 1000), 2.0)
    out = cpu_dropout(x, p)
    kept = out != 0
    n = x.numel()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(1 - kept.float().mean().item() - p) < 5 * sigma
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 2.0 / (1 - p)))
    # independent draws: a kept element says nothing of its neighbour (each 64-bit draw feeds two)
    a, b = kept.flatten()[:-1].float(), kept.flatten()[1:].float()
    corr = ((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std())
    assert abs(corr.item()) < 5 / math.sqrt(n)
    assert not torch.equal(cpu_dropout(x, p) != 0, kept)  # a new mask per call


def test_torch_seed_reproduces_the_mask_and_the_gradient_is_the_masked_scale():
    x = torch.randn(64, 48, requires_grad=True)
    torch.manual_seed(3)
    first = cpu_dropout(x, 0.2)
    torch.manual_seed(3)
    again = cpu_dropout(x, 0.2)
    assert torch.equal(first, again)
    weight = torch.randn(64, 48)
    (again * weight).sum().backward()
    torch.testing.assert_close(x.grad, (again != 0).float() * weight / 0.8)
    bf16 = cpu_dropout(x.detach().bfloat16(), 0.2)
    assert bf16.dtype == torch.bfloat16 and 0 < (bf16 == 0).float().mean() < 0.4


def test_gradient_checkpointing_recomputes_the_same_mask():
    """``torch.utils.checkpoint`` restores torch's CPU random state before recomputing: the mask
    drawn again from NumPy is the forward's, so the gradients equal the uncheckpointed ones."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(32, 32), CpuDropout(0.3), nn.Linear(32, 32)).train()
    x = torch.randn(16, 32, requires_grad=True)

    def grads(checkpointed: bool) -> list[torch.Tensor]:
        block.zero_grad()
        x.grad = None
        torch.manual_seed(7)
        out = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        out.square().sum().backward()
        return [x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    plain, recomputed = grads(False), grads(True)
    for a, b in zip(plain, recomputed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_cpu_dropout_module_is_an_nn_dropout():
    module = CpuDropout(0.5)
    x = torch.ones(100, 100)
    assert isinstance(module, nn.Dropout)
    assert (module(x) == 0).any()
    assert torch.equal(module.eval()(x), x)
    module.train()
    disable_dropout(nn.Sequential(module))
    assert module.p == 0.0 and torch.equal(module(x), x)
    with pytest.raises(ValueError, match=r"in \[0, 1\)"):
        cpu_dropout(x, 1.0)


def test_lora_layers_get_the_cpu_dropout_with_their_probability():
    peft = pytest.importorskip("peft")
    from conftest import build_tiny_model, build_tiny_tokenizer

    model = peft.get_peft_model(
        build_tiny_model(build_tiny_tokenizer()),
        peft.LoraConfig(r=2, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]),
    )
    model.add_adapter("second", peft.LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj"]))
    layers = [m for m in model.modules() if isinstance(getattr(m, "lora_dropout", None), nn.ModuleDict)]
    assert faster_lora_dropout(model) == sum("default" in m.lora_dropout for m in layers)
    for layer in layers:
        assert type(layer.lora_dropout["default"]) is CpuDropout and layer.lora_dropout["default"].p == 0.1
        if "second" in layer.lora_dropout:  # p = 0: peft's identity, left alone
            assert type(layer.lora_dropout["second"]) is nn.Identity
    assert faster_lora_dropout(model) == 0
