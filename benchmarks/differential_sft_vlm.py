"""Differential check of posttrain's SFTTrainer against the reference (TRL 1.16) on vision-language models.

Run in the benchmark environment, where both libraries are installed (and Pillow)::

    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_sft_vlm.py
    OMP_NUM_THREADS=1 benchmarks/.venv/bin/python benchmarks/differential_sft_vlm.py --only qwen2_vl_pc --verbose

The tiny vision-language models and processors of ``differential_vlm.py`` (Qwen2-VL, LLaVA-NeXT),
built once and loaded by path (Qwen2-VL's processor assembled from its saved parts and given to
both libraries). Data: eight rows with one small generated image each (``image`` column), as
``pc``: a conversational prompt with an image block and a one-message assistant completion
(``completion_only_loss`` on by default in both libraries), or ``messages``: the same turns as
one conversation (every token a target). Each library trains in its own process, 3 full-batch
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
from differential_offline import BASE, GOOD, QUESTIONS  # noqa: E402
from differential_vlm import load_processor, prepare_family, row_image  # noqa: E402

CONFIGS = {
    f"{family}_{kind}": (family, kind, {})
    for family in ("qwen2_vl", "llava_next")
    for kind in ("pc", "messages")
}
CONFIGS["qwen2_vl_pc_full"] = ("qwen2_vl", "pc", {"completion_only_loss": False})


def dataset(kind: str):
    """Eight rows with one image each: prompt-completion (``pc``) or one conversation (``messages``)."""
    from datasets import Dataset

    prompts = [
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}] for q in QUESTIONS
    ]
    completions = [[{"role": "assistant", "content": [{"type": "text", "text": a}]}] for a in GOOD]
    images = [row_image(i) for i in range(len(QUESTIONS))]
    if kind == "pc":
        return Dataset.from_dict({"prompt": prompts, "completion": completions, "image": images})
    messages = [p + c for p, c in zip(prompts, completions, strict=True)]
    return Dataset.from_dict({"messages": messages, "image": images})


def run_child(lib: str, name: str, model_dir: str, out_path: str) -> None:
    import torch

    torch.set_num_threads(1)
    if lib == "trl":
        from trl import SFTConfig, SFTTrainer
    else:
        from posttrain import SFTConfig, SFTTrainer

    family, kind, overrides = CONFIGS[name]

    def make_trainer(folder: str):
        args = SFTConfig(output_dir=folder, max_length=None, **{**BASE, **overrides})
        processor = load_processor(family, model_dir)
        processor.tokenizer.padding_side = "right"
        return SFTTrainer(model=model_dir, args=args, train_dataset=dataset(kind), processing_class=processor)

    train_and_record(out_path, {"lib": lib, "config": name}, make_trainer)


def run_parent(names: list[str], keep: str | None, verbose: bool) -> int:
    work = keep or tempfile.mkdtemp(prefix="differential-sft-vlm-")
    built = {family: prepare_family(work, family) for family in dict.fromkeys(CONFIGS[n][0] for n in names)}
    script = os.path.abspath(__file__)

    def child_args(lib: str, name: str, out: str) -> list[str]:
        return [
            script,
            "--lib",
            lib,
            "--config",
            name,
            "--model_dir",
            built[CONFIGS[name][0]][0],
            "--out",
            out,
        ]

    return drive(names, work, child_args, lambda name: built[CONFIGS[name][0]][1], None, verbose)


def main() -> int:
    return command_line(__doc__, CONFIGS, run_child, run_parent)


if __name__ == "__main__":
    sys.exit(main())
