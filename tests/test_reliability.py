"""Reliability: complete checkpoints only, faults in reward functions, non-finite losses."""

from __future__ import annotations

import asyncio
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset

from posttrain import GRPOTrainer
from posttrain.core.checkpoints import STATE_FILE, is_complete, latest_complete_checkpoint
from posttrain.rewards.runner import RewardFunctionError


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def varied_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def _trainer(tmp_path, tok, reward=varied_reward, model=None, **config):
    return GRPOTrainer(
        model=model if model is not None else build_tiny_model(tok),
        reward_funcs=reward,
        args=make_config(tmp_path, **config),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


# ---- checkpoints ------------------------------------------------------------------------------


def test_resume_skips_an_incomplete_checkpoint(tmp_path, tok):
    _trainer(tmp_path, tok, max_steps=2, save_strategy="steps", save_steps=1).train()
    assert is_complete(str(tmp_path / "checkpoint-2"))
    os.remove(tmp_path / "checkpoint-2" / STATE_FILE)  # as if killed while saving
    resumed = _trainer(tmp_path, tok, max_steps=3)
    with pytest.warns(UserWarning, match="Skipping incomplete checkpoint"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3


def test_resume_with_no_checkpoint_at_all_is_a_clear_error(tmp_path, tok):
    (tmp_path / "not-a-checkpoint").mkdir()
    with pytest.raises(ValueError, match="found no checkpoint in .*check output_dir"):
        latest_complete_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="found no checkpoint"):
        _trainer(tmp_path, tok, max_steps=1).train(resume_from_checkpoint=True)


def _seeded(out, tok, **config):
    torch.manual_seed(0)
    return GRPOTrainer(
        model=build_tiny_model(tok, seed=1),
        reward_funcs=varied_reward,
        args=make_config(out, max_steps=2, save_strategy="steps", save_steps=1, learning_rate=0.05),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


def test_killed_during_the_first_save_resumes_from_the_start(tmp_path, tok):
    """Only an interrupted first save on disk: resume=True trains from step 0, as a fresh run."""
    straight = _seeded(tmp_path / "straight", tok)
    straight.train()
    broken = tmp_path / "broken" / "checkpoint-1"
    broken.mkdir(parents=True)
    (broken / "model.safetensors").write_bytes(b"half written")
    (broken / "stale-extra-file").write_text("from the killed save")
    resumed = _seeded(tmp_path / "broken", tok)
    with pytest.warns(UserWarning, match="Every checkpoint in .* is incomplete.*starts from step 0"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert is_complete(str(broken))
    assert not (broken / "stale-extra-file").exists()  # the stale folder was replaced, not mixed


def test_rotation_keeps_only_complete_checkpoints(tmp_path, tok):
    _trainer(tmp_path, tok, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1).train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]
    assert is_complete(str(tmp_path / "checkpoint-3"))


KILL_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import make_config, standard_dataset
from posttrain import GRPOTrainer

def reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]

tok = build_tiny_tokenizer()
args = make_config({out!r}, max_steps=30, save_strategy="steps", save_steps=1, save_total_limit=2)
trainer = GRPOTrainer(model=build_tiny_model(tok), reward_funcs=reward, args=args,
                      train_dataset=standard_dataset(), processing_class=tok)
import os, torch
from transformers.trainer_utils import get_last_checkpoint
trainer.train(resume_from_checkpoint=get_last_checkpoint({out!r}) if os.path.isdir({out!r}) else None)
torch.save([p.detach() for p in trainer.model.parameters()], {out!r} + ".params.pt")
print("FINISHED", trainer.state.global_step)
"""


@pytest.mark.slow
def test_sigkill_at_random_moments_always_resumes_to_the_end(tmp_path):
    """SIGKILL a run that saves every step at random moments; resuming with transformers'
    ``get_last_checkpoint`` always finishes, with the parameters of a run never killed."""
    out = tmp_path / "run"
    script = tmp_path / "run.py"
    script.write_text(KILL_SCRIPT.format(tests=os.path.dirname(__file__), out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    rng = random.Random(0)
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        time.sleep(
            rng.uniform(4.0, 9.0)
        )  # start-up takes a few seconds, then a step (and a save) every ~0.2 s
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert final.returncode == 0, final.stderr[-3000:]
    assert "FINISHED 30" in final.stdout
    straight = tmp_path / "straight"
    once = subprocess.run(
        [sys.executable, "-c", KILL_SCRIPT.format(tests=os.path.dirname(__file__), out=str(straight))],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert "FINISHED 30" in once.stdout, once.stderr[-3000:]
    killed = torch.load(str(out) + ".params.pt")
    for a, b in zip(torch.load(str(straight) + ".params.pt"), killed, strict=True):
        assert torch.equal(a, b)


# ---- faults in reward functions ----------------------------------------------------------------


def nan_on_first(completion_ids, **kwargs):
    return [math.nan] + [1.0] * (len(completion_ids) - 1)


def always_raises(completion_ids, **kwargs):
    raise RuntimeError("service unavailable")


async def too_slow(completion_ids, **kwargs):
    await asyncio.sleep(5)
    return [1.0] * len(completion_ids)


def test_nan_reward_raises_by_default(tmp_path, tok):
    trainer = _trainer(tmp_path, tok, reward=nan_on_first, max_steps=1)
    with pytest.raises(
        RewardFunctionError, match="'nan_on_first' returned nan for sample 0; rewards must be finite"
    ):
        trainer.train()


@pytest.mark.parametrize(("func", "expected"), [(nan_on_first, 1.0), (always_raises, 4.0)])
def test_skip_policy_leaves_faults_out_and_counts_them(tmp_path, tok, func, expected):
    trainer = _trainer(tmp_path, tok, reward=[func, varied_reward], max_steps=1, reward_fault_policy="skip")
    trainer.train()
    log = trainer.state.log_history[0]
    assert log[f"rewards/{func.__name__}/faults"] == expected
    assert math.isfinite(log["loss"])


def test_async_timeout_is_a_fault(tmp_path, tok):
    trainer = _trainer(tmp_path, tok, reward=too_slow, max_steps=1, reward_timeout=0.2)
    with pytest.raises(RewardFunctionError, match="'too_slow' did not finish within reward_timeout=0.2 s"):
        trainer.train()
    skipping = _trainer(
        tmp_path,
        tok,
        reward=[too_slow, varied_reward],
        max_steps=1,
        reward_timeout=0.2,
        reward_fault_policy="skip",
    )
    skipping.train()
    assert skipping.state.log_history[0]["rewards/too_slow/faults"] == 4.0


# ---- non-finite loss and gradients -------------------------------------------------------------


def test_nan_loss_stops_before_any_update(tmp_path, tok):
    model = build_tiny_model(tok)
    # NaN logits in the training forward only (generation runs in eval mode and stays finite)
    model.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if m.training else out)
    trainer = _trainer(tmp_path, tok, model=model, max_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match="loss became nan at optimizer step 1"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_nan_gradient_stops_before_the_update(tmp_path, tok):
    model = build_tiny_model(tok)
    model.model.norm.weight.register_hook(lambda g: g * float("nan"))
    trainer = _trainer(tmp_path, tok, model=model, max_steps=2, save_strategy="steps", save_steps=1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(FloatingPointError, match="Non-finite gradients in .* at optimizer step 1"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert not list(tmp_path.glob("checkpoint-*"))  # nothing corrupt was saved


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_the_gradient_check_reads_the_clipping_norm_first(tmp_path, tok, max_grad_norm):
    """transformers computes the total gradient norm before every optimizer step (to clip it, or
    only to log it); a finite total means every entry is finite, so the check computes nothing
    more. A non-finite total, or none, sends it through each gradient's own norm."""
    trainer = _trainer(tmp_path, tok, max_steps=1, max_grad_norm=max_grad_norm)
    trainer.train()
    assert trainer._step_grad_norm is None  # taken by the step's check
    weight = trainer.model.model.norm.weight
    weight.grad = torch.full_like(weight, float("nan"))
    trainer._step_grad_norm = torch.tensor(3.0)  # a finite total: trusted, nothing recomputed
    trainer._check_gradients()
    for total in (torch.tensor(float("nan")), None):
        trainer._step_grad_norm = total
        with pytest.raises(FloatingPointError, match=r"Non-finite gradients in \['model.norm.weight'\]"):
            trainer._check_gradients()


def test_resuming_a_finished_run_trains_no_further(tmp_path, tok):
    _trainer(tmp_path, tok, max_steps=2, save_strategy="steps", save_steps=1).train()
    again = _trainer(tmp_path, tok, max_steps=2, save_strategy="steps", save_steps=1)
    with pytest.warns(UserWarning, match="already at step 2"):
        again.train(resume_from_checkpoint=True)
    assert again.state.global_step == 2
    assert not (tmp_path / "checkpoint-3").exists()
