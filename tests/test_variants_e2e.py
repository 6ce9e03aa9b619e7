"""Every objective variant trains end to end on a tiny model and logs its metrics."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer


def varied_reward(completion_ids, **kwargs):
    """Depends on the sampled tokens, so groups have spread."""
    return [float(sum(ids) % 5) for ids in completion_ids]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _train(tmp_path, tok, model=None, **config):
    model = model if model is not None else build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    args = make_config(tmp_path, **config)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=varied_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train()
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return trainer, logs, changed


CLIPPED = ["grpo", "dapo", "bnpo", "dr_grpo", "gmpo"]


@pytest.mark.parametrize(
    ("loss_type", "level"),
    [(t, "token") for t in ["grpo", "dapo", "bnpo", "dr_grpo", "cispo", "sapo", "vespo", "gmpo"]]
    + [("luspo", "sequence"), ("grpo", "sequence"), ("dapo", "sequence")],
)
def test_loss_type_trains_and_logs(tmp_path, tok, loss_type, level):
    trainer, logs, changed = _train(
        tmp_path, tok, loss_type=loss_type, importance_sampling_level=level, num_iterations=2, max_steps=2
    )
    assert changed
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    log = logs[-1]
    if loss_type in CLIPPED or loss_type == "luspo":
        assert 0.0 <= log["clip_ratio/region_mean"] <= 1.0
    else:
        assert "clip_ratio/region_mean" not in log
    if loss_type == "cispo":
        assert 0.0 <= log["cispo_clip_ratio"] <= 1.0
    if loss_type == "vespo":
        assert log["vespo/phi_seq_mean"] > 0.0


def test_kl_penalty_uses_a_frozen_reference(tmp_path, tok):
    trainer, logs, changed = _train(tmp_path, tok, beta=0.1, max_steps=2, learning_rate=0.05)
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
    assert logs[1]["kl"] > 0.0


def test_no_reference_without_kl(tmp_path, tok):
    trainer, logs, _ = _train(tmp_path, tok, max_steps=1)
    assert trainer.ref_model is None
    assert "kl" not in logs[0]


@pytest.mark.parametrize("bias_correction", [True, False])
def test_kl_with_and_without_bias_correction(tmp_path, tok, bias_correction):
    _, logs, changed = _train(
        tmp_path, tok, beta=0.1, use_bias_correction_kl=bias_correction, num_iterations=2, max_steps=2
    )
    assert changed and all(math.isfinite(h["kl"]) for h in logs)


def test_sync_ref_model_mixes_the_policy_in(tmp_path, tok):
    trainer, _, _ = _train(
        tmp_path,
        tok,
        beta=0.1,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=1.0,
        max_steps=1,
    )
    for ref, policy in zip(trainer.ref_model.parameters(), trainer.model.parameters(), strict=True):
        torch.testing.assert_close(ref, policy.detach())


def test_static_entropy_bonus(tmp_path, tok):
    _, logs, changed = _train(tmp_path, tok, entropy_coef=0.05, max_steps=2)
    assert changed
    for log in logs:
        assert log["entropy_coef"] == 0.05
        # loss = policy loss - coef * mean per-token entropy (one micro-batch per step)
        assert log["loss"] == pytest.approx(log["policy_loss"] - 0.05 * log["entropy"], rel=1e-4, abs=1e-6)


def test_adaptive_entropy_moves_saves_and_restores_the_coefficient(tmp_path, tok):
    common = dict(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=100.0,  # entropy is always below: the coefficient grows each step
        entropy_coef_delta=0.02,
        entropy_coef_max=1.0,
        save_strategy="steps",
        save_steps=2,
    )
    trainer, logs, _ = _train(tmp_path, tok, max_steps=2, **common)
    assert trainer.entropy_coef == pytest.approx(0.05)
    saved = json.loads((tmp_path / "checkpoint-2" / "posttrain_state.json").read_text())
    assert saved["entropy_coef"] == pytest.approx(0.05)
    args = make_config(tmp_path, max_steps=3, **{**common, "save_strategy": "no"})
    resumed = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=varied_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.entropy_coef == pytest.approx(0.07)  # restored 0.05, then one more step


def test_adaptive_entropy_decreases_above_target(tmp_path, tok):
    trainer, logs, _ = _train(
        tmp_path,
        tok,
        max_steps=2,
        use_adaptive_entropy=True,
        entropy_coef=0.1,
        entropy_target=0.0,
        entropy_coef_delta=0.03,
    )
    assert trainer.entropy_coef == pytest.approx(0.04)
    # above the target the bonus is not applied: the loss is the policy loss alone
    assert logs[0]["loss"] == pytest.approx(logs[0]["policy_loss"], abs=1e-6)


@pytest.mark.parametrize("quantile", [0.0, 0.2])
def test_top_entropy_quantile(tmp_path, tok, quantile):
    _, logs, changed = _train(tmp_path, tok, top_entropy_quantile=quantile, max_steps=2)
    assert changed and all(math.isfinite(h["loss"]) for h in logs)


def test_off_policy_mask(tmp_path, tok):
    _, logs, changed = _train(tmp_path, tok, off_policy_mask_threshold=0.01, num_iterations=2, max_steps=2)
    assert changed and all(math.isfinite(h["loss"]) for h in logs)


def test_cast_lm_head_to_fp32(tmp_path, tok):
    model = build_tiny_model(tok).to(torch.bfloat16)
    trainer, logs, changed = _train(tmp_path, tok, model=model, cast_lm_head_to_fp32=True, max_steps=1)
    assert trainer.model.lm_head.weight.dtype == torch.float32
    assert trainer.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert changed and math.isfinite(logs[0]["loss"])


def test_cast_lm_head_to_fp32_refuses_tied_embeddings(tmp_path, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            tie_word_embeddings=True,
        )
    )  # fmt: skip
    with pytest.raises(ValueError, match="tie_word_embeddings=True"):
        _train(tmp_path, tok, model=tied, cast_lm_head_to_fp32=True)


def test_router_aux_loss_on_a_dense_model_is_an_error(tmp_path, tok):
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.01 is set, but LlamaForCausalLM is not"):
        _train(tmp_path, tok, router_aux_loss_coef=0.01)


def test_router_aux_loss_on_a_moe_model(tmp_path, tok):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        )
    )  # fmt: skip
    trainer, logs, changed = _train(tmp_path, tok, model=moe, router_aux_loss_coef=0.01, max_steps=2)
    assert changed
    assert all(h["aux_loss"] > 0.0 for h in logs)
