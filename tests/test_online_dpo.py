"""Online DPO: the pair ordering and the losses worked by hand, the config's contract, the trainer.

Each prompt gets two completions from the policy (rows 2k and 2k + 1); a reward (or a judge)
picks the chosen one; DPO's loss table (sigmoid, or IPO on summed log-probabilities) trains on
the pair against the reference.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS, ScriptedGenerator, conversational_dataset, standard_dataset
from test_invariance import SCRIPT, token_sum_reward

from posttrain import GRPOConfig, OnlineDPOConfig, OnlineDPOTrainer
from posttrain.online_dpo import losses


def dpo_config(tmp_path, **overrides) -> OnlineDPOConfig:
    values = {
        "output_dir": str(tmp_path),
        **CPU_TEST_ARGS,
        "per_device_train_batch_size": 2,
        "max_new_tokens": 8,
    }
    values.update(overrides)
    return OnlineDPOConfig(**values)


def dpo_trainer(tmp_path, script=SCRIPT, dataset=None, **kwargs) -> OnlineDPOTrainer:
    tok = build_tiny_tokenizer()
    args = kwargs.pop("args", None) or dpo_config(tmp_path, **kwargs.pop("config", {}))
    if "judge" not in kwargs and "reward_funcs" not in kwargs:
        kwargs["reward_funcs"] = token_sum_reward
    trainer = OnlineDPOTrainer(
        model=build_tiny_model(tok, seed=3),
        args=args,
        train_dataset=dataset if dataset is not None else standard_dataset(),
        processing_class=tok,
        **kwargs,
    )
    if script is not None:
        trainer.generator = ScriptedGenerator(script, pad_token_id=0)
    return trainer


# ---- the formulas ------------------------------------------------------------------------------


def test_scores_with_the_missing_eos_penalty() -> None:
    """Weights (1, 2), a None counted out, a penalty of 0.5 on the unterminated completions."""
    rewards = torch.tensor([[1.0, 1.0], [2.0, float("nan")], [0.0, 0.5], [3.0, -1.0]])
    terminated = torch.tensor([True, False, False, True])
    scores = losses.completion_scores(rewards, torch.tensor([1.0, 2.0]), terminated, 0.5)
    torch.testing.assert_close(scores, torch.tensor([3.0, 2.0 - 0.5, 1.0 - 0.5, 1.0]))
    torch.testing.assert_close(
        losses.completion_scores(rewards, torch.tensor([1.0, 2.0]), terminated, None),
        torch.tensor([3.0, 2.0, 1.0, 1.0]),
    )


def test_the_first_completion_wins_ties() -> None:
    assert losses.first_is_chosen(torch.tensor([1.0, 2.0, 3.0, 3.0, 5.0, 4.0])).tolist() == [
        False,
        True,
        True,
    ]
    with pytest.raises(ValueError, match="pairs"):
        losses.first_is_chosen(torch.zeros(3))


def test_sigmoid_and_ipo_losses_by_hand() -> None:
    """Two pairs. Pair 0: the second row wins; pair 1: the first.

    logps (-3, -1 | -2, -5), ref (-2, -2 | -2, -4): pair 0 chosen = row 1, z = (-1 + 2) - (-3 + 2) = 2;
    pair 1 chosen = row 2, z = (-2 + 2) - (-5 + 4) = 1. beta = 0.5:
    sigmoid = mean(-log sigmoid(1), -log sigmoid(0.5)); ipo = mean((2 - 1)^2, (1 - 1)^2) = 0.5.
    """
    logps = torch.tensor([-3.0, -1.0, -2.0, -5.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -2.0, -4.0], dtype=torch.float64)
    pairs = losses.pair_logps(logps, ref, torch.tensor([False, True]))
    assert pairs.chosen.tolist() == [-1.0, -2.0] and pairs.rejected.tolist() == [-3.0, -5.0]
    sigmoid = losses.online_dpo_loss(pairs, "sigmoid", 0.5)
    expected = (-math.log(1 / (1 + math.exp(-1.0))) - math.log(1 / (1 + math.exp(-0.5)))) / 2
    assert sigmoid.loss.item() == pytest.approx(expected, rel=1e-6)
    ipo = losses.online_dpo_loss(pairs, "ipo", 0.5)
    assert ipo.loss.item() == pytest.approx(0.5, rel=1e-6)
    ipo.loss.backward()  # d/dz of mean (z - 1)^2 is (z - 1); chosen +, rejected -
    torch.testing.assert_close(logps.grad, torch.tensor([-1.0, 1.0, 0.0, -0.0], dtype=torch.float64))


# ---- the config ----------------------------------------------------------------------------------

# The reference's OnlineDPOConfig fields (../shared/reference/preference-api.md); beta's [0.1]
# becomes 0.1 when the config is built, as in the reference.
REFERENCE_DEFAULTS = {
    "reward_model_path": None, "max_new_tokens": 64, "max_length": 512, "temperature": 0.9, "top_p": 1.0,
    "top_k": 0, "min_p": None, "repetition_penalty": 1.0, "generation_kwargs": None, "cache_implementation": None,
    "missing_eos_penalty": None, "loss_type": "sigmoid", "disable_dropout": True, "use_vllm": False,
    "vllm_model_impl": "vllm", "vllm_structured_outputs_regex": None, "vllm_gpu_memory_utilization": 0.55,
    "vllm_mode": "colocate", "vllm_server_base_url": None, "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0, "vllm_group_port": 51216, "vllm_tensor_parallel_size": 1,
    "vllm_enable_sleep_mode": False, "ds3_gather_for_generation": True, "model_init_kwargs": None,
    "trust_remote_code": False, "reward_weights": None, "learning_rate": 5e-7, "remove_unused_columns": False,
}  # fmt: skip


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    config = OnlineDPOConfig(output_dir=str(tmp_path), bf16=False)
    for name, value in REFERENCE_DEFAULTS.items():
        assert getattr(config, name) == value, name
        assert f"`{name}`" in OnlineDPOConfig.__doc__ or f"{name} (`" in OnlineDPOConfig.__doc__, name
    assert config.beta == 0.1 and config.beta_at(3.0) == 0.1
    assert config.max_completion_length == 64 and config.num_generations == 2


def test_beta_per_epoch(tmp_path) -> None:
    config = dpo_config(tmp_path, beta=[0.2, 0.05])
    assert [config.beta_at(e) for e in (0.0, 0.99, 1.0, 2.5)] == [0.2, 0.2, 0.05, 0.05]
    copy = dataclasses.replace(config)  # a built config rebuilds (derived fields included)
    assert copy.beta == [0.2, 0.05] and copy.generation_batch_size == config.generation_batch_size


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param({"loss_type": "hinge"}, "loss_type", id="loss_type"),
        pytest.param({"beta": [0.1, -1.0]}, "beta", id="beta"),
        pytest.param({"beta": 0.0}, "beta", id="beta_zero"),
        pytest.param(
            {"num_generations": 4}, "num_generations=4 does not apply to online DPO", id="num_generations"
        ),
        pytest.param({"num_iterations": 2}, "num_iterations=2 does not apply", id="num_iterations"),
        pytest.param(
            {"steps_per_generation": 2}, "steps_per_generation=2 does not apply", id="steps_per_generation"
        ),
        pytest.param(
            {"max_completion_length": 100}, "set max_new_tokens instead", id="max_completion_length"
        ),
        pytest.param(
            {"generation_batch_size": 6}, "generation_batch_size=6 does not apply", id="generation_batch_size"
        ),
        pytest.param({"max_new_tokens": 0}, "max_new_tokens", id="max_new_tokens"),
    ],
)
def test_config_rejects(tmp_path, overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        dpo_config(tmp_path, **overrides)


# ---- the trainer's inputs ----------------------------------------------------------------------


class ShorterIsBetter:
    """A pairwise judge: the shorter completion wins (the first on a tie); it records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], list[list[str]]]] = []

    def judge(self, prompts: list[str], completions: list[list[str]]) -> list[int]:
        self.calls.append((prompts, completions))
        return [0 if len(a) <= len(b) else 1 for a, b in completions]


