"""One library's SFT run, measured; prints one JSON line.

Run by ``benchmarks/sft_compare.py`` in a fresh process per measurement, so peak memory belongs
to one run. The same script drives posttrain and TRL: both get the same model folder, dataset
and SFTConfig values; only the import differs.

The dataset: 256 language-modelling rows of mixed lengths (each a seeded run of words, from
a quarter of ``max_length`` to all of it, in tokens), so padding and packing matter. The
model: SmolLM2-135M-Instruct in float32 on the CPU. Tokens per second count the real
(non-padding) tokens of the rows a step trained on.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile

WORDS = (
    "the model learns to predict each next token of the text it reads and the loss measures how "
    "surprised it was by the token that came while packing puts several short texts into one row"
).split()


def texts(tokenizer, max_length: int, n: int = 256, seed: int = 0) -> list[str]:
    """``n`` texts of seeded random words, their token counts spread over [max_length / 4, max_length - 8]."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(max_length // 4, max_length - 8)
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < target:
            words += [rng.choice(WORDS) for _ in range(16)]
        ids = tokenizer(" ".join(words))["input_ids"][:target]
        out.append(tokenizer.decode(ids))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["posttrain", "trl"], required=True)
    parser.add_argument("--model", required=True, help="folder of SmolLM2-135M-Instruct in safetensors")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--max_length", type=int, default=512)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--packing", type=int, default=0)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--bf16", type=int, default=0, help="1: bf16=True (CPU autocast) in both libraries")
    opts = parser.parse_args()

    from datasets import Dataset
    from steps import StepClock
    from transformers import AutoTokenizer

    if opts.library == "posttrain":
        from posttrain import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(opts.model)
    dataset = Dataset.from_dict({"text": texts(tok, opts.max_length)})

    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            output_dir=out,
            max_steps=opts.steps,
            per_device_train_batch_size=opts.batch_size,
            max_length=opts.max_length,
            packing=bool(opts.packing),
            gradient_checkpointing=bool(opts.gradient_checkpointing),
            learning_rate=1e-5,
            bf16=bool(opts.bf16),
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
            include_num_input_tokens_seen="non_padding" if opts.library == "trl" else "no",
        )
        trainer = SFTTrainer(
            model=opts.model, args=args, train_dataset=dataset, processing_class=tok, callbacks=[clock]
        )
        trainer.train()
    step_times, tokens = clock.step_times(), clock.step_tokens()
    print(
        json.dumps(
            {
                "library": opts.library,
                "max_length": opts.max_length,
                "packing": bool(opts.packing),
                "batch_size": opts.batch_size,
                "step_times": step_times,
                "step_tokens": tokens,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
