"""Vision-language GRPO: prompts with images, tiny models and processors built offline (no downloads)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from helpers import ScriptedGenerator, make_config
from vision_models import (
    build_gemma3,
    build_llava_next,
    build_qwen2_vl,
    build_qwen3_vl,
    build_smolvlm,
    image_dataset,
    image_prompt,
    logps_with_and_without_images,
    random_image,
)

from posttrain import GRPOTrainer
from posttrain.core.batch import Rollout, VisionInputs
from posttrain.data import vision
from posttrain.ops.logprobs import completion_logps
from posttrain.ops.padding import left_pad
from posttrain.sampling.rollout import ScoredRollout


def even_token_reward(completion_ids, **kwargs):
    """How many completion tokens have an even id (varies between samples, unlike their count)."""
    return [float(sum(1 for t in ids if t % 2 == 0)) for ids in completion_ids]


def _vision_args(tmp_path, **overrides):
    values = {"max_steps": 2, "per_device_train_batch_size": 4, "num_generations": 4, "logging_steps": 1}
    return make_config(tmp_path, **{**values, **overrides})


def _encoded_rows(processor, prompts, images):
    """Left-padded prompt ids and mask, and the rows' image inputs, as the sampler encodes them."""
    ids, inputs = vision.encode_with_images(processor, processor.tokenizer, prompts, images)
    prompt_ids, prompt_mask = left_pad(ids, processor.tokenizer.pad_token_id)
    return prompt_ids, prompt_mask, inputs


def _rollout(processor, n=3, width=5, seed=0, images_per_row=lambda i: 1):
    """A rollout of ``n`` rows with images of different sizes and completions of different lengths."""
    sizes = [(40, 50), (28, 28), (56, 42), (30, 60)]
    prompts = [image_prompt(i, images_per_row(i)) for i in range(n)]
    images = [
        [random_image(10 * i + k, sizes[(i + k) % len(sizes)]) for k in range(images_per_row(i))]
        for i in range(n)
    ]
    prompt_ids, prompt_mask, inputs = _encoded_rows(processor, prompts, images)
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(10, 300, (n, width), generator=g)
    completion_mask = torch.ones(n, width, dtype=torch.long)
    for i in range(n):
        completion_mask[i, width - i :] = 0 if i else 1
    return Rollout(
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
        torch.zeros(n, dtype=torch.bool),
        vision=inputs,
    )


def _full_logits_logps(model, r: Rollout) -> torch.Tensor:
    """Completion log-probs from a plain forward with the processor's inputs and ``.logits``: [N, T]."""
    T = r.completion_ids.shape[1]
    kwargs = r.vision.model_kwargs(r.prompt_ids.shape[1], T, "cpu")
    logits = model(
        input_ids=torch.cat([r.prompt_ids, r.completion_ids], 1),
        attention_mask=torch.cat([r.prompt_mask, r.completion_mask], 1),
        **kwargs,
    ).logits[:, -T - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, r.completion_ids.unsqueeze(-1)).squeeze(-1)


# ---- Qwen2-VL ----------------------------------------------------------------------------------


