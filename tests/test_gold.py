"""GOLDTrainer and GOLDConfig: the config's contract, the same-tokenizer JSD, ULD and X-Token across
two tokenizers against hand compositions of the ops functions, training, accumulation, exact
resume, the projection command and the errors.

The student uses the shared tiny tokenizer (320 tokens, ChatML); the teacher a byte-level BPE
trained here on the same sentences with 290 tokens, its own special tokens and its own chat
template, so the two cut the completions differently (checked: some aligned spans hold more
tokens on one side than on the other).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import CORPUS, build_tiny_model, build_tiny_tokenizer
from helpers import CPU_TEST_ARGS, SGD_ARGS, ScriptedGenerator
from test_distill import _full_logits
from test_divergence import _textbook
from test_invariance import SCRIPT

from posttrain.cli.options import CLIError
from posttrain.cli.xtoken import xtoken_projection
from posttrain.data.distill import as_prompt_completion
from posttrain.distill.gold import GOLDConfig, GOLDTrainer, completion_text
from posttrain.ops.cross_tokenizer import (
    load_projection_matrix,
    matched_tokens,
    merge_group_distributions,
    save_projection_matrix,
    tempered_log_softmax,
    token_bytes,
    uld_loss,
    xtoken_p_kl,
)
from posttrain.ops.token_alignment import align_spans, byte_offsets

TEACHER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)
ANSWERS = [
    "The sky is blue and the sun is bright.",
    "one two three four five six",
    "What is 2 + 3? <answer>5</answer>",
    "Write a short story about a cat.",
]


def build_teacher_tokenizer():
    """Another byte-level BPE (290 tokens, ``<pad>`` and ``</s>``) with another chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=290, special_tokens=["<pad>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.chat_template = TEACHER_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def toks():
    return build_tiny_tokenizer(), build_teacher_tokenizer()


def chats(n: int = 8):
    from datasets import Dataset

    return Dataset.from_dict(
        {
            "messages": [
                [
                    {"role": "user", "content": f"Say something {i}"},
                    {"role": "assistant", "content": ANSWERS[i % 4]},
                ]
                for i in range(n)
            ]
        }
    )


def gold(tmp_path, toks, dataset=None, teacher=None, teacher_tok=True, **overrides) -> GOLDTrainer:
    s_tok, t_tok = toks
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "max_completion_length": 32, "lmbda": 0.0}
    values.update(overrides)
    return GOLDTrainer(
        build_tiny_model(s_tok, seed=1),
        teacher if teacher is not None else build_tiny_model(t_tok, seed=2),
        GOLDConfig(**values),
        train_dataset=dataset if dataset is not None else chats(),
        processing_class=s_tok,
        teacher_processing_class=t_tok if teacher_tok else None,
    )


def first_batch(trainer: GOLDTrainer, n: int = 4):
    (scored,) = trainer._generate_and_score([trainer.train_dataset[i] for i in range(n)], "train", 1)
    return scored


# ---- the config ----------------------------------------------------------------------------------------


