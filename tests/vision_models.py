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


def build_qwen2_vl(seed: int = 0, family: str = "qwen2_vl", for_vllm: bool = False) -> tuple[Any, Any]:
    """Qwen2-VL (or ``family="qwen2_5_vl"``): 14-pixel patches merged 2 x 2, images of 28-56 pixels a side.

    ``for_vllm``: the shapes vLLM's CPU backend runs (attention heads of 32, rotary sections summing
    to 16) and the processor's video part, which saving it needs (built with torchvision).
    """
    import torch
    from transformers import Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(QWEN_SPECIALS)
    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tok.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
    )
    video_processor = None
    if for_vllm:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video_processor = Qwen2VLVideoProcessor()
    processor = assemble_processor(
        Qwen2VLProcessor,
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=video_processor,
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
    width = 32
    if for_vllm:
        width = 64
        text.update(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1)
        text["rope_scaling"] = {"type": "mrope", "mrope_section": [4, 6, 6]}
    torch.manual_seed(seed)
    if family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": width,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [0]}  # fmt: skip
        config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
        return Qwen2_5_VLForConditionalGeneration(config), processor
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    vision = {"depth": 1, "embed_dim": 32, "hidden_size": width, "num_heads": 2, "mlp_ratio": 2, "patch_size": 14,
              "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
    config = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    return Qwen2VLForConditionalGeneration(config), processor


def build_qwen3_vl(seed: int = 0) -> tuple[Any, Any]:
    """Qwen3-VL: 16-pixel patches merged 2 x 2 (images of 32-64 pixels a side), interleaved 3-D rotary
    positions, and DeepStack (the vision block's features added to the first decoder layer's input)."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = build_tokenizer(QWEN_SPECIALS)
    template = chat_template("<|vision_start|><|image_pad|><|vision_end|>")
    tok.chat_template = template
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=32 * 32, max_pixels=64 * 64, patch_size=16, merge_size=2, temporal_patch_size=2
    )
    processor = assemble_processor(
        Qwen3VLProcessor, image_processor=image_processor, tokenizer=tok, video_processor=None, chat_template=template
    )  # fmt: skip
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in zip(
        ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"), QWEN_SPECIALS, strict=True
    )}  # fmt: skip
    text = {**TINY_DECODER, "head_dim": 8, "vocab_size": len(tok), "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                "mrope_interleaved": True},
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}  # fmt: skip
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32,
              "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
              "deepstack_visual_indexes": [0]}  # fmt: skip
    torch.manual_seed(seed)
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    return Qwen3VLForConditionalGeneration(config), processor


SMOLVLM_SPECIALS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


def build_smolvlm(seed: int = 0) -> tuple[Any, Any]:
    """SmolVLM2 (Idefics3-style): 32-pixel images of 8-pixel patches, 4 image tokens each (scale factor 2)."""
    import torch
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMProcessor
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    tok = build_tokenizer(SMOLVLM_SPECIALS)
    template = chat_template("<image>")
    tok.chat_template = template
    image_processor = SmolVLMImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
    )
    processor = assemble_processor(
        SmolVLMProcessor, image_processor=image_processor, tokenizer=tok, video_processor=None, image_seq_len=4,
        chat_template=template,
    )  # fmt: skip
    text = {**TINY_DECODER, "vocab_size": len(tok), "max_position_embeddings": 256, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "bos_token_id": None, "tie_word_embeddings": False}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    config = SmolVLMConfig(
        text_config=text, vision_config=vision, scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return SmolVLMForConditionalGeneration(config), processor


GEMMA3_SPECIALS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]


def build_gemma3(seed: int = 0) -> tuple[Any, Any]:
    """Gemma 3: 32-pixel images of 8-pixel patches pooled to 4 soft tokens, written ``<start_of_image>``."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = build_tokenizer(GEMMA3_SPECIALS)
    boi, eoi, soft = GEMMA3_SPECIALS
    tok.boi_token, tok.eoi_token, tok.image_token = boi, eoi, soft
    tok.boi_token_id, tok.eoi_token_id, tok.image_token_id = (
        tok.convert_tokens_to_ids(t) for t in GEMMA3_SPECIALS
    )
    template = chat_template(boi)
    tok.chat_template = template
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = assemble_processor(
        Gemma3Processor,
        image_processor=image_processor,
        tokenizer=tok,
        chat_template=template,
        image_seq_length=4,
    )
    text = {**TINY_DECODER, "head_dim": 8, "vocab_size": len(tok), "max_position_embeddings": 256,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None,
            "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 32, "patch_size": 8}  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=tok.image_token_id,
        boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config), processor


def build_llava_next(seed: int = 0) -> tuple[Any, Any]:
    """LLaVA-NeXT: a CLIP tower on 16-pixel crops of 8-pixel patches, any-resolution grids up to 32 x 32."""
    import torch
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = build_tokenizer(["<image>"])
    template = chat_template("<image>")
    tok.chat_template = template
    grids = [[16, 32], [32, 16], [32, 32]]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, image_grid_pinpoints=grids
    )
    processor = assemble_processor(
        LlavaNextProcessor, image_processor=image_processor, tokenizer=tok, chat_template=template, patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    text = {"model_type": "llama", **TINY_DECODER, "vocab_size": len(tok), "max_position_embeddings": 512,
            "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}  # fmt: skip
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 8, "projection_dim": 32}  # fmt: skip
    config = LlavaNextConfig(
        text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1, image_grid_pinpoints=grids,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlavaNextForConditionalGeneration(config), processor


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


def logps_with_and_without_images(model: Any, rollout: Any) -> tuple[Any, Any]:
    """The chunked completion log-probs of ``rollout`` with its image inputs, and without them
    (which must differ: the images count)."""
    import torch

    from posttrain.ops.logprobs import completion_logps

    r = rollout
    with torch.no_grad():
        with_images = completion_logps(
            model,
            r.prompt_ids,
            r.prompt_mask,
            r.completion_ids,
            r.completion_mask,
            model_inputs=r.vision_kwargs(),
        ).logps
        without_images = completion_logps(
            model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask
        ).logps
    return with_images, without_images
