"""DPO and KTO of vision-language models: preference pairs and labelled examples whose prompts hold images.

A completion's log-prob must be the model's own, run on the processor's encoding of the prompt
with its images and the completion, summed over the completion's tokens (a KTO KL pair: the
prompt, its images and another row's completion); the images must count; a row's tokens must be
what the processor gives for prompt + completion, for every family.
"""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from helpers import CPU_TEST_ARGS
from vision_models import (
    build_gemma3,
    build_llava_next,
    build_qwen2_vl,
    build_qwen3_vl,
    build_smolvlm,
    image_prompt,
    random_image,
)

from posttrain import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer
from posttrain.data import preference_vision

BUILDERS = {"qwen2_vl": build_qwen2_vl, "smolvlm": build_smolvlm}
SIZES = [(40, 50), (28, 28), (56, 42), (30, 60)]


def _pairs(n=4, column="image"):
    """Conversational pairs, one image each (sizes differ), a short chosen and a longer rejected answer."""
    images = [random_image(i, SIZES[i % len(SIZES)]) for i in range(n)]
    data = {
        "prompt": [image_prompt(i) for i in range(n)],
        "chosen": [[{"role": "assistant", "content": f"It is {i + 1}."}] for i in range(n)],
        "rejected": [[{"role": "assistant", "content": f"I cannot tell, sorry {i}."}] for i in range(n)],
    }
    data[column] = images if column == "image" else [[im] for im in images]
    return Dataset.from_dict(data)


def _config(tmp_path, **overrides):
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "per_device_train_batch_size": 2,
              "max_length": None, "gradient_checkpointing": False}  # fmt: skip
    values.update(overrides)
    return DPOConfig(**values)


def _trainer(tmp_path, family, dataset, **overrides):
    model, processor = BUILDERS[family]()
    return DPOTrainer(
        model=model, args=_config(tmp_path, **overrides), train_dataset=dataset, processing_class=processor
    )


def _side_logp(model, processor, row, side) -> tuple[torch.Tensor, list[int]]:
    """The model's summed log-prob of one side's completion, on the processor's encoding of the whole
    side with its image (the completion's tokens found by rendering the prompt alone)."""
    template = processor.chat_template
    tok = processor.tokenizer
    prompt = row["prompt"]
    full = tok.apply_chat_template(prompt + row[side], tokenize=False, chat_template=template)
    head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, chat_template=template)
    images = [row["image"]]
    enc = processor(text=[full], images=images, return_tensors="pt")
    start = processor(text=[head], images=images, return_tensors="pt")["input_ids"].shape[1]
    ids = enc["input_ids"]
    with torch.no_grad():
        logps = torch.log_softmax(model(**enc).logits[0, :-1].float(), dim=-1)
    token_logps = logps.gather(1, ids[0, 1:, None])[:, 0]
    return token_logps[start - 1 :].sum(), ids[0].tolist()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_each_sides_log_prob_is_the_models_with_its_prompts_image(tmp_path, family):
    trainer = _trainer(tmp_path, family, _pairs(2))
    model, processor = trainer.model, trainer.processing_class
    model.eval()
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer._prepare_inputs(trainer._collate(rows))
    assert batch.vision is not None and batch.vision.has_images
    with torch.no_grad():
        logps = trainer._score_pairs(model, batch, with_metrics=False).logps
    for i, row in enumerate(rows):
        for k, side in enumerate(("chosen", "rejected")):
            expected, _ = _side_logp(model, processor, row, side)
            torch.testing.assert_close(logps[k * 2 + i], expected, rtol=0, atol=2e-5)
    # the image counts: the same pair with another image scores otherwise
    other = dict(rows[0], image=random_image(99, (56, 56)))
    with torch.no_grad():
        changed = trainer._score_pairs(
            model, trainer._prepare_inputs(trainer._collate([other])), with_metrics=False
        )
    assert abs(changed.logps[0].item() - logps[0].item()) > 1e-4


@pytest.mark.parametrize(
    "build", [build_qwen2_vl, build_qwen3_vl, build_smolvlm, build_gemma3, build_llava_next],
    ids=["qwen2_vl", "qwen3_vl", "smolvlm", "gemma3", "llava_next"],
)  # fmt: skip
def test_a_pairs_tokens_are_the_processors_for_prompt_and_completion(build):
    """One processor call per row (its prompt), the completions split off the text: the tokens of
    each side must still be what the processor gives for the whole side."""
    _, processor = build()
    row = _pairs(1)[0]
    pair, inputs = preference_vision.encode_pair(row, processor, max_length=None)
    assert inputs  # the image's tensors
    for side in ("chosen", "rejected"):
        full = processor.tokenizer.apply_chat_template(
            row["prompt"] + row[side], tokenize=False, chat_template=processor.chat_template
        )
        expected = processor(text=[full], images=[row["image"]], return_tensors="pt")["input_ids"][0].tolist()
        assert pair["prompt_ids"] + pair[f"{side}_ids"] == expected


