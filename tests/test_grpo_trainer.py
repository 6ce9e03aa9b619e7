"""End-to-end GRPO training on a tiny model built from a config (no downloads)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import (
    ScriptedGenerator,
    conversational_dataset,
    length_reward,
    make_config,
    make_trainer,
    standard_dataset,
)

from posttrain import GRPOTrainer
from posttrain.models.compat import model_checkpointing

METRICS = [
    "num_tokens",
    "step_time",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
    "completions/clipped_ratio",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train_logs(trainer):
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def char_reward(completions, **kwargs):
    """Characters in the completion text (either format)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t)) for t in texts]


async def slow_parity_reward(completion_ids, **kwargs):
    """1 for an even token count, else 0, after a short wait (an I/O-bound reward)."""
    await asyncio.sleep(0.2)
    return [float(len(ids) % 2 == 0) for ids in completion_ids]


async def slow_first_token_reward(completion_ids, **kwargs):
    """The first token id modulo 3, after a short wait."""
    await asyncio.sleep(0.2)
    return [float(ids[0] % 3) if ids else 0.0 for ids in completion_ids]


@pytest.fixture
def tok():
    return build_tiny_tokenizer()


@pytest.mark.parametrize("dataset_fn", [standard_dataset, conversational_dataset])
def test_training_changes_parameters_and_logs_every_metric(tmp_path, tok, dataset_fn):
    model = build_tiny_model(tok)
    seen = {}

    def recording_reward(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, solution=solution, state=trainer_state)
        return [1.0 if str(s) in str(c) else 0.0 for c, s in zip(completions, solution, strict=True)]

    args = make_config(tmp_path, reward_weights=[1.0, 0.5, 2.0], max_steps=2)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[char_reward, slow_parity_reward, recording_reward],
        args=args,
        train_dataset=dataset_fn(),
        processing_class=tok,
    )
    before = _params(model)
    trainer.train()

    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # reward functions see the dataset columns and completions in the prompt's format
    assert len(seen["prompts"]) == 4 and len(seen["solution"]) == 4
    conversational = dataset_fn is conversational_dataset
    assert isinstance(seen["completions"][0], list if conversational else str)
    if conversational:
        assert seen["completions"][0][0]["role"] == "assistant"
    assert seen["state"] is trainer.state

    logs = _train_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        for key in METRICS + [
            f"rewards/{n}/{s}" for n in ("char_reward", "slow_parity_reward") for s in ("mean", "std")
        ]:
            assert key in log, key
            assert math.isfinite(log[key]), key
        assert (
            1
            <= log["completions/min_length"]
            <= log["completions/mean_length"]
            <= log["completions/max_length"]
            <= 8
        )
        assert 0.0 <= log["completions/clipped_ratio"] <= 1.0
        assert 0.0 < log["entropy"] <= math.log(len(tok)) + 1e-4
        for key in (
            "low_mean",
            "low_min",
            "high_mean",
            "high_max",
            "region_mean",
        ):
            assert 0.0 <= log[f"clip_ratio/{key}"] <= 1.0
        assert log["step_time"] > 0
        expected = (
            log["rewards/char_reward/mean"]
            + 0.5 * log["rewards/slow_parity_reward/mean"]
            + 2.0 * log["rewards/recording_reward/mean"]
        )
        assert log["reward"] == pytest.approx(expected, rel=1e-5)
    # each step generates 4 completions; num_tokens counts prompt + completion tokens cumulatively
    assert 0 < logs[0]["num_tokens"] < logs[1]["num_tokens"]


def test_async_rewards_are_awaited(tmp_path, tok):
    args = make_config(tmp_path, max_steps=1, reward_weights=[1.0, 1.0])
    trainer = make_trainer(tok, [slow_parity_reward, slow_first_token_reward], args)
    trainer.train()
    log = trainer.state.log_history[0]
    assert 0.0 <= log["rewards/slow_parity_reward/mean"] <= 1.0
    assert 0.0 <= log["rewards/slow_first_token_reward/mean"] <= 2.0
    assert log["reward"] == pytest.approx(
        log["rewards/slow_parity_reward/mean"] + log["rewards/slow_first_token_reward/mean"], rel=1e-5
    )


def test_model_and_tokenizer_load_from_a_path(tmp_path, tiny_model_dir):
    args = make_config(tmp_path, max_steps=1)
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=standard_dataset()
    )
    assert trainer.model.dtype == torch.float32
    assert trainer.processing_class.padding_side == "left"
    assert trainer.processing_class.pad_token == trainer.processing_class.eos_token  # fell back to EOS
    trainer.train()
    assert trainer.state.global_step == 1


def test_model_init_kwargs_dtype(tmp_path, tiny_model_dir):
    args = make_config(tmp_path, max_steps=1, model_init_kwargs={"dtype": "bfloat16"})
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=length_reward, args=args, train_dataset=standard_dataset()
    )
    assert trainer.model.dtype == torch.bfloat16


