"""Reward models as reward functions: loading, rendering, batched scoring and bad inputs."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from transformers import LlamaConfig, LlamaForSequenceClassification

from posttrain.rewards.models import RewardModel, load_reward_model, resolve_reward_funcs
from posttrain.rewards.runner import RewardRunner, reward_name

# The first assert_close imports torch.distributed.tensor (about 1 s): pay that at collection.
torch.testing.assert_close(torch.zeros(1), torch.zeros(1))

OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"

STANDARD_PROMPTS = ["What is 2 + 3?", "The sky is", "Write a short story", "one two"]
STANDARD_COMPLETIONS = [
    " <answer>5</answer>",
    " blue.",
    " about a cat who learns arithmetic and more.",
    " three",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
    [{"role": "user", "content": "Write a short story about a cat."}],
    [{"role": "user", "content": "one two"}],
]
CHAT_COMPLETIONS = [
    [{"role": "assistant", "content": "<answer>5</answer>"}],
    [{"role": "assistant", "content": "hi there"}],
    [{"role": "assistant", "content": "The cat learns arithmetic, one two three four five."}],
    [{"role": "assistant", "content": "three"}],
]


def build_reward_model(tokenizer, num_labels: int = 1, pad_token_id: int | None = -1, seed: int = 0):
    """A 2-layer Llama sequence classifier; ``pad_token_id=-1`` means the tokenizer's EOS."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_labels=num_labels,
        pad_token_id=tokenizer.eos_token_id if pad_token_id == -1 else pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():  # a larger head, so that scores differ visibly between texts
        model.score.weight.normal_(0.0, 1.0)
    return model.eval()