def test_config_defaults_are_the_references(tmp_path) -> None:
    c = GOLDConfig(output_dir=str(tmp_path))
    assert (c.temperature, c.top_p, c.top_k, c.lmbda, c.beta) == (0.9, 0.95, 0, 0.5, 0.5)
    assert (c.max_completion_length, c.max_length, c.num_generations, c.learning_rate) == (128, 1024, 1, 1e-7)
    assert (c.disable_dropout, c.seq_kd, c.use_uld_loss, c.use_extended_uld) == (True, False, False, True)
    assert (c.uld_token_merge_strategy, c.uld_use_hybrid_loss) == ("observed", False)
    assert (c.uld_hybrid_matched_weight, c.uld_hybrid_unmatched_weight) == (None, None)
    assert (c.uld_crossentropy_weight, c.uld_distillation_weight) == (0.0, 1.0)
    assert (c.uld_student_temperature, c.uld_teacher_temperature) == (1.0, 1.0)
    assert (c.uld_skip_student_eos, c.uld_skip_teacher_eos) == (True, True)
    assert (c.vllm_server_port, c.vllm_gpu_memory_utilization, c.vllm_sync_frequency) == (8001, 0.9, 1)
    assert (c.log_completions, c.log_completions_steps, c.num_completions_to_print) == (False, 100, None)
    assert c.wandb_log_unique_prompts and c.log_unique_prompts and c.callbacks == []
    assert c.teacher_tokenizer_name_or_path is None and c.generation_batch_size is not None
    assert (c.xtoken_loss_type, c.xtoken_projection_matrix_path, c.xtoken_temperature) == (None, None, 1.0)
    assert (c.xtoken_dynamic_scaling, c.xtoken_vocab_topk) == (True, 8192)
    assert not hasattr(c, "max_new_tokens") and not c.cross_tokenizer
    assert dataclasses.replace(c).max_completion_length == 128  # a copy of a built config rebuilds


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        ({"lmbda": 1.5}, ValueError, "lmbda=1.5 is invalid"),
        ({"beta": -0.1}, ValueError, "beta=-0.1 is invalid"),
        ({"num_generations": 0}, ValueError, "num_generations=0 is invalid"),
        ({"uld_crossentropy_weight": -1.0}, ValueError, "uld_crossentropy_weight=-1.0 is invalid"),
        ({"uld_student_temperature": 0.0}, ValueError, "uld_student_temperature=0.0 is invalid"),
        ({"uld_token_merge_strategy": "greedy"}, ValueError, "uld_token_merge_strategy='greedy' is invalid"),
        ({"xtoken_loss_type": "kl"}, ValueError, "xtoken_loss_type='kl' is invalid"),
        ({"xtoken_temperature": 0}, ValueError, "xtoken_temperature=0 is invalid"),
        ({"max_completion_length": 64, "max_length": 64}, ValueError, "must be below max_length=64"),
        ({"callbacks": ["cb"]}, ValueError, "pass callbacks to the trainer"),
        ({"use_uld_loss": True, "xtoken_loss_type": "p_kl", "xtoken_projection_matrix_path": "w.pt"}, ValueError, "pick one"),
        ({"xtoken_loss_type": "p_kl"}, ValueError, "X-Token needs both"),
        ({"uld_use_hybrid_loss": True}, ValueError, "set use_uld_loss=True as well"),
        ({"log_completions_steps": 0}, ValueError, "log_completions_steps=0 is invalid"),
        ({"seq_kd": True, "use_uld_loss": True}, NotImplementedError, "seq_kd=True with a cross-tokenizer loss"),
    ],
    ids=['lmbda', 'beta', 'num_generations', 'uld_ce_weight', 'uld_temperature', 'merge_strategy', 'xtoken_type', 'xtoken_temperature', 'lengths', 'callbacks', 'two_losses', 'xtoken_both', 'hybrid', 'log_completions_steps', 'seq_kd'],
)  # fmt: skip
def test_config_rejects_bad_values(tmp_path, overrides, error, match) -> None:
    with pytest.raises(error, match=match):
        GOLDConfig(output_dir=str(tmp_path), **overrides)


def test_log_completions_steps_logs_the_completions_of_every_that_many_steps(tmp_path) -> None:
    """The reference's period: the training completions of steps 0 and 2 of 4 with
    ``log_completions_steps=2``, each step's sampled rows (lmbda=1: every step samples)."""
    tok = build_tiny_tokenizer()
    trainer = gold(
        tmp_path,
        (tok, tok),
        teacher_tok=False,
        lmbda=1.0,
        max_steps=4,
        log_completions=True,
        log_completions_steps=2,
    )
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted({row["step"] for row in rows}) == [0, 2]
    assert len(rows) == 2 * CPU_TEST_ARGS["per_device_train_batch_size"]


# ---- same tokenizer: the JSD of logits / temperature ---------------------------------------------------


def test_same_tokenizer_is_the_jsd_at_the_temperature(tmp_path) -> None:
    tok = build_tiny_tokenizer()
    trainer = GOLDTrainer(
        build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2),
        GOLDConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, max_completion_length=8, lmbda=1.0, beta=0.3,
                   temperature=0.7),
        train_dataset=chats(), processing_class=tok,
    )  # fmt: skip
    trainer.generator = ScriptedGenerator(SCRIPT, 0)
    (scored,) = trainer._generate_and_score([{"prompt": f"Question {i}"} for i in range(4)], "train", 1)
    loss = trainer.compute_loss(trainer.model, scored)
    r, keep = scored.rollout, scored.rollout.completion_mask.bool()
    with torch.no_grad():
        zs = _full_logits(trainer.model, r)[keep] / 0.7
        zt = _full_logits(trainer.teacher_model, r)[keep] / 0.7
    assert loss.item() == pytest.approx((_textbook(zs, zt, 0.3).sum() / keep.sum()).item(), rel=1e-5)


