"""Bad input fails with a clear message before any training step.

Each case names the parameter or column at fault; config cases fail when the config is built,
dataset and model cases when the trainer is built (before the model loads where possible),
reward cases at the first scoring, before any optimizer step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import length_reward, make_config, standard_dataset

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.rewards.runner import RewardFunctionError


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


# ---- config ------------------------------------------------------------------------------------

CONFIG_CASES = [
    ({"per_device_train_batch_size": 3, "num_generations": 4}, "num_generations"),
    ({"num_generations": 1}, "num_generations"),
    ({"generation_batch_size": 8, "steps_per_generation": 4}, "generation_batch_size"),
    ({"loss_type": "ppo"}, "loss_type"),
    ({"scale_rewards": "sometimes"}, "scale_rewards"),
    ({"importance_sampling_level": "word"}, "importance_sampling_level"),
    ({"multi_objective_aggregation": "product"}, "multi_objective_aggregation"),
    ({"vllm_importance_sampling_mode": "token_clip"}, "vllm_importance_sampling_mode"),
    ({"epsilon": -0.1}, "epsilon"),
    ({"temperature": 0.0}, "temperature"),
    ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
    ({"max_completion_length": 0}, "max_completion_length"),
]


@pytest.mark.parametrize(("overrides", "parameter"), CONFIG_CASES, ids=[c[1] for c in CONFIG_CASES])
def test_bad_config_names_the_parameter(tmp_path, overrides, parameter):
    values = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "per_device_train_batch_size": 4}
    values["num_generations"] = 4
    values.update(overrides)
    with pytest.raises(ValueError, match=parameter):
        GRPOConfig(**values)


# ---- trainer arguments and datasets -----------------------------------------------------------


def _trainer(tmp_path, tok, dataset=None, reward_funcs=length_reward, **config):
    return GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=reward_funcs,
        args=make_config(tmp_path, **config),
        train_dataset=standard_dataset() if dataset is None else dataset,
        processing_class=tok,
    )


def test_no_prompt_column(tmp_path, tok):
    ds = Dataset.from_dict({"question": ["a", "b", "c", "d"]})
    with pytest.raises(ValueError, match="no 'prompt' column.*rename_column"):
        _trainer(tmp_path, tok, ds)


def test_prompt_none(tmp_path, tok):
    ds = Dataset.from_dict({"prompt": ["a", None, "c", "d"]})
    with pytest.raises(ValueError, match="Row 1 .*prompt=None"):
        _trainer(tmp_path, tok, ds)


def test_prompt_neither_text_nor_messages(tmp_path, tok):
    ds = Dataset.from_dict({"prompt": [[1, 2], [3, 4]]})
    with pytest.raises(ValueError, match="Row 0 .*neither text nor a list of chat messages"):
        _trainer(tmp_path, tok, ds)


def test_empty_dataset(tmp_path, tok):
    ds = Dataset.from_dict({"prompt": []})
    with pytest.raises(ValueError, match="train_dataset is empty"):
        _trainer(tmp_path, tok, ds)


def test_iterable_dataset_without_max_steps(tmp_path, tok):
    stream = standard_dataset().to_iterable_dataset()
    with pytest.raises(ValueError, match="IterableDataset.*max_steps"):
        _trainer(tmp_path, tok, stream, max_steps=-1)


def test_reward_weights_of_the_wrong_length(tmp_path, tok):
    with pytest.raises(ValueError, match="reward_weights has 3 entries but there are 1 reward"):
        _trainer(tmp_path, tok, reward_weights=[1.0, 2.0, 3.0])


def test_no_reward_and_no_environment(tmp_path, tok):
    with pytest.raises(ValueError, match="needs a reward: pass reward_funcs"):
        _trainer(tmp_path, tok, reward_funcs=None)


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(FileNotFoundError, match="model path './no/such/model' does not exist"):
        GRPOTrainer(
            model="./no/such/model",
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=standard_dataset(),
        )


def test_dataset_smaller_than_one_batch(tmp_path, tok):
    with pytest.raises(ValueError, match="has 1 prompts but one batch needs 2"):
        _trainer(tmp_path, tok, standard_dataset(1), num_generations=2)


def test_peft_config_of_the_wrong_type(tmp_path, tok):
    with pytest.raises(TypeError, match="peft_config must be a peft.PeftConfig"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=standard_dataset(),
            processing_class=tok,
            peft_config=object(),
        )


# ---- reward functions: fail at the first scoring, before any update -------------------------


def returns_too_few(prompts, **kwargs):
    return [1.0] * (len(prompts) - 1)


def returns_text(prompts, **kwargs):
    return ["good"] * len(prompts)


def raises_on_third(prompts, **kwargs):
    if len(prompts) > 2:
        raise KeyError("answer")
    return [0.0] * len(prompts)


@pytest.mark.parametrize(
    ("func", "pattern"),
    [
        (returns_too_few, "'returns_too_few' returned 3 values for 4 completions"),
        (returns_text, "'returns_text' returned 'good' \\(str\\) for sample 0"),
        (raises_on_third, "'raises_on_third' raised KeyError.*sample"),
    ],
    ids=["wrong-count", "non-number", "raises"],
)
def test_bad_reward_function_stops_before_any_update(tmp_path, tok, func, pattern):
    trainer = _trainer(tmp_path, tok, reward_funcs=func)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(RewardFunctionError, match=pattern):
        trainer.train()
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_raising_reward_names_the_failing_sample(tmp_path, tok):
    def fails_on_solution_3(solution, **kwargs):
        return [1.0 / (int(s) - 3) for s in solution]  # ZeroDivisionError for solution "3": rows 4 and 5

    ds = Dataset.from_dict({"prompt": [f"p{i}" for i in range(4)], "solution": ["1", "2", "3", "4"]})
    trainer = _trainer(
        tmp_path,
        tok,
        ds,
        reward_funcs=fails_on_solution_3,
        num_generations=2,
        per_device_train_batch_size=8,
        shuffle_dataset=False,
    )
    with pytest.raises(RewardFunctionError, match="'fails_on_solution_3' raised ZeroDivisionError.*sample 4"):
        trainer.train()


MORE_CONFIG_CASES = [
    ({"delta": 0.9}, "delta"),
    ({"ref_model_mixup_alpha": 1.5}, "ref_model_mixup_alpha"),
    ({"ref_model_sync_steps": 0}, "ref_model_sync_steps"),
    ({"entropy_coef_delta": -0.1}, "entropy_coef_delta"),
    ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min"),
    ({"off_policy_mask_threshold": -1.0}, "off_policy_mask_threshold"),
    ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0}, "clip_min"),
    ({"sync_ref_model": True}, "sync_ref_model"),
    ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds"),
]


@pytest.mark.parametrize(("overrides", "parameter"), MORE_CONFIG_CASES, ids=[c[1] for c in MORE_CONFIG_CASES])
def test_bad_objective_settings_name_the_parameter(tmp_path, overrides, parameter):
    values = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, **overrides}
    with pytest.raises(ValueError, match=parameter):
        GRPOConfig(**values)


def test_conversational_dataset_without_chat_template(tmp_path, tok):
    from helpers import conversational_dataset

    plain = build_tiny_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="conversational .* no chat template"):
        GRPOTrainer(
            model=build_tiny_model(plain),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            train_dataset=conversational_dataset(),
            processing_class=plain,
        )


def test_streamed_eval_dataset_with_a_bad_eval_batch(tmp_path, tok):
    stream = standard_dataset().to_iterable_dataset()
    with pytest.raises(ValueError, match="evaluation batch \\(3 completions\\).*per_device_eval_batch_size"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=length_reward,
            args=make_config(tmp_path, per_device_eval_batch_size=3, num_generations_eval=2),
            train_dataset=standard_dataset(),
            eval_dataset=stream,
            processing_class=tok,
        )


def test_train_dataset_missing(tmp_path, tok):
    with pytest.raises(ValueError, match="needs a train_dataset"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=length_reward,
            args=make_config(tmp_path),
            processing_class=tok,
        )


@pytest.mark.parametrize("family", ["rloo", "online_dpo"])
def test_no_prompt_column_names_the_trainer_that_needs_it(tmp_path, tok, family):
    """RLOO's and online DPO's message used to say "GRPO needs one"."""
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer, RLOOConfig, RLOOTrainer

    config, trainer, name = {
        "rloo": (RLOOConfig, RLOOTrainer, "RLOOTrainer"),
        "online_dpo": (OnlineDPOConfig, OnlineDPOTrainer, "OnlineDPOTrainer"),
    }[family]
    ds = Dataset.from_dict({"question": ["a", "b", "c", "d"]})
    with pytest.raises(ValueError, match=f"no 'prompt' column.*{name} needs one: rename"):
        trainer(
            model=build_tiny_model(tok),
            reward_funcs=lambda completion_ids, **kw: [0.0] * len(completion_ids),
            args=config(
                output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4
            ),
            train_dataset=ds,
            processing_class=tok,
        )