def test_iterable_dataset_trains_with_max_steps(tmp_path, tok):
    stream = conversational_dataset(32).to_iterable_dataset()
    args = make_config(tmp_path, max_steps=3)
    trainer = make_trainer(tok, char_reward, args, stream)
    trainer.train()
    assert trainer.state.global_step == 3


def test_completions_are_masked_after_eos(tmp_path, tok):
    eos, pad = tok.eos_token_id, tok.pad_token_id or tok.eos_token_id
    seen = []

    def record(completion_ids, completions, **kwargs):
        seen.extend(zip(completion_ids, completions, strict=True))
        return [0.0] * len(completion_ids)

    args = make_config(tmp_path, max_steps=1)
    trainer = make_trainer(tok, record, args)
    trainer.generator = ScriptedGenerator([[5, 6, eos, 7, 8], [9, 10, 11, 12, 13], [eos, 14], [15, eos]], pad)
    trainer.train()
    ids = [s[0] for s in seen[:4]]
    assert ids == [[5, 6, eos], [9, 10, 11, 12, 13], [eos], [15, eos]]
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == pytest.approx(0.25)
    assert trainer.state.log_history[0]["completions/mean_terminated_length"] == pytest.approx(2.0)
    assert trainer.state.log_history[0]["completions/max_length"] == 5


def test_groups_share_a_prompt_and_batches_count_completions(tmp_path, tok):
    batches = []

    def record(prompts, **kwargs):
        batches.append(list(prompts))
        return [0.0] * len(prompts)

    # 2 completions per prompt, 6 completions per device batch, 2 accumulation steps:
    # one generation of 12 completions (6 prompts) per optimizer step
    args = make_config(
        tmp_path, per_device_train_batch_size=6, num_generations=2, gradient_accumulation_steps=2, max_steps=2
    )
    trainer = make_trainer(tok, record, args)
    trainer.train()
    assert [len(b) for b in batches] == [12, 12]  # generated once per optimizer step
    for b in batches:
        assert all(b[i] == b[i + 1] for i in range(0, 12, 2))
        assert len(set(b)) == 6


def test_shuffle_dataset_false_keeps_order(tmp_path, tok):
    batches = []

    def record(prompts, **kwargs):
        batches.append(prompts[0])
        return [0.0] * len(prompts)

    ds = standard_dataset()
    args = make_config(tmp_path, shuffle_dataset=False, max_steps=3)
    trainer = GRPOTrainer(
        model=build_tiny_model(tok), reward_funcs=record, args=args, train_dataset=ds, processing_class=tok
    )
    trainer.train()
    assert batches == [ds[0]["prompt"], ds[1]["prompt"], ds[2]["prompt"]]


def test_none_rewards_are_excluded_per_sample(tmp_path, tok):
    def only_even_rows(solution, **kwargs):
        return [1.0 if int(s) % 2 == 0 else None for s in solution]

    def only_odd_rows(solution, **kwargs):
        return [3.0 if int(s) % 2 == 1 else None for s in solution]

    args = make_config(
        tmp_path, max_steps=4, shuffle_dataset=False, per_device_train_batch_size=4, num_generations=2
    )
    trainer = make_trainer(tok, [only_even_rows, only_odd_rows], args)
    trainer.train()
    log = trainer.state.log_history[0]
    assert log["rewards/only_even_rows/mean"] == 1.0 and log["rewards/only_odd_rows/mean"] == 3.0
    assert log["reward"] == pytest.approx(2.0)  # two prompts: one scored 1.0, the other 3.0
    assert log["frac_reward_zero_std"] == 1.0  # each group's completions got the same reward


def test_all_none_rewards_warn(tmp_path, tok):
    def never(prompts, **kwargs):
        return [None] * len(prompts)

    args = make_config(tmp_path, max_steps=1)
    trainer = make_trainer(tok, never, args)
    with pytest.warns(UserWarning, match="All reward functions returned None"):
        trainer.train()


def test_log_metric_and_log_extra_reach_the_trainer(tmp_path, tok):
    def reward(completions, log_metric, log_extra, **kwargs):
        log_metric("my_accuracy", 0.25)
        log_extra("golden", ["x"] * len(completions))
        return [0.0] * len(completions)

    args = make_config(tmp_path, max_steps=1)
    trainer = make_trainer(tok, reward, args)
    trainer.train()
    assert trainer.state.log_history[0]["my_accuracy"] == 0.25
    assert trainer.log_extra_columns == {"golden": ["x"] * 4}