def test_qwen2_vl_processor_expands_one_image_into_its_pad_tokens():
    _, processor = build_qwen2_vl()
    tok = processor.tokenizer
    image = random_image(0, (40, 50))
    ids, inputs = vision.encode_with_images(processor, tok, [image_prompt(3)], [[image]])
    grid = inputs.rows[0]["image_grid_thw"]  # [1, 3]: t, h, w patches
    assert grid.shape == (1, 3)
    pads = ids[0].count(tok.convert_tokens_to_ids("<|image_pad|>"))
    assert pads == int(grid.prod()) // 4 > 0  # patches merged 2 x 2
    assert inputs.rows[0]["pixel_values"].shape[0] == int(grid.prod())
    assert inputs.rows[0]["mm_token_type_ids"].shape == (len(ids[0]),)
    assert int(inputs.rows[0]["mm_token_type_ids"].sum()) == pads
    text = tok.decode(ids[0])
    assert text.startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")
    assert text.endswith("What is 3 plus one?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen2_vl_trains_two_steps_and_moves_the_vision_tower(tmp_path):
    model, processor = build_qwen2_vl()
    visual = [p.detach().clone() for p in model.model.visual.parameters()]
    language = [p.detach().clone() for p in model.model.language_model.parameters()]
    seen = {}

    def reward(completion_ids, image, prompts, **kwargs):
        seen["images"] = image
        return even_token_reward(completion_ids)

    args = _vision_args(tmp_path, beta=0.1, num_iterations=2)  # old and reference log-probs with images too
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=image_dataset(4),
        processing_class=processor,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 2
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert (
        logs[0]["reward_std"] > 0 and logs[1]["kl"] > 0
    )  # the second step reuses the batch (num_iterations)
    assert any(
        not torch.equal(a, b) for a, b in zip(language, model.model.language_model.parameters(), strict=True)
    )
    assert any(not torch.equal(a, b) for a, b in zip(visual, model.model.visual.parameters(), strict=True))
    assert len(seen["images"]) == 4 and all(img.size == (50, 40) for img in seen["images"])


def test_qwen2_vl_rows_with_several_images_of_different_sizes_train(tmp_path):
    model, processor = build_qwen2_vl()
    dataset = image_dataset(4, column="images", images_per_row=2)
    args = _vision_args(tmp_path, max_steps=1, steps_per_generation=2, gradient_accumulation_steps=2,
                        per_device_train_batch_size=2)  # fmt: skip
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=args,
        train_dataset=dataset,
        processing_class=processor,
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert math.isfinite(log["loss"])


def test_qwen2_vl_chunked_completion_logps_equal_a_plain_forward_with_pixel_values():
    model, processor = build_qwen2_vl()
    model.eval()
    r = _rollout(processor, n=3)
    with torch.no_grad():
        expected = _full_logits_logps(model, r)
        chunked = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            model_inputs=r.vision_kwargs(),
        ).logps
        naive = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask,
            chunk_size=None, model_inputs=r.vision_kwargs(),
        ).logps  # fmt: skip
        without_images = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask
        ).logps
    mask = r.completion_mask.bool()
    torch.testing.assert_close(chunked[mask], expected[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without_images[mask], expected[mask], atol=1e-4)  # the images count


def test_qwen2_vl_micro_batches_keep_their_rows_images():
    model, processor = build_qwen2_vl()
    model.eval()
    r = _rollout(processor, n=4)
    scored = ScoredRollout(rollout=r, rewards=torch.zeros(4, 1), advantages=torch.arange(4.0))
    halves = scored.split(2)
    for k, half in enumerate(halves):
        for j, row in enumerate(half.rollout.vision.rows):
            original = r.vision.rows[2 * k + j]
            assert row.keys() == original.keys()
            assert all(torch.equal(row[name], original[name]) for name in row)
    kwargs = halves[1].rollout.vision_kwargs()
    grids = torch.cat([r.vision.rows[i]["image_grid_thw"] for i in (2, 3)])
    assert torch.equal(kwargs["image_grid_thw"], grids)
    assert kwargs["pixel_values"].shape[0] == int(grids.prod(dim=1).sum())
    with torch.no_grad():
        whole = _full_logits_logps(model, r)
        for k, half in enumerate(halves):
            h = half.rollout
            part = completion_logps(
                model, h.prompt_ids, h.prompt_mask, h.completion_ids, h.completion_mask,
                model_inputs=h.vision_kwargs(),
            ).logps  # fmt: skip
            mask = h.completion_mask.bool()
            torch.testing.assert_close(
                part[mask], whole[2 * k : 2 * k + 2, : mask.shape[1]][mask], rtol=1e-5, atol=1e-5
            )


# ---- the completions log with images (log_multimodal) ------------------------------------------


@pytest.mark.parametrize("log_multimodal", [True, False])
def test_completions_log_saves_the_prompt_images_with_log_multimodal(tmp_path, log_multimodal):
    import json

    import numpy as np
    from PIL import Image

    model, processor = build_qwen2_vl()
    args = _vision_args(tmp_path, max_steps=1, log_completions=True, log_multimodal=log_multimodal)
    trainer = GRPOTrainer(
        model=model, reward_funcs=even_token_reward, args=args, train_dataset=image_dataset(4),
        processing_class=processor,
    )  # fmt: skip
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 4  # one prompt, 4 completions
    blocks = [row["prompt"][0]["content"][0] for row in rows]
    folder = tmp_path / "completion_images"
    if not log_multimodal:
        assert all(b["type"] == "image" and b.get("image") is None for b in blocks) and not folder.exists()
        return
    (path,) = {b["image"] for b in blocks}  # the prompt's one image, written once
    assert [f.name for f in folder.iterdir()] == [path.split("/")[1]]
    shown = np.asarray(Image.open(tmp_path / path))
    assert any(np.array_equal(shown, np.asarray(random_image(i))) for i in range(4))  # the row's own image


# ---- bad inputs --------------------------------------------------------------------------------


def test_an_image_column_with_a_text_only_model_is_refused_before_training(tmp_path):
    tok = build_tiny_tokenizer()
    with pytest.raises(ValueError, match=r"train_dataset has an 'image' column.*LlamaForCausalLM.*text-only"):
        GRPOTrainer(
            model=build_tiny_model(tok),
            reward_funcs=even_token_reward,
            args=_vision_args(tmp_path),
            train_dataset=image_dataset(4),
            processing_class=tok,
        )


def test_a_vision_model_with_a_plain_tokenizer_is_refused(tmp_path):
    model, processor = build_qwen2_vl()
    with pytest.raises(
        ValueError, match=r"'image' column.*without an image processor.*Qwen2VLForConditionalGeneration"
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=even_token_reward,
            args=_vision_args(tmp_path),
            train_dataset=image_dataset(4),
            processing_class=processor.tokenizer,
        )


def test_images_that_do_not_match_the_placeholders_are_refused_naming_the_row(tmp_path):
    from datasets import Dataset

    model, processor = build_qwen2_vl()
    prompts = [image_prompt(i, images=2 if i == 0 else 1) for i in range(4)]
    dataset = Dataset.from_dict({"prompt": prompts, "image": [random_image(i) for i in range(4)]})
    with pytest.raises(
        ValueError, match=r"Row 0 of train_dataset of the dataset has 1 image\(s\) but its prompt has 2"
    ):
        GRPOTrainer(
            model=model, reward_funcs=even_token_reward, args=_vision_args(tmp_path), train_dataset=dataset,
            processing_class=processor,
        )  # fmt: skip


def test_a_mismatch_in_a_later_row_is_refused_when_its_batch_is_sampled(tmp_path):
    _, processor = build_qwen2_vl()
    prompts = [image_prompt(0), [{"role": "user", "content": "no image here"}]]
    images = [[random_image(0)], [random_image(1)]]
    with pytest.raises(
        ValueError, match=r"Row 1 of this batch of the dataset has 1 image\(s\) but its prompt has 0"
    ):
        vision.encode_with_images(processor, processor.tokenizer, prompts, images)


def test_a_vision_model_loads_by_path(tmp_path):
    from posttrain.models import loading

    model, _ = build_qwen2_vl()
    model.save_pretrained(tmp_path / "qwen2-vl")
    loaded = loading.load_policy(str(tmp_path / "qwen2-vl"), None, False)
    assert type(loaded).__name__ == "Qwen2VLForConditionalGeneration"
    assert loading.is_vision_model(loaded) and not loading.is_vision_model(
        build_tiny_model(build_tiny_tokenizer())
    )


# ---- Qwen2.5-VL --------------------------------------------------------------------------------


def test_qwen2_5_vl_logps_match_a_plain_forward_and_it_trains(tmp_path):
    model, processor = build_qwen2_vl(family="qwen2_5_vl")
    model.eval()
    r = _rollout(processor, n=2)
    with torch.no_grad():
        expected = _full_logits_logps(model, r)
        chunked = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            model_inputs=r.vision_kwargs(),
        ).logps
    mask = r.completion_mask.bool()
    torch.testing.assert_close(chunked[mask], expected[mask], rtol=1e-5, atol=1e-5)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path, max_steps=1),
        train_dataset=image_dataset(4),
        processing_class=processor,
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert math.isfinite(log["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ---- SmolVLM2 (Idefics3-style: [rows, images, C, H, W] pixel values with a pixel mask) ----------


def test_smolvlm_rows_with_different_image_counts_score_as_a_plain_forward():
    model, processor = build_smolvlm()
    model.eval()
    r = _rollout(processor, n=3, images_per_row=lambda i: 1 + i % 2)
    kwargs = r.vision_kwargs()
    assert kwargs["pixel_values"].shape[:2] == (3, 2)  # one row of images per row, padded with zero images
    assert not kwargs["pixel_values"][0, 1].any() and not kwargs["pixel_attention_mask"][0, 1].any()
    with torch.no_grad():
        expected = _full_logits_logps(model, r)
        chunked = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, model_inputs=kwargs
        ).logps
        without_images = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask
        ).logps
    mask = r.completion_mask.bool()
    torch.testing.assert_close(chunked[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without_images[mask], expected[mask], atol=1e-4)


def test_smolvlm_trains_and_moves_the_connector(tmp_path):
    model, processor = build_smolvlm()
    connector = [p.detach().clone() for p in model.model.connector.parameters()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path),
        train_dataset=image_dataset(4, column="images", images_per_row=2),
        processing_class=processor,
    )
    image_token = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert trainer.generator.config.suppress_tokens == [
        image_token
    ]  # a sampled placeholder would want an image
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert any(
        not torch.equal(a, b) for a, b in zip(connector, model.model.connector.parameters(), strict=True)
    )


