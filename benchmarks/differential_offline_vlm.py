"""Differential check of posttrain's offline trainers (SFT, DPO, KTO) against the reference (TRL 1.16) on
vision-language models.

Run in the benchmark environment, where both libraries are installed (and Pillow)::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_offline_vlm.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_offline_vlm.py --only sft_qwen2_vl_pc --verbose

The tiny vision-language models and processors of ``differential_vlm.py`` (Qwen2-VL, LLaVA-NeXT),
built once and loaded by path (Qwen2-VL's processor assembled from its saved parts and given to
both libraries). Data: eight rows with one small generated image each (``image`` column), as
``pc``: a conversational prompt with an image block and a one-message assistant completion
(``completion_only_loss`` on by default in both libraries), or ``messages``: the same turns as
one conversation (every token a target) for SFT; for DPO, ``pairs``: the same prompts with a
chosen (the answer) and a rejected completion (another answer); for KTO, ``unpaired``: each
prompt with the good answer (label True, even rows) or the bad one (False, odd rows). Each library trains in its own
process, 3 full-batch
steps of plain SGD on the same rows; the parent compares every metric both log and the
parameters after the 3 steps (``differential.compare``).

Nothing here is copied from the reference; it only calls both libraries' public API.
"""

from __future__ import annotations

import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from differential import command_line, drive, train_and_record  # noqa: E402
from differential_offline import BAD, BASE, GOOD, QUESTIONS  # noqa: E402
from differential_vlm import load_processor, prepare_family, row_image  # noqa: E402

CONFIGS = {
    f"sft_{family}_{kind}": ("sft", family, kind, {})
    for family in ("qwen2_vl", "llava_next")
    for kind in ("pc", "messages")
}
CONFIGS["sft_qwen2_vl_pc_full"] = ("sft", "qwen2_vl", "pc", {"completion_only_loss": False})
# whole conversations, the assistant's turns alone the targets (a marked copy of the family's template)
CONFIGS.update(
    {f"sft_{family}_messages_assistant": ("sft", family, "messages", {"assistant_only_loss": True})
     for family in ("qwen2_vl", "llava_next")}
)  # fmt: skip
CONFIGS.update({f"dpo_{family}": ("dpo", family, "pairs", {}) for family in ("qwen2_vl", "llava_next")})
CONFIGS["dpo_qwen2_vl_ipo"] = ("dpo", "qwen2_vl", "pairs", {"loss_type": ["ipo"]})
CONFIGS["dpo_qwen2_vl_images"] = ("dpo", "qwen2_vl", "pairs_images", {})
# sequential sampling (the reference's forced default) gives both libraries the same KL pairs
KTO_BASE = {"train_sampling_strategy": "sequential"}
CONFIGS.update(
    {f"kto_{family}": ("kto", family, "unpaired", KTO_BASE) for family in ("qwen2_vl", "llava_next")}
)
# with half the rows undesirable the KL estimate stays at its floor, 0; with every row desirable
# (the good answers) it is positive from the second step
CONFIGS["kto_qwen2_vl_kl"] = ("kto", "qwen2_vl", "unpaired_good", {**KTO_BASE, "learning_rate": 0.3})


def dataset(kind: str):
    """Eight rows with one image each: prompt-completion (``pc``), one conversation (``messages``),
    or preference pairs (``pairs``; ``pairs_images``: the image as a one-item ``images`` list)."""
    from datasets import Dataset

    prompts = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in QUESTIONS
    ]
    completions = [[{"role": "assistant", "content": [{"type": "text", "text": a}]}] for a in GOOD]
    images = [row_image(i) for i in range(len(QUESTIONS))]
    if kind.startswith(
        "unpaired"
    ):  # the good answer for even rows (every row: _good), the bad one for odd rows
        labels = [i % 2 == 0 or kind == "unpaired_good" for i in range(len(QUESTIONS))]
        texts = [g if keep else b for g, b, keep in zip(GOOD, BAD, labels, strict=True)]
        answers = [[{"role": "assistant", "content": [{"type": "text", "text": t}]}] for t in texts]
        return Dataset.from_dict({"prompt": prompts, "completion": answers, "label": labels, "image": images})
    if kind.startswith("pairs"):
        rejected = [[{"role": "assistant", "content": [{"type": "text", "text": b}]}] for b in BAD]
        column = {"images": [[im] for im in images]} if kind == "pairs_images" else {"image": images}
        return Dataset.from_dict({"prompt": prompts, "chosen": completions, "rejected": rejected, **column})
    if kind == "pc":
        return Dataset.from_dict({"prompt": prompts, "completion": completions, "image": images})
    messages = [p + c for p, c in zip(prompts, completions, strict=True)]
    return Dataset.from_dict({"messages": messages, "image": images})


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import importlib

    import torch

    torch.set_num_threads(1)
    trainer_name, family, kind, overrides = CONFIGS[name]
    module = importlib.import_module("trl" if lib == "trl" else "posttrain")
    config_class = getattr(module, f"{trainer_name.upper()}Config")
    trainer_class = getattr(module, f"{trainer_name.upper()}Trainer")

    def make_trainer(folder: str):
        extra = {}
        if overrides.get("assistant_only_loss"):
            from differential_vlm import IMAGE_TEXT, _template

            extra["chat_template_path"] = os.path.join(folder, "marked.jinja")
            with open(extra["chat_template_path"], "w") as f:
                f.write(_template(IMAGE_TEXT[family], marked=True))
        args = config_class(output_dir=folder, max_length=None, **{**BASE, **overrides, **extra})
        processor = load_processor(family, model_dir)
        processor.tokenizer.padding_side = "right"
        return trainer_class(
            model=model_dir, args=args, train_dataset=dataset(kind), processing_class=processor
        )

    train_and_record(out_path, {"lib": lib, "config": name}, make_trainer)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    work = keep or tempfile.mkdtemp(prefix="differential-offline-vlm-")
    built = {family: prepare_family(work, family) for family in dict.fromkeys(CONFIGS[n][1] for n in names)}
    script = os.path.abspath(__file__)

    def child_args(lib: str, name: str, out: str) -> list[str]:
        return [
            script,
            "--lib",
            lib,
            "--config",
            name,
            "--model_dir",
            built[CONFIGS[name][1]][0],
            "--out",
            out,
        ]

    return drive(names, work, child_args, lambda name: built[CONFIGS[name][1]][1], None, verbose)


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