def test_dataset_completions_keep_the_template_tail_with_one_tokenizer_only(tmp_path, toks) -> None:
    """One tokenizer: a dataset completion trains through ChatML's newline after <|im_end|>, as the
    reference's and GKD's do (it used to end at the EOS); across tokenizers (ULD) it ends at the EOS."""
    tok = build_tiny_tokenizer()
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    same = GOLDTrainer(
        build_tiny_model(tok, seed=1), build_tiny_model(tok, seed=2),
        GOLDConfig(output_dir=str(tmp_path / "same"), **CPU_TEST_ARGS, max_completion_length=8, lmbda=0.0),
        train_dataset=chats(), processing_class=tok,
    )  # fmt: skip
    uld = gold(tmp_path / "uld", toks, use_uld_loss=True)
    for trainer, tail in ((same, newline), (uld, [toks[0].eos_token_id])):
        scored = first_batch(trainer)
        r = scored.rollout
        for i in range(r.completion_ids.shape[0]):
            ids = r.completion_ids[i][r.completion_mask[i].bool()].tolist()
            assert ids[-len(tail) :] == tail


def test_different_vocabularies_need_a_cross_tokenizer_loss(tmp_path, toks) -> None:
    with pytest.raises(
        ValueError, match=r"vocabulary has 290 tokens and the student's 320.*use_uld_loss=True"
    ):
        gold(tmp_path, toks)


# ---- ULD against the ops functions ----------------------------------------------------------------------