# ---- Gemma 3 (token_type_ids, pooled soft tokens), LLaVA-NeXT (any-resolution crops) and Qwen3-VL
# (interleaved 3-D rotary positions, DeepStack features) --------------------------------------------


@pytest.mark.parametrize(
    "build", [build_gemma3, build_llava_next, build_qwen3_vl], ids=["gemma3", "llava_next", "qwen3_vl"]
)
def test_family_scores_as_a_plain_forward_and_trains(tmp_path, build):
    model, processor = build()
    model.eval()
    r = _rollout(processor, n=3, images_per_row=lambda i: 1 + i % 2)
    with torch.no_grad():
        expected = _full_logits_logps(model, r)
    ours, without_images = logps_with_and_without_images(model, r)
    mask = r.completion_mask.bool()
    torch.testing.assert_close(ours[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(without_images[mask], expected[mask], atol=1e-4)
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path),
        train_dataset=image_dataset(4),
        processing_class=processor,
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_place_images_puts_one_block_per_image_at_the_start_of_the_first_user_message():
    a, b = random_image(0), random_image(1)
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Compare them."},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Now?"},
    ]
    placed = vision.place_images(prompt, [a, b])
    assert placed[0] == prompt[0] and placed[2:] == prompt[2:]
    assert placed[1]["content"] == [
        {"type": "image"},
        {"type": "image"},
        {"type": "text", "text": "Compare them."},
    ]
    assert prompt[1]["content"] == "Compare them."  # the row is not changed
    assert vision.place_images(image_prompt(0), [a]) == image_prompt(0)  # blocks say where images go
    assert vision.place_images("What is this?", [a]) == "What is this?"  # text writes the image token
    assert vision.place_images(prompt, []) == prompt


