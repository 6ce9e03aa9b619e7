"""Differential check of posttrain's GRPOTrainer against the reference (TRL 1.16) on a vision-language model.

Run in the benchmark environment, where both libraries are installed (and Pillow)::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_vlm.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_vlm.py --only qwen2_vl_blocks_dapo --verbose

``differential.py`` (GRPO on text) on a tiny vision-language model. The parent builds, per family,
a seeded float32 model from its config (a 2-layer decoder of hidden size 32 and a one-block vision
tower) with its processor (the family's image processor, a byte-level BPE tokenizer with the
family's image tokens, a ChatML template that renders ``{"type": "image"}`` blocks as the family's
placeholder), as ``tests/vision_models.py`` builds them, and saves them once to a folder:

- ``qwen2_vl``: Qwen2-VL (14-pixel patches merged 2 x 2, ``image_grid_thw``, ``mm_token_type_ids``,
  3-D rotary positions). ``AutoProcessor`` cannot load a Qwen2-VL processor here (it always loads
  the video processor, which needs torchvision, absent), so each process assembles the processor
  from the folder's tokenizer (left padding, as the reference loads it), image processor and chat
  template, and passes it to both libraries as ``processing_class``; the model loads by path.
- ``llava_next``: LLaVA-NeXT (a CLIP tower on 16-pixel crops, any-resolution grids,
  ``image_sizes``): model and processor both load by path in both libraries.

Data: eight rows, each with one small generated image (an ``image`` column; seeded random pixels,
four sizes) and a conversational prompt, in two forms: ``blocks``, a user message with an explicit
``{"type": "image"}`` block before its question; ``strings``, a system message and a user message
with plain-string contents (each library puts one image block per image at the start of the first
user message).

Generation is replaced, as in ``differential.py``, by a ``rollout_func`` returning fixed
completions (``differential.rollout_plan`` of the row's question, the completion's index and the
call number) and, as sampler log-probs, the initial model's own log-probs of them given the prompt
AND its image, plus a known perturbation. The function renders each prompt with the template and
encodes it with its image through the processor, so its ``prompt_ids`` carry the image's expanded
placeholder tokens; it takes the image from the prompt's image block (``{"type": "image", "image":
<PIL image>}``) and records whether the block held it. The reference's GRPOTrainer runs with its
vLLM flag switched on after construction (``differential.switch_on_vllm_flag``), the path on which
it uses the rollout's log-probs. Nothing else of either library is replaced: the reference's own
rollout_func path re-encodes each row's prompt with its images through the processor for the
forward pass (pixel values, grid sizes, ``mm_token_type_ids``), so it carries images unchanged.

Besides every metric and the parameters after 3 plain-SGD steps (``differential.compare``), each
configuration's line says whether the rollout_func received the same prompts in both libraries
(each prompt once, after undoing the reference's per-row repetition, fidelity.md departure 2;
compared as role, text and image pixels, a plain-string content counting as one text block),
whether those prompts held their images, and how many times the policy's vision tower ran during
training in each (0 would mean the forward pass never saw the pixels).

Configurations: ``{family}_{blocks|strings}_{dapo|grpo|beta|iter2}``: the default (dapo), loss_type
grpo, beta 0.1 (the KL reference scores with the images too), num_iterations 2 (the old policy's
log-probs with the images).

Nothing here is copied from the reference; it only calls both libraries' public API.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from differential import (  # noqa: E402
    BASE,
    CORPUS,
    PROMPTS,
    G,
    command_line,
    drive,
    length_reward,
    record_failure,
    record_run,
    rollout_plan,
    switch_on_vllm_flag,
    token_sum_reward,
)

FAMILIES = ("qwen2_vl", "llava_next")
#: Options of every configuration: differential.py's, as plain SGD at 0.1 without clipping.
VLM_BASE = {**BASE, "learning_rate": 0.1, "max_grad_norm": 0.0}
OBJECTIVES = {
    "dapo": {},
    "grpo": {"loss_type": "grpo"},
    "beta": {"beta": 0.1},
    "iter2": {"num_iterations": 2},
}
CONFIGS = {
    f"{family}_{kind}_{objective}": (family, kind, overrides)
    for family in FAMILIES
    for kind in ("blocks", "strings")
    for objective, overrides in OBJECTIVES.items()
}
SIZES = [(40, 50), (28, 28), (56, 42), (30, 60)]
SYSTEM = "Answer briefly."


# ----------------------------------------------------------------------------------------------
# The tiny vision-language models and their processors


def _tokenizer(extra_specials: list[str]):
    """A byte-level BPE tokenizer with ChatML turns (pad <|endoftext|>, EOS <|im_end|>) and image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *extra_specials]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": extra_specials})
    return tok


