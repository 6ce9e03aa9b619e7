"""The held-out accuracy of the default runs: greedy completions scored by the task's answer rewards."""

from __future__ import annotations

import torch
from conftest import CHAT_TEMPLATE, build_tiny_model, build_tiny_tokenizer
from datasets import Dataset

from posttrain.rewards.evaluate import task_accuracy


class Scripted(torch.nn.Module):
    """A stand-in whose ``generate`` appends a fixed answer, so the scores are known."""

    def __init__(self, tok, answers):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.tok, self.answers, self.calls = tok, answers, 0

    def generate(self, input_ids, attention_mask, generation_config):
        rows = []
        for _ in range(input_ids.shape[0]):
            rows.append(self.tok(self.answers[self.calls])["input_ids"])
            self.calls += 1
        width = max(len(r) for r in rows)
        pad = self.tok.pad_token_id
        tail = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, tail], dim=1)


def test_accuracy_and_format_are_the_shares_of_right_and_tagged_answers(capsys):
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} + 1?"}] for i in range(4)],
            "solution": ["1", "2", "3", "4"],
        }
    )
    model = Scripted(tok, ["<answer>1</answer>", "<answer>5</answer>", "3", "<answer>4</answer>"])
    result = task_accuracy(model, tok, data, batch_size=3, progress="held-out accuracy")
    assert result == {"accuracy": 0.5, "format": 0.75}
    assert model.calls == 4 and model.training  # every prompt once; the training mode is restored
    assert "held-out accuracy" in capsys.readouterr().err


def test_a_real_model_gives_shares_between_zero_and_one():
    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    data = Dataset.from_dict({"prompt": ["What is 1 + 1?", "What is 2 + 2?"], "solution": ["2", "4"]})
    result = task_accuracy(build_tiny_model(tok), tok, data, max_new_tokens=4)
    assert set(result) == {"accuracy", "format"} and all(0.0 <= v <= 1.0 for v in result.values())


def test_greedy_completions_through_the_fast_paths_equal_generate(monkeypatch):
    """The held-out evaluation samples through the training sampler's lean loop and fused step,
    greedy; its completions are those of ``model.generate(do_sample=False)``."""
    from posttrain.rewards import evaluate

    tok = build_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.pad_token = tok.eos_token
    model = build_tiny_model(tok)
    data = Dataset.from_dict({"prompt": [f"What is {i} + {i}?" for i in range(5)], "solution": ["0"] * 5})
    seen: dict[str, list] = {"fast": [], "plain": []}
    monkeypatch.setattr(evaluate, "answer_format_reward", lambda completions: [0.0] * len(completions))
    monkeypatch.setattr(
        evaluate,
        "answer_accuracy_reward",
        lambda completions, solutions: seen["fast"].extend(completions) or [],
    )
    paths = []
    generate = evaluate.TransformersGenerator.generate

    def spy(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        paths.append(self.path.taken)
        return out

    monkeypatch.setattr(evaluate.TransformersGenerator, "generate", spy)
    evaluate.task_accuracy(model, tok, data, max_new_tokens=6, batch_size=5)
    assert paths == ["lean"]
    ids = [tok(p)["input_ids"] for p in data["prompt"]]
    from posttrain.ops.padding import left_pad

    prompt_ids, mask = left_pad(ids, tok.pad_token_id)
    out = model.generate(input_ids=prompt_ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    assert seen["fast"] == tok.batch_decode(out[:, prompt_ids.shape[1] :], skip_special_tokens=True)
