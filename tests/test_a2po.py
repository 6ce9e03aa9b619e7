"""A*-PO: the value estimate and the regression loss worked by hand, the config's contract, stage 1
(sampling, caching, resuming, filtering, the binary-reward check) and the trainer end to end.

The formulas are transcribed from the paper (arXiv 2505.20686) and the
paper index: ``V*(x) = beta1 * log mean_j exp(r_j / beta1)`` over reference samples, and
``loss = mean_i (beta2 * log(pi / pi_ref)(y_i|x_i) - (r_i - V*(x_i)))^2``.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import (
    CPU_TEST_ARGS,
    SGD_ARGS,
    conversational_dataset,
    standard_dataset,
    two_processes_against_one,
)
from test_invariance import SCRIPT

from posttrain import A2POConfig, A2POTrainer, GRPOConfig
from posttrain.a2po import losses
from posttrain.a2po.values import VALUES_FILE, row_key
from posttrain.generation.base import Samples
from posttrain.ops.reductions import Normalizers


def odd_sum(completion_ids, **kwargs):
    """A binary reward: whether the completion's token ids sum to an odd number."""
    return [float(sum(ids) % 2) for ids in completion_ids]


class PromptKeyedGenerator:
    """Answers the k-th row of a prompt within a batch with ``SCRIPT[(sum of prompt ids + k) % 8]``.

    Each prompt's completions depend only on the prompt and its rank among the batch's rows of
    that prompt, so stage 1 (N rows per prompt) and stage 2 (one row) give the same completions
    however the prompts are split across batches or processes.
    """

    def __init__(self) -> None:
        self.rows = 0

    def generate(self, prompt_ids, prompt_mask, **kwargs):
        seen: dict[int, int] = {}
        rows = []
        for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist(), strict=True):
            key = sum(t for t, m in zip(ids, mask, strict=True) if m)
            k = seen.get(key, 0)
            seen[key] = k + 1
            rows.append(SCRIPT[(key + k) % len(SCRIPT)])
        self.rows += len(rows)
        return Samples.from_lists(rows, 0, prompt_ids.device)


def a2po_config(tmp_path, **overrides) -> A2POConfig:
    values = {
        "output_dir": str(tmp_path),
        **CPU_TEST_ARGS,
        "max_completion_length": 8,
        "num_value_samples": 4,
        "beta2": 0.1,
    }
    values.update(overrides)
    return A2POConfig(**values)


def a2po_trainer(
    tmp_path, tok=None, dataset=None, generator=PromptKeyedGenerator, reward=odd_sum, **overrides
):
    tok = tok if tok is not None else build_tiny_tokenizer()
    trainer = A2POTrainer(
        model=build_tiny_model(tok, seed=3),
        reward_funcs=reward,
        args=a2po_config(tmp_path, **overrides),
        train_dataset=dataset if dataset is not None else standard_dataset(),
        processing_class=tok,
    )
    if generator is not None:
        trainer.generator = generator()
    return trainer


# ---- the formulas ------------------------------------------------------------------------------


def test_value_estimate_by_hand() -> None:
    """beta1 = 0.5, N = 4: no success gives 0, all successes 1, one success 0.5 * log((3 + e^2) / 4)."""
    rewards = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64
    )
    expected = torch.tensor([0.0, 0.5 * math.log((3 + math.e**2) / 4), 1.0], dtype=torch.float64)
    torch.testing.assert_close(losses.value_estimates(rewards, 0.5), expected)
    # between the mean reward (beta1 large) and the best reward (beta1 small)
    one = rewards[1:2]
    assert abs(losses.value_estimates(one, 1e4).item() - 0.25) < 1e-4
    assert abs(losses.value_estimates(one, 1e-3).item() - 1.0) < 1e-2


