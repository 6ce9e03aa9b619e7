"""What a TRL user's script, callback or test relies on beyond the config: trainer attributes,
the reference's helper methods, a replaced ``model.generate``, streaming options, warnings."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, make_trainer, standard_dataset
from test_reward_models import build_reward_model

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.core.batch import Rollout
from posttrain.grpo.loss import LossSettings, grpo_loss
from posttrain.grpo.objectives import Normalizers
from posttrain.ops.logprobs import PolicyOutput
from posttrain.sampling.rollout import ScoredRollout


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def constant(completions, **kwargs):
    return [1.0] * len(completions)


# ---- attributes ----------------------------------------------------------------------------------


def test_reward_func_names_and_processing_classes(tmp_path, tok):
    reward_model = build_reward_model(tok)
    reward_model.config._name_or_path = "org/tiny-reward"
    trainer = make_trainer(
        tok,
        [constant, reward_model],
        make_config(tmp_path),
        reward_processing_classes=[None, tok],
    )
    assert trainer.reward_func_names == ["constant", "tiny-reward"]
    assert trainer.reward_funcs[0] is constant and trainer.reward_funcs[1] is reward_model
    assert trainer.reward_processing_classes[0] is None
    assert trainer.reward_processing_classes[1] is tok


# ---- get_high_entropy_mask -------------------------------------------------------------------------


def test_get_high_entropy_mask_takes_the_quantile_of_the_valid_entropies(tmp_path, tok):
    trainer = make_trainer(tok, constant, make_config(tmp_path))
    entropies = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 0.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    # valid values 1..6; the 0.5 quantile is 3.5 (linear interpolation): 4, 5, 6 kept
    assert trainer.get_high_entropy_mask(entropies, mask, 0.5).tolist() == [
        [False, False, False, False],
        [True, True, True, False],
    ]
    assert trainer.get_high_entropy_mask(entropies, mask, 0.0).tolist() == mask.bool().tolist()
    only_max = trainer.get_high_entropy_mask(entropies, mask, 1.0)
    assert only_max.sum().item() == 1 and only_max[1, 2].item()
    nothing = trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5)
    assert nothing.dtype == torch.bool and not nothing.any()


def test_the_loss_takes_the_entropy_threshold_over_every_process():
    """With another process's much higher entropies in the population, none of this process's
    tokens reaches the top 20 %: the policy term is 0."""
    logps = torch.full((1, 3), -1.0, requires_grad=True)
    entropy = torch.tensor([[1.0, 2.0, 3.0]])
    rollout = Rollout(
        prompt_ids=torch.ones(1, 1, dtype=torch.long),
        prompt_mask=torch.ones(1, 1, dtype=torch.long),
        completion_ids=torch.ones(1, 3, dtype=torch.long),
        completion_mask=torch.ones(1, 3, dtype=torch.long),
        is_terminated=torch.tensor([True]),
    )
    batch = ScoredRollout(rollout=rollout, rewards=torch.zeros(1, 1), advantages=torch.tensor([1.0]))
    settings = LossSettings(top_entropy_quantile=0.2)
    out = PolicyOutput(logps=logps, entropy=entropy)
    mask = torch.ones(1, 3)
    alone = grpo_loss(out, batch, mask, settings, 0.0)
    pooled = grpo_loss(
        out, batch, mask, settings, 0.0, lambda local: torch.cat([local, torch.full((12,), 50.0)])
    )
    # alone: the token of entropy 3 is kept (ratio 1, advantage 1): -1 over the default token
    # normaliser of 1; pooled: no token is kept
    assert Normalizers().tokens == 1.0
    assert alone.loss.item() == pytest.approx(-1.0)
    assert pooled.loss.item() == 0.0


# ---- get_off_policy_mask -----------------------------------------------------------------------------


def test_get_off_policy_mask_matches_the_reference_semantics():
    advantages = torch.tensor([[-1.0], [-1.0], [1.0], [-1.0]])
    current = torch.tensor([[-2.0, -2.0], [-1.0, -1.0], [-3.0, -3.0], [-2.0, -2.0]])
    sampler = torch.tensor([[-1.0, -1.0], [-1.0, float("nan")], [-1.0, -1.0], [-1.0, 5.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    keep = GRPOTrainer.get_off_policy_mask(advantages, current, sampler, mask, off_policy_threshold=0.5)
    # row 0: drifted by 1 > 0.5 with A < 0: dropped; row 1: the NaN counts 0, mean 0: kept;
    # row 2: A >= 0: kept; row 3: the padding position never counts, mean 1: dropped
    assert keep.tolist() == [[0], [1], [1], [0]]
    assert keep.dtype == mask.dtype and keep.shape == (4, 1)
    assert (
        GRPOTrainer.get_off_policy_mask(advantages, current, sampler, mask.float(), 5.0).tolist()
        == [[1.0]] * 4
    )


# ---- a replaced model.generate -------------------------------------------------------------------------


def test_a_generate_replaced_on_the_model_instance_is_called(tmp_path, tok):
    seen: list[list[int]] = []

    def record(completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return [0.0] * len(completion_ids)

    trainer = make_trainer(tok, record, make_config(tmp_path, max_steps=1))
    calls = []

    def fake_generate(input_ids, attention_mask, **kwargs):
        calls.append(input_ids.shape)
        tail = torch.tensor([[7, 8, tok.eos_token_id]]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, tail], dim=1)

    trainer.model.generate = fake_generate
    trainer.train()
    assert calls and seen == [[7, 8, tok.eos_token_id]] * 4
    assert trainer.generator.path.lean_blocker == "model.generate is replaced on the instance"


# ---- streaming datasets ------------------------------------------------------------------------------


def test_an_iterable_train_set_sets_the_streaming_options(tmp_path, tok):
    args = make_config(tmp_path, dataloader_num_workers=2)
    with pytest.warns(UserWarning, match="dataloader_num_workers=2 with an IterableDataset"):
        make_trainer(tok, constant, args, dataset=standard_dataset().to_iterable_dataset())
    assert args.accelerator_config.dispatch_batches is False
    assert args.dataloader_num_workers == 0


def test_a_map_style_train_set_keeps_its_workers_beside_an_iterable_eval_set(tmp_path, tok):
    args = make_config(tmp_path, dataloader_num_workers=2, eval_strategy="steps", eval_steps=1)
    make_trainer(tok, constant, args, eval_dataset=standard_dataset(8).to_iterable_dataset())
    assert args.accelerator_config.dispatch_batches is False
    assert args.dataloader_num_workers == 2


def test_dispatch_batches_true_with_a_stream_is_an_error(tmp_path, tok):
    args = make_config(tmp_path, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="dispatch_batches=True"):
        make_trainer(tok, constant, args, dataset=standard_dataset().to_iterable_dataset())


# ---- environments and config warnings ------------------------------------------------------------------


class Env:
    def reset(self, **kwargs) -> str:
        return "Say something."


def test_several_environments_without_a_dataset_to_route_them_is_an_error(tmp_path, tok):
    with pytest.raises(ValueError, match="no row says which environment"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=constant,
            args=make_config(tmp_path),
            processing_class=tok,
            environment_factory={"a": Env, "b": Env},
        )


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "dr_grpo", "cispo"])
def test_sequence_level_ratios_with_a_token_summed_loss_warn(tmp_path, loss_type):
    with pytest.warns(UserWarning, match="sums over tokens"):
        GRPOConfig(
            output_dir=str(tmp_path), loss_type=loss_type, importance_sampling_level="sequence", bf16=False
        )


def test_gspo_with_the_per_sequence_loss_does_not_warn(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        GRPOConfig(
            output_dir=str(tmp_path), loss_type="grpo", importance_sampling_level="sequence", bf16=False
        )


# ---- use_liger_kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["grpo", "sft"])
def test_use_liger_kernel_without_the_package_fails_before_the_model_loads(tmp_path, tok, family):
    """transformers' Trainer would raise only when train() starts, after the model loaded; the model
    here does not exist, so the liger error coming first shows nothing was loaded."""
    from datasets import Dataset
    from transformers.utils import is_liger_kernel_available

    from posttrain import SFTConfig, SFTTrainer

    if is_liger_kernel_available():
        pytest.skip("liger-kernel is installed here")
    with pytest.raises(ImportError, match="use_liger_kernel=True needs the liger-kernel package"):
        if family == "grpo":
            GRPOTrainer(
                model="no-such/model",
                reward_funcs=constant,
                args=make_config(tmp_path, use_liger_kernel=True),
                train_dataset=standard_dataset(),
                processing_class=tok,
            )
        else:
            SFTTrainer(
                model="no-such/model",
                args=SFTConfig(
                    output_dir=str(tmp_path), use_liger_kernel=True, use_cpu=True, report_to="none"
                ),
                train_dataset=Dataset.from_dict({"text": ["one two three"] * 4}),
                processing_class=tok,
            )
