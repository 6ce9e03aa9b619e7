"""The bf16 step's three copies removed in session 35, each measured old against new in one process.

On a shared host whose speed drifts between minutes, whole-step timings of two trees do not
resolve changes of a few per cent; each part is timed here with the old and the new code
alternating in one process (medians after a warm-up round):

- ``build``: the bf16 sampler copy built inside a micro-step after an autocast prefill (the
  micro-step's casts held) from its own casts of the float32 weights (before) or from the
  micro-step's (``weight_casts.shared_cast``, after).
- ``middle``: the fused decode step of the bf16 copy of a bf16-trained policy, the MLP's middle in
  float32 (before) or in bf16 as autocast computes it (``FusedDecoder.bf16_middle``, after): 8 rows,
  64 tokens of SmolLM2-135M-Instruct.
- ``head``: the chunked head's forward and backward in bf16 products (256-row chunks), each
  chunk's product added to the float32 gradient with one mixed-dtype ``add_`` (before) or by
  blocks of rows (``chunked.add_in_blocks``, after).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/bf16_copies.py [--parts build middle head]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.generation.decode import SamplingSettings, lean_generate_with_logps
from posttrain.generation.fused_step import FusedDecoder
from posttrain.models.embedded import resolve_embedded
from posttrain.ops import chunked, weight_casts

ROUNDS = 7


def build(model: torch.nn.Module) -> dict[str, float]:
    ids = torch.randint(0, 1000, (1, 52))
    times: dict[str, list[float]] = {"before": [], "after": []}
    original = weight_casts.shared_cast
    with torch.no_grad():
        for r in range(ROUNDS):
            for name in times:
                casts = weight_casts.WeightCasts()
                casts.attach(model)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    model(input_ids=ids, logits_to_keep=1)  # the prefill casts every decoder weight
                if name == "before":
                    weight_casts.shared_cast = lambda *a, **k: None  # the casts stay held, unused
                start = time.perf_counter()
                decoder = FusedDecoder(model, 8, "bf16", autocast_dtype=torch.bfloat16)
                elapsed = time.perf_counter() - start
                weight_casts.shared_cast = original
                casts.release()
                del decoder
                if r:
                    times[name].append(elapsed * 1e3)
    return {f"{k} ms": statistics.median(v) for k, v in times.items()}


def middle(model: torch.nn.Module, tok: AutoTokenizer) -> dict[str, float]:
    messages = [{"role": "user", "content": "Write a short story about a robot learning to paint."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = (ids if isinstance(ids, torch.Tensor) else ids["input_ids"]).repeat(8, 1)
    settings = SamplingSettings(
        max_new_tokens=64,
        min_new_tokens=64,
        temperature=1.0,
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.eos_token_id,
        do_sample=True,
    )
    times: dict[str, list[float]] = {"before": [], "after": []}
    with torch.no_grad():
        for r in range(ROUNDS):
            for name in times:
                decoder = FusedDecoder(model, 8, "bf16", autocast_dtype=torch.bfloat16)
                decoder.bf16_middle = name == "after"
                step, spent = decoder.step, [0.0]

                def timed(*args, _step=step, _spent=spent, **kwargs):
                    start = time.perf_counter()
                    out = _step(*args, **kwargs)
                    _spent[0] += time.perf_counter() - start
                    return out

                decoder.step = timed
                torch.manual_seed(r)
                lean_generate_with_logps(model, ids, torch.ones_like(ids), settings, None, decoder)
                if r:
                    times[name].append(spent[0] / 63 * 1e3)  # the prompt's own step is the model's
    return {f"{k} ms a token": statistics.median(v) for k, v in times.items()}


def head(rows: int) -> dict[str, float]:
    torch.manual_seed(0)
    weight = (torch.randn(49152, 576) * 0.05).requires_grad_()
    hidden = torch.randn(rows, 576, requires_grad=True)
    targets = torch.randint(0, 49152, (rows,))
    blocks = chunked.add_in_blocks
    times: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(4):
        for name in times:
            chunked.add_in_blocks = blocks if name == "after" else (lambda total, part: total.add_(part))
            weight.grad = None
            start = time.perf_counter()
            logps, _ = chunked.token_stats(
                hidden, weight, None, targets, 1.0, 256, False, False, product_dtype=torch.bfloat16
            )
            logps.sum().backward()
            if r:
                times[name].append(time.perf_counter() - start)
    chunked.add_in_blocks = blocks
    return {f"{k} s": statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--parts", nargs="+", choices=["build", "middle", "head"], default=["build", "middle", "head"]
    )
    opts = parser.parse_args()
    path = resolve_embedded("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if "build" in opts.parts:
        print("build", build(model))
    if "middle" in opts.parts:
        print("middle", middle(model, AutoTokenizer.from_pretrained(path)))
    if "head" in opts.parts:
        for rows in (512, 2048, 8192):
            print(f"head {rows} rows", head(rows))


if __name__ == "__main__":
    main()
