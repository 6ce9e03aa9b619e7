"""The fused decode step of another commit against this tree's, alternating in one process.

On a shared host whose speed drifts by tens of per cent between minutes, two trees timed in
separate processes do not resolve a change of a few per cent in the decode step. This script
loads ``generation/fused_step.py`` as it was at ``--against`` (``git show``) next to this tree's,
builds both decoders from one model (SmolLM2-135M-Instruct, the embedded default) and samples
the same prompt with each in turn, same seed per round: it prints whether their tokens and
log-probs are equal and the median time of a decode step in each (after a warm-up round; the
prompt's own step is the model's forward and is not counted).

The older module runs against this tree's other modules (``fused_blockers``, ``reduced_kernels``,
``weight_casts``), so ``--against`` must be a commit whose ``fused_step.py`` still fits them.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/decode_against.py --against 37c4ee1 --backend bf16``
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.generation.decode import SamplingSettings, lean_generate_with_logps
from posttrain.generation.fused_step import FusedDecoder
from posttrain.models.embedded import resolve_embedded

ROOT = Path(__file__).resolve().parent.parent


def load_from(commit: str) -> type:
    """``FusedDecoder`` as ``generation/fused_step.py`` defined it at ``commit``."""
    source = subprocess.run(
        ["git", "show", f"{commit}:src/posttrain/generation/fused_step.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "fused_step_then.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("fused_step_then", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fused_step_then"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.FusedDecoder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--against", default="HEAD", help="the commit whose fused step is compared")
    parser.add_argument("--backend", choices=["bf16", "onednn"], default="bf16")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=64)
    opts = parser.parse_args()
    path = resolve_embedded("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = (ids if isinstance(ids, torch.Tensor) else ids["input_ids"]).repeat(opts.rows, 1)
    settings = SamplingSettings(
        max_new_tokens=opts.new_tokens,
        min_new_tokens=opts.new_tokens,
        temperature=1.0,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.eos_token_id,
        do_sample=True,
    )
    autocast = torch.bfloat16 if opts.backend == "bf16" else None  # a bf16-trained policy's copy
    spent = [0.0]
    times: dict[str, list[float]] = {opts.against: [], "this tree": []}
    with torch.no_grad():
        decoders = {
            opts.against: load_from(opts.against)(model, opts.rows, opts.backend, autocast_dtype=autocast),
            "this tree": FusedDecoder(model, opts.rows, opts.backend, autocast_dtype=autocast),
        }
        for decoder in decoders.values():
            step = decoder.step

            def timed(*args, _step=step, **kwargs):
                start = time.perf_counter()
                out = _step(*args, **kwargs)
                spent[0] += time.perf_counter() - start
                return out

            decoder.step = timed
        for r in range(opts.rounds):
            outputs = {}
            for name, decoder in decoders.items():
                spent[0] = 0.0
                torch.manual_seed(r)
                outputs[name] = lean_generate_with_logps(
                    model, ids, torch.ones_like(ids), settings, None, decoder
                )
                if r:
                    times[name].append(spent[0] / (opts.new_tokens - 1) * 1e3)
            if r == 0:
                then, now = outputs.values()
                equal = all(torch.equal(a, b) for a, b in zip(then, now, strict=True))
                print(f"round 0: tokens and log-probs equal: {equal}")
    medians = {name: round(statistics.median(v), 2) for name, v in times.items()}
    print(f"{opts.backend}, {opts.rows} rows, {opts.new_tokens} tokens: ms a decode step {medians}")


if __name__ == "__main__":
    main()