@pytest.mark.parametrize(
    "build",
    [build_gemma3, build_llava_next, build_qwen2_vl, build_smolvlm, build_qwen3_vl],
    ids=["gemma3", "llava_next", "qwen2_vl", "smolvlm", "qwen3_vl"],
)
def test_a_dataset_without_image_blocks_trains_as_with_them(tmp_path, build):
    """The spec's dataset format (a prompt and an image column, no blocks): the image goes at the start
    of the first user message, as in the reference, and the prompt encodes as the explicit blocks do."""
    from datasets import Dataset

    model, processor = build()
    plain = [[{"role": "user", "content": f"What is {i} plus one?"}] for i in range(4)]
    images = [[random_image(i)] for i in range(4)]
    placed, _ = vision.encode_with_images(
        processor,
        processor.tokenizer,
        [vision.place_images(p, im) for p, im in zip(plain, images, strict=True)],
        images,
    )
    explicit, _ = vision.encode_with_images(
        processor, processor.tokenizer, [image_prompt(i) for i in range(4)], images
    )
    assert placed == explicit
    before = [p.detach().clone() for p in model.parameters()]
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path, max_steps=1),
        train_dataset=Dataset.from_dict({"prompt": plain, "image": [im[0] for im in images]}),
        processing_class=processor,
    )
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert math.isfinite(log["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


# ---- LoRA on the vision-language projection --------------------------------------------------


def test_lora_on_the_multimodal_projector_trains_one_step_with_the_reference_as_the_base(tmp_path):
    peft = pytest.importorskip("peft")
    model, processor = build_qwen2_vl()
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["merger.mlp.0", "merger.mlp.2", "q_proj", "v_proj"]
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path, max_steps=1, beta=0.1),  # the KL reference: adapters disabled
        train_dataset=image_dataset(4),
        processing_class=processor,
        peft_config=config,
    )
    trainable = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("merger" in n for n in trainable) and all("lora_" in n for n in trainable)
    assert trainer.ref_model is None
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert math.isfinite(log["loss"])
    moved = [
        n for n, p in trainer.model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])
    ]
    assert any("merger" in n and "lora_B" in n for n in moved)


