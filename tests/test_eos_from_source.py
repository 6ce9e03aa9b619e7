"""Termination and length come from the source of the tokens, never from padded ids.

The tiny tokenizer (like the embedded SmolLM2 and many chat models) pads with its EOS token, so
a completion cut at the length limit and right-padded to a longer one looks, in the padded
tensor, as if it ended with EOS. Every site that right-pads (rollout_func, continuous batching,
the tool loop, scripted generators) must carry each row's own length.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import ScriptedGenerator, make_config, standard_dataset

from posttrain import GRPOTrainer
from posttrain.agents.loop import Episode, LoopSettings, ToolLoop
from posttrain.generation.base import Samples, build_rollout, mask_after_eos
from posttrain.generation.continuous_batching import ContinuousBatchingGenerator
from posttrain.generation.transformers_backend import sampling_config

G = 4


@pytest.fixture(scope="module")
def tok():
    t = build_tiny_tokenizer()
    t.pad_token = t.eos_token  # what prepare_tokenizer does; stated here because the tests rely on it
    return t


def test_a_short_row_without_eos_stays_unterminated_when_pad_is_eos():
    EOS = 2
    ids = torch.tensor([[5, 6, EOS, EOS], [5, 6, 7, EOS], [5, EOS, EOS, EOS]])
    mask, terminated = mask_after_eos(ids, [EOS], lengths=torch.tensor([2, 4, 2]))
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert terminated.tolist() == [False, True, True]
    # without the lengths the padded row reads as terminated: what the source must prevent
    assert mask_after_eos(ids, [EOS])[1].tolist() == [True, True, True]


def test_samples_from_lists_then_build_rollout_keeps_each_rows_length():
    EOS = 2
    samples = Samples.from_lists(
        [[5, 6], [5, 6, 7, EOS], [9, EOS]], EOS, logps=[[-1, -2], [-1] * 4, [-3, -4]]
    )
    assert samples.lengths.tolist() == [2, 4, 2]
    assert samples.completion_ids.tolist() == [[5, 6, EOS, EOS], [5, 6, 7, EOS], [9, EOS, EOS, EOS]]
    r = build_rollout(
        torch.ones(3, 1, dtype=torch.long), torch.ones(3, 1, dtype=torch.long), samples, [EOS], EOS
    )
    assert r.completion_lengths.tolist() == [2, 4, 2]
    assert r.is_terminated.tolist() == [False, True, True]


# ---- rollout_func, through the trainer -------------------------------------------------------------


def _completions(eos: int) -> list[list[int]]:
    """Per prompt: ends with EOS (3 tokens), cut short (2), ends with EOS (5), cut at the limit (6)."""
    return [[5, 6, eos], [7, 8], [9, 10, 11, 12, eos], [13, 14, 15, 16, 17, 18]]


def _rollout_func(tok, seen_ids):
    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            for completion in _completions(tok.eos_token_id):
                out["prompt_ids"].append(tok(p)["input_ids"])
                out["completion_ids"].append(completion)
                out["logprobs"].append([-1.0] * len(completion))
        return out

    return rollout_func


def test_rollout_func_completions_keep_their_length_and_termination(tmp_path, tok):
    seen: list[list[int]] = []

    def record(completion_ids, **kwargs):
        seen.extend(list(c) for c in completion_ids)
        return [float(len(c)) for c in completion_ids]

    args = make_config(
        tmp_path, per_device_train_batch_size=8, num_generations=G, max_steps=1, max_completion_length=6
    )
    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=record,
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
        rollout_func=_rollout_func(tok, seen),
    )
    trainer.train()
    assert seen == _completions(tok.eos_token_id) * 2  # not [7, 8, EOS]: the padding is no token
    log = trainer.state.log_history[0]
    assert log["completions/clipped_ratio"] == 0.5
    assert log["completions/mean_length"] == (3 + 2 + 5 + 6) / 4
    assert log["completions/mean_terminated_length"] == (3 + 5) / 2


def test_mask_truncated_completions_masks_the_short_truncated_row(tmp_path, tok):
    from posttrain.generation.rollout_func import call_rollout_func

    args = make_config(
        tmp_path,
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=6,
        mask_truncated_completions=True,
    )
    trainer = GRPOTrainer(
        model=build_tiny_model(tok),
        reward_funcs=lambda completion_ids, **kw: [0.0] * len(completion_ids),
        args=args,
        train_dataset=standard_dataset(),
        processing_class=tok,
        rollout_func=_rollout_func(tok, []),
    )
    rollout = call_rollout_func(
        trainer.rollout_func, ["a"] * G, G, trainer, [tok.eos_token_id], tok.pad_token_id, torch.device("cpu")
    ).rollout
    assert trainer._loss_mask(rollout).sum(dim=1).tolist() == [3, 0, 5, 0]


# ---- the other right-padding sites --------------------------------------------------------------------


def test_continuous_batching_reports_each_completions_length(tok, monkeypatch):
    eos = tok.eos_token_id
    config = sampling_config(
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=eos,
        eos_token_ids=[eos],
        generation_kwargs=None,
    )
    model = build_tiny_model(tok)
    gen = ContinuousBatchingGenerator(get_model=lambda: model, config=config)
    monkeypatch.setattr(gen, "_run", lambda model, prompts: [[5, 6], [7, 8, 9, eos]])
    prompt = torch.tensor([[3, 4], [3, 4]])
    samples = gen.generate(prompt, torch.ones_like(prompt))
    r = build_rollout(prompt, torch.ones_like(prompt), samples, [eos], eos)
    assert r.completion_lengths.tolist() == [2, 4]
    assert r.is_terminated.tolist() == [False, True]


def test_the_tool_loop_does_not_read_padding_as_the_end_of_a_turn(tok):
    """A turn the generator cut short (no EOS) beside a longer one: the short turn ends unfinished,
    with its own tokens only."""
    from posttrain.agents.templates import resolve_template

    tok = build_tiny_tokenizer()
    tok.chat_template = (Path(__file__).parent / "chat_templates" / "qwen2_5_instruct.jinja").read_text()
    eos = tok.eos_token_id
    short = tok("one two", add_special_tokens=False)["input_ids"]
    ended = tok("three four five", add_special_tokens=False)["input_ids"] + [eos]
    settings = LoopSettings(
        max_completion_length=32,
        max_tool_calling_iterations=None,
        max_model_length=None,
        eos_token_ids=[eos],
        pad_token_id=eos,
        chat_template_kwargs={},
    )
    loop = ToolLoop(tok, resolve_template(tok.chat_template, []), settings)
    episodes = [Episode(prompt=[], prompt_ids=[3, 4], tools={}, schemas=None) for _ in range(2)]
    turns = loop._generate(ScriptedGenerator([short, ended], eos), episodes, torch.device("cpu"))
    assert turns == [(short, False), (ended, True)]