def test_regression_loss_and_gradient_by_hand() -> None:
    """Two completions, beta2 = 0.5, 4 completions per step: loss = sum (0.5 d_i - A_i)^2 / 4, and
    d loss / d logp_t = 2 (0.5 d_i - A_i) * 0.5 / 4 on each counted token of completion i."""
    logps = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, -0.5, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([0.25, -0.5], dtype=torch.float64)
    loss, implicit = losses.regression_loss(logps, ref, mask, adv, 0.5, Normalizers(sequences=4.0))
    d = [(-1.0 + 1.5) + (-2.0 + 1.0), 3 * 0.5]  # -0.5, 1.5 (the masked 9.0 does not count)
    errors = [0.5 * d[0] - 0.25, 0.5 * d[1] + 0.5]  # -0.5, 1.25
    torch.testing.assert_close(loss, torch.tensor((errors[0] ** 2 + errors[1] ** 2) / 4, dtype=torch.float64))
    torch.testing.assert_close(implicit, torch.tensor([0.5 * d[0], 0.5 * d[1]], dtype=torch.float64))
    loss.backward()
    expected = torch.tensor([[errors[0] / 4] * 3, [errors[1] / 4] * 3], dtype=torch.float64) * mask
    torch.testing.assert_close(logps.grad, expected)


def test_first_non_binary() -> None:
    assert losses.first_non_binary(torch.tensor([0.0, 1.0, 1.0 + 1e-9])) is None
    assert losses.first_non_binary(torch.tensor([0.0, 0.5, 2.0])) == 1
    assert losses.first_non_binary(torch.tensor([1.0, float("nan")])) == 1


# ---- the config ----------------------------------------------------------------------------------

# The reference's A2POConfig own fields (../shared/reference/sft-online-distillation-api.md), and
# TrainingArguments' learning rate, which it keeps
REFERENCE_FIELDS = {
    "model_init_kwargs": None, "trust_remote_code": False, "max_prompt_length": 512, "max_completion_length": 256,
    "temperature": 1.0, "top_p": 1.0, "top_k": None, "num_value_samples": 8, "beta1": 0.5,
    "filter_all_incorrect": True, "beta2": 1e-3, "reward_weights": None, "learning_rate": 5e-5,
}  # fmt: skip