def test_images_with_continuous_batching_are_not_built_yet(tmp_path):
    model, processor = build_qwen2_vl()
    args = _vision_args(tmp_path, use_transformers_continuous_batching=True)
    with pytest.raises(
        NotImplementedError, match=r"train_dataset has images; vision-language models sample with"
    ):
        GRPOTrainer(
            model=model, reward_funcs=even_token_reward, args=args, train_dataset=image_dataset(4),
            processing_class=processor,
        )  # fmt: skip


# ---- rollout_func with images ------------------------------------------------------------------


def _image_rollout_func(model, processor, seen, expand=True):
    """A rollout_func that takes each prompt's image from its image block, encodes the prompt with it
    (``expand=False``: with the tokenizer alone, one placeholder token per image), and returns fixed
    completions with the model's own log-probs given the image."""
    tok = processor.tokenizer
    frozen = copy.deepcopy(model).eval()

    def rollout_func(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        for p in prompts:
            seen.append(p)
            images = [b["image"] for m in p for b in m["content"] if b["type"] == "image"]  # blocks only
            text = tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            enc = (
                processor(text=[text], images=images, return_tensors="pt")
                if expand
                else tok([text], return_tensors="pt")
            )
            p_ids = enc["input_ids"][0].tolist()
            kwargs = {n: v for n, v in enc.items() if n not in ("input_ids", "attention_mask")}
            for k in range(4):
                ids = [20 + k, 30 + 3 * k, 41, tok.eos_token_id]
                if "mm_token_type_ids" in enc:  # 0 over the completion
                    kwargs["mm_token_type_ids"] = torch.cat(
                        [enc["mm_token_type_ids"], torch.zeros(1, 4, dtype=torch.long)], 1
                    )
                with torch.no_grad():
                    logits = frozen(input_ids=torch.tensor([p_ids + ids]), **kwargs).logits[
                        0, len(p_ids) - 1 : -1
                    ]
                logps = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                out["prompt_ids"].append(p_ids)
                out["completion_ids"].append(ids)
                out["logprobs"].append(logps.tolist())
        return out

    return rollout_func  # fmt: skip


def _plain_string_dataset(n: int = 4):
    """``n`` rows with a system and a user message of plain strings, and an image column."""
    from datasets import Dataset

    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} plus one?"}]
               for i in range(n)]  # fmt: skip
    return Dataset.from_dict({"prompt": prompts, "image": [random_image(i) for i in range(n)]})


