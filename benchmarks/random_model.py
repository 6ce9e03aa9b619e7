"""A SmolLM2-135M-Instruct folder with random weights, for machines that lack the embedded model.

Usage::

    python benchmarks/random_model.py --source DIR --out /tmp/smollm2

``DIR`` holds the model's ``config.json`` and tokenizer files (copied from the embedded model's
cached folder; about 4 MB, small enough to travel where the 540 MB of weights cannot). The
architecture, the tokenizer and the chat template are the real ones, so a benchmark step does the
same work as with the trained weights: every completion is exactly N tokens long
(``min_new_tokens``), whatever the weights sample.
"""

from __future__ import annotations

import argparse
import os
import shutil

COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True, help="folder with config.json and the tokenizer files")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(opts.source)
    torch.manual_seed(opts.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(opts.out)
    for name in COPIED:
        path = os.path.join(opts.source, name)
        if os.path.isfile(path) and name != "config.json":
            shutil.copy(path, os.path.join(opts.out, name))
    print(f"{opts.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, random weights")


if __name__ == "__main__":
    main()
