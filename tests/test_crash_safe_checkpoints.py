"""A checkpoint folder is whole or absent: killed while saving, every family resumes exactly with
``get_last_checkpoint`` (transformers' idiom), and an incomplete folder given by path is refused.

A kill is a ``BaseException`` raised between two files of a save: like SIGKILL, it leaves on disk
exactly what was written so far, and nothing after it runs (no handler catches a
``BaseException`` subclass). ``test_a_real_sigkill_between_two_files`` does it with SIGKILL in a
child process once, to show the in-process kill leaves the same state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from unittest import mock

import pytest
import torch
import transformers
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, make_config, standard_dataset
from transformers.trainer_utils import get_last_checkpoint

from posttrain import GRPOTrainer
from posttrain.core import checkpoints

STEPS = 3
SAVE = {"max_steps": STEPS, "save_strategy": "steps", "save_steps": 1}


class Killed(BaseException):
    """The process dies here."""


def varied_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def _grpo(out, tok):
    return GRPOTrainer(
        model=build_tiny_model(tok, seed=1),
        reward_funcs=varied_reward,
        args=make_config(out, learning_rate=0.05, **SAVE),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


def _sft(out, tok):
    from test_sft_trainer import prompt_completion, trainer_for

    return trainer_for(out, tok, prompt_completion(16), **SAVE)


def _dpo(out, tok):
    from test_dpo_trainer import trainer_for

    return trainer_for(out, tok, loss_type=["sigmoid", "bco_pair"], **SAVE)  # BCO's running mean too


def _kto(out, tok):
    from test_kto_trainer import trainer_for

    return trainer_for(out, tok, **SAVE)


def _orpo(out, tok):
    from test_orpo_cpo_trainers import make

    return make("orpo", out, tok, **SAVE)


def _reward(out, tok):
    from test_reward_trainer import trainer_for

    return trainer_for(out, tok, **SAVE)


def _rloo(out, tok):
    from test_rloo import rloo_trainer

    return rloo_trainer(out, tok, script=None, beta=0.1, learning_rate=0.05, **SAVE)


def _online_dpo(out, tok):
    from test_online_dpo import dpo_trainer

    return dpo_trainer(out, script=None, config={**SAVE, "learning_rate": 1e-2})


def _gkd(out, tok):
    from test_distill import distill_trainer

    from posttrain import GKDConfig, GKDTrainer

    return distill_trainer(
        out, tok, cls=GKDTrainer, config=GKDConfig, scripted=False, learning_rate=0.05, **SAVE
    )


def _cpo(out, tok):
    from test_orpo_cpo_trainers import make

    return make("cpo", out, tok, loss_type="simpo", beta=2.0, **SAVE)


def _a2po(out, tok):
    from test_a2po import a2po_trainer

    return a2po_trainer(out, tok, generator=None, learning_rate=0.05, steps_per_generation=2, **SAVE)


def _async_grpo(out, tok):
    from test_async_grpo import async_trainer

    return async_trainer(out, max_staleness=2, learning_rate=0.05, **SAVE)


def _distillation(out, tok):
    from test_distill import distill_trainer

    return distill_trainer(out, tok, scripted=False, learning_rate=0.05, **SAVE)


def _gold(out, tok):
    from test_gold import build_teacher_tokenizer, chats, gold

    return gold(out, (tok, build_teacher_tokenizer()), chats(16), use_uld_loss=True, lmbda=0.5, learning_rate=0.05,
                temperature=1.0, **SAVE)  # fmt: skip


def _iw_opd(out, tok):
    from test_distill import conversations

    from posttrain import IWOPDConfig, IWOPDTrainer

    return IWOPDTrainer(
        build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2),
        IWOPDConfig(output_dir=str(out), **{**CPU_TEST_ARGS, **SAVE, "learning_rate": 0.05}, max_completion_length=8,
                    max_length=64),
        train_dataset=conversations(), processing_class=tok,
    )  # fmt: skip


def _sdft(out, tok):
    from test_sdft import sdft_trainer

    return sdft_trainer(out, tok, scripted=False, teacher_model_kind="ema", teacher_update_rate=0.5,
                        learning_rate=0.05, **SAVE)  # fmt: skip


def _sdpo(out, tok):
    from test_sdpo import sdpo_trainer

    return sdpo_trainer(out, reward=varied_reward, scripted=False, num_iterations=2, distillation_weight=0.5, teacher_update_rate=0.5,
                        learning_rate=0.05, **SAVE)  # fmt: skip


FAMILIES = {
    "grpo": _grpo,
    "sft": _sft,
    "dpo": _dpo,
    "kto": _kto,
    "orpo": _orpo,
    "reward": _reward,
    "rloo": _rloo,
    "online_dpo": _online_dpo,
    "gkd": _gkd,
    "cpo": _cpo,
    "a2po": _a2po,
    "async_grpo": _async_grpo,
    "distillation": _distillation,
    "gold": _gold,
    "iw_opd": _iw_opd,
    "sdft": _sdft,
    "sdpo": _sdpo,
}


@contextlib.contextmanager
def killed_at(step: int, target, attribute: str):
    """Die when ``target.attribute`` is called while saving ``checkpoint-{step}``."""
    original = getattr(target, attribute)
    trainers = []

    def dying(*args, **kwargs):
        owner = args[0] if args and isinstance(args[0], transformers.Trainer) else trainers[0]
        if owner.state.global_step == step:
            raise Killed(attribute)
        return original(*args, **kwargs)

    with mock.patch.object(target, attribute, dying):
        yield trainers


def _train(build, out, tok, resume=None):
    torch.manual_seed(0)
    trainer = build(out, tok)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _kill_then_resume(build, out, tok, target, attribute):
    torch.manual_seed(0)
    trainer = build(out, tok)
    with killed_at(2, target, attribute) as owners:
        owners.append(trainer)
        with pytest.raises(Killed):
            trainer.train()
    visible = sorted(n for n in os.listdir(out) if n.startswith("checkpoint-"))
    assert visible == ["checkpoint-1"]  # the half-written checkpoint-2 is not visible under its name
    assert os.path.isdir(out / ".checkpoint-2.partial")
    last = get_last_checkpoint(str(out))
    assert os.path.basename(last) == "checkpoint-1"
    with pytest.warns(UserWarning, match=r"Removed \['.checkpoint-2.partial'\]"):
        resumed = _train(build, out, tok, resume=last)
    assert resumed.state.global_step == STEPS
    assert not any(n.startswith(".") for n in os.listdir(out))  # no staging folder left
    assert checkpoints.is_complete(str(out / f"checkpoint-{STEPS}"))
    return resumed


def _recording(build):
    """``build``, keeping the parameters each trainer starts from."""

    def wrapped(out, tok):
        trainer = build(out, tok)
        trainer.start_params = [p.detach().clone() for p in trainer.model.parameters()]
        return trainer

    return wrapped


def _assert_same(straight, resumed):
    """Bit-equal parameters, after a run that moved them (equal untrained ones would prove nothing)."""
    for p, q in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(p, q)
    moved = [
        not torch.equal(p.detach(), q)
        for p, q in zip(straight.model.parameters(), straight.start_params, strict=True)
    ]
    assert any(moved), "the run did not train"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_killed_between_two_files_of_a_save_resumes_exactly(tmp_path, family):
    """The kill lands after the weights and before the optimizer's state (the folder used to be
    visible as ``checkpoint-2`` then, and ``get_last_checkpoint`` picked it)."""
    tok = build_tiny_tokenizer()
    build = _recording(FAMILIES[family])
    straight = _train(build, tmp_path / "straight", tok)
    resumed = _kill_then_resume(
        build, tmp_path / "killed", tok, transformers.Trainer, "_save_optimizer_and_scheduler"
    )
    _assert_same(straight, resumed)


@pytest.mark.parametrize(
    ("where", "target", "attribute"),
    [
        ("before the weights", transformers.Trainer, "save_model"),
        ("before the RNG states", transformers.Trainer, "_save_rng_state"),
        ("before the completion mark", checkpoints, "write_state"),
        ("before the rename", checkpoints, "publish"),
    ],
)
def test_killed_anywhere_in_a_save_resumes_exactly(tmp_path, where, target, attribute):
    tok = build_tiny_tokenizer()
    build = _recording(_grpo)
    straight = _train(build, tmp_path / "straight", tok)
    resumed = _kill_then_resume(build, tmp_path / "killed", tok, target, attribute)
    _assert_same(straight, resumed)


SIGKILL_CHILD = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch, transformers
from conftest import build_tiny_tokenizer
from test_crash_safe_checkpoints import _grpo

original = transformers.Trainer._save_optimizer_and_scheduler

def dying(self, output_dir):
    if self.state.global_step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, output_dir)

transformers.Trainer._save_optimizer_and_scheduler = dying
torch.manual_seed(0)
_grpo({out!r}, build_tiny_tokenizer()).train()
"""


