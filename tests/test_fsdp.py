"""FSDP2: two CPU processes (gloo) shard the model, generate with full parameters, stay in sync.

The slow tests run ``tests/scripts/sharded_train.py`` under torchrun. The fast ones check the
helpers of ``posttrain.models.distributed`` on one process.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from scripts.sharded_train import read_ranks, run_once
from test_deepspeed import assert_sharded_close

from posttrain.models import distributed


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return run_once(tmp_path_factory.getbasetemp(), "fsdp")


@pytest.fixture(scope="module")
def ddp_params(tmp_path_factory):
    """The parameters after the same 2 steps with plain DDP (shared with tests/test_deepspeed.py)."""
    return torch.load(run_once(tmp_path_factory.getbasetemp(), "ddp") / "params.pt")


@pytest.mark.slow
def test_fsdp2_trains_sharded_and_ranks_end_identical(fsdp_run):
    ranks = read_ranks(fsdp_run)
    for rank in ranks:
        assert rank["backend"] == "DistributedType.FSDP"
        assert rank["sharded"]  # the trained model holds DTensor shards
        assert rank["full_at_generation"] == [True, True]  # one generation per step, unsharded
    assert ranks[0]["params"] == ranks[1]["params"]  # the gathered full state dict
    assert ranks[0]["logs"] == ranks[1]["logs"]
    assert all(h["grad_norm"] > 0 for h in ranks[0]["logs"])


@pytest.mark.slow
def test_fsdp2_checkpoint_holds_the_gathered_weights(fsdp_run):
    from safetensors.torch import load_file

    params = torch.load(fsdp_run / "params.pt")
    saved = load_file(fsdp_run / "checkpoint-2" / "model.safetensors")
    assert set(saved) == set(params)
    for name, value in params.items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert (fsdp_run / "checkpoint-2" / "optimizer.bin").is_file()


@pytest.mark.slow
def test_fsdp2_matches_ddp(fsdp_run, ddp_params):
    """Same seed, same batches: sharding changes the update by float rounding only."""
    ddp = ddp_params
    fsdp = torch.load(fsdp_run / "params.pt")
    assert set(fsdp) == set(ddp)
    for name in ddp:
        assert_sharded_close(fsdp[name], ddp[name])
    initial = _initial_params()
    assert any(not torch.equal(fsdp[name], initial[name]) for name in initial)


@pytest.mark.slow
def test_fsdp2_with_a_kl_reference(tmp_path_factory):
    ranks = read_ranks(run_once(tmp_path_factory.getbasetemp(), "fsdp-kl"))
    assert ranks[0]["params"] == ranks[1]["params"]
    kls = [h["kl"] for h in ranks[0]["logs"]]
    assert kls[0] == 0.0 and kls[1] > 0.0  # the policy moved away from the reference


def _initial_params() -> dict[str, torch.Tensor]:
    from conftest import build_tiny_model, build_tiny_tokenizer

    return build_tiny_model(build_tiny_tokenizer(), seed=0).state_dict()


# ---- one process -------------------------------------------------------------------------------


def _accelerator(distributed_type=DistributedType.NO, **state) -> SimpleNamespace:
    return SimpleNamespace(is_fsdp2=False, state=SimpleNamespace(distributed_type=distributed_type, **state))


def test_generation_parameters_is_a_no_op_without_sharding():
    context = distributed.generation_parameters(_accelerator(), torch.nn.Linear(2, 2))
    assert isinstance(context, contextlib.nullcontext)


def test_fsdp2_full_parameters_passes_a_plain_model_through():
    model = torch.nn.Linear(2, 2)
    with distributed.fsdp2_full_parameters(model):
        assert isinstance(model.weight, torch.nn.Parameter)
    assert distributed.fsdp2_modules(model) == []


def test_use_fsdp_on_cpu_leaves_other_setups_alone():
    trainer = SimpleNamespace(
        args=SimpleNamespace(fsdp_plugin_args=None, activation_checkpointing=False),
        accelerator=_accelerator(DistributedType.MULTI_CPU),
    )
    assert distributed.use_fsdp_on_cpu(trainer) is False  # no FSDP asked for
    trainer.args.fsdp_plugin_args = {"fsdp_version": 2}
    trainer.accelerator = _accelerator(DistributedType.MULTI_GPU)
    assert distributed.use_fsdp_on_cpu(trainer) is False  # accelerate handles GPUs itself


def test_use_fsdp_on_cpu_refuses_fsdp1():
    trainer = SimpleNamespace(
        args=SimpleNamespace(fsdp_plugin_args={"fsdp_version": 1}, activation_checkpointing=False),
        accelerator=_accelerator(DistributedType.MULTI_CPU),
    )
    with pytest.raises(ValueError, match="FSDP2 only"):
        distributed.use_fsdp_on_cpu(trainer)
