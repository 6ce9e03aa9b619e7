"""Selective activation checkpointing, ``gradient_checkpointing_kwargs={"selective": True}`` (ops/sac.py).

What a user relies on: backward runs no attention kernel again (full checkpointing runs it once
per checkpointed layer); the gradients, and the parameters after a training step, are those of
full checkpointing and of no checkpointing; it works with posttrain's CPU layer budget and the
shared prompt pass; the config refuses the combinations that cannot work; an SFT run trains.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import TINY_DECODER, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain import GRPOConfig, SFTConfig, SFTTrainer
from posttrain.ops import checkpointing, sac
from posttrain.ops.logprobs import completion_logps

pytestmark = pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")

VOCAB = 96
LAYERS = 3


class AttentionCalls(TorchDispatchMode):
    """Counts the attention kernels (``sac.attention_ops()``) that really run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in sac.attention_ops():
            self.count += 1
        return func(*args, **(kwargs or {}))


def tiny_llama(mode: str, attn: str = "sdpa", layers: int = LAYERS) -> LlamaForCausalLM:
    """A tiny Llama; ``mode``: "none", "full" (non-reentrant checkpointing) or "sac"."""
    torch.manual_seed(0)
    config = {**TINY_DECODER, "num_hidden_layers": layers}
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attn, **config)
    )
    if mode != "none":
        kwargs = {"selective": True} if mode == "sac" else {"use_reentrant": False}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        sac.use_selective_checkpointing(model, kwargs)
    model.train()
    return model


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding on one row
    return ids, mask


def backward_of(model: torch.nn.Module) -> tuple[int, int, dict[str, torch.Tensor]]:
    """Attention kernels run in the forward and in backward, and every parameter's gradient."""
    ids, mask = padded_batch()
    with AttentionCalls() as forward:
        logits = model(ids, attention_mask=mask).logits
    loss = torch.log_softmax(logits.float(), dim=-1)[..., :-1, :].gather(-1, ids[:, 1:, None]).mean()
    with AttentionCalls() as backward:
        loss.backward()
    return forward.count, backward.count, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_grads(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)


# ---- the model: what backward recomputes, and the gradients --------------------------------------


def test_backward_runs_no_attention_with_sac_and_one_per_layer_with_full_checkpointing():
    none_fwd, none_bwd, _ = backward_of(tiny_llama("none"))
    full_fwd, full_bwd, _ = backward_of(tiny_llama("full"))
    sac_fwd, sac_bwd, _ = backward_of(tiny_llama("sac"))
    assert none_fwd == full_fwd == sac_fwd == LAYERS  # the forward is unchanged
    assert none_bwd == 0
    assert full_bwd == LAYERS  # full checkpointing runs each layer's attention again
    assert sac_bwd == 0  # SAC takes the saved output instead


def test_sac_gradients_equal_full_checkpointing_and_no_checkpointing():
    _, _, none = backward_of(tiny_llama("none"))
    _, _, full = backward_of(tiny_llama("full"))
    _, _, selective = backward_of(tiny_llama("sac"))
    assert_same_grads(selective, full)
    assert_same_grads(selective, none)


def test_layer_checkpoint_functions_are_non_reentrant_with_the_sac_context_and_without_the_key():
    model = tiny_llama("sac")
    funcs = [layer._gradient_checkpointing_func for layer in model.model.layers]
    for func in funcs:
        assert isinstance(func, functools.partial)
        assert func.keywords["context_fn"] is sac.selective_context
        assert func.keywords["use_reentrant"] is False
        assert sac.SELECTIVE_KEY not in func.keywords
    # applying it again (a second train() call) changes nothing
    assert sac.use_selective_checkpointing(model, {"selective": True}) > 0
    for layer, before in zip(model.model.layers, funcs, strict=True):
        assert layer._gradient_checkpointing_func.keywords == before.keywords