def test_a_real_sigkill_between_two_files(tmp_path):
    out = tmp_path / "killed"
    # the child's steps are compared bit for bit with this process's: the same number of threads
    # (another count sums in another order; AVX2 kernels showed it in the last bits)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}
    code = SIGKILL_CHILD.format(tests=os.path.dirname(__file__), out=str(out))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert sorted(os.listdir(out)) == [".checkpoint-2.partial", "checkpoint-1"]
    assert os.listdir(out / ".checkpoint-2.partial" / "checkpoint-2")  # the weights were written
    tok = build_tiny_tokenizer()
    build = _recording(_grpo)
    straight = _train(build, tmp_path / "straight", tok)
    with pytest.warns(UserWarning, match="Removed"):
        resumed = _train(build, out, tok, resume=get_last_checkpoint(str(out)))
    _assert_same(straight, resumed)


def test_an_incomplete_folder_given_by_path_is_refused_before_training(tmp_path):
    tok = build_tiny_tokenizer()
    out = tmp_path / "run"
    _train(_grpo, out, tok)
    older = out / "checkpoint-4"  # as an older version, or another tool, left it: config only
    older.mkdir()
    (older / "config.json").write_text("{}")
    trainer = _grpo(out, tok)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError) as err:
        trainer.train(resume_from_checkpoint=str(older))
    message = str(err.value)
    assert "checkpoint-4" in message and "model's weights" in message
    assert "optimizer.pt" in message and "trainer_state.json" in message
    assert f"newest whole checkpoint beside it is {out / 'checkpoint-3'}" in message
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_save_only_model_checkpoints_resume_without_an_optimizer(tmp_path):
    tok = build_tiny_tokenizer()
    out = tmp_path / "run"
    _train(lambda o, t: _with(o, t, save_only_model=True), out, tok)
    assert checkpoints.missing_files(str(out / "checkpoint-2"), needs_optimizer=False) == []
    assert checkpoints.missing_files(str(out / "checkpoint-2")) == ["optimizer.pt"]


def _with(out, tok, **config):
    return GRPOTrainer(
        model=build_tiny_model(tok, seed=1),
        reward_funcs=varied_reward,
        args=make_config(out, learning_rate=0.05, **{**SAVE, **config}),
        train_dataset=standard_dataset(),
        processing_class=tok,
    )


def test_the_final_save_leaves_whole_files_when_killed(tmp_path):
    """A kill while the final model's weights are written leaves the previous save loadable."""
    tok = build_tiny_tokenizer()
    trainer = _with(tmp_path / "run", tok, max_steps=1, save_strategy="no")
    trainer.train()
    target = tmp_path / "final"
    trainer.save_model(str(target))
    first = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)

    def torn(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half written")
        raise Killed("save_file")

    with mock.patch("transformers.modeling_utils.safe_save_file", torn), pytest.raises(Killed):
        trainer.save_model(str(target))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    for a, b in zip(first.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
    trainer.save_model(str(target))  # the next save replaces the staging folder and publishes
    assert not (target / ".save.partial").exists()
    last = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    for a, b in zip(trainer.model.parameters(), last.parameters(), strict=True):
        assert torch.equal(a.detach(), b)