def _full_logps(model, ids: list[int], temperature: float) -> torch.Tensor:
    """[L, V] unshifted log-probs of one unpadded sequence (row t predicts token t + 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return tempered_log_softmax(logits, temperature)


def _hand_rows(trainer: GOLDTrainer, scored, merge: str, temps: tuple[float, float]):
    """Each sample's merged rows on both sides, built from the texts with the ops functions alone.

    Full sequences (prompt + completion, each model in its own tokens), aligned completion spans
    shifted by the prompt lengths, the last span dropped; the EOS of both sides skipped.
    """
    s_tok, t_tok = trainer._tokenizer, trainer._pair.tokenizer
    r, strategy = scored.rollout, trainer.args.uld_token_merge_strategy
    out, nll, tokens, multi = [], 0.0, 0, False
    for i in range(r.completion_ids.shape[0]):
        prompt = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist()
        completion = r.completion_ids[i][r.completion_mask[i].bool()].tolist()
        assert completion[-1] == s_tok.eos_token_id  # the dataset's completions end with EOS
        text = s_tok.decode(completion[:-1], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        s = byte_offsets(s_tok, text)
        assert s.ids == completion[:-1]  # the student's tokens are the text's own tokenisation here
        row = trainer.train_dataset[i]
        t_prompt = t_tok(t_tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"]  # fmt: skip
        t = byte_offsets(t_tok, text)
        end = len(text.encode())
        aligned = align_spans(
            [*s.offsets, (end, end)], [*t.offsets, (end, end)],
            student_skip=[len(s.ids)], teacher_skip=[len(t.ids)],
        ).drop_last()  # fmt: skip
        multi |= any(not g.is_one_to_one for g in aligned.groups)
        aligned = aligned.shifted(len(prompt), len(t_prompt))
        s_ids, t_ids = prompt + completion, t_prompt + t.ids + [t_tok.eos_token_id]
        s_logps = _full_logps(trainer.model, s_ids, temps[0])
        sm, sv = merge_group_distributions(
            s_logps, torch.tensor(s_ids), aligned.student_ranges(), strategy=strategy, merge=merge
        )
        t_logps = _full_logps(trainer.teacher_model, t_ids, temps[1])
        tm, tv = merge_group_distributions(
            t_logps, torch.tensor(t_ids), aligned.teacher_ranges(), strategy=strategy, merge=merge
        )
        out.append((sm[sv & tv], tm[sv & tv]))
        plain = _full_logps(trainer.model, s_ids, 1.0)
        nll -= sum(plain[len(prompt) - 1 + j, tok].item() for j, tok in enumerate(completion))
        tokens += len(completion)
    assert multi, "the two tokenizers should cut some span differently"
    return out, nll / tokens


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"uld_use_hybrid_loss": True, "uld_hybrid_matched_weight": 0.5},
        {"uld_token_merge_strategy": "bayesian", "uld_crossentropy_weight": 0.3, "uld_distillation_weight": 2.0,
         "uld_student_temperature": 0.8, "uld_teacher_temperature": 1.5},
    ],
    ids=["uld", "hybrid", "bayesian_ce_temperatures"],
)  # fmt: skip
def test_uld_loss_is_the_ops_composition(tmp_path, toks, overrides) -> None:
    trainer = gold(tmp_path, toks, use_uld_loss=True, **overrides)
    scored = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, scored)
    a = trainer.args
    rows, ce = _hand_rows(trainer, scored, "chain", (a.uld_student_temperature, a.uld_teacher_temperature))
    index = torch.cat([torch.full((len(s),), i) for i, (s, _) in enumerate(rows)])
    common = matched_tokens(*toks, 320, 290) if a.uld_use_hybrid_loss else None
    want, _ = uld_loss(
        torch.cat([s for s, _ in rows]).exp(), torch.cat([t for _, t in rows]).exp(), index, len(rows),
        crossentropy=torch.tensor(ce), distillation_weight=a.uld_distillation_weight,
        crossentropy_weight=a.uld_crossentropy_weight, common_map=common,
        matched_weight=a.uld_hybrid_matched_weight, unmatched_weight=a.uld_hybrid_unmatched_weight,
    )  # fmt: skip
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in trainer.teacher_model.parameters())


def test_training_reduces_the_uld_loss(tmp_path, toks) -> None:
    trainer = gold(
        tmp_path, toks, use_uld_loss=True, max_steps=10, learning_rate=0.02, lr_scheduler_type="constant"
    )
    fixed = first_batch(trainer)
    with torch.no_grad():
        start = trainer.compute_loss(trainer.model.eval(), fixed).item()
    trainer.train()
    with torch.no_grad():
        end = trainer.compute_loss(trainer.model.eval(), fixed).item()
    assert end < 0.8 * start
    assert all(
        "off_policy_loss" in h and "distillation_loss" in h for h in trainer.state.log_history if "loss" in h
    )


def test_the_hybrid_logs_its_two_parts(tmp_path, toks) -> None:
    trainer = gold(
        tmp_path, toks, use_uld_loss=True, uld_use_hybrid_loss=True, max_steps=1, per_device_eval_batch_size=4
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["matched_loss"] > 0 and logged["unmatched_loss"] > 0
    assert logged["distillation_loss"] == pytest.approx(
        logged["matched_loss"] + logged["unmatched_loss"], rel=1e-5
    )
    metrics = trainer.evaluate(as_prompt_completion(chats(4)))  # the dataset's completions
    logged = trainer.state.log_history[-1]
    assert metrics["eval_loss"] > 0
    assert logged["eval_distillation_loss"] == pytest.approx(metrics["eval_loss"], rel=1e-5)


def test_checkpointed_samples_give_the_plain_gradients(tmp_path, toks, monkeypatch) -> None:
    """One sample's [T, V] at a time (recomputed in backward) changes no gradient, the head's included."""
    grads = []
    for plain in (False, True):
        trainer = gold(tmp_path, toks, use_uld_loss=True, uld_crossentropy_weight=0.2)
        if plain:
            monkeypatch.setattr(
                GOLDTrainer, "_per_sample", lambda self, fn, sides: fn(sides, sides.student[0])
            )
        trainer.compute_loss(trainer.model, first_batch(trainer)).backward()
        grads.append([p.grad.clone() for p in trainer.model.parameters()])
    assert grads[0][-1].abs().sum() > 0  # the LM head's
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _sgd_params(path, toks, per_device: int, accumulation: int) -> list[torch.Tensor]:
    trainer = gold(
        path, toks, use_uld_loss=True, uld_crossentropy_weight=0.5, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accumulation, max_steps=1, shuffle_dataset=False, **SGD_ARGS,
    )  # fmt: skip
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_accumulation_gives_the_same_update(tmp_path, toks) -> None:
    """Per-sample means over the step's samples and the NLL over its tokens: 1 x 8 equals 4 x 2."""
    one, four = _sgd_params(tmp_path / "one", toks, 8, 1), _sgd_params(tmp_path / "four", toks, 2, 4)
    for a, b in zip(one, four, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_resume_is_exact(tmp_path, toks) -> None:
    """On- and off-policy steps (lmbda=0.5) with the real sampler: stopped after step 1 and resumed."""

    def run(out, resume=None):
        torch.manual_seed(0)
        trainer = gold(
            out, toks, chats(16), use_uld_loss=True, lmbda=0.5, max_steps=3, save_strategy="steps", save_steps=1,
            learning_rate=0.05, temperature=1.0,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    straight = run(tmp_path / "straight")
    sources = {"on_policy_loss" in h for h in straight.state.log_history if "loss" in h}
    assert sources == {True, False}  # both kinds of step happened
    run(tmp_path / "stopped")
    resumed = run(tmp_path / "stopped", resume=str(tmp_path / "stopped" / "checkpoint-1"))
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


# ---- X-Token ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def projection_path(tmp_path_factory, toks):
    """The pair's projection matrix, built by the command from saved models."""
    folder = tmp_path_factory.mktemp("xtoken")
    for name, tok, seed in (("student", toks[0], 1), ("teacher", toks[1], 2)):
        build_tiny_model(tok, seed).save_pretrained(folder / name)
        tok.save_pretrained(folder / name)
    path = folder / "projection.pt"
    xtoken_projection(
        [
            "--student",
            str(folder / "student"),
            "--teacher",
            str(folder / "teacher"),
            "--top-k",
            "4",
            "--output",
            str(path),
        ]
    )
    return str(path)


def test_xtoken_p_kl_is_the_ops_composition(tmp_path, toks, projection_path) -> None:
    trainer = gold(
        tmp_path, toks, xtoken_loss_type="p_kl", xtoken_projection_matrix_path=projection_path,
        xtoken_temperature=2.0, xtoken_vocab_topk=16, xtoken_dynamic_scaling=False, xtoken_ce_scale=0.1,
    )  # fmt: skip
    scored = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, scored)
    rows, ce = _hand_rows(trainer, scored, "mean", (2.0, 2.0))
    s, t = torch.cat([s for s, _ in rows]), torch.cat([t for _, t in rows])
    kd = xtoken_p_kl(s, t, load_projection_matrix(projection_path, 320, 290), top_k=16)  # the batch's top 16
    want = 2.0**2 * kd.sum() / len(kd) + 0.1 * ce
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()


@pytest.mark.parametrize("loss_type", ["p_kl", "h_kl"])
def test_xtoken_dynamic_scaling_balances_ce_and_kd(tmp_path, toks, projection_path, loss_type) -> None:
    """Eq. 7: sg(L_CE / L_KD) L_KD + L_CE, whose value is 2 L_CE when L_KD > 0; it trains and logs."""
    teacher = str(Path(projection_path).parent / "teacher")  # by path: its tokenizer loads from there too
    trainer = gold(
        tmp_path, toks, teacher=teacher, teacher_tok=False, xtoken_loss_type=loss_type,
        xtoken_projection_matrix_path=projection_path, max_steps=2,
    )  # fmt: skip
    scored = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, scored)
    _, ce = _hand_rows(trainer, scored, "mean", (1.0, 1.0))
    assert loss.item() == pytest.approx(2 * ce, rel=1e-5)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert {"crossentropy", "distillation_loss", "off_policy_loss", "xtoken/kd_scale"} <= set(logged)