def test_plain_text_prompts_write_the_image_token_and_images_take_a_list(tmp_path):
    model, processor = build_qwen2_vl()
    token = processor.image_token
    images = [[random_image(i), random_image(10 + i, (28, 56))] for i in range(2)]
    data = Dataset.from_dict({
        "prompt": [f"Compare <|vision_start|>{token}<|vision_end|> and <|vision_start|>{token}<|vision_end|> {i}:"
                   for i in range(2)],
        "chosen": [" same.", " different."], "rejected": [" a cat.", " blue sky."], "images": images,
    })  # fmt: skip
    trainer = DPOTrainer(model=model, args=_config(tmp_path), train_dataset=data, processing_class=processor)
    pair, inputs = preference_vision.encode_pair(trainer.train_dataset[0], processor, max_length=None)
    assert inputs["image_grid_thw"].shape[0] == 2  # both images read
    full = processor(text=[data[0]["prompt"] + " same." + processor.tokenizer.eos_token], images=images[0])
    assert pair["prompt_ids"] + pair["chosen_ids"] == full["input_ids"][0]
    trainer.train()
    assert trainer.state.log_history[-2]["rewards/margins"] > 0


def test_dpo_trains_a_vision_language_model_and_moves_its_vision_tower(tmp_path):
    trainer = _trainer(tmp_path, "qwen2_vl", _pairs(4, column="images"), max_steps=3, learning_rate=5e-3)
    tower = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/margins" in h]
    assert logs[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference
    assert logs[-1]["rewards/margins"] > logs[0]["rewards/margins"] and logs[-1]["rewards/accuracies"] > 0.5
    moved = [n for n, p in trainer.model.named_parameters() if n in tower and not torch.equal(p, tower[n])]
    assert moved, "the images' gradient must reach the vision tower"


def test_precomputed_reference_log_probs_equal_the_live_reference(tmp_path):
    live = _trainer(tmp_path / "live", "qwen2_vl", _pairs(2))
    pre = _trainer(tmp_path / "pre", "qwen2_vl", _pairs(2), precompute_ref_log_probs=True)
    assert pre.ref_model is None and "image" in pre.train_dataset.column_names
    rows = [pre.train_dataset[i] for i in range(2)]
    batch = live._prepare_inputs(live._collate(rows))
    expected = live._reference_scores(batch)
    got = torch.tensor([r["ref_chosen_logps"] for r in rows] + [r["ref_rejected_logps"] for r in rows])
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-4)


def test_max_length_cuts_the_completions_never_the_prompt_and_refuses_a_prompt_that_fills_it():
    _, processor = build_qwen2_vl()
    row = _pairs(1)[0]
    whole, _ = preference_vision.encode_pair(row, processor, max_length=None)
    limit = len(whole["prompt_ids"]) + 2
    cut, _ = preference_vision.encode_pair(row, processor, max_length=limit)
    assert cut["prompt_ids"] == whole["prompt_ids"]
    assert cut["chosen_ids"] == whole["chosen_ids"][:2] and cut["rejected_ids"] == whole["rejected_ids"][:2]
    with pytest.raises(
        ValueError, match=r"Row 3: its prompt takes \d+ tokens with its images, so max_length="
    ):
        preference_vision.encode_pair(row, processor, max_length=len(whole["prompt_ids"]), index=3)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"max_length": 64, "truncation_mode": "keep_end"},
            "truncation_mode='keep_end' cuts the start of the prompt",
        ),
        ({"padding_free": True}, "padding_free joins a batch's sequences into one row"),
    ],
)
def test_what_pairs_with_images_cannot_do_is_refused_before_the_model_loads(tmp_path, overrides, message):
    _, processor = build_qwen2_vl()
    with pytest.raises(ValueError, match=message):
        DPOTrainer(
            model="no/such-model", args=_config(tmp_path, **overrides), train_dataset=_pairs(2),
            processing_class=processor,
        )  # fmt: skip