def test_needs_exactly_one_way_to_order_pairs(tmp_path) -> None:
    with pytest.raises(ValueError, match="needs a way to order each pair"):
        dpo_trainer(tmp_path, reward_funcs=None)
    with pytest.raises(ValueError, match="both a judge and rewards"):
        dpo_trainer(tmp_path, reward_funcs=token_sum_reward, judge=ShorterIsBetter())
    with pytest.raises(TypeError, match="without a judge"):
        dpo_trainer(tmp_path, judge=object())
    with pytest.raises(NotImplementedError, match="data_collator"):
        dpo_trainer(tmp_path, data_collator=lambda rows: rows)
    tok = build_tiny_tokenizer()
    with pytest.raises(TypeError, match="OnlineDPOConfig"):
        OnlineDPOTrainer(
            build_tiny_model(tok),
            reward_funcs=token_sum_reward,
            args=GRPOConfig(output_dir=str(tmp_path), bf16=False),
        )


def test_pairs_follow_the_scores_and_the_loss_is_the_formula(tmp_path) -> None:
    """Two prompts (4 completions): the higher token-sum reward is chosen; at the first step the policy
    is its reference, so z = 0 and the sigmoid loss is log 2; after moving the policy it is the
    formula on the trainer's own log-probs (at temperature 1)."""
    trainer = dpo_trainer(tmp_path)
    rows = [{"prompt": f"Question {i}"} for i in range(2) for _ in range(2)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    scores = chunk.rewards[:, 0]
    first = scores.view(2, 2)[:, 0] >= scores.view(2, 2)[:, 1]
    torch.testing.assert_close(chunk.advantages, torch.stack([first, ~first], 1).flatten().float() * 2 - 1)
    loss = trainer.compute_loss(trainer.model, chunk)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-5)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss = trainer.compute_loss(trainer.model, chunk)
    r = chunk.rollout
    out = trainer.model(
        input_ids=torch.cat([r.prompt_ids, r.completion_ids], 1),
        attention_mask=torch.cat([r.prompt_mask, r.completion_mask], 1),
    )
    # the policy's own log-probs, not at the sampling temperature (0.9): DPO has no importance ratio
    # for it to enter, and the reference and the paper take the policy's (they departed at 0.9)
    assert trainer.args.temperature == 0.9
    logits = out.logits[:, r.prompt_ids.shape[1] - 1 : -1]
    token = torch.log_softmax(logits.double(), -1).gather(2, r.completion_ids.unsqueeze(2)).squeeze(2)
    mask = r.completion_mask.double()
    u = ((token - chunk.ref_logps.double()) * mask).sum(1).view(2, 2)
    z = torch.where(first, u[:, 0] - u[:, 1], u[:, 1] - u[:, 0])
    expected = -torch.nn.functional.logsigmoid(0.1 * z).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


