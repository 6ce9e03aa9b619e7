"""SFT of vision-language models: rows with images, tiny models and processors built offline.

The loss must be the cross-entropy of the model's own logits, run on the processor's encoding of
each row with its images, over the completion's tokens (or a conversation's), never over the
prompt or the images' placeholder tokens; the images must count.
"""

from __future__ import annotations

import pytest
import torch
from helpers import CPU_TEST_ARGS
from vision_models import build_qwen2_vl, build_smolvlm, image_prompt, random_image

from posttrain import SFTConfig, SFTTrainer
from posttrain.data import sft_vision

BUILDERS = {"qwen2_vl": build_qwen2_vl, "smolvlm": build_smolvlm}


def _rows(n=4, column="image"):
    """Conversational prompt-completion rows, one image each (sizes differ)."""
    from datasets import Dataset

    sizes = [(40, 50), (28, 28), (56, 42), (30, 60)]
    prompts = [image_prompt(i) for i in range(n)]
    completions = [[{"role": "assistant", "content": f"It is {i + 1}, surely."}] for i in range(n)]
    images = [random_image(i, sizes[i % len(sizes)]) for i in range(n)]
    data = {"prompt": prompts, "completion": completions}
    data[column] = images if column == "image" else [[im] for im in images]
    return Dataset.from_dict(data)


def _messages(n=4):
    from datasets import Dataset

    messages = [
        [
            {"role": "user", "content": f"Describe picture {i}."},
            {"role": "assistant", "content": f"Noise {i}."},
        ]
        for i in range(n)
    ]
    return Dataset.from_dict({"messages": messages, "image": [random_image(i) for i in range(n)]})


def _trainer(tmp_path, family, dataset, **overrides):
    model, processor = BUILDERS[family]()
    values = {"output_dir": str(tmp_path), **CPU_TEST_ARGS, "per_device_train_batch_size": 2, "max_steps": 2,
              "learning_rate": 1e-2, "logging_steps": 1, "max_length": None, "gradient_checkpointing": False}  # fmt: skip
    values.update(overrides)
    return SFTTrainer(
        model=model, args=SFTConfig(**values), train_dataset=dataset, processing_class=processor
    )


def _reference_loss(model, processor, row) -> torch.Tensor:
    """Cross-entropy of the model's full logits on one row encoded by its processor, over the
    completion's tokens (found by rendering the prompt alone), image tokens left out."""
    tok = processor.tokenizer
    prompt = row["prompt"]
    full = tok.apply_chat_template(
        prompt + row["completion"], tokenize=False, chat_template=processor.chat_template
    )
    head = tok.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, chat_template=processor.chat_template
    )
    images = [row["image"]]
    enc = processor(text=[full], images=images, return_tensors="pt")
    start = processor(text=[head], images=images, return_tensors="pt")["input_ids"].shape[1]
    ids = enc["input_ids"]
    assert torch.equal(
        ids[0, :start], processor(text=[head], images=images, return_tensors="pt")["input_ids"][0]
    )
    with torch.no_grad():
        logits = model(**enc).logits[0, :-1].float()
    targets = ids[0, 1:]
    keep = torch.arange(1, ids.shape[1]) >= start
    keep &= targets != tok.convert_tokens_to_ids(processor.image_token)
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return losses[keep].mean()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_loss_is_the_models_cross_entropy_on_the_completion_with_its_image(tmp_path, family):
    trainer = _trainer(tmp_path, family, _rows(2))
    model = trainer.model
    model.eval()
    batch = trainer._prepare_inputs(trainer._collate([trainer.train_dataset[0]]))
    assert batch.vision is not None and batch.vision.has_images
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    expected = _reference_loss(model, trainer.processing_class, trainer.train_dataset[0])
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    # the image counts: the same row with another image gives another loss
    other = dict(trainer.train_dataset[0], image=random_image(99, (56, 56)))
    with torch.no_grad():
        changed = trainer.compute_loss(model, trainer._prepare_inputs(trainer._collate([other])))
    assert abs(changed.item() - loss.item()) > 1e-6


def test_a_left_padded_batch_gives_each_row_its_own_loss(tmp_path):
    """Rows of different lengths and image sizes in one batch: the batch's loss is the mean over
    all their targets, each row's targets scored as if alone."""
    trainer = _trainer(tmp_path, "qwen2_vl", _rows(3))
    model = trainer.model
    model.eval()
    rows = [trainer.train_dataset[i] for i in range(3)]
    with torch.no_grad():
        batch = trainer._prepare_inputs(trainer._collate(rows))
        total = trainer.compute_loss(model, batch) * batch.num_targets
        alone = []
        for r in rows:
            one = trainer._prepare_inputs(trainer._collate([r]))
            alone.append(trainer.compute_loss(model, one) * one.num_targets)
    torch.testing.assert_close(total, sum(alone), rtol=1e-4, atol=1e-4)


def test_targets_are_the_completion_never_the_prompt_or_the_image(tmp_path):
    trainer = _trainer(tmp_path, "qwen2_vl", _rows(1))
    processor = trainer.processing_class
    ids, mask, inputs = sft_vision.encode_row(trainer.train_dataset[0], processor, None, None, "keep_start")
    image_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    assert ids.count(image_id) > 0 and all(m == 0 for t, m in zip(ids, mask, strict=True) if t == image_id)
    completion = processor.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert completion.startswith("It is 1, surely.")
    assert "pixel_values" in inputs and "image_grid_thw" in inputs


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_sft_trains_a_vision_language_model_on_conversations_with_images(tmp_path, family):
    trainer = _trainer(tmp_path, family, _messages(4), max_steps=3)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert "mean_token_accuracy" in trainer.state.log_history[0]


