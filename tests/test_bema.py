"""BEMACallback: hand-computed updates, tau-relative time, frozen parameters, saving and resuming."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer

from posttrain.sft.bema import BEMA_DIR, STATE_FILE, BEMACallback, bema_coefficients


class Toy(torch.nn.Module):
    """A frozen parameter registered *before* the trainable one (the reference pairs them by position)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.tensor([7.0, 7.0, 7.0]), requires_grad=False)
        self.w = torch.nn.Parameter(torch.zeros(2))


def drive(cb: BEMACallback, model: Toy, steps, output_dir: str = "unused", start: int = 0):
    """Run the callback over global steps start+1..steps with theta_s = s * [1, 2]."""
    args = SimpleNamespace(output_dir=output_dir)
    state = SimpleNamespace(global_step=start, is_world_process_zero=True)
    with torch.no_grad():
        model.w.copy_(start * torch.tensor([1.0, 2.0]))
    cb.on_train_begin(args, state, None, model=model)
    for s in range(start + 1, steps + 1):
        with torch.no_grad():
            model.w.copy_(s * torch.tensor([1.0, 2.0]))
        state.global_step = s
        cb.on_step_end(args, state, None, model=model)
    return args, state


def test_hand_computed_updates_count_t_from_update_after():
    """update_after=1, update_freq=2, lag=0, powers 1: beta_t = alpha_t = 1/t with t = step - 1.
    Step 1: tau; theta_tau = EMA = [1, 2].
    Step 3 (t=2): EMA = [1,2]/2 + [3,6]/2 = [2, 4]; BEMA = [2,4] + ([3,6] - [1,2])/2 = [3, 6].
    Step 5 (t=4): EMA = 3/4 [2,4] + 1/4 [5,10] = [2.75, 5.5]; BEMA = [2.75,5.5] + [4,8]/4 = [3.75, 7.5].
    (Counting t from step 0 as the reference does would give beta = 1/3, 1/5 instead.)"""
    cb = BEMACallback(update_freq=2, ema_power=1.0, bias_power=1.0, lag=0, update_after=1)
    model = Toy()
    drive(cb, model, 3)
    torch.testing.assert_close(cb.bema_state_dict()["w"], torch.tensor([3.0, 6.0]))
    drive_more(cb, model, 4, 5)
    torch.testing.assert_close(cb.ema["w"], torch.tensor([2.75, 5.5]))
    torch.testing.assert_close(cb.bema_state_dict()["w"], torch.tensor([3.75, 7.5]))
    assert cb.num_updates == 2 and cb.last_update_step == 5 and cb.start_step == 1


def drive_more(cb, model, first, last):
    """Continue an already started run over steps first..last."""
    state = SimpleNamespace(global_step=first, is_world_process_zero=True)
    for s in range(first, last + 1):
        with torch.no_grad():
            model.w.copy_(s * torch.tensor([1.0, 2.0]))
        state.global_step = s
        cb.on_step_end(None, state, None, model=model)


def test_default_powers_golden():
    """lag=10, t=1: beta = 11^-0.5 = 0.3015113, alpha = 11^-0.2 = 0.6190439. From theta_0 = 0 to [1, 2]:
    EMA = beta [1,2]; BEMA = (beta + alpha) [1, 2] = [0.9205553, 1.8411105]."""
    assert bema_coefficients(
        1, lag=10, multiplier=1.0, ema_power=0.5, bias_power=0.2, min_ema_multiplier=0.0
    ) == (
        pytest.approx(0.3015113, rel=1e-6),
        pytest.approx(0.6190439, rel=1e-6),
    )
    cb = BEMACallback(update_freq=1)
    drive(cb, Toy(), 1)
    torch.testing.assert_close(
        cb.bema_state_dict()["w"], torch.tensor([0.9205553, 1.8411105]), rtol=1e-6, atol=0
    )


def test_min_ema_multiplier_floors_beta():
    beta, alpha = bema_coefficients(
        90, lag=10, multiplier=1.0, ema_power=0.5, bias_power=0.2, min_ema_multiplier=0.5
    )
    assert beta == 0.5 and alpha == pytest.approx(100**-0.2)


def test_only_trainable_parameters_are_tracked_by_name():
    cb = BEMACallback(update_freq=1)
    model = Toy()
    drive(cb, model, 2)
    assert cb.names == ["w"] and set(cb.bema_state_dict()) == {"w"}