def test_a_text_only_model_or_a_plain_tokenizer_is_refused(tmp_path):
    from conftest import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match="a text-only model that cannot read"):
        DPOTrainer(
            model=build_tiny_model(tok), args=_config(tmp_path), train_dataset=_pairs(2), processing_class=tok
        )
    model, processor = build_qwen2_vl()
    with pytest.raises(ValueError, match="processing_class is a tokenizer without an image processor"):
        DPOTrainer(
            model=model, args=_config(tmp_path), train_dataset=_pairs(2), processing_class=processor.tokenizer
        )


def test_images_that_do_not_match_the_placeholders_are_refused_naming_the_row():
    _, processor = build_qwen2_vl()
    row = dict(_pairs(1)[0])
    row["prompt"] = image_prompt(0, images=2)
    with pytest.raises(ValueError, match=r"Row 5 of the dataset has 1 image\(s\) but its prompt has 2"):
        preference_vision.encode_pair(row, processor, max_length=None, index=5)


# ---- KTO ----------------------------------------------------------------------------------------


def _examples(n=4, labels=(True, False, True, False)):
    images = [random_image(i, SIZES[i % len(SIZES)]) for i in range(n)]
    return Dataset.from_dict({
        "prompt": [image_prompt(i) for i in range(n)],
        "completion": [[{"role": "assistant", "content": f"It is {i + 1}{'.' * (i + 1)}"}] for i in range(n)],
        "label": list(labels[:n]), "image": images,
    })  # fmt: skip


def _kto(tmp_path, dataset, family="qwen2_vl", **overrides):
    model, processor = BUILDERS[family]()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "per_device_train_batch_size": 4, "max_length": None,
              "gradient_checkpointing": False, **overrides}  # fmt: skip
    return KTOTrainer(
        model=model, args=KTOConfig(**values), train_dataset=dataset, processing_class=processor
    )


def _completion_logp(model, processor, prompt, image, completion_ids) -> torch.Tensor:
    """The model's summed log-prob of ``completion_ids`` after the processor's encoding of the prompt with its image."""
    head = processor.tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, chat_template=processor.chat_template
    )
    enc = processor(text=[head], images=[image], return_tensors="pt")
    start = enc["input_ids"].shape[1]
    ids = torch.cat([enc["input_ids"], torch.tensor([completion_ids])], dim=1)
    extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
    if "mm_token_type_ids" in extra:
        extra["mm_token_type_ids"] = torch.nn.functional.pad(
            extra["mm_token_type_ids"], (0, len(completion_ids))
        )
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0, :-1].float()
    token_logps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return token_logps[start - 1 :].sum()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_kto_examples_and_kl_pairs_score_as_the_model_with_the_prompts_image(tmp_path, family):
    trainer = _kto(tmp_path, _examples(4), family)
    model, processor = trainer.model, trainer.processing_class
    model.eval()
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer._prepare_inputs(trainer._collate(rows))
    assert batch.examples.vision is not None and batch.kl is not None
    with torch.no_grad():
        logps = trainer._score(model, batch.stacked(), train=False).logps
    completions = [
        preference_vision.encode_example(r, processor, max_length=None)[0]["completion_ids"] for r in rows
    ]
    for i, row in enumerate(rows):
        own = _completion_logp(model, processor, row["prompt"], row["image"], completions[i])
        kl = _completion_logp(model, processor, row["prompt"], row["image"], completions[i - 1])
        torch.testing.assert_close(logps[i], own, rtol=0, atol=2e-5)
        torch.testing.assert_close(logps[4 + i], kl, rtol=0, atol=2e-5)  # 2e-4 with misplaced token types


@pytest.mark.filterwarnings("ignore:The training set holds only desirable examples")
def test_kto_trains_on_examples_with_images_and_moves_the_vision_tower(tmp_path):
    # every example desirable: their rewards rise, and with them the mismatched pairs' (kl > 0)
    trainer = _kto(tmp_path, _examples(4, labels=(True,) * 4), max_steps=3, learning_rate=5e-3)
    tower = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert logs[0]["loss"] == pytest.approx(0.5, abs=1e-4)  # the policy starts as its reference
    assert logs[-1]["rewards/chosen"] > 0 and logs[-1]["kl"] > 0
    moved = [n for n, p in trainer.model.named_parameters() if n in tower and not torch.equal(p, tower[n])]
    assert moved, "the images' gradient must reach the vision tower"