@pytest.mark.parametrize("rows", ["blocks", "strings"])
def test_rollout_func_gets_the_images_and_they_reach_the_forward(tmp_path, rows):
    """As in the reference, rollout_func gets each prompt with every content a list of blocks and its
    images in their image blocks, and the completions are scored with the images (posttrain handed
    the bare placeholders, or plain strings, and scored without the images). With the sampler's
    log-probs those of the same weights given the images, the trainer's equal them up to float noise."""
    model, processor = build_qwen2_vl()
    seen: list = []
    calls = [0]
    model.model.visual.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path, max_steps=1),
        train_dataset=image_dataset(4) if rows == "blocks" else _plain_string_dataset(4),
        processing_class=processor,
        rollout_func=_image_rollout_func(model, processor, seen),
    )
    trainer.train()
    (prompt,) = seen  # one prompt per step: each once
    assert all(isinstance(m["content"], list) for m in prompt)
    user = [m for m in prompt if m["role"] == "user"][0]
    assert user["content"][0]["type"] == "image" and user["content"][0]["image"].size == (50, 40)
    assert calls[0] > 0  # the policy's vision tower ran
    (log,) = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    assert log["sampling/sampling_logp_difference/max"] < 1e-4


def test_rollout_func_token_aligned_inputs_follow_its_own_prompt_tokens():
    """A rollout_func's prompt may hold text of its own after the image: Qwen2-VL's mm_token_type_ids
    (its 3-D rotary positions) must sit on the rollout's image tokens, not the trainer's encoding's."""
    _, processor = build_qwen2_vl()
    tok, image = processor.tokenizer, random_image(0)
    encoded, inputs = vision.encode_with_images(processor, tok, [image_prompt(0)], [[image]])
    own = [
        {
            "role": "user",
            "content": [*image_prompt(0)[0]["content"], {"type": "text", "text": " In one word."}],
        }
    ]
    text = tok.apply_chat_template(own, tokenize=False, add_generation_prompt=True)
    expected = processor(text=[text], images=[image], return_tensors="pt")
    ids = expected["input_ids"][0].tolist()
    row = vision.follow_prompt(
        inputs.rows[0], encoded[0], ids, tok.convert_tokens_to_ids("<|image_pad|>"), "row 0"
    )
    kwargs = VisionInputs([row]).model_kwargs(len(ids), 0, "cpu")
    assert torch.equal(kwargs["mm_token_type_ids"], expected["mm_token_type_ids"])
    assert torch.equal(kwargs["pixel_values"], expected["pixel_values"])


def test_rollout_func_prompt_ids_without_the_expanded_image_tokens_are_refused(tmp_path):
    model, processor = build_qwen2_vl()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=even_token_reward,
        args=_vision_args(tmp_path, max_steps=1),
        train_dataset=image_dataset(4),
        processing_class=processor,
        rollout_func=_image_rollout_func(model, processor, [], expand=False),
    )
    with pytest.raises(ValueError, match=r"row 0 of this batch hold 1 image tokens, but its images take \d+"):
        trainer.train()