def test_num_iterations_reuses_generations_with_old_logps(tmp_path, tok):
    calls = []

    def record(prompts, **kwargs):
        calls.append(len(prompts))
        return [float(i % 2) for i in range(len(prompts))]

    args = make_config(tmp_path, num_iterations=2, max_steps=4, epsilon=0.01, learning_rate=0.05)
    trainer = make_trainer(tok, record, args)
    trainer.train()
    assert calls == [4, 4]  # one generation per two optimizer steps
    logs = _train_logs(trainer)
    # on the replay the policy has moved, so the ratio leaves 1 and the clip can act
    assert logs[0]["clip_ratio/region_mean"] == 0.0
    assert logs[1]["clip_ratio/region_mean"] > 0.0


def test_steps_per_generation_buffers_rollouts(tmp_path, tok):
    calls = []

    def record(prompts, **kwargs):
        calls.append(len(prompts))
        return [float(i % 2) for i in range(len(prompts))]

    args = make_config(tmp_path, steps_per_generation=2, max_steps=4)
    trainer = make_trainer(tok, record, args)
    trainer.train()
    assert calls == [8, 8]  # 8 completions generated at once, used over two optimizer steps


def test_evaluation_with_dict_of_datasets_and_num_generations_eval(tmp_path, tok):
    sizes = []

    def record(prompts, **kwargs):
        sizes.append(len(prompts))
        return [float(len(p)) for p in prompts]

    args = make_config(
        tmp_path,
        max_steps=1,
        eval_strategy="steps",
        eval_steps=1,
        num_generations_eval=2,
        per_device_eval_batch_size=2,
    )
    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=record,
        args=args,
        train_dataset=standard_dataset(),
        eval_dataset={"std": standard_dataset(4), "chat": conversational_dataset(4)},
        processing_class=tok,
    )
    trainer.train()
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    for name in ("std", "chat"):
        assert f"eval_{name}_loss" in logs
        assert f"eval_{name}_reward" in logs
        assert f"eval_{name}_completions/mean_length" in logs
    # training batch of 4, then 4 prompts x 2 generations per eval dataset in batches of 2
    assert sizes == [4] + [2] * 8


def test_mask_truncated_completions_excludes_cut_completions(tmp_path, tok):
    args = make_config(tmp_path, max_steps=1, mask_truncated_completions=True)
    trainer = make_trainer(tok, length_reward, args)
    # every completion is truncated: nothing is left in the loss, so nothing moves
    trainer.generator = ScriptedGenerator(
        [[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]], 0
    )
    before = _params(trainer.model)
    trainer.train()
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_disable_dropout(tmp_path, tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        attention_dropout=0.3,
    )
    model = LlamaForCausalLM(config)
    args = make_config(tmp_path, disable_dropout=True)
    GRPOTrainer(
        model=model,
        reward_funcs=length_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    assert model.config.attention_dropout == 0.3  # config untouched, modules switched off
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_checkpoint_and_resume(tmp_path, tok):
    args = make_config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = make_trainer(tok, length_reward, args)
    trainer.train()
    assert (tmp_path / "checkpoint-1").is_dir() and (tmp_path / "checkpoint-2").is_dir()
    args = make_config(tmp_path, max_steps=3, save_strategy="no")
    resumed = make_trainer(tok, length_reward, args)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert resumed.state.num_input_tokens_seen > trainer.state.num_input_tokens_seen


def test_gradient_checkpointing_still_trains(tmp_path, tok):
    model = build_tiny_model(tok)
    args = make_config(tmp_path, max_steps=1, gradient_checkpointing=True)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=char_reward,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
    )
    before = _params(model)
    trainer.train()
    assert model_checkpointing(model)
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)]
    assert all(changed)  # every parameter received a gradient through the checkpointed layers


def test_sampling_parameters_reach_generate(tmp_path, tok):
    args = make_config(
        tmp_path,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        max_completion_length=5,
        generation_kwargs={"top_k": 7, "suppress_tokens": [3]},
        cache_implementation="static",
    )
    trainer = make_trainer(tok, char_reward, args)
    config = trainer.generator.config
    assert (config.temperature, config.top_p, config.min_p, config.repetition_penalty) == (
        0.7,
        0.9,
        0.05,
        1.1,
    )
    assert config.top_k == 7  # generation_kwargs override the named parameters
    assert config.suppress_tokens == [3]
    assert config.max_new_tokens == 5 and config.do_sample and config.use_cache
    assert config.cache_implementation == "static"


def test_generation_batch_size_sets_steps_per_generation(tmp_path, tok):
    calls = []

    def record(prompts, **kwargs):
        calls.append(len(prompts))
        return [float(i % 2) for i in range(len(prompts))]

    args = make_config(tmp_path, generation_batch_size=12, max_steps=3)
    assert args.steps_per_generation == 3
    trainer = make_trainer(tok, record, args)
    trainer.train()
    assert calls == [12]


def test_importing_posttrain_is_cheap():
    import subprocess
    import sys

    code = "import sys, posttrain; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]