def test_config_has_the_reference_fields_and_defaults(tmp_path) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(A2POConfig)}
    for name, value in REFERENCE_FIELDS.items():
        assert name in defaults, f"A2POConfig lacks the reference field {name}"
        assert defaults[name] == value, f"{name}: {defaults[name]!r} != the reference's {value!r}"
        assert f"`{name}`" in A2POConfig.__doc__ or f"{name} (`" in A2POConfig.__doc__, f"{name} undocumented"
    config = a2po_config(tmp_path)
    assert config.num_generations == 1 and config.num_generations_eval == 1
    assert (
        dataclasses.replace(config).generation_batch_size == config.generation_batch_size
    )  # a copy rebuilds


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        pytest.param(
            {"num_generations": 4}, "num_generations=4 does not apply to A.-PO", id="num_generations"
        ),
        pytest.param({"beta": 0.1}, "beta=0.1 does not apply", id="beta"),
        pytest.param({"sync_ref_model": True}, "sync_ref_model=True does not apply", id="sync_ref_model"),
        pytest.param({"num_iterations": 2}, "num_iterations=2 does not apply", id="num_iterations"),
        pytest.param({"beta1": 0.0}, "beta1=0.0 is invalid", id="beta1"),
        pytest.param({"beta2": -1.0}, "beta2=-1.0 is invalid", id="beta2"),
        pytest.param({"num_value_samples": 0}, "num_value_samples=0 is invalid", id="num_value_samples"),
        pytest.param({"max_prompt_length": 0}, "max_prompt_length=0 is invalid", id="max_prompt_length"),
        pytest.param({"top_k": -1}, "top_k=-1 is invalid", id="top_k"),
    ],
)
def test_config_rejects_bad_values(tmp_path, overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        a2po_config(tmp_path, **overrides)


def test_trainer_refuses_a_grpo_config(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    args = GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True)
    with pytest.raises(TypeError, match="A2POConfig"):
        A2POTrainer(build_tiny_model(tok), odd_sum, args, standard_dataset(), processing_class=tok)


def test_streamed_dataset_is_refused(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    streamed = standard_dataset().to_iterable_dataset()
    with pytest.raises(ValueError, match="map-style dataset"):
        A2POTrainer(build_tiny_model(tok), odd_sum, a2po_config(tmp_path), streamed, processing_class=tok)


# ---- stage 1 ---------------------------------------------------------------------------------------


def _expected_rewards(trainer: A2POTrainer, row: dict) -> list[float]:
    """The rewards of a prompt's N PromptKeyedGenerator completions, worked out independently."""
    ids = trainer.processing_class(row["prompt"])["input_ids"]
    key = sum(ids)
    n = trainer.args.num_value_samples
    return [float(sum(SCRIPT[(key + k) % len(SCRIPT)]) % 2) for k in range(n)]


def test_stage_one_samples_every_prompt_once_and_caches_it(tmp_path) -> None:
    dataset = standard_dataset(10)
    trainer = a2po_trainer(tmp_path, dataset=dataset, per_device_eval_batch_size=4)
    trainer.estimate_values()
    assert trainer.generator.rows == 10 * 4  # rounds of 4, 4 and 2 prompts, 4 samples each
    store = trainer.value_store.rewards
    for row in dataset:
        assert store[row_key(dict(row))] == _expected_rewards(trainer, dict(row))
    lines = (tmp_path / VALUES_FILE).read_text().splitlines()
    assert json.loads(lines[0])["settings"]["num_value_samples"] == 4 and len(lines) == 11
    # a second trainer in the same output_dir samples nothing again
    again = a2po_trainer(tmp_path, dataset=dataset, per_device_train_batch_size=4)
    again.estimate_values()
    assert again.generator.rows == 0 and again.value_store.rewards == store


def test_an_interrupted_stage_one_resumes_where_it_stopped(tmp_path) -> None:
    dataset = standard_dataset(8)
    full = a2po_trainer(tmp_path / "full", dataset=dataset)
    full.estimate_values()
    lines = (tmp_path / "full" / VALUES_FILE).read_text().splitlines()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / VALUES_FILE).write_text(
        "\n".join(lines[:4]) + '\n{"key": "half-writ'
    )  # 3 prompts done
    resumed = a2po_trainer(tmp_path / "cut", dataset=dataset)
    resumed.estimate_values()
    assert resumed.generator.rows == 5 * 4  # only the 5 missing prompts
    assert resumed.value_store.rewards == full.value_store.rewards


def test_a_values_file_of_other_settings_is_refused(tmp_path) -> None:
    a2po_trainer(tmp_path).estimate_values()
    other = a2po_trainer(tmp_path, num_value_samples=2)
    with pytest.raises(ValueError, match=r"num_value_samples: 4 there, 2 now.*delete the file"):
        other.estimate_values()


def test_beta1_changes_without_sampling_again(tmp_path) -> None:
    a2po_trainer(tmp_path).estimate_values()
    trainer = a2po_trainer(tmp_path, beta1=2.0)
    trainer.estimate_values()
    assert trainer.generator.rows == 0


def test_never_solved_prompts_are_dropped(tmp_path) -> None:
    """filter_all_incorrect drops exactly the prompts whose N rewards are all 0."""
    dataset = standard_dataset(16)
    trainer = a2po_trainer(tmp_path, dataset=dataset, num_value_samples=2)
    expected = [dict(r) for r in dataset if any(_expected_rewards(trainer, dict(r)))]
    assert 0 < len(expected) < 16  # the script makes some prompts unsolvable
    trainer.estimate_values()
    assert [dict(r) for r in trainer.train_dataset] == expected
    kept = a2po_trainer(tmp_path, dataset=dataset, num_value_samples=2, filter_all_incorrect=False)
    kept.estimate_values()
    assert len(kept.train_dataset) == 16


def test_every_prompt_unsolved_is_a_clear_error(tmp_path) -> None:
    zero = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731
    trainer = a2po_trainer(tmp_path, reward=zero)
    with pytest.raises(ValueError, match="none of the 16 training prompts.*filter_all_incorrect=False"):
        trainer.train()


def test_a_reward_that_is_not_binary_is_named(tmp_path) -> None:
    def half(completions, **kw):
        return [0.5 if i == 2 else 1.0 for i in range(len(completions))]

    trainer = a2po_trainer(tmp_path, reward=half)
    with pytest.raises(
        ValueError, match=r"binary reward.*stage 1.*sample 2 scored 0.5 \(half=0.5\): prompt 'Question 0"
    ):
        trainer.train()
    assert trainer.state.global_step == 0


def test_stage_one_samples_the_reference_under_peft(tmp_path) -> None:
    """With trained adapters the reference is the base: stage 1 generates with the adapters off."""
    from peft import LoraConfig

    tok = build_tiny_tokenizer()
    trainer = A2POTrainer(
        model=build_tiny_model(tok, seed=3),
        reward_funcs=odd_sum,
        args=a2po_config(tmp_path, max_steps=1),
        train_dataset=standard_dataset(),
        processing_class=tok,
        peft_config=LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    assert trainer.ref_model is None
    states = []

    class Recording(PromptKeyedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            lora = [m for m in trainer.model.modules() if hasattr(m, "disable_adapters")]
            states.append(all(m.disable_adapters for m in lora))
            return super().generate(prompt_ids, prompt_mask, **kwargs)

    trainer.generator = Recording()
    trainer.train()
    assert states[0] is True and states[-1] is False  # stage 1 on the base, stage 2 on the policy
    assert any(h.get("implicit_reward", 0.0) != 0.0 for h in trainer.state.log_history)


def test_stage_one_samples_the_frozen_reference_even_mid_training(tmp_path) -> None:
    """Prompts first met by evaluate() after some steps get V* from the reference, not the policy."""
    trainer = a2po_trainer(tmp_path, max_steps=2)
    states = []

    class Recording(PromptKeyedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            states.append(trainer.model is trainer.ref_model)
            return super().generate(prompt_ids, prompt_mask, **kwargs)

    trainer.generator = Recording()
    trainer.train()
    assert states[0] is True and states[-1] is False
    states.clear()
    trainer.evaluate(standard_dataset(24).select(range(16, 24)))
    assert states[0] is True and states[-1] is False  # stage 1 for the new prompts, then evaluation
    assert trainer.model is not trainer.ref_model


# ---- stage 2 ---------------------------------------------------------------------------------------


def test_trainer_feeds_its_rollout_to_the_formulas(tmp_path) -> None:
    """The advantages are r - V*(x) with V* from the prompts' stored rewards, and the loss is the
    regression of the trainer's own log-probs against its reference's: at temperature 1 whatever
    the sampling temperature (0.7 here), as in the reference."""
    trainer = a2po_trainer(tmp_path, per_device_train_batch_size=4, temperature=0.7)
    trainer.estimate_values()
    with torch.no_grad():  # move the policy away from the reference so the log-ratio is not zero
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [dict(trainer.train_dataset[i]) for i in range(4)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    stored = torch.tensor([_expected_rewards(trainer, r) for r in rows])
    values = 0.5 * (torch.logsumexp(stored / 0.5, dim=1) - math.log(4))
    torch.testing.assert_close(chunk.advantages, chunk.rewards[:, 0] - values, rtol=1e-5, atol=1e-6)
    loss = trainer.compute_loss(trainer.model, chunk)
    r = chunk.rollout
    from posttrain.ops.logprobs import completion_logps

    with torch.no_grad():
        policy = completion_logps(
            trainer.model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask
        )
    mask = r.model_token_mask.to(policy.logps.dtype)
    implicit = 0.1 * ((policy.logps - chunk.ref_logps) * mask).sum(dim=1)
    assert implicit.abs().min() > 0
    expected = ((implicit - chunk.advantages) ** 2).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-7)


def test_prompts_are_cut_to_max_prompt_length(tmp_path) -> None:
    seen = []

    class Recording(PromptKeyedGenerator):
        def generate(self, prompt_ids, prompt_mask, **kwargs):
            seen.append(int(prompt_mask.sum(dim=1).max()))
            return super().generate(prompt_ids, prompt_mask, **kwargs)

    trainer = a2po_trainer(tmp_path, generator=Recording, max_prompt_length=3, max_steps=1)
    trainer.train()
    assert seen and max(seen) == 3


@pytest.mark.parametrize("dataset", [standard_dataset, conversational_dataset])
def test_trains_and_logs_the_reference_metrics(tmp_path, dataset) -> None:
    tok = build_tiny_tokenizer()
    trainer = a2po_trainer(tmp_path, tok, dataset=dataset(), generator=None, reward=odd_sum, max_steps=3)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for name in ("reward", "v_star", "implicit_reward", "advantage", "rewards/odd_sum/mean", "num_tokens"):
        assert name in logs[-1], f"{name} not logged"
    assert logs[0]["implicit_reward"] == 0.0  # the first completions are scored by the reference itself
    assert logs[-1]["implicit_reward"] != 0.0
    assert abs(logs[0]["advantage"] - (logs[0]["reward"] - logs[0]["v_star"])) < 1e-6
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_evaluation_reports_the_regression_loss(tmp_path) -> None:
    """evaluate() first estimates V* of eval prompts stage 1 has not seen; before any step the
    policy is the reference, so the loss is the mean of (r - V*)^2."""
    tok = build_tiny_tokenizer()
    unseen = standard_dataset(24).select(range(16, 24))
    trainer = A2POTrainer(
        build_tiny_model(tok, seed=3),
        odd_sum,
        a2po_config(tmp_path, per_device_eval_batch_size=4),
        standard_dataset(),
        processing_class=tok,
    )
    trainer.generator = PromptKeyedGenerator()
    metrics = trainer.evaluate(unseen)
    logged = trainer.state.log_history[-1]  # the eval metrics are merged into the log, as in training
    assert {"eval_loss", "eval_v_star", "eval_advantage", "eval_implicit_reward"} <= set(logged)
    assert logged["eval_implicit_reward"] == 0.0
    errors = []
    for row in unseen:
        stored = _expected_rewards(trainer, dict(row))
        value = 0.5 * math.log(sum(math.exp(r / 0.5) for r in stored) / len(stored))
        errors.append((stored[0] - value) ** 2)  # the evaluated completion is the first sample's
    assert abs(metrics["eval_loss"] - sum(errors) / len(errors)) < 1e-5
    assert len(trainer.value_store.rewards) == 16 + 8


def _sgd_params(tmp_path, per_device: int, accumulation: int) -> list[torch.Tensor]:
    trainer = a2po_trainer(
        tmp_path,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        **SGD_ARGS,
        shuffle_dataset=False,
    )
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_same_update(tmp_path) -> None:
    one = _sgd_params(tmp_path / "one", 8, 1)
    four = _sgd_params(tmp_path / "four", 2, 4)
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_resume_is_exact(tmp_path) -> None:
    tok = build_tiny_tokenizer()

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = a2po_trainer(
            out, tok, generator=None, max_steps=3, save_strategy="steps", save_steps=1, learning_rate=0.05,
            steps_per_generation=2,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    assert resumed.generator is not None
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---- two processes --------------------------------------------------------------------------------


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> A2POTrainer:
    """Two SGD steps of A*-PO on 10 prompts (stage 1 included), 4 prompts per step in all."""
    tok = build_tiny_tokenizer()
    args = a2po_config(
        out_dir,
        per_device_train_batch_size=per_device,
        max_steps=2,
        **SGD_ARGS,
        shuffle_dataset=False,
        filter_all_incorrect=False,
        seed=1,
        **overrides,
    )
    return A2POTrainer(
        build_tiny_model(tok, seed=3), odd_sum, args, standard_dataset(10), processing_class=tok
    )


def ddp_generator(trainer: A2POTrainer) -> PromptKeyedGenerator:
    """Completions that depend on the prompt only, so both layouts sample alike (stage 1 too)."""
    return PromptKeyedGenerator()


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """2 processes x 2 prompts give the parameters, metrics and values file of 1 process x 4."""
    keys = ("reward", "v_star", "advantage", "implicit_reward", "num_tokens")
    logs = two_processes_against_one(
        "test_a2po", ddp_comparable_trainer, SCRIPT, tmp_path, 29579, (2, 4), keys
    )
    assert logs[-1]["implicit_reward"] != 0.0
    two = (tmp_path / VALUES_FILE).read_text().splitlines()
    one = (tmp_path / "one" / VALUES_FILE).read_text().splitlines()
    assert len(two) == 11 and sorted(two[1:]) == sorted(one[1:])


# ---- posttrain a2po -------------------------------------------------------------------------------


def test_cli_trains_and_saves(tmp_path, tiny_model_dir, capsys) -> None:
    """``posttrain a2po`` on a jsonl file with a dotted-path binary reward: two real steps, saved."""
    from posttrain.cli.a2po import a2po
    from posttrain.cli.main import COMMANDS

    assert COMMANDS["a2po"] is a2po
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus one?"}) + "\n" for i in range(8)))
    out = tmp_path / "run"
    trainer = a2po(
        ["--model_name_or_path", tiny_model_dir, "--dataset_name", str(data), "--output_dir", str(out),
         "--reward_funcs", "test_a2po.odd_sum", "--beta1", "1.0", "--num_value_samples", "2",
         "--filter_all_incorrect", "false", "--max_steps", "2", "--per_device_train_batch_size", "4",
         "--max_completion_length", "8", "--use_cpu", "--bf16", "false", "--report_to", "none",
         "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1"]
    )  # fmt: skip
    assert isinstance(trainer, A2POTrainer) and trainer.state.global_step == 2
    assert trainer.args.beta1 == 1.0 and trainer.args.num_value_samples == 2
    assert any("v_star" in h for h in trainer.state.log_history)
    assert (out / "config.json").exists() and (out / VALUES_FILE).exists()
    assert f"posttrain a2po: saved the trained model to {out}" in capsys.readouterr().out


# ---- prompts with images --------------------------------------------------------------------------


def test_a_row_with_images_keys_by_its_pixels_not_its_memory_address() -> None:
    """The stage-1 store's key of a row decoded twice is one key (it was a new one at every decode:
    ``str`` of an image holds its address, so training could not find its own values); two rows with
    the same text and other images are two prompts."""
    from vision_models import image_dataset

    data = image_dataset(2)
    assert row_key(dict(data[0])) == row_key(dict(data[0]))
    same_text = dict(data[1], prompt=data[0]["prompt"])
    assert row_key(same_text) != row_key(dict(data[0]))


def test_a2po_estimates_and_trains_on_prompts_with_images(tmp_path) -> None:
    from vision_models import build_qwen2_vl, image_dataset

    model, processor = build_qwen2_vl()

    def reward(completion_ids, **kwargs):
        return [float(sum(ids) % 2) for ids in completion_ids]

    args = A2POConfig(
        output_dir=str(tmp_path), **{**CPU_TEST_ARGS, "per_device_train_batch_size": 2, "gradient_checkpointing": False},
        max_completion_length=6, num_value_samples=2, filter_all_incorrect=False,
    )  # fmt: skip
    trainer = A2POTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=image_dataset(4),
        processing_class=processor,
    )
    trainer.train()
    assert len(trainer.value_store.rewards) == 4  # one value per prompt and image
    assert [h for h in trainer.state.log_history if "v_star" in h]
