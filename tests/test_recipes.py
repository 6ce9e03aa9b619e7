"""The paper recipes in ``recipes/``: each is a valid GRPOConfig and trains on a tiny model.

A recipe is a YAML mapping of GRPOConfig fields, loaded with ``yaml.safe_load`` and passed as
``GRPOConfig(output_dir=..., **values)``. The file checks are strict (every key a field, every
value line commented, the header naming the paper); the training test shrinks each recipe to a
two-step CPU run with the overrides of ``TINY_RUN``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import length_reward, standard_dataset

from posttrain import GRPOConfig, GRPOTrainer

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

# Recipe name -> strings its header must contain: the paper's full title and its arXiv id.
PAPERS: dict[str, tuple[str, ...]] = {
    "deepseekmath": (
        "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models",
        "2402.03300",
    ),
    "deepseek_r1": (
        "DeepSeek-R1: Incentivizing Reasoning Capability in LLMs via Reinforcement Learning",
        "2501.12948",
    ),
    "gspo": ("Group Sequence Policy Optimization", "2507.18071"),
    "gmpo": ("Geometric-Mean Policy Optimization", "2507.20673"),
    "dapo": ("DAPO: An Open-Source LLM Reinforcement Learning System at Scale", "2503.14476"),
    "long_cot": ("Demystifying Long Chain-of-Thought Reasoning in LLMs", "2502.03373"),
    "intellect_2": (
        "INTELLECT-2: A Reasoning Model Trained Through Globally Decentralized Reinforcement Learning",
        "2505.07291",
    ),
    "skywork_or1": ("Skywork Open Reasoner 1 Technical Report", "2505.22312"),
    "beyond_80_20": (
        "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement Learning "
        "for LLM Reasoning",
        "2506.01939",
    ),
    "dr_grpo": ("Understanding R1-Zero-Like Training: A Critical Perspective", "2503.20783"),
    "lite_ppo": ("Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning", "2508.08221"),
    "tis": (
        "Truncated Importance Sampling",
        "Safe and Efficient Off-Policy Reinforcement Learning",
        "1606.02647",
    ),
    "mis": (
        "Masked Importance Sampling",
        "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
        "2510.18855",
    ),
    "scalerl": ("The Art of Scaling Reinforcement Learning Compute for LLMs", "2510.13786"),
    "2_grpo": ("It Takes Two: Your GRPO Is Secretly DPO", "2510.00977"),
    "sapo": ("Soft Adaptive Policy Optimization", "2511.20347"),
    "deepseek_v3_2": ("DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models", "2512.02556"),
    "gdpo": (
        "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL Optimization",
        "2601.05242",
    ),
    "luspo": (
        "Length-Unbiased Sequence Policy Optimization: Revealing and Controlling Response Length "
        "Variation in RLVR",
        "2602.05261",
    ),
    "vespo": (
        "VESPO: Variational Sequence-Level Soft Policy Optimization for Stable Off-Policy LLM Training",
        "2602.10693",
    ),
}

# Overrides that shrink any recipe to a two-step CPU run on the tiny model (each value wins over
# the recipe's):
TINY_RUN: dict[str, Any] = {
    # batch shape: one generation batch of 4 completions per optimizer step, no accumulation. The
    # recipes' batch fields describe the papers' multi-GPU jobs (e.g. 512 completions per step).
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 1,
    "generation_batch_size": None,
    "steps_per_generation": None,
    "max_completion_length": 8,
    "max_steps": 2,
    # CPU, float32, nothing written or reported, a log line (with its loss) every step.
    "bf16": False,
    "use_cpu": True,
    "report_to": "none",
    "save_strategy": "no",
    "gradient_checkpointing": False,
    "logging_steps": 1,
    "disable_tqdm": True,
    # vLLM needs a GPU. Without it the recipes' vllm_importance_sampling_* fields (TIS, MIS,
    # VESPO) and the Keep Sampling Mask (DeepSeek-V3.2) are inert: generation and training then
    # use the same model, so there is no mismatch to correct.
    "use_vllm": False,
    # With 8-token completions nearly every completion is truncated; DAPO's overlong filtering
    # would mask them all and leave no gradient, so the tiny run keeps them in the loss.
    "mask_truncated_completions": False,
}
# num_generations: 4, or the recipe's own group size when it is smaller (2-GRPO keeps its 2).
TINY_NUM_GENERATIONS = 4

_KEY_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*:")
_NUMBER_LIKE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _recipe_paths() -> list[Path]:
    return sorted(RECIPES_DIR.glob("*.yaml"))


def _load(path: Path) -> dict[str, Any]:
    with open(path) as f:
        return yaml.safe_load(f)


def _header(path: Path) -> str:
    """The comment block at the top of a recipe, before its first key."""
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            lines.append(line.lstrip("#").strip())
        elif line.strip():
            break
    return " ".join(lines)


def even_token_reward(completion_ids, **kwargs):
    """Fraction of even token ids: varies between completions even when all have the same length."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


RECIPES = [p.stem for p in _recipe_paths()]
GRPO_FIELDS = {f.name for f in dataclasses.fields(GRPOConfig)}


def test_one_recipe_per_paper():
    assert sorted(RECIPES) == sorted(PAPERS)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_file_is_well_formed(name):
    path = RECIPES_DIR / f"{name}.yaml"
    values = _load(path)
    assert isinstance(values, dict) and values, f"{path} must hold a non-empty mapping"

    unknown = sorted(set(values) - GRPO_FIELDS)
    assert not unknown, f"{path}: keys that are not GRPOConfig fields: {unknown}"

    # YAML 1.1 reads `3e-4` (no dot) as a string: every number must parse as a number.
    for key, value in values.items():
        assert not (isinstance(value, str) and _NUMBER_LIKE.fullmatch(value)), (
            f"{path}: {key}={value!r} parsed as a string; write it with a dot, e.g. 3.0e-4"
        )

    # every value line cites its source in a comment
    for line in path.read_text().splitlines():
        match = _KEY_LINE.match(line)
        if match:
            assert " # " in line, f"{path}: the line of {match.group(1)!r} has no source comment"

    header = _header(path)
    for needle in PAPERS[name]:
        assert needle in header, f"{path}: the header does not name {needle!r}"


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_trains_two_steps(name, tmp_path):
    values = _load(RECIPES_DIR / f"{name}.yaml")
    overrides = dict(TINY_RUN, output_dir=str(tmp_path))
    overrides["num_generations"] = min(
        values.get("num_generations", TINY_NUM_GENERATIONS), TINY_NUM_GENERATIONS
    )

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    args = GRPOConfig(**{**values, **overrides})
    trainer = GRPOTrainer(
        model=model,
        # two rewards, so that multi-reward settings (GDPO) have something to act on
        reward_funcs=[length_reward, even_token_reward],
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    trainer.train()

    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2
    assert all(math.isfinite(loss) for loss in losses)
