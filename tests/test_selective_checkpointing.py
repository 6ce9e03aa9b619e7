"""Checkpointing that keeps the top layers' activations within the gradients' budget (ops/checkpointing.py).

What a user relies on: the gradients are those of full checkpointing; the top layers are the
ones left uncheckpointed, only as many as the unallocated gradients pay for; nothing is left
uncheckpointed where gradients already exist or where the switch is off; the flags come back.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import TINY_DECODER
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

from posttrain.ops import checkpointing
from posttrain.ops.logprobs import completion_logps

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

VOCAB = 96
COMMON = {"vocab_size": VOCAB, **TINY_DECODER, "num_hidden_layers": 4, "max_position_embeddings": 128}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}


def checkpointed(name: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = FAMILIES[name]()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def batch(rows: int = 4, prompt: int = 5, completion: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """One prompt shared by every row (the GRPO case), completions with some padding."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(1, VOCAB, (1, prompt), generator=g).expand(rows, prompt).contiguous()
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[1, 4:] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, VOCAB, (rows, completion), generator=g),
        "completion_mask": completion_mask,
    }


def forwards_of(inputs: dict[str, torch.Tensor]) -> list[tuple[int, int, int]]:
    """The passes ``completion_logps`` runs for ``batch()``: the prompt once, then the completions."""
    rows, width = inputs["completion_ids"].shape
    prompt = inputs["prompt_ids"].shape[1]
    return [(1, prompt, prompt), (rows, width, prompt + width)]


def share_for(model: torch.nn.Module, inputs: dict[str, torch.Tensor], layers: int) -> float:
    """A ``BUDGET_SHARE`` that leaves exactly ``layers`` layers uncheckpointed."""
    per_layer = checkpointing.activation_bytes(model.model.layers[-1], forwards_of(inputs), 4)
    budget = checkpointing.gradient_budget(list(model.model.layers))
    return (layers + 0.5) * per_layer / budget


def loss_and_grads(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    out = completion_logps(model, **inputs, temperature=0.7, with_entropy=True, chunk_size=8)
    loss = (out.logps * inputs["completion_mask"]).sum() + 0.1 * out.entropy.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def forward_calls(model: torch.nn.Module) -> list[int]:
    """Count each decoder layer's forward runs (a checkpointed layer runs again in backward)."""
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gradients_equal_full_checkpointing_and_only_the_top_layers_skip_recomputation(name, monkeypatch):
    inputs = batch()
    model = checkpointed(name)
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", share_for(model, inputs, 2))
    calls = forward_calls(model)
    loss, grads = loss_and_grads(model, inputs)
    # two passes each (prompt, completions); the bottom two layers are recomputed in backward
    assert calls == [4, 4, 2, 2]
    assert all(layer.gradient_checkpointing for layer in model.model.layers)  # flags restored

    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "0")
    calls[:] = [0] * 4
    full_loss, full_grads = loss_and_grads(model, inputs)
    assert calls == [4, 4, 4, 4]
    torch.testing.assert_close(loss, full_loss, rtol=0, atol=0)
    for key, grad in full_grads.items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-6, atol=1e-7, msg=key)


def test_the_count_follows_the_unallocated_gradients(monkeypatch):
    model = checkpointed()
    inputs = batch()
    forwards = forwards_of(inputs)
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", share_for(model, inputs, 3))
    assert checkpointing.uncheckpointed_layers(model, forwards) == 3
    # longer completions: more activations per layer, fewer layers fit
    longer = [(1, 5, 5), (4, 60, 65)]
    assert checkpointing.uncheckpointed_layers(model, longer) < 3
    # gradient accumulation: the gradients already exist, so keeping activations would add to them
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    assert checkpointing.uncheckpointed_layers(model, forwards) == 0
    model.zero_grad(set_to_none=True)
    # frozen layers (LoRA-like training of other parameters): no gradient memory to spend
    for p in model.model.layers.parameters():
        p.requires_grad_(False)
    assert checkpointing.uncheckpointed_layers(model, forwards) == 0


def test_nothing_changes_without_gradients_or_without_checkpointing(monkeypatch):
    model = checkpointed()
    inputs = batch()
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", 1e6)
    forwards = forwards_of(inputs)
    assert checkpointing.uncheckpointed_layers(model, forwards) == 4
    with torch.no_grad():
        assert checkpointing.uncheckpointed_layers(model, forwards) == 0
    model.model.layers[0].gradient_checkpointing = False  # someone else's selective choice: left alone
    assert checkpointing.uncheckpointed_layers(model, forwards) == 0


def test_the_switch_reads_only_0_or_1(monkeypatch):
    model = checkpointed()
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", 1e6)
    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "0")
    assert checkpointing.uncheckpointed_layers(model, [(1, 4, 4)]) == 0
    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "1")
    assert checkpointing.uncheckpointed_layers(model, [(1, 4, 4)]) == 4
    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "off")
    with pytest.raises(ValueError, match="POSTTRAIN_SELECTIVE_CHECKPOINTING='off'.*set it to 0"):
        checkpointing.uncheckpointed_layers(model, [(1, 4, 4)])


def test_unknown_layer_shapes_are_never_left_uncheckpointed():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

    assert checkpointing.activation_bytes(Block(), [(2, 3, 3)], 4) is None


def saved_bytes(layer: torch.nn.Module, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """Bytes of the distinct tensors ``layer`` saves for backward in an uncheckpointed forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_logps(model, **inputs, temperature=1.0, chunk_size=8)
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_activation_estimate_covers_what_a_layer_saves(name):
    """An estimate below the truth would let kept activations exceed the gradients' budget."""
    model = FAMILIES[name]()
    model.train()
    inputs = batch(rows=6, prompt=7, completion=12)
    measured = saved_bytes(model.model.layers[1], model, inputs)
    estimate = checkpointing.activation_bytes(model.model.layers[1], forwards_of(inputs), 4)
    assert measured <= estimate <= 1.3 * measured, (measured, estimate)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_bad_switch_fails_when_the_trainer_is_built(tmp_path, monkeypatch):
    from conftest import build_tiny_tokenizer
    from helpers import length_reward, make_config, make_trainer

    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "yes")
    with pytest.raises(ValueError, match="POSTTRAIN_SELECTIVE_CHECKPOINTING='yes' is not 0 or 1"):
        make_trainer(build_tiny_tokenizer(), length_reward, make_config(tmp_path, max_steps=1))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_trainer_trains_with_it_and_restores_the_flags(tmp_path, monkeypatch):
    from conftest import build_tiny_tokenizer
    from helpers import length_reward, make_config, make_trainer

    kept = []
    original = checkpointing.within_gradient_budget

    @contextlib.contextmanager
    def spy(model, forwards):
        with original(model, forwards) as count:
            layers = checkpointing.decoder_layers(model)
            kept.append((count, [layer.gradient_checkpointing for layer in layers]))
            yield count

    monkeypatch.setattr(checkpointing, "within_gradient_budget", spy)
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", 1e6)  # every layer fits
    config = make_config(tmp_path, max_steps=2, gradient_checkpointing=True)
    trainer = make_trainer(build_tiny_tokenizer(), length_reward, config)
    trainer.train()
    layers = trainer.model.model.layers
    # inside each training forward every layer kept its activations (none of them was checkpointed)
    assert kept and all(count == len(layers) and not any(flags) for count, flags in kept)
    assert all(layer.gradient_checkpointing for layer in layers)
    assert trainer.state.global_step == 2
