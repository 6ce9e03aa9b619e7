"""Distillation of vision-language models: the student samples from prompts with images, and the
student and the teacher both read the pixels when the loss is computed.

The loss must be the token mean of the divergence between the two models' own logits on the
processor's encoding of each prompt with its images; what images cannot do yet is refused by name
before any model loads.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CPU_TEST_ARGS
from test_divergence import _textbook
from vision_models import build_qwen2_vl, image_dataset

from posttrain import DistillationConfig, DistillationTrainer, GKDConfig, GKDTrainer, SDFTConfig, SDFTTrainer

ARGS = {**CPU_TEST_ARGS, "per_device_train_batch_size": 2, "gradient_checkpointing": False}


def _trainer(
    tmp_path, cls=DistillationTrainer, config=DistillationConfig, teacher=None, data=None, **overrides
):
    student, processor = build_qwen2_vl(seed=0)
    teacher = teacher if teacher is not None else build_qwen2_vl(seed=1)[0]
    budget = {"max_new_tokens": 6} if config is GKDConfig else {"max_completion_length": 6}
    args = config(output_dir=str(tmp_path), **{**ARGS, **budget, **overrides})
    return cls(
        model=student,
        teacher_model=teacher,
        args=args,
        train_dataset=data if data is not None else image_dataset(4),
        processing_class=processor,
    )


def _logits(model, r, images: bool) -> torch.Tensor:
    """[B, T, V] logits of the completion positions, the plain way, with or without the pixels."""
    ids = torch.cat([r.prompt_ids, r.completion_ids], 1)
    mask = torch.cat([r.prompt_mask, r.completion_mask], 1)
    extra = r.vision_kwargs() if images else {}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, **extra).logits
    return logits[:, r.prompt_ids.shape[1] - 1 : -1].double()


@pytest.mark.parametrize(
    ("cls", "config", "overrides", "loss_temperature"),
    [
        (DistillationTrainer, DistillationConfig, {"beta": 1.0, "temperature": 0.7}, 0.7),
        (GKDTrainer, GKDConfig, {"beta": 0.3, "temperature": 0.7, "lmbda": 1.0}, 1.0),
    ],
)
def test_the_loss_is_the_divergence_of_both_models_logits_with_the_images(
    tmp_path, cls, config, overrides, loss_temperature
):
    trainer = _trainer(tmp_path, cls, config, **overrides)
    rows = [trainer.train_dataset[i] for i in range(2)]
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    r = scored.rollout
    assert r.vision is not None and r.vision.has_images
    loss = trainer.compute_loss(trainer.model, scored)
    keep = r.completion_mask.bool()

    def want(images: bool) -> float:
        zs = _logits(trainer.model, r, images)[keep] / loss_temperature
        zt = _logits(trainer.teacher_model, r, images)[keep] / loss_temperature
        return (_textbook(zs, zt, trainer.args.beta).sum() / keep.sum()).item()

    assert loss.item() == pytest.approx(want(images=True), rel=1e-5)
    assert abs(want(images=False) - loss.item()) > 1e-3 * abs(loss.item())  # the pixels count


def test_distillation_trains_the_students_vision_tower(tmp_path):
    trainer = _trainer(tmp_path, learning_rate=5e-3)
    tower = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "visual" in n}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if n in tower and not torch.equal(p, tower[n])]
    assert moved, "the images' gradient must reach the student's vision tower"


def test_what_distillation_with_images_cannot_do_is_refused(tmp_path):
    from conftest import build_tiny_model

    from posttrain.distill.teachers import LocalTeacherServer

    with pytest.raises(
        NotImplementedError, match="a served teacher \\(TeacherServer\\) with images is not built"
    ):
        _trainer(tmp_path, teacher=LocalTeacherServer(build_qwen2_vl(seed=1)[0], 0))
    _, processor = build_qwen2_vl()
    with pytest.raises(ValueError, match="the teacher is a .*, a text-only model that cannot read them"):
        _trainer(tmp_path, teacher=build_tiny_model(processor.tokenizer, seed=1))


@pytest.mark.parametrize("family", ["GOLD", "IWOPD"])
def test_gold_and_iwopd_losses_read_the_images(tmp_path, family):
    """Their losses are not the plain divergence; with the same rollout, its image inputs taken
    away, the loss must change (both models read the pixels)."""
    import dataclasses

    import posttrain

    cls, config = getattr(posttrain, f"{family}Trainer"), getattr(posttrain, f"{family}Config")
    trainer = _trainer(tmp_path, cls, config, **({"lmbda": 1.0} if family == "GOLD" else {}))
    (scored,) = trainer._generate_and_score(
        [trainer.train_dataset[i] for i in range(2)], "train", num_chunks=1
    )
    assert scored.rollout.vision is not None
    with torch.no_grad():
        with_images = trainer.compute_loss(trainer.model, scored).item()
        blind = dataclasses.replace(scored, rollout=dataclasses.replace(scored.rollout, vision=None))
        without = trainer.compute_loss(trainer.model, blind).item()
    assert abs(with_images - without) > 1e-4 * max(abs(with_images), 1e-3)


def _conversations(n=4):
    """``messages`` rows (a question about the row's image, then the assistant's answer) with one image each."""
    from datasets import Dataset
    from vision_models import random_image

    messages = [[{"role": "user", "content": f"What is {i} plus one?"}, {"role": "assistant", "content": f"{i + 1}."}]
                for i in range(n)]  # fmt: skip
    return Dataset.from_dict(
        {"messages": messages, "image": [random_image(i, (28 + 7 * i, 40)) for i in range(n)]}
    )


def test_dataset_completions_with_images_score_as_the_processor_encodes_them(tmp_path):
    """GKD's off-policy steps (lmbda=0) train on the dataset's completions: the rollout holds the
    processor's encoding of each conversation with its image (placeholders expanded, the image
    inputs carried), and the loss is the divergence of both models' logits with the pixels."""
    trainer = _trainer(tmp_path, GKDTrainer, GKDConfig, data=_conversations(), lmbda=0.0, beta=0.5)
    rows = [trainer.train_dataset[i] for i in range(2)]
    (scored,) = trainer._generate_and_score(rows, "train", num_chunks=1)
    assert scored.extra["source"] == "dataset"
    r = scored.rollout
    assert r.vision is not None and r.vision.has_images
    processor = trainer.processing_class
    for i, row in enumerate(rows):
        question = row["prompt"][0]["content"]
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        text = processor.tokenizer.apply_chat_template(
            prompt + row["completion"], tokenize=False, chat_template=processor.chat_template
        )
        expected = processor(text=[text], images=[row["image"]])["input_ids"][0]
        prompt_ids = r.prompt_ids[i][r.prompt_mask[i].bool()].tolist()
        assert prompt_ids + r.completion_ids[i][r.completion_mask[i].bool()].tolist() == expected
    loss = trainer.compute_loss(trainer.model, scored)
    keep = r.completion_mask.bool()
    zs, zt = _logits(trainer.model, r, True)[keep], _logits(trainer.teacher_model, r, True)[keep]
    assert loss.item() == pytest.approx((_textbook(zs, zt, 0.5).sum() / keep.sum()).item(), rel=1e-5)