def test_selective_false_only_removes_the_key():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, **TINY_DECODER))
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"selective": False, "use_reentrant": False}
    )
    assert sac.use_selective_checkpointing(model, {"selective": False, "use_reentrant": False}) == 0
    for layer in model.model.layers:
        assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False}


def test_the_policy_saves_only_attention_ops():
    ops = sac.attention_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in ops
    assert torch.ops.aten._scaled_dot_product_efficient_attention.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in ops
    assert torch.ops.aten._scaled_dot_product_cudnn_attention.default in ops
    for op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten._softmax.default):
        assert op not in ops
        assert sac.attention_policy(None, op) == torch.utils.checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert (
        sac.attention_policy(None, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        == torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    )


def test_eager_attention_warns_and_recomputes_everything_with_the_same_gradients():
    with pytest.warns(UserWarning, match="attn_implementation='eager'"):
        selective_model = tiny_llama("sac", attn="eager")
    _, _, full = backward_of(tiny_llama("full", attn="eager"))
    _, _, selective = backward_of(selective_model)
    assert_same_grads(selective, full)


# ---- with posttrain's CPU layer budget and the shared prompt pass (the GRPO scoring path) -------


def grpo_batch(rows: int = 4, prompt: int = 5, completion: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(1, VOCAB, (1, prompt), generator=g).expand(rows, prompt).contiguous()
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[1, 4:] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, VOCAB, (rows, completion), generator=g),
        "completion_mask": completion_mask,
    }


