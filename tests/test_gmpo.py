"""GMPOConfig / GMPOTrainer: the reference's experimental GMPO API on GRPO's "gmpo" objective."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, make_config, make_trainer, standard_dataset
from test_invariance import token_sum_reward

import posttrain
from posttrain import GMPOConfig, GMPOTrainer, GRPOConfig


def test_the_config_is_grpos_with_gmpos_defaults(tmp_path) -> None:
    gmpo = GMPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    grpo = GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    assert isinstance(gmpo, GRPOConfig)
    assert (gmpo.epsilon, gmpo.epsilon_high, gmpo.loss_type, gmpo.beta) == (0.4, None, "gmpo", 0.0)
    changed = {
        f.name for f in dataclasses.fields(GMPOConfig) if getattr(gmpo, f.name) != getattr(grpo, f.name)
    }
    assert changed == {"epsilon", "loss_type"}  # epsilon_high None: the upper clip reuses epsilon
    assert "GMPOConfig" in posttrain.__all__ and "GMPOTrainer" in posttrain.__all__


def test_another_objective_is_refused_not_ignored(tmp_path) -> None:
    """The reference ignores loss_type under GMPO; posttrain says it does not apply."""
    with pytest.raises(
        ValueError, match=r"GMPOConfig trains GMPO's objective only.*GRPOConfig\(loss_type='dapo'\)"
    ):
        GMPOConfig(output_dir=str(tmp_path), loss_type="dapo", bf16=False, use_cpu=True)
    tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match="GMPOTrainer trains GMPO's objective"):
        GMPOTrainer(build_tiny_model(tok), token_sum_reward, make_config(tmp_path), processing_class=tok,
                    train_dataset=standard_dataset())  # fmt: skip


def test_the_trainer_trains_like_grpo_with_loss_type_gmpo(tmp_path) -> None:
    """Same seed, data and scripted rollouts: GMPOTrainer's parameters equal GRPOTrainer's with
    GRPOConfig(loss_type="gmpo", epsilon=0.4), bit for bit."""
    from helpers import RankScriptedGenerator
    from test_invariance import SCRIPT

    tok = build_tiny_tokenizer()
    values = {
        **CPU_TEST_ARGS,
        "num_generations": 4,
        "max_completion_length": 8,
        "seed": 3,
        "learning_rate": 5e-2,
    }
    runs = []
    for config, trainer_cls in (
        (GMPOConfig(output_dir=str(tmp_path / "gmpo"), **values), GMPOTrainer),
        (GRPOConfig(output_dir=str(tmp_path / "grpo"), loss_type="gmpo", epsilon=0.4, **values), None),
    ):
        model = build_tiny_model(tok, seed=2)
        if trainer_cls is None:
            trainer = make_trainer(tok, token_sum_reward, config, model=model)
        else:
            trainer = trainer_cls(
                model, token_sum_reward, config, train_dataset=standard_dataset(), processing_class=tok
            )
        trainer.generator = RankScriptedGenerator(SCRIPT, offset=0, stride=config.generation_batch_size)
        trainer.train()
        runs.append([p.detach().clone() for p in trainer.model.parameters()])
        assert any("clip_ratio/region_mean" in h for h in trainer.state.log_history)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_the_default_output_folder_is_named_after_the_model(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    model.config._name_or_path = "org/tiny-llama"
    args = GMPOTrainer.default_args(model, GMPOConfig, "GMPO")
    assert isinstance(args, GMPOConfig) and args.output_dir.endswith("tiny-llama-GMPO")
