"""RLOO and REINFORCE++: the formulas worked by hand, the config's contract, the trainer end to end.

The leave-one-out baseline, the KL folded into the reward, REINFORCE++'s batch normalisation and
the sequence-level clipped loss are each checked against an independent transcription of the
formulas (the reference's RLOO docs, Ahmadian et al. 2024, Hu 2025), then the trainer is checked
to feed them its own rollout's tensors.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import (
    CPU_TEST_ARGS,
    SGD_ARGS,
    ScriptedGenerator,
    conversational_dataset,
    standard_dataset,
    two_processes_against_one,
)
from test_invariance import SCRIPT, token_sum_reward  # scripted completions of different lengths

from posttrain import GRPOConfig, RLOOConfig, RLOOTrainer
from posttrain.ops.reductions import Normalizers
from posttrain.rloo import losses


def rloo_config(tmp_path, **overrides) -> RLOOConfig:
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "num_generations": 4, "max_completion_length": 8}
    values.update(overrides)
    return RLOOConfig(**values)


def rloo_trainer(tmp_path, tok=None, dataset=None, script=SCRIPT, **overrides) -> RLOOTrainer:
    tok = tok if tok is not None else build_tiny_tokenizer()
    trainer = RLOOTrainer(
        model=build_tiny_model(tok, seed=3),
        reward_funcs=token_sum_reward,
        args=rloo_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else standard_dataset(),
        processing_class=tok,
    )
    if script is not None:
        trainer.generator = ScriptedGenerator(script, pad_token_id=0)
    return trainer


# ---- the formulas ------------------------------------------------------------------------------


def test_leave_one_out_by_hand() -> None:
    """G=2: each baseline is the other reward. G=4 on (1, 2, 3, 6): sum 12, baseline (12 - r)/3,
    so A = (1 - 11/3, 2 - 10/3, 3 - 3, 6 - 2) = (-8/3, -4/3, 0, 4) = 4/3 (r - mean)."""
    r = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    torch.testing.assert_close(
        losses.leave_one_out(r, 2), torch.tensor([-1.0, 1.0, -3.0, 3.0], dtype=torch.float64)
    )
    expected = torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(losses.leave_one_out(r, 4), expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(losses.leave_one_out(r, 4), 4 / 3 * (r - r.mean()), rtol=1e-5, atol=0)


def test_leave_one_out_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="whole groups"):
        losses.leave_one_out(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="at least 2"):
        losses.leave_one_out(torch.zeros(4), 1)


def test_advantages_fold_the_kl_and_clip_the_task_reward() -> None:
    """Two functions weighted (1, 0.5), a None, the task reward clipped to [0, 4], KL beta=0.1."""
    rewards = torch.tensor([[1.0, 2.0], [5.0, float("nan")], [0.0, -4.0], [3.0, 0.0]], dtype=torch.float64)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    kl = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    adv, metrics = losses.rloo_advantages(rewards, weights, 2, kl, beta=0.1, clip_range=(0.0, 4.0))
    task = [min(max(1.0 + 1.0, 0.0), 4.0), min(5.0, 4.0), max(0.0 - 2.0, 0.0), 3.0]  # 2, 4, 0, 3
    total = [t - 0.1 * k for t, k in zip(task, kl.tolist(), strict=True)]  # 1.95, 4.1, -0.2, 3.0
    expected = [total[0] - total[1], total[1] - total[0], total[2] - total[3], total[3] - total[2]]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-12)
    assert metrics["frac_reward_zero_std"] == 0.0


def test_reinforce_pp_normalises_over_the_batch() -> None:
    rewards = torch.tensor([[1.0], [2.0], [3.0], [6.0]], dtype=torch.float64)
    adv, _ = losses.rloo_advantages(rewards, torch.ones(1, dtype=torch.float64), 2, normalize=True)
    raw = [-1.0, 1.0, -3.0, 3.0]
    mean = sum(raw) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in raw) / 3)  # Bessel
    expected = torch.tensor([(x - mean) / (std + 1e-4) for x in raw], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=0)


def test_zero_std_fraction_is_measured_on_the_task_reward() -> None:
    rewards = torch.tensor([[1.0], [1.0], [0.0], [2.0]])
    kl = torch.tensor([0.0, 3.0, 0.0, 0.0])
    adv, metrics = losses.rloo_advantages(rewards, torch.ones(1), 2, kl, beta=1.0)
    assert metrics["frac_reward_zero_std"] == 0.5
    assert adv[:2].abs().sum() > 0  # the KL still separates the first group


def test_sequence_clipped_loss_by_hand() -> None:
    """Ratios exp(+0.5), exp(-0.5), 1 with A = (1, -1, 2), eps 0.2 / 0.28, 3 sequences.

    Completion 0: rho = e^0.5 = 1.6487 > 1.28 and A > 0, so the clipped 1.28 wins: -1.28.
    Completion 1: rho = e^-0.5 = 0.6065 < 0.8 and A < 0: min(-0.6065, -0.8) = -0.8: +0.8.
    Completion 2: rho = 1: -2. Loss = (-1.28 + 0.8 - 2) / 3.
    """
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    old = torch.zeros(3, 3, dtype=torch.float64)
    logps = torch.tensor([[0.2, 0.3, 9.0], [-0.1, -0.1, -0.3], [0.0, 5.0, 5.0]], dtype=torch.float64)
    logps.requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, stats = losses.sequence_clipped_loss(logps, old, adv, mask, 0.2, 0.28, Normalizers(sequences=3.0))
    torch.testing.assert_close(loss, torch.tensor((-1.28 + 0.8 - 2.0) / 3, dtype=torch.float64))
    assert stats["high"].tolist() == [1.0, 0.0, 0.0]
    assert stats["low"].tolist() == [0.0, 1.0, 0.0]
    assert stats["region"].tolist() == [1.0, 1.0, 0.0]
    loss.backward()
    # clipped completions pass no gradient; the unclipped one gets -A/3 * d rho/d logp = -2/3 on its token
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[2, 0] = -2.0 / 3
    torch.testing.assert_close(logps.grad, expected)


def test_on_policy_gradient_is_reinforce_with_the_baseline() -> None:
    """On-policy rho = 1: the gradient is -A_i / N on every counted token (REINFORCE)."""
    logps = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.5, -1.5], dtype=torch.float64)
    loss, _ = losses.sequence_clipped_loss(
        logps, logps.detach(), adv, mask, 0.2, 0.2, Normalizers(sequences=4.0)
    )
    loss.backward()
    torch.testing.assert_close(logps.grad, -adv.unsqueeze(1) * mask / 4.0)
    torch.testing.assert_close(loss, -adv.sum() / 4.0)


# ---- the config ----------------------------------------------------------------------------------

# The reference's RLOOConfig own fields (../shared/reference/sft-online-distillation-api.md)
REFERENCE_FIELDS = {
    "model_init_kwargs": None, "trust_remote_code": False, "router_aux_loss_coef": None, "disable_dropout": False,
    "num_generations": 2, "num_generations_eval": None, "max_completion_length": 512,
    "ds3_gather_for_generation": True, "shuffle_dataset": True, "pad_to_multiple_of": "auto",
    "generation_batch_size": None, "steps_per_generation": None, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
    "min_p": None, "generation_kwargs": None, "chat_template_kwargs": None, "repetition_penalty": 1.0,
    "cache_implementation": None, "use_vllm": False, "vllm_mode": "colocate", "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False, "vllm_structured_outputs_regex": None, "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000, "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216, "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1, "beta": 0.05, "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None,
    "reward_weights": None, "normalize_advantages": False, "reward_clip_range": None,
    "mask_truncated_completions": False, "sync_ref_model": False, "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512, "log_completions": False, "log_multimodal": True,
    "num_completions_to_print": None, "log_unique_prompts": False, "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None, "use_transformers_paged": False,
    "learning_rate": 1e-6, "remove_unused_columns": False,
}  # fmt: skip


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(RLOOConfig)}
    for name, value in REFERENCE_FIELDS.items():
        assert name in defaults, f"RLOOConfig lacks the reference field {name}"
        assert defaults[name] == value, f"{name}: {defaults[name]!r} != the reference's {value!r}"
    for name in REFERENCE_FIELDS:
        assert f"`{name}`" in RLOOConfig.__doc__ or f"{name} (`" in RLOOConfig.__doc__, f"{name} undocumented"
    # GRPO's own loss options are not RLOO fields
    assert "loss_type" not in defaults and "scale_rewards" not in defaults
    assert GRPOConfig(output_dir=str(tmp_path), bf16=False).num_generations == 8  # GRPO keeps its default


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        pytest.param({"num_generations": 1}, ValueError, "num_generations", id="num_generations"),
        pytest.param({"reward_clip_range": (3.0, 1.0)}, ValueError, "reward_clip_range", id="clip_reversed"),
        pytest.param({"reward_clip_range": (1.0,)}, ValueError, "reward_clip_range", id="clip_not_a_pair"),
        pytest.param({"beta": -0.1}, ValueError, "beta", id="beta"),
        pytest.param(
            {"auto_find_batch_size": True}, ValueError, "auto_find_batch_size", id="auto_find_batch_size"
        ),
        pytest.param(
            {"sync_ref_model": True, "beta": 0.0}, ValueError, "sync_ref_model", id="sync_without_kl"
        ),
        pytest.param(
            {"per_device_train_batch_size": 3, "num_generations": 2},
            ValueError,
            "num_generations=2",
            id="split_group",
        ),
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        rloo_config(tmp_path, **overrides)


def test_dynamic_sampling_with_a_kl_warns(tmp_path) -> None:
    with pytest.warns(UserWarning, match="dynamic_sampling=True keeps groups"):
        rloo_config(tmp_path, dynamic_sampling=True, per_device_train_batch_size=8)


def test_reward_clip_range_list_becomes_a_tuple(tmp_path) -> None:
    assert rloo_config(tmp_path, reward_clip_range=[-1, 1]).reward_clip_range == (-1, 1)


def test_trainer_refuses_a_grpo_config(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(TypeError, match="RLOOConfig"):
        RLOOTrainer(build_tiny_model(tok), token_sum_reward, args, standard_dataset(), processing_class=tok)


# ---- the trainer ---------------------------------------------------------------------------------


def test_trainer_feeds_its_rollout_to_the_formulas(tmp_path) -> None:
    """The advantages the trainer hands to the loss are rloo_advantages of its rewards and of the
    KL sums of its own old and reference log-probs over the loss mask."""
    trainer = rloo_trainer(tmp_path, beta=0.3, per_device_train_batch_size=8, max_completion_length=5)
    with torch.no_grad():  # move the policy away from the reference so the KL is not zero
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt": f"Question {i}"} for i in range(2) for _ in range(4)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    mask = trainer._loss_mask(chunk.rollout)
    kl = ((chunk.old_logps - chunk.ref_logps) * mask).sum(dim=1)
    assert kl.abs().min() > 0
    task = chunk.rewards[:, 0].to(kl.dtype)  # the reward runner's scores (tested on their own)
    total = task - 0.3 * kl
    expected = torch.cat([g - (g.sum() - g) / 3 for g in total.view(2, 4)])
    torch.testing.assert_close(chunk.advantages, expected, rtol=1e-5, atol=1e-6)
    # on-policy: the ratio is 1, so the loss is -mean(A)
    loss = trainer.compute_loss(trainer.model, chunk)
    torch.testing.assert_close(loss, -expected.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dataset", [standard_dataset, conversational_dataset])
def test_trains_and_logs_the_reference_metrics(tmp_path, dataset) -> None:
    tok = build_tiny_tokenizer()
    trainer = rloo_trainer(tmp_path, tok, dataset=dataset(), script=None, beta=0.1, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for name in (
        "reward", "reward_std", "frac_reward_zero_std", "rewards/token_sum_reward/mean", "kl", "entropy",
        "clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
        "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio", "num_tokens",
        "step_time",
    ):  # fmt: skip
        assert name in logs[-1], f"{name} not logged"
    assert logs[0]["kl"] == 0.0  # the first rollout is sampled by the reference itself
    assert logs[-1]["kl"] != 0.0
    assert logs[-1]["clip_ratio/region_mean"] == 0.0  # on-policy: the ratio is 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_beta_zero_loads_no_reference(tmp_path) -> None:
    trainer = rloo_trainer(tmp_path, beta=0.0, max_steps=1)
    assert trainer.ref_model is None
    trainer.train()
    assert "kl" not in trainer.state.log_history[0]


def _sgd_params(tmp_path, per_device: int, accumulation: int, **overrides) -> list[torch.Tensor]:
    trainer = rloo_trainer(
        tmp_path,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        **SGD_ARGS,
        **overrides,
    )
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


@pytest.mark.parametrize("overrides", [{}, {"normalize_advantages": True, "beta": 0.2}])
def test_accumulation_gives_the_same_update(tmp_path, overrides) -> None:
    one = _sgd_params(tmp_path / "one", 8, 1, **overrides)
    four = _sgd_params(tmp_path / "four", 2, 4, **overrides)
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_resume_is_exact(tmp_path) -> None:
    tok = build_tiny_tokenizer()

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = rloo_trainer(
            out, tok, script=None, beta=0.1, num_iterations=2, max_steps=3, save_strategy="steps", save_steps=1,
            learning_rate=0.05,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_peft_reference_is_the_base_with_adapters_off(tmp_path) -> None:
    from peft import LoraConfig

    tok = build_tiny_tokenizer()
    trainer = RLOOTrainer(
        model=build_tiny_model(tok, seed=3),
        reward_funcs=token_sum_reward,
        args=rloo_config(tmp_path, beta=0.1, max_steps=2, learning_rate=0.05),
        train_dataset=standard_dataset(),
        processing_class=tok,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    assert trainer.ref_model is None
    trainer.generator = ScriptedGenerator(SCRIPT, pad_token_id=0)
    rows = [{"prompt": f"Question {i}"} for i in range(4)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    assert not torch.allclose(chunk.old_logps, chunk.ref_logps)  # adapters on vs off
    trainer.train()
    assert trainer.state.log_history[-2]["kl"] != 0.0


# ---- two processes --------------------------------------------------------------------------------


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> RLOOTrainer:
    """Two SGD steps of RLOO with a KL on one repeated prompt, groups of 4 (the two-process test)."""
    from datasets import Dataset

    tok = build_tiny_tokenizer()
    args = rloo_config(
        out_dir,
        per_device_train_batch_size=per_device,
        num_generations=4,
        beta=0.2,
        max_steps=2,
        **SGD_ARGS,
        seed=1,
        **overrides,
    )
    prompts = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 16})
    return RLOOTrainer(build_tiny_model(tok, seed=3), token_sum_reward, args, prompts, processing_class=tok)


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """2 processes x 2 completions give the parameters and metrics of 1 process x 4."""
    keys = ("reward", "kl", "frac_reward_zero_std", "clip_ratio/region_mean", "num_tokens")
    logs = two_processes_against_one(
        "test_rloo", ddp_comparable_trainer, SCRIPT, tmp_path, 29563, (2, 4), keys
    )
    assert logs[-1]["kl"] != 0.0


# ---- posttrain rloo -------------------------------------------------------------------------------


def test_cli_trains_and_saves(tmp_path, tiny_model_dir, capsys) -> None:
    """``posttrain rloo`` on a jsonl file with a dotted-path reward: REINFORCE++ flags reach the
    config, two real steps, the model saved."""
    import json

    from posttrain.cli.main import COMMANDS
    from posttrain.cli.rloo import rloo

    assert COMMANDS["rloo"] is rloo
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus one?"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    trainer = rloo(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out),
         "--reward_funcs", "helpers.length_reward", "--normalize_advantages", "true",
         "--reward_clip_range", "0", "5", "--max_steps", "2", "--per_device_train_batch_size", "4",
         "--max_completion_length", "8", "--use_cpu", "--bf16", "false", "--report_to", "none",
         "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]
    )  # fmt: skip
    assert isinstance(trainer, RLOOTrainer) and trainer.state.global_step == 2
    assert trainer.args.normalize_advantages and trainer.args.reward_clip_range == (0.0, 5.0)
    assert trainer.args.num_generations == 4  # the command's laptop default, under RLOO's own 2
    assert any("rewards/length_reward/mean" in h for h in trainer.state.log_history)
    assert (out / "config.json").exists()
    assert f"posttrain rloo: saved the trained model to {out}" in capsys.readouterr().out


def test_a_reward_model_scores_the_completions(tmp_path) -> None:
    """A sequence classifier saved to a folder, given by path, is a reward of RLOO as of GRPO."""
    from test_reward_models import build_reward_model
    from transformers import PreTrainedModel

    tok = build_tiny_tokenizer()
    path = tmp_path / "tiny-rm"
    build_reward_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    trainer = RLOOTrainer(
        model=build_tiny_model(tok, seed=3),
        reward_funcs=[str(path), token_sum_reward],
        args=rloo_config(tmp_path / "run", max_steps=1),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    assert isinstance(trainer.reward_funcs[0], PreTrainedModel)
    assert trainer.reward_func_names == ["tiny-rm", "token_sum_reward"]
    trainer.generator = ScriptedGenerator(SCRIPT, pad_token_id=0)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["rewards/tiny-rm/std"] > 0  # the classifier tells the scripted completions apart