@pytest.mark.parametrize("dataset", [standard_dataset, conversational_dataset])
def test_trains_and_logs_the_reference_metrics(tmp_path, dataset) -> None:
    trainer = dpo_trainer(
        tmp_path, script=None, dataset=dataset(), config={"max_steps": 2, "learning_rate": 1e-2}
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for name in (
        "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
        "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
        "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token",
        "beta", "rewards/token_sum_reward/mean", "completions/mean_length",
    ):  # fmt: skip
        assert name in logs[-1], name
    assert logs[0]["objective/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is its reference
    assert logs[0]["loss"] == pytest.approx(math.log(2), rel=1e-3)
    assert logs[0]["rewards/margins"] == pytest.approx(
        logs[0]["rewards/chosen"] - logs[0]["rewards/rejected"], abs=1e-6
    )
    assert logs[0]["objective/scores_margin"] >= 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_a_judge_orders_the_pairs(tmp_path) -> None:
    judge = ShorterIsBetter()
    trainer = dpo_trainer(tmp_path, judge=judge, config={"max_steps": 1, "learning_rate": 1e-2})
    assert trainer.reward_funcs == []
    rows = [{"prompt": f"Question {i}"} for i in range(2) for _ in range(2)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    prompts, completions = judge.calls[-1]
    assert prompts == ["Question 0", "Question 1"] and all(len(pair) == 2 for pair in completions)
    expected = [0 if len(a) <= len(b) else 1 for a, b in completions]
    first = chunk.advantages.view(-1, 2)[:, 0] > 0
    assert [0 if f else 1 for f in first.tolist()] == expected
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert "objective/scores" not in log and "reward" not in log and "rewards/accuracies" in log


def test_a_judge_answer_out_of_range_is_named(tmp_path) -> None:
    class Broken:
        def judge(self, prompts, completions):
            return [2] * len(prompts)

    trainer = dpo_trainer(tmp_path, judge=Broken())
    rows = [{"prompt": "Question 0"}] * 2
    with pytest.raises(ValueError, match="Broken.judge returned 1 answers for 1 pairs, and 2 for pair 0"):
        trainer._generate_and_score(rows, "train", num_chunks=1)


def test_long_prompts_are_cut_on_the_left_to_max_length(tmp_path) -> None:
    trainer = dpo_trainer(tmp_path, config={"max_length": 10})
    rows = [{"prompt": "a long question " * 10}] * 2
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    width = chunk.rollout.completion_ids.shape[1]
    assert chunk.rollout.prompt_ids.shape[1] == 10 - width


def test_beta_follows_the_epoch(tmp_path) -> None:
    data = Dataset.from_dict({"prompt": ["What is 1 plus 1?", "What is 2 plus 2?"]})
    trainer = dpo_trainer(
        tmp_path, dataset=data, config={"beta": [0.2, 0.05], "num_train_epochs": 2, "max_steps": -1}
    )
    trainer.train()
    betas = [h["beta"] for h in trainer.state.log_history if "loss" in h]
    assert betas == [0.2, 0.05]


def test_resume_is_exact(tmp_path) -> None:
    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = dpo_trainer(
            out,
            script=None,
            config={"max_steps": 3, "save_strategy": "steps", "save_steps": 1, "learning_rate": 1e-2},
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_cli_trains_and_saves(tmp_path, tiny_model_dir, capsys) -> None:
    """``posttrain online-dpo`` on a jsonl file with a dotted-path reward: two steps, the model saved."""
    import json

    from posttrain.cli.main import COMMANDS
    from posttrain.cli.online_dpo import online_dpo

    assert COMMANDS["online-dpo"] is online_dpo
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus one?"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    trainer = online_dpo(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out),
         "--reward_funcs", "helpers.length_reward", "--beta", "0.2", "0.1", "--loss_type", "ipo",
         "--missing_eos_penalty", "1.0", "--max_steps", "2", "--per_device_train_batch_size", "2",
         "--max_new_tokens", "8", "--use_cpu", "--bf16", "false", "--report_to", "none",
         "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]
    )  # fmt: skip
    assert isinstance(trainer, OnlineDPOTrainer) and trainer.state.global_step == 2
    assert trainer.args.beta == [0.2, 0.1] and trainer.args.loss_type == "ipo"
    assert trainer.args.max_completion_length == 8
    assert (out / "config.json").exists()
    assert f"posttrain online-dpo: saved the trained model to {out}" in capsys.readouterr().out


# ---- two processes --------------------------------------------------------------------------------


def ddp_comparable_trainer(out_dir: str, prompts_per_device: int, **overrides) -> OnlineDPOTrainer:
    """Two SGD steps of online DPO on one repeated prompt (the two-process test)."""
    data = Dataset.from_dict({"prompt": ["What is 2 plus 3?"] * 16})
    config = {
        "per_device_train_batch_size": prompts_per_device,
        "max_steps": 2,
        "optim": "sgd",
        "learning_rate": 0.5,
    }
    config.update(max_grad_norm=0.0, lr_scheduler_type="constant", seed=1, beta=0.5, **overrides)
    return dpo_trainer(out_dir, script=None, dataset=data, config=config)


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """2 processes x 1 pair give the parameters and metrics of 1 process x 2 pairs."""
    from helpers import two_processes_against_one

    keys = ("loss", "objective/kl", "objective/scores", "rewards/margins", "rewards/accuracies")
    logs = two_processes_against_one(
        "test_online_dpo", ddp_comparable_trainer, SCRIPT, tmp_path, 29571, (1, 2), keys
    )
    assert logs[-1]["objective/kl"] != 0.0


def test_reward_model_path_scores_the_pairs(tmp_path) -> None:
    """``OnlineDPOConfig(reward_model_path=...)`` with no reward_funcs: the classifier orders the pairs."""
    from test_reward_models import build_reward_model
    from transformers import PreTrainedModel

    tok = build_tiny_tokenizer()
    path = tmp_path / "tiny-rm"
    build_reward_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    trainer = dpo_trainer(
        tmp_path, reward_funcs=None, config={"reward_model_path": str(path), "max_steps": 1}
    )
    assert isinstance(trainer.reward_funcs[0], PreTrainedModel) and trainer.reward_func_names == ["tiny-rm"]
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["objective/scores_margin"] > 0  # the classifier tells the scripted completions apart


def test_evaluation_samples_pairs_and_logs_eval_metrics(tmp_path) -> None:
    """``evaluate()``: ``per_device_eval_batch_size`` prompts, each sampled twice, the loss and metrics."""
    data = Dataset.from_dict({"prompt": [f"What is {i} plus 1?" for i in range(4)]})
    trainer = dpo_trainer(tmp_path, dataset=data, config={"per_device_eval_batch_size": 2})
    trainer.eval_dataset = data
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(math.log(2), rel=1e-4)  # the policy is its reference
    logged = trainer.state.log_history[-1]  # the eval metrics are merged into the log, as in training
    for name in (
        "eval_objective/kl",
        "eval_rewards/accuracies",
        "eval_objective/scores",
        "eval_val/contain_eos_token",
    ):
        assert name in logged, name
    assert logged["eval_objective/kl"] == pytest.approx(0.0, abs=1e-5)
    assert trainer.generator.calls == 4 * 2  # 4 prompts, each sampled twice


@pytest.mark.parametrize("family", ["online_dpo", "rloo", "a2po", "async_grpo"])
def test_router_aux_loss_of_a_moe_policy_is_trained_and_logged(tmp_path, family) -> None:
    """``router_aux_loss_coef`` is resolved once by the online core and added by each family's loss."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from posttrain import A2POConfig, A2POTrainer, AsyncGRPOConfig, AsyncGRPOTrainer, RLOOConfig, RLOOTrainer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    moe = Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        )
    )  # fmt: skip
    common = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "max_steps": 1, "router_aux_loss_coef": 0.01}
    if family == "rloo":
        args = RLOOConfig(**common, num_generations=2, max_completion_length=8)
        trainer = RLOOTrainer(moe, token_sum_reward, args, standard_dataset(), processing_class=tok)
    elif family == "a2po":
        args = A2POConfig(**common, max_completion_length=8, num_value_samples=2, filter_all_incorrect=False)
        odd = lambda completion_ids, **kw: [float(sum(ids) % 2) for ids in completion_ids]  # noqa: E731
        trainer = A2POTrainer(moe, odd, args, standard_dataset(), processing_class=tok)
    elif family == "async_grpo":
        args = AsyncGRPOConfig(**common, num_generations=2, max_completion_length=8, num_sampler_logprobs=2)
        trainer = AsyncGRPOTrainer(moe, token_sum_reward, args, standard_dataset(), processing_class=tok)
    else:
        args = OnlineDPOConfig(**{**common, "per_device_train_batch_size": 2}, max_new_tokens=8)
        trainer = OnlineDPOTrainer(
            moe,
            reward_funcs=token_sum_reward,
            args=args,
            train_dataset=standard_dataset(),
            processing_class=tok,
        )
    assert trainer.aux_loss_coef == 0.01
    trainer.generator = ScriptedGenerator(SCRIPT, pad_token_id=0)
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["aux_loss"] > 0.0