#: Each family's image placeholder in its chat template.
IMAGE_TEXT = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava_next": "<image>"}


def _template(image_text: str, marked: bool = False) -> str:
    """ChatML; an image block renders as ``image_text``, a string content as itself. ``marked``: each
    assistant turn's content and end-of-turn token in ``{% generation %}`` markers (assistant_only_loss)."""
    content = (
        "{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
        + image_text
        + "{% elif c['type'] "
        "== 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    )
    turn = "<|im_start|>{{ m['role'] }}\n" + content + "<|im_end|>\n"
    if marked:
        assistant = "<|im_start|>assistant\n{% generation %}" + content + "<|im_end|>{% endgeneration %}\n"
        turn = "{% if m['role'] == 'assistant' %}" + assistant + "{% else %}" + turn + "{% endif %}"
    return (
        "{% for m in messages %}"
        + turn
        + "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _text_config(tok, positions: int) -> dict:
    return {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(tok),
        "max_position_embeddings": positions,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": None,
    }


QWEN_SPECIALS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_family_dir(family: str, path: str) -> None:
    """Save the family's seeded tiny model and its processor's parts to ``path``."""
    import torch

    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        tok = _tokenizer(QWEN_SPECIALS)
        tok.chat_template = _template(IMAGE_TEXT["qwen2_vl"])
        image_processor = Qwen2VLImageProcessorPil(
            min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2, temporal_patch_size=2
        )
        names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
        ids = {n: tok.convert_tokens_to_ids(t) for n, t in zip(names, QWEN_SPECIALS, strict=True)}
        text = {
            **_text_config(tok, 512),
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            "tie_word_embeddings": False,
        }
        vision = {"depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2, "mlp_ratio": 2,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}  # fmt: skip
        torch.manual_seed(0)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
        model.save_pretrained(path)
        tok.save_pretrained(path)  # the chat template with it
        image_processor.save_pretrained(path)
        return
    from transformers import LlavaNextConfig, LlavaNextForConditionalGeneration, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tok = _tokenizer(["<image>"])
    tok.chat_template = _template(IMAGE_TEXT["llava_next"])
    grids = [[16, 32], [32, 16], [32, 32]]
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}, image_grid_pinpoints=grids
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, chat_template=tok.chat_template, patch_size=8,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,
    )  # fmt: skip
    text = {"model_type": "llama", **_text_config(tok, 512)}
    vision = {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "image_size": 16, "patch_size": 8, "projection_dim": 32}  # fmt: skip
    config = LlavaNextConfig(
        text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1, image_grid_pinpoints=grids,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlavaNextForConditionalGeneration(config).save_pretrained(path)
    processor.save_pretrained(path)


def load_processor(family: str, path: str):
    """The family's processor from its folder (Qwen2-VL: assembled from its saved parts, see the docstring)."""
    from transformers import AutoProcessor

    if family != "qwen2_vl":
        return AutoProcessor.from_pretrained(path, padding_side="left", truncation_side="left")
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    tok = AutoTokenizer.from_pretrained(path, padding_side="left", truncation_side="left")
    image_processor = AutoImageProcessor.from_pretrained(path)
    # no video processor (it needs torchvision): skip the sub-processor class check that would refuse None
    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None):
        return Qwen2VLProcessor(
            image_processor=image_processor,
            tokenizer=tok,
            video_processor=None,
            chat_template=tok.chat_template,
        )


def prepare_family(work: str, family: str) -> tuple[str, str]:
    """The family's folder under ``work`` (built once) and its saved initial parameters."""
    import torch
    from transformers import AutoModelForImageTextToText

    model_dir = os.path.join(work, family)
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        build_family_dir(family, model_dir)
    init_path = os.path.join(work, f"{family}.init.pt")
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    torch.save({k: v.detach().float() for k, v in model.state_dict().items()}, init_path)
    return model_dir, init_path


# ----------------------------------------------------------------------------------------------
# Data, rollouts


def row_image(i: int):
    """Row ``i``'s image: seeded random pixels, one of four sizes."""
    import numpy as np
    from PIL import Image

    h, w = SIZES[i % len(SIZES)]
    return Image.fromarray(np.random.default_rng(i).integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def dataset(kind: str):
    """The eight rows: a prompt with an explicit image block (``blocks``) or plain strings (``strings``)."""
    from datasets import Dataset

    if kind == "blocks":
        prompts = [
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in PROMPTS
        ]
    else:
        prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in PROMPTS]
    return Dataset.from_dict({"prompt": prompts, "image": [row_image(i) for i in range(len(PROMPTS))]})


def _blocks(message: dict) -> list[dict]:
    content = message.get("content")
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])


