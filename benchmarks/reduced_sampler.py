"""The reduced-precision sampler's decode step against float32's, on the anchor's shape.

SmolLM2-135M-Instruct (float32), 8 rows (one prompt, 8 completions), the fused one-token decode
step (``fused_step.FusedDecoder``) with each backend: ``onednn`` (float32, the default sampler),
and the reduced copies of ``GRPOConfig.sampler_precision`` that run on this CPU. One trajectory
is sampled from the float32 step; every backend is teacher-forced along it, each step alternating
the backends so that a shared machine's drift falls on all of them alike. Printed per backend:

- the median decode step (wall and process CPU time) and its ratio to float32's;
- the time to build the copy (what the sampler pays after each optimizer step);
- ``|log p_backend - log p_float32|`` of the sampled tokens (mean and max), the mismatch the
  importance-sampling correction sees (up to the float32 step's own 1e-6 against training).

``--products`` also times the linear products alone over one step's weights (the part a
reduced copy changes). ``--calls N`` times N rounds of whole generation calls (8 completions of
exactly 64 tokens, ``TransformersGenerator`` with each ``sampler_precision``, alternating), each
after ``weights_changed()``, as after an optimizer step: the reduced copy's rebuild is in the call,
as the float32 path's per-call packing is.

Run: ``.venv/bin/python -u benchmarks/reduced_sampler.py --steps 40 --threads 1``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.generation import reduced_precision
from posttrain.generation.decode import preallocated_cache
from posttrain.generation.fused_step import FusedDecoder

MODEL = os.path.expanduser("~/.cache/posttrain/models/smollm2-135m-instruct")
QUESTION = "What is 17 + 25? Think briefly, then give the answer inside <answer></answer>."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--backends", nargs="+", default=None, help="default: every reduced one this CPU runs"
    )
    parser.add_argument("--products", action="store_true")
    parser.add_argument("--calls", type=int, default=0)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    backends = opts.backends or [
        b for b in reduced_precision.REDUCED_BACKENDS if reduced_precision.backend_blocker(b) is None
    ]
    names = ["onednn", *backends]
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    text = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].repeat(opts.rows, 1)
    rows, width = ids.shape
    build: dict[str, float] = {}
    decoders = {}
    with torch.no_grad():
        for name in names:
            start = time.perf_counter()
            decoders[name] = FusedDecoder(model, rows, name)
            build[name] = time.perf_counter() - start
        caches = {name: preallocated_cache(model, width + opts.steps + 1) for name in names}
        for cache in caches.values():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache).logits[:, -1]
        torch.manual_seed(0)
        tokens = torch.multinomial(torch.softmax(logits, -1), 1)[:, 0]
        key_mask = torch.ones(rows, width + opts.steps + 1, dtype=torch.long)
        wall = {n: [] for n in names}
        cpu = {n: [] for n in names}
        diff = {n: [] for n in names}
        for step in range(opts.steps):
            positions = torch.full((rows,), width + step)
            out = {}
            for name in names:
                w, c = time.perf_counter(), time.process_time()
                out[name] = decoders[name].step(
                    tokens, positions, key_mask[:, : width + step + 1], caches[name].layers
                )
                if step >= 2:  # the first steps warm the kernels
                    wall[name].append(time.perf_counter() - w)
                    cpu[name].append(time.process_time() - c)
            reference = torch.log_softmax(out["onednn"], -1)
            tokens = torch.multinomial(reference.exp(), 1)[:, 0]
            for name in names:
                logp = torch.log_softmax(out[name], -1)
                diff[name].append((logp - reference).gather(1, tokens[:, None]).abs()[:, 0])
    base_wall, base_cpu = statistics.median(wall["onednn"]), statistics.median(cpu["onednn"])
    for name in names:
        d = torch.cat(diff[name])
        row = {
            "backend": name,
            "rows": rows,
            "threads": opts.threads,
            "step_wall_ms": 1e3 * statistics.median(wall[name]),
            "step_cpu_ms": 1e3 * statistics.median(cpu[name]),
            "wall_ratio": statistics.median(wall[name]) / base_wall,
            "cpu_ratio": statistics.median(cpu[name]) / base_cpu,
            "build_s": build[name],
            "logp_difference_mean": float(d.mean()),
            "logp_difference_max": float(d.max()),
            "isa": torch.backends.cpu.get_cpu_capability(),
        }
        print(json.dumps(row), flush=True)
    if opts.products:
        products(decoders, names)
    if opts.calls:
        del decoders, caches
        calls(model, tok, ids, ["float32", *backends], opts.calls)


def calls(model, tok, ids: torch.Tensor, precisions: list[str], rounds: int) -> None:
    """Whole generation calls per ``sampler_precision``, each rebuilding the reduced copy."""
    from posttrain.generation.transformers_backend import TransformersGenerator, sampling_config

    config = sampling_config(
        max_new_tokens=64,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        pad_token_id=tok.pad_token_id or 0,
        eos_token_ids=[tok.eos_token_id],
        generation_kwargs={"min_new_tokens": 64},
    )
    mask = torch.ones_like(ids)
    generators = {p: TransformersGenerator(lambda: model, config, sampler_precision=p) for p in precisions}
    wall = {p: [] for p in precisions}
    refresh = {p: [] for p in precisions}
    for _ in range(rounds):
        for precision, generator in generators.items():
            generator.weights_changed()
            start = time.perf_counter()
            generator.generate(ids, mask)
            wall[precision].append(time.perf_counter() - start)
            if generator.reduced is not None:
                refresh[precision].append(generator.reduced.last_refresh_seconds)
    base = statistics.median(wall["float32"])
    for precision in precisions:
        row = {
            "precision": precision,
            "call_wall_s": [round(t, 2) for t in wall[precision]],
            "ratio": statistics.median(wall[precision]) / base,
            "refresh_s": [round(t, 2) for t in refresh[precision]],
        }
        print(json.dumps(row), flush=True)


def products(decoders: dict, names: list[str]) -> None:
    """The linear products of one decode step alone, per backend (alternating, medians)."""
    first = decoders[names[0]]
    rows = 8
    x = {w: torch.randn(rows, w) for w in (576, first.q_width, first.intermediate)}

    def run(decoder: FusedDecoder) -> None:
        for layer in decoder.layers:
            decoder._linear(x[576], layer.qkv[0])
            decoder._linear(x[first.q_width], layer.o)
            decoder._linear(x[576], layer.gate_up[0])
            decoder._linear(x[first.intermediate], layer.down)
        decoder._linear(x[576], decoder.head)

    times = {n: [] for n in names}
    with torch.no_grad():
        for repeat in range(7):
            for name in names:
                start = time.process_time()
                run(decoders[name])
                if repeat:
                    times[name].append(time.process_time() - start)
    base = statistics.median(times[names[0]])
    for name in names:
        t = statistics.median(times[name])
        print(json.dumps({"backend": name, "products_cpu_ms": 1e3 * t, "ratio": t / base}), flush=True)


if __name__ == "__main__":
    main()
