"""Bad input to the preference trainers (DPO, KTO, ORPO, CPO, reward modelling) that no other test
triggers: each case checks that the error (or warning) names the parameter, column or row at fault.

The rows of docs/errors.md that cite these tests quote the messages checked here.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import (
    CPOConfig,
    CPOTrainer,
    DPOConfig,
    DPOTrainer,
    KTOConfig,
    KTOTrainer,
    ORPOConfig,
    ORPOTrainer,
)
from posttrain.data import preference, unpaired
from posttrain.reward import losses as reward_losses
from posttrain.reward.config import RewardConfig
from posttrain.reward.trainer import collate_reward_pairs

CONFIGS = {"dpo": DPOConfig, "kto": KTOConfig, "orpo": ORPOConfig, "cpo": CPOConfig, "reward": RewardConfig}
PAIR_TRAINERS = {
    "dpo": (DPOTrainer, DPOConfig),
    "orpo": (ORPOTrainer, ORPOConfig),
    "cpo": (CPOTrainer, CPOConfig),
}

USER = {"role": "user", "content": "hello"}
HI = {"role": "assistant", "content": "hi there"}
ONE = {"role": "assistant", "content": "one"}


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    t.chat_template = CHAT_TEMPLATE
    return t


def config(kind: str, tmp_path, **overrides):
    return CONFIGS[kind](**{"output_dir": str(tmp_path), **CPU_TEST_ARGS, **overrides})


def pairs(n: int = 4) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "chosen": [f" <answer>{2 * i}</answer>" for i in range(n)],
            "rejected": [f" {2 * i + 1}" for i in range(n)],
        }
    )


def examples(n: int = 4) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "completion": [f" {2 * i}" for i in range(n)],
            "label": [i % 2 == 0 for i in range(n)],
        }
    )


# ---- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "values", "message"),
    [
        pytest.param("dpo", {"beta": 0.0}, "beta=0.0 is invalid: it must be a positive number", id="dpo-beta"),
        pytest.param(
            "dpo", {"discopop_tau": 0.0}, "discopop_tau=0.0 is invalid: it must be a positive number",
            id="dpo-discopop_tau",
        ),
        pytest.param(
            "dpo", {"precompute_ref_batch_size": 0}, "precompute_ref_batch_size=0 is invalid: it must be None or a "
            "positive integer", id="dpo-precompute_ref_batch_size",
        ),
        pytest.param(
            "dpo", {"ref_model_sync_steps": 0}, "ref_model_sync_steps=0 is invalid: it must be a positive integer",
            id="dpo-ref_model_sync_steps",
        ),
        pytest.param(
            "dpo", {"ref_model_mixup_alpha": 1.5}, r"ref_model_mixup_alpha=1.5 is invalid: it must be a number in "
            r"\[0, 1\]", id="dpo-ref_model_mixup_alpha",
        ),
        pytest.param(
            "dpo", {"truncation_mode": "middle"}, "truncation_mode='middle' is invalid: it must be one of "
            "'keep_start', 'keep_end'", id="dpo-truncation_mode",
        ),
        pytest.param(
            "dpo", {"max_length": 0}, r"max_length=0 is invalid: it must be None or a positive integer \(tokens",
            id="dpo-max_length",
        ),
        pytest.param("kto", {"beta": 0.0}, "beta=0.0 is invalid: it must be a positive number", id="kto-beta"),
        pytest.param(
            "kto", {"ref_model_mixup_alpha": -0.1}, "ref_model_mixup_alpha=-0.1 is invalid",
            id="kto-ref_model_mixup_alpha",
        ),
        pytest.param(
            "kto", {"precompute_ref_batch_size": 0}, "precompute_ref_batch_size=0 is invalid",
            id="kto-precompute_ref_batch_size",
        ),
        pytest.param(
            "kto", {"ref_model_sync_steps": 0}, "ref_model_sync_steps=0 is invalid", id="kto-ref_model_sync_steps"
        ),
        pytest.param(
            "cpo", {"simpo_gamma": math.inf}, "simpo_gamma=inf is invalid: it must be a finite number",
            id="cpo-simpo_gamma",
        ),
        pytest.param(
            "orpo", {"is_encoder_decoder": "yes"}, "is_encoder_decoder='yes' is invalid: it must be None, True or "
            "False", id="orpo-is_encoder_decoder",
        ),
        pytest.param(
            "reward", {"chat_template_path": ""}, "chat_template_path='' is invalid: it must be None or a path",
            id="reward-chat_template_path",
        ),
        pytest.param(
            "reward", {"max_length": 0}, "max_length=0 is invalid: it must be None or a positive integer",
            id="reward-max_length",
        ),
    ],
)  # fmt: skip
def test_config_rules_name_the_parameter_and_the_fix(tmp_path, kind, values, message):
    with pytest.raises(ValueError, match=message) as err:
        config(kind, tmp_path, **values)
    assert "; set " in str(err.value) or "; leave " in str(err.value) or "; use " in str(err.value)


def test_an_unknown_or_refused_f_divergence_fails_when_the_dpo_config_is_built(tmp_path):
    with pytest.raises(
        ValueError, match=r"f_divergence_type='kl' is not supported; use one of \['reverse_kl'"
    ):
        config("dpo", tmp_path, f_divergence_type="kl")
    with pytest.raises(
        ValueError, match=r"f_divergence_type='forward_kl' is not supported by loss_type \['bco_pair'\]"
    ):
        config("dpo", tmp_path, loss_type="bco_pair", f_divergence_type="forward_kl")


def test_dpo_refuses_a_moving_reference_with_precomputed_log_probs(tmp_path):
    with pytest.raises(
        ValueError, match="sync_ref_model=True moves the reference during training.*scores the pairs"
    ):
        config("dpo", tmp_path, sync_ref_model=True, precompute_ref_log_probs=True)


# ---- datasets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(PAIR_TRAINERS))
def test_pair_trainers_refuse_missing_empty_and_streamed_datasets_before_the_model_loads(tmp_path, tok, kind):
    trainer_class, _ = PAIR_TRAINERS[kind]
    name = trainer_class.__name__
    args = config(kind, tmp_path)
    with pytest.raises(
        ValueError, match=rf"{name} needs a train_dataset of preference pairs \(chosen, rejected\)"
    ):
        trainer_class("no/such-model", args=args, processing_class=tok)
    with pytest.raises(
        ValueError, match="train_dataset is empty; pass a dataset with at least one preference pair"
    ):
        trainer_class("no/such-model", args=args, train_dataset=pairs(0), processing_class=tok)
    with pytest.raises(ValueError, match="eval_dataset is empty"):
        trainer_class(
            "no/such-model", args=args, train_dataset=pairs(), eval_dataset=pairs(0), processing_class=tok
        )
    with pytest.raises(
        ValueError, match=rf"train_dataset is an IterableDataset; {name} tokenises the whole dataset"
    ):
        trainer_class(
            "no/such-model", args=args, train_dataset=pairs().to_iterable_dataset(), processing_class=tok
        )


@pytest.mark.parametrize("kind", ["orpo", "cpo", "reward"])
@pytest.mark.parametrize("column", ["image", "images"])
def test_a_dataset_with_images_is_refused_not_trained_on_its_text_alone(tmp_path, tok, kind, column):
    """These families train on text only: an image column would be dropped without a word (it was,
    before: ORPO and CPO trained on the text), so it is refused before the model loads (DPO and KTO
    take images: tests/test_preference_vision.py)."""
    from vision_models import random_image

    from posttrain import RewardTrainer

    trainer_class = {
        **{k: v[0] for k, v in PAIR_TRAINERS.items()},
        "reward": RewardTrainer,
    }[kind]
    data = pairs().to_dict()
    images = [random_image(i) for i in range(4)]
    data[column] = images if column == "image" else [[im] for im in images]
    with pytest.raises(
        NotImplementedError, match=rf"has an '{column}' column, but {trainer_class.__name__} with images"
    ):
        trainer_class(
            "no/such-model",
            args=config(kind, tmp_path),
            train_dataset=Dataset.from_dict(data),
            processing_class=tok,
        )


def test_implicit_rows_without_a_shared_prompt_are_refused(tmp_path, tok):
    args = config("dpo", tmp_path)
    no_prompt = Dataset.from_dict({"chosen": ["Yes"], "rejected": ["No"]})
    with pytest.raises(ValueError, match="Row 0: 'chosen' and 'rejected' share no leading text") as err:
        DPOTrainer(
            "no/such-model", args=args, train_dataset=no_prompt, processing_class=tok
        )  # before loading
    assert "Add a 'prompt' column" in str(err.value)
    later = Dataset.from_dict({"chosen": ["The sky is blue", "Yes"], "rejected": ["The sky is red", "No"]})
    with pytest.raises(ValueError, match="Row 1: 'chosen' and 'rejected' share no leading text"):
        DPOTrainer(build_tiny_model(tok), args=args, train_dataset=later, processing_class=tok)  # tokenising


def test_identical_pairs_are_refused_in_every_row_and_counted_in_some(tmp_path, tok):
    args = config("dpo", tmp_path)
    same = Dataset.from_dict({"prompt": ["one", "two"], "chosen": [" a", " b"], "rejected": [" a", " b"]})
    with pytest.raises(
        ValueError, match=r"In every row \(2 rows, e.g. rows 0, 1\) 'chosen' and 'rejected' are"
    ):
        DPOTrainer(build_tiny_model(tok), args=args, train_dataset=same, processing_class=tok)
    some = Dataset.from_dict({"prompt": ["one", "two"], "chosen": [" a", " b"], "rejected": [" a", " c"]})
    with pytest.warns(UserWarning, match=r"1 of 2 rows have identical 'chosen' and 'rejected'.*\(rows 0\)"):
        trainer = DPOTrainer(build_tiny_model(tok), args=args, train_dataset=some, processing_class=tok)
    assert len(trainer.train_dataset) == 2


def test_a_model_that_cannot_generate_is_refused_by_the_pair_trainers(tmp_path, tok):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    classifier = LlamaForSequenceClassification(
        LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_labels=1)
    )  # fmt: skip
    with pytest.raises(
        TypeError, match=r"model must be a causal language model \(it has no generate method\)"
    ):
        DPOTrainer(classifier, args=config("dpo", tmp_path), train_dataset=pairs(), processing_class=tok)


def test_a_completion_that_adds_no_tokens_is_refused(tok):
    silent = build_tiny_tokenizer()  # a template that drops assistant messages
    silent.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(ValueError, match="Row 3: the 'chosen' completion adds no tokens after the prompt"):
        preference.tokenize_pair({"prompt": [USER], "chosen": [HI], "rejected": [ONE]}, silent, index=3)
    with pytest.raises(ValueError, match="Row 3: the completion adds no tokens after the prompt"):
        unpaired.tokenize_example({"prompt": [USER], "completion": [HI], "label": True}, silent, index=3)


def test_the_prepare_functions_refuse_a_stream_and_no_rows(tok):
    stream = pairs().to_iterable_dataset()
    with pytest.raises(
        ValueError, match="prepare_preference_dataset needs a datasets.Dataset or a list of dicts"
    ):
        preference.prepare_preference_dataset(stream, tok)
    with pytest.raises(
        ValueError, match="prepare_unpaired_dataset needs a datasets.Dataset or a list of dicts"
    ):
        unpaired.prepare_unpaired_dataset(examples().to_iterable_dataset(), tok)
    with pytest.raises(ValueError, match="The KTO dataset has no rows"):
        unpaired.prepare_unpaired_dataset([], tok)


@pytest.mark.parametrize(
    ("columns", "match"),
    [
        pytest.param({"prompt": ["a"], "label": [True]}, "The KTO dataset has no 'completion' column", id="no_completion"),
        pytest.param(
            {"prompt": ["a"], "completion": [5], "label": [True]},
            "Row 0: column 'completion' holds int, not text or a list of messages",
            id="int_completion",
        ),
    ],
)  # fmt: skip
def test_bad_kto_datasets_fail_before_the_model_loads(tmp_path, tok, columns, match):
    with pytest.raises(ValueError, match=match):
        KTOTrainer(
            "no/such-model",
            args=config("kto", tmp_path),
            train_dataset=Dataset.from_dict(columns),
            processing_class=tok,
        )


def test_collate_unpaired_errors():
    with pytest.raises(ValueError, match="collate_unpaired got no rows"):
        unpaired.collate_unpaired([], 0)
    with pytest.raises(ValueError, match="collate_unpaired needs a pad_token_id and got None"):
        unpaired.collate_unpaired([{"prompt_ids": [1], "completion_ids": [2], "label": True}], None)
    with pytest.raises(ValueError, match="Row 0: 'completion_ids' is empty"):
        unpaired.collate_unpaired([{"prompt_ids": [1], "completion_ids": [], "label": True}], 0)


def test_reward_collation_and_loss_errors():
    with pytest.raises(ValueError, match="collate_reward_pairs got no rows"):
        collate_reward_pairs([], 0)
    row = {"chosen_ids": [1, 2], "rejected_ids": [1, 3]}
    with pytest.raises(ValueError, match="Padding needs a pad token id and got None"):
        collate_reward_pairs([row], None)
    with pytest.raises(ValueError, match="Row 1 has no 'margin' while other rows have one"):
        collate_reward_pairs([{**row, "margin": 1.0}, row], 0)
    scores = torch.zeros(3)
    with pytest.raises(ValueError, match=r"margin must hold one value per pair, shape \(3,\); got \(2,\)"):
        reward_losses.pair_losses(scores, scores, torch.zeros(2))
    with pytest.raises(ValueError, match="reward_metrics needs at least one pair"):
        reward_losses.reward_metrics(torch.zeros(0), torch.zeros(0))


# ---- calls ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dpo", "kto", "orpo", "cpo"])
def test_compute_loss_does_not_return_outputs(tmp_path, tok, kind):
    trainer_class = {"dpo": DPOTrainer, "kto": KTOTrainer, "orpo": ORPOTrainer, "cpo": CPOTrainer}[kind]
    data = examples() if kind == "kto" else pairs()
    trainer = trainer_class(
        build_tiny_model(tok), args=config(kind, tmp_path), train_dataset=data, processing_class=tok
    )
    with pytest.raises(
        ValueError, match=rf"{trainer_class.__name__}.compute_loss does not return model outputs"
    ):
        trainer.compute_loss(trainer.model, None, return_outputs=True)