def test_kto_pairs_with_images_become_examples_that_keep_them(tmp_path):
    trainer = _kto(tmp_path, _pairs(2, column="images"))
    data = trainer.train_dataset
    assert data["label"] == [True, True, False, False]
    assert [len(images) for images in data["images"]] == [1, 1, 1, 1]
    assert (
        data[0]["images"][0].tobytes() == data[2]["images"][0].tobytes()
    )  # a pair's two examples, one image
    trainer.train()


def test_kto_precomputed_reference_equals_the_live_reference_with_images(tmp_path):
    live = _kto(tmp_path / "live", _examples(4), train_sampling_strategy="sequential")
    pre = _kto(tmp_path / "pre", _examples(4), precompute_ref_log_probs=True)
    rows = [pre.train_dataset[i] for i in range(4)]
    assert "image" in pre.train_dataset.column_names
    batch = live._prepare_inputs(live._collate([live.train_dataset[i] for i in range(4)]))
    expected = live._reference_scores(batch.stacked())
    got = torch.tensor([r["ref_logps"] for r in rows] + [r["ref_kl_logps"] for r in rows])
    torch.testing.assert_close(got, expected.float(), rtol=1e-5, atol=1e-4)


# ---- online DPO ---------------------------------------------------------------------------------


def _online_dpo(tmp_path, **overrides):
    from posttrain import OnlineDPOConfig, OnlineDPOTrainer

    model, processor = build_qwen2_vl()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "per_device_train_batch_size": 2, "max_new_tokens": 6,
              "gradient_checkpointing": False, **overrides}  # fmt: skip
    data = Dataset.from_dict({"prompt": [image_prompt(i) for i in range(4)],
                              "image": [random_image(i, SIZES[i]) for i in range(4)]})  # fmt: skip

    def reward(completion_ids, **kwargs):
        return [float(sum(ids) % 7) for ids in completion_ids]

    return OnlineDPOTrainer(
        model=model, reward_funcs=reward, args=OnlineDPOConfig(**values), train_dataset=data,
        processing_class=processor,
    )  # fmt: skip


def test_online_dpo_loss_is_the_formula_on_the_models_log_probs_with_the_images(tmp_path):
    import math

    trainer = _online_dpo(tmp_path)
    rows = [trainer.train_dataset[i] for i in range(2) for _ in range(2)]
    (chunk,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    r = chunk.rollout
    assert r.vision is not None and r.vision.has_images
    assert trainer.compute_loss(trainer.model, chunk).item() == pytest.approx(math.log(2), rel=1e-5)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    loss = trainer.compute_loss(trainer.model, chunk)

    def pair_loss(images: bool) -> float:
        extra = r.vision_kwargs() if images else {}  # without: the placeholders read as text
        ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
        with torch.no_grad():
            out = trainer.model(
                input_ids=ids, attention_mask=torch.cat([r.prompt_mask, r.completion_mask], 1), **extra
            )
        logits = out.logits[:, r.prompt_ids.shape[1] - 1 : -1].double()
        token = torch.log_softmax(logits, -1).gather(2, r.completion_ids.unsqueeze(2)).squeeze(2)
        u = ((token - chunk.ref_logps.double()) * r.completion_mask.double()).sum(1).view(2, 2)
        first = chunk.advantages.view(2, 2)[:, 0] > 0
        z = torch.where(first, u[:, 0] - u[:, 1], u[:, 1] - u[:, 0])
        return (-torch.nn.functional.logsigmoid(0.1 * z).mean()).item()

    assert loss.item() == pytest.approx(pair_loss(images=True), rel=1e-4)
    assert abs(pair_loss(images=False) - loss.item()) > 1e-3  # the images count


def test_online_dpo_trains_a_vision_language_model_and_moves_its_vision_tower(tmp_path):
    trainer = _online_dpo(tmp_path, learning_rate=5e-3)
    tower = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    assert [h for h in trainer.state.log_history if "rewards/margins" in h]
    moved = [n for n, p in trainer.model.named_parameters() if n in tower and not torch.equal(p, tower[n])]
    assert moved, "the images' gradient must reach the vision tower"


def test_online_dpo_refuses_a_max_length_that_cuts_the_prompts_images(tmp_path):
    trainer = _online_dpo(tmp_path, max_length=12)
    rows = [trainer.train_dataset[0]] * 2
    with pytest.raises(
        ValueError, match=r"max_length=12 leaves room for \d+ prompt tokens .* would remove image tokens"
    ):
        trainer._generate_and_score(rows, "train", num_chunks=1)