def manual_score(model, tokenizer, text: str) -> float:
    """The reference: one unpadded forward of ``text``."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(input_ids=ids).logits[0, 0].item()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("models") / "tiny-rm"
    build_reward_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


# ---- loading -------------------------------------------------------------------------------------


def test_load_from_path_scores_like_a_manual_forward(reward_dir, tokenizer):
    (rm,) = resolve_reward_funcs(reward_dir)
    assert isinstance(rm, RewardModel)
    assert rm.__name__ == "tiny-rm" == reward_name(rm)
    assert rm.model.dtype == torch.float32
    assert rm.model.config.num_labels == 1
    reference = build_reward_model(tokenizer)
    expected = [
        manual_score(reference, tokenizer, p + c)
        for p, c in zip(STANDARD_PROMPTS, STANDARD_COMPLETIONS, strict=True)
    ]
    got = rm(prompts=STANDARD_PROMPTS, completions=STANDARD_COMPLETIONS)
    assert all(isinstance(v, float) for v in got)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def test_load_from_path_honours_dtype_and_rejects_other_num_labels(reward_dir):
    rm = load_reward_model(reward_dir, init_kwargs={"dtype": "bfloat16"})
    assert rm.model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_labels=1"):
        load_reward_model(reward_dir, init_kwargs={"num_labels": 3})


def test_pretrained_model_passed_in(tokenizer):
    model = build_reward_model(tokenizer)
    (rm,) = resolve_reward_funcs([model], [tokenizer])
    assert rm.model is model
    assert rm.__name__ == "LlamaForSequenceClassification"  # built from a config: no path
    model.config._name_or_path = "org/my-reward-model"
    assert RewardModel(model, tokenizer).__name__ == "my-reward-model"
    text = STANDARD_PROMPTS[0] + STANDARD_COMPLETIONS[0]
    assert rm([STANDARD_PROMPTS[0]], [STANDARD_COMPLETIONS[0]]) == pytest.approx(
        [manual_score(model, tokenizer, text)], rel=1e-5
    )


def test_pretrained_model_loads_its_tokenizer_from_its_path(reward_dir):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    (rm,) = resolve_reward_funcs([model], None)
    assert rm.tokenizer.chat_template is not None
    assert rm.tokenizer.eos_token == "<|im_end|>"


def test_callables_pass_through_and_their_processing_classes_are_ignored(reward_dir, tokenizer):
    def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    funcs = resolve_reward_funcs([length_reward, reward_dir], [tokenizer, None])
    assert funcs[0] is length_reward
    assert isinstance(funcs[1], RewardModel)
    existing = funcs[1]
    assert resolve_reward_funcs([existing])[0] is existing  # already a reward model: kept


# ---- scoring -------------------------------------------------------------------------------------


def test_conversational_scores_use_the_chat_template(tokenizer):
    model = build_reward_model(tokenizer)
    rm = RewardModel(model, tokenizer)
    got = rm(prompts=CHAT_PROMPTS, completions=CHAT_COMPLETIONS)
    expected = []
    for p, c in zip(CHAT_PROMPTS, CHAT_COMPLETIONS, strict=True):
        text = tokenizer.apply_chat_template(p + c, tokenize=False)
        assert text.endswith(f"<|im_start|>assistant\n{c[0]['content']}<|im_end|>\n")
        assert rm.render(p, c) == text
        expected.append(manual_score(model, tokenizer, text))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("conversational", [False, True])
@pytest.mark.parametrize("config_pad", ["eos", None])
def test_batching_matches_one_at_a_time(tokenizer, conversational, config_pad):
    prompts, completions = (
        (CHAT_PROMPTS, CHAT_COMPLETIONS) if conversational else (STANDARD_PROMPTS, STANDARD_COMPLETIONS)
    )
    prompts, completions = prompts * 2, completions[::-1] * 2  # lengths vary within each batch
    model = build_reward_model(tokenizer, pad_token_id=-1 if config_pad == "eos" else None)
    batched = RewardModel(model, tokenizer, batch_size=3)(prompts, completions)
    single = RewardModel(model, tokenizer, batch_size=1)(prompts, completions)
    assert model.config.pad_token_id == tokenizer.eos_token_id  # set when missing
    lengths = {
        len(tokenizer(t, add_special_tokens=False)["input_ids"])
        for t in _texts(tokenizer, prompts, completions)
    }
    assert len(lengths) > 1  # right padding is exercised
    torch.testing.assert_close(torch.tensor(batched), torch.tensor(single), rtol=1e-5, atol=1e-6)
    assert len(set(round(v, 4) for v in single)) > 1  # the texts get different scores


def _texts(tokenizer, prompts, completions):
    rm = RewardModel(build_reward_model(tokenizer), tokenizer)
    return [rm.render(p, c) for p, c in zip(prompts, completions, strict=True)]


def test_reward_tokenizer_differs_from_the_policy_tokenizer(reward_dir, tokenizer):
    policy_tokenizer = build_tiny_tokenizer()
    policy_tokenizer.padding_side = "left"
    reward_tokenizer = build_tiny_tokenizer()
    reward_tokenizer.chat_template = OTHER_TEMPLATE
    (rm,) = resolve_reward_funcs([reward_dir], [reward_tokenizer])
    assert rm.tokenizer is reward_tokenizer
    text = rm.render(CHAT_PROMPTS[0], CHAT_COMPLETIONS[0])
    assert text == "[user] What is 2 + 3?\n[assistant] <answer>5</answer>\n"
    assert "<|im_start|>" not in text
    expected = manual_score(build_reward_model(tokenizer), reward_tokenizer, text)
    assert rm([CHAT_PROMPTS[0]], [CHAT_COMPLETIONS[0]]) == pytest.approx([expected], rel=1e-5)
    assert policy_tokenizer.chat_template != OTHER_TEMPLATE  # only the reward tokenizer renders


def test_tokenizers_are_not_mutated(tokenizer):
    tok = build_tiny_tokenizer()
    tok.padding_side = "left"
    assert tok.pad_token is None
    rm = RewardModel(build_reward_model(tok), tok, batch_size=4)
    rm(STANDARD_PROMPTS, STANDARD_COMPLETIONS)
    assert tok.pad_token is None
    assert tok.padding_side == "left"


def test_continued_assistant_message_is_rendered_once(tokenizer):
    rm = RewardModel(build_reward_model(tokenizer), tokenizer)
    prompt = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "The answer is"}]
    completion = [{"role": "assistant", "content": "The answer is 5"}]
    text = rm.render(prompt, completion)
    assert text.count("The answer is") == 1
    assert text == tokenizer.apply_chat_template([prompt[0], completion[0]], tokenize=False)


def test_no_gradients_and_eval_mode(tokenizer):
    model = build_reward_model(tokenizer)
    model.train()
    rm = RewardModel(model, tokenizer, batch_size=2)
    model.train()  # as if something switched it back
    seen = []

    def hook(module, args, output):
        seen.append((torch.is_grad_enabled(), module.training))

    handle = model.register_forward_hook(hook)
    try:
        scores = rm(STANDARD_PROMPTS, STANDARD_COMPLETIONS)
    finally:
        handle.remove()
    assert len(scores) == 4
    assert seen == [(False, False), (False, False)]  # two batches, no grad, eval mode
    assert all(p.grad is None for p in model.parameters())


def test_truncation_keeps_the_end_and_warns_once(tokenizer):
    model = build_reward_model(tokenizer)
    rm = RewardModel(model, tokenizer, max_length=5)
    text = STANDARD_PROMPTS[2] + STANDARD_COMPLETIONS[2]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 5
    with pytest.warns(UserWarning, match="max_length=5"):
        got = rm([STANDARD_PROMPTS[2]], [STANDARD_COMPLETIONS[2]])
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids[-5:]])).logits[0, 0].item()
    assert got == pytest.approx([expected], rel=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rm([STANDARD_PROMPTS[2]], [STANDARD_COMPLETIONS[2]])  # warned once only
    right = RewardModel(model, tokenizer, max_length=5, truncation_side="right")
    with pytest.warns(UserWarning):
        got_right = right([STANDARD_PROMPTS[2]], [STANDARD_COMPLETIONS[2]])
    with torch.no_grad():
        expected_right = model(input_ids=torch.tensor([ids[:5]])).logits[0, 0].item()
    assert got_right == pytest.approx([expected_right], rel=1e-5)


def test_default_max_length_is_the_position_limit(tokenizer):
    rm = RewardModel(build_reward_model(tokenizer), tokenizer)
    assert rm.max_length == 256  # the tokenizer has no limit; the config has 256 positions


def test_runs_in_the_reward_runner_with_extra_keyword_arguments(tokenizer):
    model = build_reward_model(tokenizer)
    rm = RewardModel(model, tokenizer)
    kwargs = {
        "prompts": STANDARD_PROMPTS,
        "completions": STANDARD_COMPLETIONS,
        "completion_ids": [[1]] * 4,
        "solution": ["5", "blue", "", "three"],
        "trainer_state": None,
    }
    scores = RewardRunner([rm]).score(4, kwargs)
    assert scores.shape == (4, 1)
    torch.testing.assert_close(scores[:, 0], torch.tensor(rm(**kwargs)), rtol=1e-5, atol=1e-6)
    assert rm([], []) == []


def test_to_moves_the_model(tokenizer):
    rm = RewardModel(build_reward_model(tokenizer), tokenizer)
    assert rm.to("cpu") is rm
    assert rm.device.type == "cpu"


# ---- bad inputs ----------------------------------------------------------------------------------


def test_missing_local_path_names_it(tmp_path):
    missing = os.path.join(str(tmp_path), "no-such-reward-model")
    with pytest.raises(FileNotFoundError, match="no-such-reward-model"):
        resolve_reward_funcs([missing])


def test_classifier_with_two_labels_is_refused(tmp_path, tokenizer):
    model = build_reward_model(tokenizer, num_labels=2)
    with pytest.raises(ValueError, match="num_labels=2.*one number per text"):
        resolve_reward_funcs([model], [tokenizer])
    path = tmp_path / "two-labels"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with pytest.raises(ValueError, match="num_labels=2"):
        resolve_reward_funcs([str(path)])


def test_causal_lm_is_refused_as_a_model_and_warned_about_as_a_checkpoint(tmp_path, tokenizer):
    causal = build_tiny_model(tokenizer)
    with pytest.raises(TypeError, match="sequence classification"):
        resolve_reward_funcs([causal], [tokenizer])
    path = tmp_path / "causal"
    causal.save_pretrained(path)
    tokenizer.save_pretrained(path)
    with pytest.warns(UserWarning, match="newly initialized"):
        (rm,) = resolve_reward_funcs([str(path)])
    assert rm.model.config.num_labels == 1


def test_misaligned_reward_processing_classes(reward_dir, tokenizer):
    def f(completions, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="2 entries but there are 1 reward"):
        resolve_reward_funcs([reward_dir], [tokenizer, tokenizer])
    with pytest.raises(ValueError, match="single reward processing class was given for 2"):
        resolve_reward_funcs([f, reward_dir], tokenizer)
    with pytest.raises(TypeError, match=r"reward_funcs\[1\]"):
        resolve_reward_funcs([f, 3])
    with pytest.raises(TypeError, match="hub id, a local path or a PreTrainedModel"):
        load_reward_model(3)  # type: ignore[arg-type]


def test_conversational_input_without_chat_template(tokenizer):
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    rm = RewardModel(build_reward_model(tokenizer), plain)
    with pytest.raises(ValueError, match="no chat template"):
        rm(CHAT_PROMPTS[:1], CHAT_COMPLETIONS[:1])
    with pytest.raises(TypeError, match="standard format"):
        rm(["text prompt"], CHAT_COMPLETIONS[:1])


def test_model_without_name_needs_a_tokenizer(tokenizer):
    with pytest.raises(ValueError, match="reward_processing_classes"):
        resolve_reward_funcs([build_reward_model(tokenizer)])


def test_bad_arguments(tokenizer):
    model = build_reward_model(tokenizer)
    with pytest.raises(ValueError, match="batch_size"):
        RewardModel(model, tokenizer, batch_size=0)
    with pytest.raises(ValueError, match="truncation_side"):
        RewardModel(model, tokenizer, truncation_side="middle")
    rm = RewardModel(model, tokenizer)
    with pytest.raises(ValueError, match="one prompt per completion"):
        rm(STANDARD_PROMPTS[:2], STANDARD_COMPLETIONS)
    with pytest.raises(ValueError, match="empty text"):
        rm([""], [""])


def test_no_padding_token_anywhere(tokenizer):
    tok = build_tiny_tokenizer()
    tok.eos_token = None
    model = build_reward_model(tokenizer, pad_token_id=None)
    with pytest.raises(ValueError, match="padding token"):
        RewardModel(model, tok)


def test_trainer_scores_with_a_reward_model_by_path(tmp_path, reward_dir, tokenizer):
    """A reward model given by path trains next to a callable; its metrics carry its name."""
    from conftest import build_tiny_model
    from helpers import conversational_dataset, length_reward, make_config

    from posttrain import GRPOTrainer

    trainer = GRPOTrainer(
        model=build_tiny_model(tokenizer),
        reward_funcs=[reward_dir, length_reward],
        args=make_config(tmp_path, max_steps=2),
        train_dataset=conversational_dataset(),
        processing_class=tokenizer,
    )
    name = trainer.rewards.names[0]
    trainer.train()
    log = trainer.state.log_history[0]
    assert f"rewards/{name}/mean" in log and f"rewards/{name}/std" in log
    assert trainer.processing_class.padding_side == "left"  # the policy tokenizer is untouched
