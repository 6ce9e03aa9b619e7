"""Tiny vision-language models and their processors, built offline from configs (no downloads).

Each builder returns ``(model, processor)``: a 2-layer decoder with hidden size 32 and a one-block
vision tower, and the family's processor assembled from its image processor class (small images),
a byte-level BPE tokenizer trained on a few sentences with the family's special tokens, and a chat
template that renders ``{"type": "image"}`` blocks as the family's placeholder.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

from conftest import CORPUS, TINY_DECODER


def build_tokenizer(extra_specials: list[str]) -> Any:
    """A byte-level BPE tokenizer with ChatML turns and the family's image tokens as specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": extra_specials})
    return fast


def chat_template(image_text: str) -> str:
    """ChatML whose image blocks render as ``image_text``."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        + image_text
        + "{% elif c['type'] "
        "== 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def assemble_processor(processor_class: type, **parts: Any) -> Any:
    """The processor from its parts. Processors with a video part check it against the video
    processor base class, which needs torchvision; the tests use no videos, so the check is skipped."""
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return processor_class(**parts)


QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen2_vl(seed: int = 0, family: str = "qwen2_vl") -> tuple[Any, Any]:
    """Qwen2-VL (or ``family="qwen2_5_vl"``): 14-pixel patches merged 2 x 2, images of 28-56 pixels a side."""
    import torch
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(QWEN_SPECIALS)
    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tok.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    processor = assemble_processor(
        Qwen2VLProcessor,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=None,
        chat_template=template,
    )
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_SPECIALS, strict=True
    )}  # fmt: skip
    text = {
        **TINY_DECODER,
        "vocab_size": len(tok),
        "max_position_embeddings": 512,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [0]}  # fmt: skip
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        return Qwen2_5_VLForConditionalGeneration(config), processor
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    return Qwen2VLForConditionalGeneration(config), processor


def random_image(seed: int, size: tuple[int, int] = (40, 50)) -> Any:
    """A small RGB PIL image of random pixels."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(*size, 3), dtype=np.uint8))


def image_prompt(i: int, images: int = 1) -> list[dict[str, Any]]:
    """A conversational prompt with ``images`` image blocks before its question."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": f"What is {i} plus one?"}]
    return [{"role": "user", "content": content}]


def image_dataset(n: int = 4, column: str = "image", images_per_row: int = 1) -> Any:
    """``n`` conversational rows with one image each (``image``) or a list of them (``images``)."""
    from datasets import Dataset

    prompts = [image_prompt(i, images_per_row) for i in range(n)]
    if column == "image":
        return Dataset.from_dict({"prompt": prompts, "image": [random_image(i) for i in range(n)]})
    images = [[random_image(10 * i + k, (28 + 14 * k, 42)) for k in range(images_per_row)] for i in range(n)]
    return Dataset.from_dict({"prompt": prompts, "images": images})