def test_the_images_column_takes_a_list_per_row(tmp_path):
    trainer = _trainer(tmp_path, "qwen2_vl", _rows(2, column="images"), max_steps=1)
    trainer.train()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        ({"packing": True}, ValueError, "packing and padding_free join rows"),
        ({"padding_free": True}, ValueError, "packing and padding_free join rows"),
        ({"eval_packing": True}, ValueError, "packing and padding_free join rows"),
    ],
)
def test_what_rows_with_images_cannot_do_is_refused_before_the_model_loads(
    tmp_path, overrides, error, message
):
    args = SFTConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, **overrides)
    with pytest.raises(error, match=message):
        SFTTrainer(model="never-loaded", args=args, train_dataset=_messages(2))


def test_a_tokenizer_without_an_image_processor_is_refused(tmp_path):
    model, processor = build_qwen2_vl()
    args = SFTConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS)
    with pytest.raises(ValueError, match="tokenizer without an image processor"):
        SFTTrainer(model=model, args=args, train_dataset=_messages(2), processing_class=processor.tokenizer)


def test_skip_prepare_dataset_keeps_the_images(tmp_path):
    """Rows with images are encoded batch by batch anyway: skip_prepare_dataset changes nothing
    for them (the image column is not dropped as an already tokenised dataset's extra column)."""
    plain = _trainer(tmp_path / "a", "qwen2_vl", _rows(2))
    skipped = _trainer(tmp_path / "b", "qwen2_vl", _rows(2), dataset_kwargs={"skip_prepare_dataset": True})
    skipped._set_signature_columns_if_needed()
    assert skipped._vision and "image" in skipped._signature_columns
    row = skipped.train_dataset[0]
    with torch.no_grad():
        a = plain.compute_loss(plain.model.eval(), plain._prepare_inputs(plain._collate([row])))
        b = skipped.compute_loss(skipped.model.eval(), skipped._prepare_inputs(skipped._collate([row])))
    torch.testing.assert_close(a, b)


def test_chat_template_path_reaches_the_processor(tmp_path):
    """A row with images renders with the processor's template: chat_template_path must change it too."""
    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
        "<|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}"
    )
    trainer = _trainer(tmp_path, "qwen2_vl", _rows(1), chat_template_path=str(template))
    assert trainer.processing_class.chat_template == template.read_text()
    ids, _, _ = sft_vision.encode_row(
        trainer.train_dataset[0], trainer.processing_class, None, None, "keep_start"
    )
    assert "assistant: It is 1" in trainer.processing_class.tokenizer.decode(ids)


def test_a_text_only_model_is_refused(tmp_path):
    from conftest import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    args = SFTConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS)
    with pytest.raises(ValueError, match="a text-only model that cannot read them"):
        SFTTrainer(model=build_tiny_model(tok), args=args, train_dataset=_messages(2), processing_class=tok)


def test_a_cut_through_an_image_is_refused(tmp_path):
    trainer = _trainer(tmp_path, "qwen2_vl", _rows(1))
    with pytest.raises(ValueError, match="would cut its image tokens"):
        sft_vision.encode_row(trainer.train_dataset[0], trainer.processing_class, None, 4, "keep_start")


def _marked_template(image_text: str) -> str:
    """ChatML whose image blocks render as ``image_text``, assistant turns in {% generation %} markers."""
    content = (
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}"
        + image_text
        + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
    )
    return (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n{% generation %}"
        + content
        + "<|im_end|>{% endgeneration %}\n{% else %}<|im_start|>{{ m['role'] }}\n"
        + content
        + "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


IMAGE_TEXT = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "smolvlm": "<image>"}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_assistant_only_loss_targets_the_assistant_turns_of_a_conversation_with_images(tmp_path, family):
    """Two turns, an image in each user turn: the targets are the two answers (and their end-of-turn
    tokens), nothing of the user turns, the images or the template around them."""
    from datasets import Dataset

    template = tmp_path / "marked.jinja"
    template.write_text(_marked_template(IMAGE_TEXT[family]))
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A dog, surely."}]},
    ]
    data = Dataset.from_dict(
        {"messages": [messages], "images": [[random_image(0), random_image(1, (28, 56))]]}
    )
    trainer = _trainer(tmp_path, family, data, assistant_only_loss=True, chat_template_path=str(template))
    processor = trainer.processing_class
    ids, mask, inputs = sft_vision.encode_row(
        trainer.train_dataset[0], processor, None, None, "keep_start", assistant_only_loss=True
    )
    full = processor(
        text=[
            processor.tokenizer.apply_chat_template(
                messages, tokenize=False, chat_template=processor.chat_template
            )
        ],
        images=data[0]["images"],
    )["input_ids"][0]
    assert ids == full  # the processor's tokens of the whole conversation
    targets = processor.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert targets == "A cat.<|im_end|>A dog, surely.<|im_end|>"
    trainer.train()  # and it trains on them


def test_assistant_only_loss_with_images_needs_a_marked_processor_template(tmp_path):
    with pytest.raises(ValueError, match="needs the processor's chat template .* to wrap assistant turns"):
        _trainer(tmp_path, "qwen2_vl", _messages(2), assistant_only_loss=True)


def test_assistant_only_loss_on_plain_text_rows_with_images_is_refused(tmp_path):
    from datasets import Dataset

    data = Dataset.from_dict(
        {"prompt": ["<|image_pad|> What?"], "completion": [" A cat."], "image": [random_image(0)]}
    )
    args = SFTConfig(output_dir=str(tmp_path), **CPU_TEST_ARGS, assistant_only_loss=True)
    with pytest.raises(
        ValueError, match="assistant_only_loss=True needs chat messages, but train_dataset has plain"
    ):
        SFTTrainer(model="never-loaded", args=args, train_dataset=data)
