"""Scoring with each prompt run once (ops/shared_prefix.py) against scoring every row whole.

The shared path must give the same log-probs, entropy and gradient of every parameter as the
row-by-row chunked path, for every supported family, with gradient checkpointing and with LoRA,
while running the prompt pass on the distinct prompts only.
"""

from __future__ import annotations

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
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from posttrain.ops import shared_prefix
from posttrain.ops.logprobs import completion_logps

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

EXACT = {"rtol": 1e-5, "atol": 1e-5}
GRAD = {"rtol": 1e-5, "atol": 1e-6}
VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    **TINY_DECODER,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=8)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None)),
}


def family(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[name]()


def grouped_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two prompts of different lengths (left-padded), three completions each, rows interleaved."""
    g = torch.Generator().manual_seed(seed)
    short, long_ = torch.randint(1, VOCAB, (4,), generator=g), torch.randint(1, VOCAB, (7,), generator=g)
    order = [0, 1, 0, 0, 1, 1]
    prompt_ids = torch.zeros(6, 7, dtype=torch.long)
    prompt_mask = torch.zeros(6, 7, dtype=torch.long)
    for row, which in enumerate(order):
        if which == 0:
            prompt_ids[row, 3:], prompt_mask[row, 3:] = short, 1
        else:
            prompt_ids[row], prompt_mask[row] = long_, 1
    completion_mask = torch.ones(6, 9, dtype=torch.long)
    completion_mask[1, 5:] = 0
    completion_mask[3, 2:] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, VOCAB, (6, 9), generator=g),
        "completion_mask": completion_mask,
    }


def scored(model, inputs, share: bool, chunk_size: int | None = 8):
    return completion_logps(
        model, **inputs, temperature=0.7, with_entropy=True, entropy_grad=True, chunk_size=chunk_size,
        share_prompts=share,
    )  # fmt: skip


def loss_and_grads(model, inputs, share: bool, chunk_size: int | None = 8):
    model.zero_grad(set_to_none=True)
    out = scored(model, inputs, share, chunk_size)
    mask = inputs["completion_mask"].float()
    weights = torch.linspace(-1.0, 2.0, mask.numel()).view(mask.shape)
    ((out.logps * weights * mask).sum() + 0.3 * (out.entropy * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out, grads


def assert_same(model, inputs, reference_chunk: int | None = 8):
    shared, shared_grads = loss_and_grads(model, inputs, share=True)
    plain, plain_grads = loss_and_grads(model, inputs, share=False, chunk_size=reference_chunk)
    mask = inputs["completion_mask"].bool()
    torch.testing.assert_close(shared.logps[mask], plain.logps[mask], **EXACT)
    torch.testing.assert_close(shared.entropy[mask], plain.entropy[mask], **EXACT)
    assert shared_grads.keys() == plain_grads.keys()
    for name in plain_grads:
        torch.testing.assert_close(shared_grads[name], plain_grads[name], **GRAD, msg=name)


def count_rows(model) -> tuple[list[tuple[int, ...]], torch.utils.hooks.RemovableHandle]:
    """Record the shapes the input embedding sees: one entry per model call."""
    shapes: list[tuple[int, ...]] = []
    embed = model.get_input_embeddings()
    handle = embed.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes, handle


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_values_and_gradients_equal_the_row_by_row_path(name):
    model = family(name)
    assert shared_prefix.supported(model)
    inputs = grouped_batch()
    shapes, handle = count_rows(model)
    scored(model, inputs, share=True)
    handle.remove()
    assert shapes == [(2, 7), (6, 9)]  # the prompt pass sees the 2 distinct prompts, once
    assert_same(model, inputs)


def test_equal_to_the_full_logits_path():
    model = family("llama", seed=1)
    assert_same(model, grouped_batch(seed=1), reference_chunk=None)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_exact_with_gradient_checkpointing(name):
    model = family(name, seed=2)
    model.gradient_checkpointing_enable()
    model.train()
    assert shared_prefix.supported(model)
    assert_same(model, grouped_batch(seed=2))
    layer = model.model.layers[0]
    assert layer._can_checkpoint_with_cache is False  # restored to the class's value


def test_reentrant_checkpointing_falls_back_to_the_row_by_row_path():
    model = family("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    assert not shared_prefix.supported(model)


def test_exact_with_lora():
    peft = pytest.importorskip("peft")
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=3)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0
    )
    model = peft.get_peft_model(model, config)
    for name, p in model.named_parameters():  # LoRA B starts at zero: make the adapters matter
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    inputs = grouped_batch(seed=3)
    inputs = {k: v.clamp(max=len(tok) - 1) for k, v in inputs.items()}
    assert shared_prefix.supported(model)
    assert_same(model, inputs)


def test_no_shared_prompt_means_no_prompt_pass():
    model = family("llama")
    inputs = grouped_batch()
    inputs["prompt_ids"][:, -1] = torch.arange(6)  # every row's prompt now differs
    assert shared_prefix.prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"]) is None
    shapes, handle = count_rows(model)
    scored(model, inputs, share=True)
    handle.remove()
    assert shapes == [(6, 16)]


def test_prompt_groups_finds_the_distinct_prompts_and_drops_common_padding():
    ids = torch.tensor([[0, 0, 5, 6], [0, 0, 5, 6], [0, 0, 0, 7], [9, 0, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 1, 1]])  # row 3: pad token 9
    groups = shared_prefix.prompt_groups(ids, mask)
    assert groups is not None
    assert groups.ids.shape == (2, 2)  # two all-padding columns removed
    assert groups.inverse[0] == groups.inverse[1] == groups.inverse[3] != groups.inverse[2]
    torch.testing.assert_close(groups.ids[groups.inverse[0]], torch.tensor([5, 6]))
    torch.testing.assert_close(groups.mask[groups.inverse[2]], torch.tensor([0, 1]))


def test_unsupported_models_use_the_row_by_row_path():
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    )
    sliding = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=4))
    wrapped = torch.nn.Module()
    wrapped.module = family("llama")
    for model in (moe, sliding, wrapped):
        assert not shared_prefix.supported(model)
    shapes, handle = count_rows(moe)
    scored(moe, grouped_batch(), share=True)
    handle.remove()
    assert shapes == [(6, 16)]


def test_the_trainer_runs_each_prompt_once_per_micro_batch(tmp_path):
    from helpers import length_reward, make_config, make_trainer

    tok = build_tiny_tokenizer()
    args = make_config(
        tmp_path, per_device_train_batch_size=8, num_generations=4, max_steps=1, gradient_checkpointing=True
    )
    trainer = make_trainer(tok, [length_reward], args)
    shapes, handle = count_rows(trainer.model)
    compute_loss = trainer.compute_loss
    calls: list[list[tuple[int, ...]]] = []

    def recorded(*a, **k):
        shapes.clear()
        loss = compute_loss(*a, **k)
        calls.append(list(shapes))
        return loss

    trainer.compute_loss = recorded
    trainer.train()
    handle.remove()
    [(prompt_pass, completion_pass)] = calls
    assert prompt_pass[0] == 2 and prompt_pass[1] > 1  # the 2 distinct prompts, once each
    assert completion_pass == (8, args.max_completion_length)  # 2 prompts x 4 completions