def test_rloo_trains_a_vision_language_model_whose_loss_reads_the_images(tmp_path):
    """RLOO samples and scores as GRPO does: its loss on a rollout changes when the rollout's image
    inputs are taken away, and training moves the vision tower (against the reference:
    benchmarks/differential_online.py --only rloo_vlm)."""
    import dataclasses

    from posttrain import RLOOConfig, RLOOTrainer

    model, processor = build_qwen2_vl()
    visual = [p.detach().clone() for p in model.model.visual.parameters()]
    args = RLOOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
        max_steps=2, learning_rate=1e-2, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        gradient_checkpointing=False, logging_steps=1,
    )  # fmt: skip

    def token_sum(completion_ids, **kwargs):  # a spread in every group: advantages not zero
        return [float(sum(ids)) for ids in completion_ids]

    trainer = RLOOTrainer(
        model=model, reward_funcs=token_sum, args=args, train_dataset=image_dataset(4),
        processing_class=processor,
    )  # fmt: skip
    (scored,) = trainer._generate_and_score(
        [trainer.train_dataset[i] for i in (0, 0, 1, 1)], "train", num_chunks=1
    )
    moved = copy.deepcopy(trainer.model)  # a policy one step away from the sampler: ratios and KL not trivial
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
        loss = trainer.compute_loss(moved, scored).item()
        blind = dataclasses.replace(scored, rollout=dataclasses.replace(scored.rollout, vision=None))
        assert abs(trainer.compute_loss(moved, blind).item() - loss) > 1e-3 * abs(loss)
    trainer.train()
    assert any(not torch.equal(a, b) for a, b in zip(visual, model.model.visual.parameters(), strict=True))


# ---- engines that run the processor themselves (vLLM) ---------------------------------------------


class _EngineSideGenerator(ScriptedGenerator):
    """A scripted generator that, like vLLM's, takes rows with images as ``EnginePrompts``."""

    runs_processor = True

    def __init__(self, completions, pad_token_id):
        super().__init__(completions, pad_token_id)
        self.prompts = []

    def generate(self, prompt_ids, prompt_mask, engine_prompts=None):
        self.prompts.append((prompt_ids, prompt_mask, engine_prompts))
        return super().generate(prompt_ids, prompt_mask)


def test_an_engine_that_runs_the_processor_gets_one_placeholder_per_image_and_the_images(tmp_path):
    """What vLLM is sent (tests/test_vllm_engine_vision.py runs it): each row's tokens as the
    tokenizer alone gives them (the placeholder unexpanded) and the row's own images; the trainer
    keeps the processor's expansion for its forwards, and its loss reads the images."""
    model, processor = build_qwen2_vl()
    tok = processor.tokenizer
    dataset = image_dataset(4, column="images", images_per_row=2)
    trainer = GRPOTrainer(
        model=model, reward_funcs=even_token_reward, args=_vision_args(tmp_path, max_steps=1),
        train_dataset=dataset, processing_class=processor,
    )  # fmt: skip
    generator = _EngineSideGenerator([[7, 8, tok.eos_token_id], [9, tok.eos_token_id]], tok.pad_token_id)
    trainer.generator = generator
    trainer.train()
    ((prompt_ids, prompt_mask, sent),) = generator.prompts
    rows = [[np.asarray(im).tobytes() for im in row] for row in dataset["images"]]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for i, (ids, images) in enumerate(zip(sent.ids, sent.images, strict=True)):
        assert [np.asarray(im).tobytes() for im in images] in rows  # a row's own images, in order
        assert ids.count(pad) == 2  # one placeholder per image, left for the engine to expand
        expanded = prompt_ids[i][prompt_mask[i].bool()].tolist()
        assert expanded.count(pad) > 2  # the trainer's rows hold the expansion
        assert [t for t in expanded if t != pad] == [t for t in ids if t != pad]
        assert sent.requests()[i] == {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def test_agent_episodes_with_images_through_vllm_are_not_built_yet(tmp_path):
    model, processor = build_qwen2_vl()

    def lookup(word: str) -> str:
        """Look a word up.

        Args:
            word: the word.
        """
        return word

    with pytest.raises(
        NotImplementedError, match=r"train_dataset has images and the model samples with tools"
    ):
        GRPOTrainer(
            model=model, reward_funcs=even_token_reward, args=_vision_args(tmp_path, use_vllm=True),
            train_dataset=image_dataset(4), processing_class=processor, tools=[lookup],
        )  # fmt: skip