def test_a_projection_of_the_wrong_shape_is_refused(tmp_path, toks) -> None:
    path = tmp_path / "wrong.pt"
    save_projection_matrix(torch.eye(290, 320).to_sparse(), path)
    with pytest.raises(ValueError, match=r"has shape \(290, 320\).*expected \(320, 290\)"):
        gold(tmp_path, toks, xtoken_loss_type="h_kl", xtoken_projection_matrix_path=str(path))


def test_the_projection_command_checks_its_input(tmp_path, projection_path, toks) -> None:
    w = load_projection_matrix(projection_path, 320, 290)
    assert torch.allclose(torch.sparse.sum(w, dim=1).to_dense(), torch.ones(320))
    with pytest.raises(CLIError, match="--top-k 0"):
        xtoken_projection(
            ["--student", "a", "--teacher", "b", "--top-k", "0", "--output", str(tmp_path / "w.pt")]
        )
    with pytest.raises(CLIError, match="does not exist"):
        xtoken_projection(["--student", "a", "--teacher", "b", "--output", str(tmp_path / "no" / "w.pt")])
    with pytest.raises(CLIError, match="--student './no/such/model'"):
        xtoken_projection(
            ["--student", "./no/such/model", "--teacher", "b", "--output", str(tmp_path / "w.pt")]
        )