def test_a_max_length_that_cuts_a_dataset_prompts_images_is_refused(tmp_path):
    trainer = _trainer(tmp_path, GKDTrainer, GKDConfig, data=_conversations(), lmbda=0.0, max_length=12)
    with pytest.raises(ValueError, match=r"Row 0 of this batch: its prompt takes \d+ tokens with its images"):
        trainer._generate_and_score([trainer.train_dataset[0]], "train", num_chunks=1)


def test_the_teachers_samples_read_the_images(tmp_path):
    """``seq_kd=True``: the off-policy steps sample with the teacher, which reads each prompt's pixels
    (its vision tower runs when it samples), and the rollout carries the images for the loss."""
    trainer = _trainer(tmp_path, GKDTrainer, GKDConfig, lmbda=0.0, seq_kd=True)
    calls = []
    trainer.teacher_model.model.visual.register_forward_hook(lambda *args: calls.append(1))
    (scored,) = trainer._generate_and_score(
        [trainer.train_dataset[i] for i in range(2)], "train", num_chunks=1
    )
    assert scored.extra["source"] == "teacher" and calls
    assert scored.rollout.vision is not None and scored.rollout.vision.has_images
    trainer.train()


def _with_context(data):
    return data.add_column("privileged_context", [f"The answer is {i + 1}." for i in range(len(data))])


def test_sdft_teacher_reads_its_prompt_with_the_images_and_the_context(tmp_path):
    """SDFT's teacher prompt is the row's prompt (its image placed as the student's) with the
    privileged context filled in: its tokens are the processor's encoding of that prompt with the
    image, and the teacher's divergence reads the pixels."""
    import dataclasses

    model, processor = build_qwen2_vl()
    args = SDFTConfig(output_dir=str(tmp_path), **ARGS, num_generations=2, max_completion_length=6)
    trainer = SDFTTrainer(
        model=model, args=args, train_dataset=_with_context(image_dataset(2)), processing_class=processor
    )
    row = trainer.train_dataset[0]
    (scored,) = trainer._generate_and_score([row, row], "train", num_chunks=1)
    assert scored.teacher_vision is not None and scored.teacher_vision.has_images
    question = row["prompt"][0]["content"][-1]["text"]
    filled = args.teacher_prompt_template.format(prompt=question, privileged_context="The answer is 1.")
    teacher_prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": filled}]}]
    text = processor.tokenizer.apply_chat_template(
        teacher_prompt, tokenize=False, add_generation_prompt=True, chat_template=processor.chat_template
    )
    expected = processor(text=[text], images=[row["image"]])["input_ids"][0]
    assert scored.teacher_prompt_ids[0][scored.teacher_prompt_mask[0].bool()].tolist() == expected
    model.eval()
    with torch.no_grad():
        student, _, _ = trainer._student_side(model, scored, False)
        mask = trainer._loss_mask(scored.rollout).float()
        seeing, _ = trainer._distillation_per_sample(student, scored, mask)
        blind, _ = trainer._distillation_per_sample(
            student, dataclasses.replace(scored, teacher_vision=None), mask
        )
    assert (seeing - blind).abs().max() > 1e-6


def test_sdpo_trains_with_images_its_reprompts_reading_them(tmp_path):
    from posttrain import SDPOConfig, SDPOTrainer

    def first_succeeds(completion_ids, **kwargs):  # each group's first sample: the others reprompt with it
        return [float(i % 4 == 0) for i in range(len(completion_ids))]

    model, processor = build_qwen2_vl()
    args = SDPOConfig(output_dir=str(tmp_path), **{**ARGS, "per_device_train_batch_size": 4}, num_generations=4,
                      max_completion_length=6)  # fmt: skip
    trainer = SDPOTrainer(
        model=model,
        reward_funcs=first_succeeds,
        args=args,
        train_dataset=image_dataset(4),
        processing_class=processor,
    )
    (scored,) = trainer._generate_and_score([trainer.train_dataset[0]] * 4, "train", num_chunks=1)
    assert scored.teacher_rows is not None and scored.teacher_rows.sum() == 3
    assert scored.teacher_vision is not None and scored.teacher_vision.has_images
    trainer.train()
