"""SFTTrainer on two CPU processes (gloo): DDP gives the update of one process with the global
batch, whatever the split of target tokens between the ranks; FSDP2 and ZeRO-2/3 train like DDP.

The tests run ``tests/scripts/sft_sharded_train.py`` under torchrun, one launch per backend per
session (module-scoped fixtures); the ``ddp`` launch also trains the padding-free and packed
variants and is the reference of the sharded ones.

Tolerances: the update is plain SGD (lr 0.5, no clipping), so an error in the loss's scale or
normalisation moves the parameters in proportion. Measured on this recipe, the parameters of
DDP and of one process with the global batch differ by at most 2.1e-7 (float32 rounding of
sums taken in another order: about 2 ulp at the largest parameters, near 1.0), FSDP2 and ZeRO-2
match DDP bit for bit, ZeRO-3 to 1.2e-7, packed to 2.2e-8 and padding-free bit for bit. The
tests allow ``atol=1e-6`` (8 ulp at 1.0). Normalising each rank by its own target tokens instead
(``num_items_in_batch`` = local count x processes) moves the parameters by 0.64 from the
one-process update on the same batches.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch
from scripts.sft_sharded_train import read_ranks, report, run_once, train

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: pip install 'posttrain[deepspeed]'",
)

#: float32 rounding of the parameters (about 1 at most): see the module docstring.
ATOL = 1e-6
#: Relative rounding of the logged loss and gradient norm (measured: at most 1.2e-7).
LOG_RTOL = 1e-6


def _run(tmp_path_factory, mode: str) -> Path:
    return run_once(tmp_path_factory.getbasetemp(), mode)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    return _run(tmp_path_factory, "ddp")


@pytest.fixture(scope="module")
def ddp_ranks(ddp_run) -> list[dict]:
    return read_ranks(ddp_run)


def _params(out_dir: Path, variant: str = "plain") -> dict[str, torch.Tensor]:
    return torch.load(out_dir / f"{variant}.pt")


def _assert_params_close(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=ATOL, msg=name)


def _assert_logs_close(actual: list[dict], expected: list[dict], keys=("loss", "grad_norm")) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        assert a["step"] == b["step"]
        for key in keys:
            assert a[key] == pytest.approx(b[key], rel=LOG_RTOL), (a["step"], key)


def _step_sequences(ranks: list[dict], variant: str = "plain") -> list[Counter]:
    """Per optimizer step, the sequences both ranks trained on (a multiset of token tuples)."""
    steps = zip(*(r[variant]["batches"] for r in ranks), strict=True)
    return [Counter(tuple(s) for batch in step for s in batch["sequences"]) for step in steps]


def _assert_ranks_agree(ranks: list[dict], variant: str = "plain") -> None:
    """Both ranks end with the same (gathered) parameters and log the same values."""
    assert ranks[0][variant]["params"] == ranks[1][variant]["params"]
    assert ranks[0][variant]["logs"] == ranks[1][variant]["logs"]


# ---- DDP -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_ranks_agree_with_unequal_target_tokens(ddp_run, ddp_ranks):
    _assert_ranks_agree(ddp_ranks)
    assert ddp_ranks[0]["plain"]["backend"] == "DistributedType.MULTI_CPU"
    logs = ddp_ranks[0]["plain"]["logs"]
    assert [h["step"] for h in logs] == [1, 2, 3]
    assert all(h["grad_norm"] > 0 for h in logs)
    batches = [r["plain"]["batches"] for r in ddp_ranks]
    for mine, theirs in zip(*batches, strict=True):
        # the premise of the normalisation test: the ranks hold different numbers of targets
        assert mine["targets"] != theirs["targets"]
        assert mine["num_items"] == theirs["num_items"] == mine["targets"] + theirs["targets"]
    assert sum(_step_sequences(ddp_ranks), Counter()) == Counter(
        tuple(s) for r in ddp_ranks for b in r["whole"]["batches"] for s in b["sequences"]
    )  # 3 steps see every row once
    initial = _initial_params()
    assert any(not torch.equal(_params(ddp_run)[n], initial[n]) for n in initial)


@pytest.mark.slow
def test_ddp_update_equals_one_process_with_the_global_batch(ddp_run, ddp_ranks, tmp_path):
    trainer, batches = train(str(tmp_path), per_device_train_batch_size=4)  # 2 processes x 2 rows
    single, params = report(trainer, "ddp", batches)
    # the same rows make each step's global batch
    assert [Counter(tuple(s) for s in b["sequences"]) for b in batches] == _step_sequences(ddp_ranks)
    assert [b["num_items"] for b in batches] == [b["num_items"] for b in ddp_ranks[0]["plain"]["batches"]]
    _assert_params_close(params, _params(ddp_run))
    keys = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")
    _assert_logs_close(single["logs"], ddp_ranks[0]["plain"]["logs"], keys)


@pytest.mark.slow
def test_padding_free_under_ddp_equals_padded(ddp_run, ddp_ranks):
    _assert_ranks_agree(ddp_ranks, "padding_free")
    assert _step_sequences(ddp_ranks, "padding_free") == _step_sequences(ddp_ranks)
    _assert_params_close(_params(ddp_run, "padding_free"), _params(ddp_run))
    _assert_logs_close(ddp_ranks[0]["padding_free"]["logs"], ddp_ranks[0]["plain"]["logs"])


@pytest.mark.slow
def test_packing_under_ddp_equals_the_same_rows_unpacked(ddp_run, ddp_ranks):
    """One step over the whole dataset: 4 packed bins (2 per rank) against 12 padded rows."""
    for variant in ("whole", "packed"):
        _assert_ranks_agree(ddp_ranks, variant)
    packed = [b for r in ddp_ranks for b in r["packed"]["batches"]]
    assert sum(len(b["sequences"]) for b in packed) == 12  # 3 sequences in each of the 4 bins
    assert packed[0]["targets"] != packed[1]["targets"]
    assert _step_sequences(ddp_ranks, "packed") == _step_sequences(ddp_ranks, "whole")
    _assert_params_close(_params(ddp_run, "packed"), _params(ddp_run, "whole"))
    _assert_logs_close(ddp_ranks[0]["packed"]["logs"], ddp_ranks[0]["whole"]["logs"])


# ---- sharded: FSDP2, ZeRO-2, ZeRO-3 ------------------------------------------------------------------


def _assert_trains_like_ddp(out_dir: Path, ddp_run: Path, ddp_ranks: list[dict], backend: str) -> list[dict]:
    ranks = read_ranks(out_dir)
    assert [r["plain"]["backend"] for r in ranks] == [backend] * 2
    _assert_ranks_agree(ranks)
    assert _step_sequences(ranks) == _step_sequences(ddp_ranks)
    _assert_params_close(_params(out_dir), _params(ddp_run))
    _assert_logs_close(ranks[0]["plain"]["logs"], ddp_ranks[0]["plain"]["logs"])
    assert [h["num_tokens"] for h in ranks[0]["plain"]["logs"]] == [
        h["num_tokens"] for h in ddp_ranks[0]["plain"]["logs"]
    ]
    return ranks


@pytest.mark.slow
def test_fsdp2_trains_sharded_like_ddp(tmp_path_factory, ddp_run, ddp_ranks):
    ranks = _assert_trains_like_ddp(
        _run(tmp_path_factory, "fsdp"), ddp_run, ddp_ranks, "DistributedType.FSDP"
    )
    assert all(r["plain"]["sharded"] for r in ranks)  # DTensor shards


@pytest.mark.slow
@needs_deepspeed
def test_zero2_trains_like_ddp(tmp_path_factory, ddp_run, ddp_ranks):
    ranks = _assert_trains_like_ddp(
        _run(tmp_path_factory, "zero2"), ddp_run, ddp_ranks, "DistributedType.DEEPSPEED"
    )
    assert not any(r["plain"]["sharded"] for r in ranks)  # ZeRO-2 partitions the optimizer, not the weights


@pytest.mark.slow
@needs_deepspeed
def test_zero3_trains_sharded_like_ddp(tmp_path_factory, ddp_run, ddp_ranks):
    ranks = _assert_trains_like_ddp(
        _run(tmp_path_factory, "zero3"), ddp_run, ddp_ranks, "DistributedType.DEEPSPEED"
    )
    assert all(r["plain"]["sharded"] for r in ranks)  # ZeRO-3 placeholders


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp", pytest.param("zero3", marks=needs_deepspeed)])
def test_sharded_runs_log_the_ddp_token_accuracy(tmp_path_factory, ddp_ranks, mode):
    """The sharded head scores with full logits, DDP with the chunked head: both count a hit where
    the target's log-prob equals the top one, bit for bit (``ops.logprobs.top_log_softmax``)."""
    ranks = read_ranks(_run(tmp_path_factory, mode))
    sharded, ddp = ranks[0]["plain"]["logs"], ddp_ranks[0]["plain"]["logs"]
    _assert_logs_close(sharded, ddp, ("mean_token_accuracy",))
    assert any(h["mean_token_accuracy"] > 0 for h in ddp)  # the check has hits to count


def _initial_params() -> dict[str, torch.Tensor]:
    from conftest import build_tiny_model, build_tiny_tokenizer

    return build_tiny_model(build_tiny_tokenizer(), seed=0).state_dict()