def grpo_backward(model: torch.nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    inputs = grpo_batch()
    out = completion_logps(model, **inputs, temperature=0.7, with_entropy=True, chunk_size=8)
    loss = (out.logps * inputs["completion_mask"]).sum() + 0.1 * out.entropy.sum()
    with AttentionCalls() as backward:
        loss.backward()
    return backward.count, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kept", [0, 2], ids=["every-layer-checkpointed", "top-2-kept"])
def test_sac_with_the_cpu_layer_budget_and_a_shared_prompt(monkeypatch, kept):
    layers = 4
    # a budget share that leaves exactly `kept` top layers uncheckpointed (ops/checkpointing.py)
    probe = tiny_llama("full", layers=layers)
    inputs = grpo_batch()
    rows, width = inputs["completion_ids"].shape
    prompt = inputs["prompt_ids"].shape[1]
    per_layer = checkpointing.activation_bytes(
        probe.model.layers[-1], [(1, prompt, prompt), (rows, width, prompt + width)], 4
    )
    share = (kept + 0.5) * per_layer / checkpointing.gradient_budget(list(probe.model.layers))
    monkeypatch.setattr(checkpointing, "BUDGET_SHARE", share)

    full_bwd, full = grpo_backward(tiny_llama("full", layers=layers))
    sac_bwd, selective = grpo_backward(tiny_llama("sac", layers=layers))
    _, none = grpo_backward(tiny_llama("none", layers=layers))
    assert full_bwd == 2 * (layers - kept)  # the prompt pass and the completion pass, per checkpointed layer
    assert sac_bwd == 0
    assert_same_grads(selective, full)
    assert_same_grads(selective, none)


# ---- the config ----------------------------------------------------------------------------------


def sft_config(tmp_path, **overrides: Any) -> SFTConfig:
    return SFTConfig(**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def test_selective_needs_gradient_checkpointing(tmp_path):
    with pytest.raises(ValueError, match="needs gradient_checkpointing=True") as err:
        sft_config(tmp_path, gradient_checkpointing=False, gradient_checkpointing_kwargs={"selective": True})
    assert "gradient_checkpointing_kwargs" in str(err.value)
    assert "Set gradient_checkpointing=True, or remove 'selective'" in str(err.value)
    with pytest.raises(ValueError, match="needs gradient_checkpointing=True"):
        sft_config(
            tmp_path, activation_checkpointing=False, activation_checkpointing_kwargs={"selective": True}
        )


def test_selective_refuses_reentrant_checkpointing(tmp_path):
    with pytest.raises(ValueError, match="non-reentrant") as err:
        sft_config(
            tmp_path,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"selective": True, "use_reentrant": True},
        )
    assert "Drop 'use_reentrant' from gradient_checkpointing_kwargs or set it to False" in str(err.value)


def test_selective_must_be_a_bool_and_excludes_a_context_fn(tmp_path):
    with pytest.raises(ValueError, match="must be True or False"):
        sft_config(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": "yes"})
    with pytest.raises(ValueError, match="both 'selective' and 'context_fn'"):
        sft_config(
            tmp_path,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"selective": True, "context_fn": sac.selective_context},
        )


def test_selective_is_accepted_under_both_names_and_as_json(tmp_path):
    for overrides in (
        {"gradient_checkpointing_kwargs": {"selective": True}},
        {"gradient_checkpointing_kwargs": {"selective": True, "use_reentrant": False}},
        {"activation_checkpointing_kwargs": {"selective": True}},
        {"gradient_checkpointing_kwargs": '{"selective": true}'},  # the command line's form
    ):
        args = sft_config(tmp_path, gradient_checkpointing=True, **overrides)
        assert args.activation_checkpointing is True
        assert sac.requested(args.activation_checkpointing_kwargs)
    grpo = GRPOConfig(
        output_dir=str(tmp_path),
        **{**CPU_TEST_ARGS, "gradient_checkpointing": True},
        num_generations=4,
        gradient_checkpointing_kwargs={"selective": True},
    )
    assert sac.requested(grpo.activation_checkpointing_kwargs)


# ---- an SFT run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def sft_trainer(tmp_path, tok, **overrides: Any) -> SFTTrainer:
    dataset = Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(8)],
            "completion": [f" <answer>{2 * i}</answer>" for i in range(8)],
        }
    )
    return SFTTrainer(
        model=build_tiny_model(tok, seed=0),
        args=sft_config(tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tok,
    )


def counting_backward(trainer: SFTTrainer, monkeypatch) -> AttentionCalls:
    """Count the attention kernels run inside the trainer's backward calls."""
    calls = AttentionCalls()
    backward = trainer.accelerator.backward

    def counted(loss: torch.Tensor, **kwargs: Any) -> None:
        with calls:
            backward(loss, **kwargs)

    monkeypatch.setattr(trainer.accelerator, "backward", counted)
    return calls


def test_sft_trains_with_sac_to_the_parameters_of_full_and_no_checkpointing(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_SELECTIVE_CHECKPOINTING", "0")  # every layer checkpointed: SAC everywhere
    runs = {
        "none": {"gradient_checkpointing": False},
        "full": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
        "sac": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"selective": True}},
    }
    params, backward_attention, losses = {}, {}, {}
    initial = {n: p.detach().clone() for n, p in build_tiny_model(tok, seed=0).named_parameters()}
    for name, overrides in runs.items():
        trainer = sft_trainer(tmp_path / name, tok, max_steps=1, **overrides)
        calls = counting_backward(trainer, monkeypatch)
        out = trainer.train()
        losses[name] = out.training_loss
        backward_attention[name] = calls.count
        params[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        if name == "sac":
            for layer in trainer.model.model.layers:
                assert layer._gradient_checkpointing_func.keywords["context_fn"] is sac.selective_context
                assert sac.SELECTIVE_KEY not in layer._gradient_checkpointing_func.keywords
    assert backward_attention == {"none": 0, "full": 2, "sac": 0}  # the tiny model has 2 layers
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses.values())
    assert losses["sac"] == pytest.approx(losses["full"], rel=1e-6)
    assert any(not torch.equal(params["sac"][n], initial[n]) for n in initial)  # it trained
    assert_same_grads(params["sac"], params["full"])
    assert_same_grads(params["sac"], params["none"])