# ---- the pieces ------------------------------------------------------------------------------------------


def test_completion_text_follows_the_generated_bytes(toks) -> None:
    s_tok = toks[0]
    pieces = token_bytes(s_tok)
    e_acute = s_tok.convert_tokens_to_ids(["Ã", "©"])  # the two bytes of "é", one token each
    ids = s_tok("caf", add_special_tokens=False)["input_ids"] + e_acute + [s_tok.eos_token_id]
    text, offsets = completion_text(ids, pieces, set(s_tok.all_special_ids))
    assert text == "café"
    assert offsets[-3:] == [(3, 5), (3, 5), (5, 5)]  # both halves get the whole character; EOS none
    broken, spans = completion_text([e_acute[1], e_acute[0]], pieces, set())
    assert broken == "\ufffd\ufffd" and spans == [(0, 3), (3, 6)]  # invalid bytes are replaced
    straddling, spans = completion_text(
        [0, 1], [b"a\xc3", b"\xa9b"], set()
    )  # "a" + half of "é", then the rest
    assert straddling == "aéb" and spans == [(0, 4), (1, 4)]


def test_the_teacher_tokenizer_must_be_found(tmp_path, toks) -> None:
    s_tok, t_tok = toks
    with pytest.raises(ValueError, match="teacher_processing_class"):
        GOLDTrainer(
            build_tiny_model(s_tok, seed=1), build_tiny_model(t_tok, seed=2),
            GOLDConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, use_uld_loss=True, lmbda=0.0),
            train_dataset=chats(), processing_class=s_tok,
        )  # fmt: skip
    untemplated = copy.deepcopy(t_tok)
    untemplated.chat_template = None
    with pytest.raises(ValueError, match="the teacher's tokenizer has none"):
        GOLDTrainer(
            build_tiny_model(s_tok, seed=1), build_tiny_model(t_tok, seed=2),
            GOLDConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, use_uld_loss=True, lmbda=0.0),
            train_dataset=chats(), processing_class=s_tok, teacher_processing_class=untemplated,
        )  # fmt: skip


def test_the_projection_command_is_registered() -> None:
    from posttrain.cli.main import COMMANDS
    from posttrain.cli.xtoken import xtoken_projection

    assert COMMANDS["xtoken-projection"] is xtoken_projection


def ddp_comparable_trainer(out_dir: str, per_device: int, **overrides) -> GOLDTrainer:
    """Two SGD steps of cross-tokenizer ULD on the dataset's completions (the two-process test)."""
    return gold(
        out_dir, (build_tiny_tokenizer(), build_teacher_tokenizer()), chats(16), use_uld_loss=True,
        uld_crossentropy_weight=0.5, shuffle_dataset=False, seed=1,
        **{**SGD_ARGS, "per_device_train_batch_size": per_device, "max_steps": 2}, **overrides,
    )  # fmt: skip


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path) -> None:
    """2 processes x 2 rows give the parameters and metrics of 1 process x 4 (the ULD mean is over
    the step's samples on every process)."""
    from helpers import two_processes_against_one

    two_processes_against_one(
        "test_gold",
        ddp_comparable_trainer,
        SCRIPT,
        tmp_path,
        29597,
        (2, 4),
        ("loss", "off_policy_loss", "num_tokens"),
    )