def canonical(prompt: list[dict], strict: bool = False) -> str:
    """A digest of a prompt as the model reads it: each message's role, texts and image pixels
    (a plain-string content counts as one text block unless ``strict``; an image block without its
    image as 'none')."""
    parts = []
    for message in prompt:
        parts.append(
            f"<{message['role']}>" + ("str" if strict and isinstance(message["content"], str) else "")
        )
        for block in _blocks(message):
            if block.get("type") == "image":
                image = block.get("image")
                parts.append(
                    "image:" + (hashlib.md5(image.tobytes()).hexdigest() if image is not None else "none")
                )
            elif block.get("type") == "text":
                parts.append("text:" + str(block.get("text")))
    return hashlib.md5("|".join(parts).encode()).hexdigest()[:12]


def question(prompt: list[dict]) -> str:
    """The prompt's question: the text of its last user message."""
    user = [m for m in prompt if m["role"] == "user"][-1]
    return next(b["text"] for b in _blocks(user) if b.get("type") == "text")


TOKEN_ALIGNED = ("mm_token_type_ids", "token_type_ids")


class VisionRollouts:
    """The rollout_func: each prompt rendered and encoded with its image, fixed completions, and the
    initial model's log-probs of them given the image (plus a perturbation) as the sampler's."""

    def __init__(self, model_dir: str, family: str, lib: str):
        import torch
        from transformers import AutoModelForImageTextToText

        self.processor = load_processor(family, model_dir)
        self.tok = self.processor.tokenizer
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.lib, self.calls = lib, 0
        self.received: list[int] = []
        self.prompts: list[list[str]] = []  # per call, each prompt's canonical digest
        self.layout: list[list[str]] = []  # the same, telling a plain-string content from a text block
        self.with_image = [0, 0]  # image blocks holding their image / all image blocks
        self.images = {q: row_image(i) for i, q in enumerate(PROMPTS)}

    def _image_of(self, prompt: list[dict]):
        """The prompt's image, from its image block; from the data when the block lacks it (counted)."""
        held = [b.get("image") for m in prompt for b in _blocks(m) if b.get("type") == "image"]
        self.with_image[1] += len(held)
        self.with_image[0] += sum(1 for image in held if image is not None)
        if len(held) != 1:
            raise AssertionError(f"expected one image block, got {len(held)}: {prompt}")
        return held[0] if held[0] is not None else self.images[question(prompt)]

    def __call__(self, prompts, trainer):
        import torch

        self.received.append(len(prompts))
        if self.lib == "trl":  # each row's prompt (departure 2)
            unique = list(prompts[::G])
            assert all(canonical(prompts[i]) == canonical(unique[i // G]) for i in range(len(prompts)))
        else:
            unique = list(prompts)
        self.prompts.append([canonical(p) for p in unique])
        self.layout.append([canonical(p, strict=True) for p in unique])
        eos = self.tok.eos_token_id
        specials = set(self.tok.added_tokens_decoder)  # ChatML and image tokens: never in a completion
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "group_index": []}
        for p in unique:
            text = self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            enc = self.processor(text=[text], images=[self._image_of(p)], return_tensors="pt")
            p_ids = enc["input_ids"][0].tolist()
            extra = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
            for j in range(G):
                ids, perturb = rollout_plan(question(p), j, self.calls, len(self.tok), specials, eos)
                kwargs = {
                    k: torch.cat([v, v.new_zeros(1, len(ids))], 1) if k in TOKEN_ALIGNED else v
                    for k, v in extra.items()
                }
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([p_ids + ids]), **kwargs).logits
                    logits = logits[0, len(p_ids) - 1 : -1].float()
                    true = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
                out["prompt_ids"].append(p_ids)
                out["completion_ids"].append(ids)
                out["logprobs"].append([float(t) + d for t, d in zip(true.tolist(), perturb, strict=True)])
                out["group_index"].append(j)
        self.calls += 1
        return out


# ----------------------------------------------------------------------------------------------
# Child: one library, one configuration


def vision_tower(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = base.model
    return inner.visual if hasattr(inner, "visual") else inner.vision_tower


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    if lib == "trl":
        from trl import GRPOConfig, GRPOTrainer
    else:
        from posttrain import GRPOConfig, GRPOTrainer

    family, kind, overrides = CONFIGS[name]
    rollouts = VisionRollouts(model_dir, family, lib)
    result: dict = {"lib": lib, "config": name}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            args = GRPOConfig(output_dir=tmp, **{**VLM_BASE, **overrides})
            # Qwen2-VL's processor cannot load by path here (see the docstring): the same one, given to both
            given = {"processing_class": load_processor(family, model_dir)} if family == "qwen2_vl" else {}
            trainer = GRPOTrainer(
                model=model_dir,
                reward_funcs=[token_sum_reward, length_reward],
                args=args,
                train_dataset=dataset(kind),
                rollout_func=rollouts,
                **given,
            )
            if lib == "trl":
                switch_on_vllm_flag(trainer)
            calls = [0]
            vision_tower(trainer.model).register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
            trainer.train()
        except Exception as exc:  # noqa: BLE001 - recorded as "not accepted"
            record_failure(out_path, result, exc)
            return
        result.update(
            rollout_calls=rollouts.received,
            prompts=rollouts.prompts,
            layout=rollouts.layout,
            with_image=rollouts.with_image,
            vision_calls=calls[0],
        )
        record_run(out_path, result, trainer)


# ----------------------------------------------------------------------------------------------
# Parent


def note(res: dict) -> str:
    trl, pt = res["trl"], res["posttrain"]
    same = "same" if trl["prompts"] == pt["prompts"] else "DIFFERENT"
    if trl["prompts"] == pt["prompts"] and trl["layout"] != pt["layout"]:
        same += " (but plain-string contents in one, text blocks in the other)"
    held = "; ".join(
        f"{lib} {r['with_image'][0]}/{r['with_image'][1]}" for lib, r in (("trl", trl), ("posttrain", pt))
    )
    return (
        f"rollout_func prompts per call trl {trl['rollout_calls']} posttrain {pt['rollout_calls']}, {same} prompts; "
        f"image blocks holding their image: {held}; vision tower calls trl {trl['vision_calls']} "
        f"posttrain {pt['vision_calls']}"
    )


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    work = keep or tempfile.mkdtemp(prefix="differential-vlm-")
    built = {family: prepare_family(work, family) for family in dict.fromkeys(CONFIGS[n][0] for n in names)}
    script = os.path.abspath(__file__)

    def child_args(lib: str, name: str, out: str) -> list[str]:
        model_dir = built[CONFIGS[name][0]][0]
        return [script, "--lib", lib, "--config", name, "--model_dir", model_dir, "--out", out]

    return drive(names, work, child_args, lambda name: built[CONFIGS[name][0]][1], note, verbose)


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
