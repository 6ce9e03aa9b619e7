"""One library's DPO run, measured; prints one JSON line.

Run by ``benchmarks/dpo_compare.py`` in a fresh process per measurement, so peak memory belongs
to one run. The same script drives posttrain and TRL: both get the same model folder, pairs and
DPOConfig values (sigmoid loss, the reference a frozen copy of the initial model); only the
import differs.

The pairs: 64 prompts of about 24 tokens, each with a chosen and a rejected completion of
``completion_length`` tokens (seeded runs of words, the rejected one a different run). The
model: SmolLM2-135M-Instruct in float32 on the CPU.
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
    "the model learns which of two answers people prefer and the loss pushes the preferred one up "
    "while the reference keeps it close to where it started"
).split()


def words_of(tokenizer, n_tokens: int, rng: random.Random) -> str:
    """A seeded run of words that tokenises to exactly ``n_tokens`` tokens (after a leading space)."""
    words: list[str] = []
    while len(tokenizer(" " + " ".join(words))["input_ids"]) < n_tokens:
        words += [rng.choice(WORDS) for _ in range(32)]
    ids = tokenizer(" " + " ".join(words))["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def pairs(tokenizer, completion_length: int, n: int = 64, seed: int = 0) -> dict[str, list[str]]:
    rng = random.Random(seed)
    out: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(n):
        out["prompt"].append(f"Question {i}: write a short paragraph about preferences and models.")
        out["chosen"].append(words_of(tokenizer, completion_length, rng))
        out["rejected"].append(words_of(tokenizer, completion_length, rng))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--library", choices=["posttrain", "trl"], required=True)
    parser.add_argument("--model", required=True, help="folder of SmolLM2-135M-Instruct in safetensors")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--completion_length", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--bf16", type=int, default=0, help="1: bf16=True (CPU autocast) in both libraries")
    opts = parser.parse_args()

    from datasets import Dataset
    from steps import StepClock
    from transformers import AutoTokenizer

    if opts.library == "posttrain":
        from posttrain import DPOConfig, DPOTrainer
    else:
        from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(opts.model)
    dataset = Dataset.from_dict(pairs(tok, opts.completion_length))
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(
            output_dir=out,
            max_steps=opts.steps,
            per_device_train_batch_size=opts.batch_size,
            max_length=None,
            gradient_checkpointing=bool(opts.gradient_checkpointing),
            learning_rate=1e-6,
            beta=0.1,
            bf16=bool(opts.bf16),
            use_cpu=True,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        )
        trainer = DPOTrainer(
            model=opts.model, args=args, train_dataset=dataset, processing_class=tok, callbacks=[clock]
        )
        trainer.train()
    print(
        json.dumps(
            {
                "library": opts.library,
                "completion_length": opts.completion_length,
                "batch_size": opts.batch_size,
                "step_times": clock.step_times(),
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "threads": int(os.environ.get("OMP_NUM_THREADS", "0")) or None,
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