def test_bema_saved_at_train_end_and_model_weights_put_back(tmp_path):
    cb = BEMACallback(update_freq=2, ema_power=1.0, bias_power=1.0, lag=0, update_after=1)
    model = Toy()
    args, state = drive(cb, model, 5, output_dir=str(tmp_path))
    cb.on_train_end(args, state, None, model=model)
    saved = torch.load(tmp_path / BEMA_DIR / "model.pt", weights_only=True)
    torch.testing.assert_close(saved["w"], torch.tensor([3.75, 7.5]))
    torch.testing.assert_close(saved["frozen"], torch.tensor([7.0, 7.0, 7.0]))
    torch.testing.assert_close(model.w.detach(), torch.tensor([5.0, 10.0]))  # training weights untouched


def test_resume_from_a_checkpoint_continues_the_average(tmp_path):
    straight = BEMACallback(update_freq=2, ema_power=0.5, bias_power=0.2, lag=3, update_after=1)
    drive(straight, Toy(), 7)
    first = BEMACallback(update_freq=2, ema_power=0.5, bias_power=0.2, lag=3, update_after=1)
    args, state = drive(first, Toy(), 4, output_dir=str(tmp_path))
    first.on_save(args, state, None)
    assert (tmp_path / "checkpoint-4" / STATE_FILE).is_file()
    resumed = BEMACallback(update_freq=2, ema_power=0.5, bias_power=0.2, lag=3, update_after=1)
    drive(resumed, Toy(), 7, output_dir=str(tmp_path), start=4)
    assert resumed.num_updates == straight.num_updates == 3
    torch.testing.assert_close(resumed.bema_state_dict()["w"], straight.bema_state_dict()["w"])


def test_resume_without_state_restarts_with_a_warning(tmp_path):
    cb = BEMACallback(update_freq=2)
    with pytest.warns(UserWarning, match="average restarts here"):
        drive(cb, Toy(), 6, output_dir=str(tmp_path), start=4)
    assert cb.start_step == 4 and cb.num_updates == 1


def test_no_update_warns_and_saves_the_final_weights(tmp_path):
    cb = BEMACallback(update_freq=10)
    model = Toy()
    args, state = drive(cb, model, 3, output_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="no update happened.*first update at step 10"):
        cb.on_train_end(args, state, None, model=model)
    saved = torch.load(tmp_path / BEMA_DIR / "model.pt", weights_only=True)
    torch.testing.assert_close(saved["w"], torch.tensor([3.0, 6.0]))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"update_freq": 0}, "update_freq=0): update_freq must be an integer >= 1"),
        ({"multiplier": 0.0}, "multiplier must be > 0"),
        ({"min_ema_multiplier": 2.0}, "min_ema_multiplier must be in [0, 1]"),
        ({"update_after": -1}, "update_after must be an integer >= 0"),
    ],
)
def test_hyperparameter_errors(kw, needle):
    with pytest.raises(ValueError) as err:
        BEMACallback(**kw)
    assert needle in str(err.value)


def test_with_the_transformers_trainer_saves_a_loadable_model_and_resumes(tmp_path):
    """A tiny Llama with its embeddings frozen, 6 steps, BEMA every 2 steps, checkpoints every 2 steps:
    {output_dir}/bema loads with from_pretrained and holds the BEMA weights; resuming from checkpoint-4
    reproduces the straight run's BEMA weights."""
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments

    tok = build_tiny_tokenizer()
    data = [
        {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids)}
        for ids in ([5, 6, 7, 8], [9, 10, 11, 12])
    ]

    def run(out, resume=None):
        model = build_tiny_model(tok)
        model.model.embed_tokens.weight.requires_grad_(False)
        cb = BEMACallback(update_freq=2, lag=1)
        args = TrainingArguments(
            output_dir=str(out), max_steps=6, per_device_train_batch_size=1, learning_rate=1e-2, save_steps=2,
            report_to=[], use_cpu=True, bf16=False, logging_steps=100, seed=0, disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        trainer.train(resume_from_checkpoint=resume)
        return cb, model

    cb, model = run(tmp_path / "a")
    assert "model.embed_tokens.weight" not in cb.names and cb.num_updates == 3
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "a" / BEMA_DIR)
    params = dict(loaded.named_parameters())
    for name, value in cb.bema_state_dict().items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-6)
    assert not torch.allclose(params["lm_head.weight"], model.lm_head.weight)
    resumed, _ = run(tmp_path / "a", resume=str(tmp_path / "a" / "checkpoint-4"))
    assert resumed.num_updates == 3
    for name, value in cb.bema_state_dict().items():
        torch.testing.assert_close(resumed.bema_state_dict()[name], value, rtol=0, atol=1e-6)
    assert os.path.isfile(tmp_path / "a" / "checkpoint-4" / STATE_FILE)
