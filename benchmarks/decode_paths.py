"""Generation paths on the anchor shape, measured side by side in one process.

Three measurements, each alternating the variants so that the drift of a shared machine falls
on all of them alike (medians, ratios to the first variant):

- ``--step_repeats N``: the prompt prefill (every row against each distinct prompt once) and
  one decode step (8 rows, 1 token, KV cache of the prompt) under each weight-layout variant,
  alternating step by step; plus what packing the weights costs per ``generate`` call.
- ``--rounds N``: whole ``generate`` calls: 8 completions of exactly 64 tokens
  (``min_new_tokens=64``) of one prompt, seeded, for each of ``--variants``; the sampled tokens
  are compared with the first variant's, and the largest absolute logit difference along the
  sampled sequences is printed. The ``lean`` variants sample with another random stream than
  ``generate``, so their tokens differ from ``plain``'s (``tests/test_lean_decode.py`` checks
  their exactness with top-k 1).
- ``--microbench``: the LM head product alone, ``F.linear`` against oneDNN prepacked.

SmolLM2-135M-Instruct in float32 on the CPU. ``--threads 1`` (the default) makes the process
CPU time a steadier measure than the wall clock on a shared machine; ``--threads 2`` is the
anchor's thread count (CPU time then adds both threads).

Run: ``.venv/bin/python -u benchmarks/decode_paths.py --step_repeats 30 --rounds 3``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from posttrain.generation.continuous_batching import ContinuousBatchingGenerator
from posttrain.generation.transformers_backend import (
    TransformersGenerator,
    group_prompts,
    onednn_prepacked_linears,
    packable_linears,
    prefill_shared_prefix,
)

MODEL = os.path.expanduser("~/.cache/posttrain/models/smollm2-135m-instruct")
QUESTION = "What is 17 + 25? Think briefly, then give the answer inside <answer></answer>."

Variant = Callable[[torch.nn.Module, GenerationConfig, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- weight-layout variants (subsets of what onednn_prepacked_linears swaps) ----------------------


@contextlib.contextmanager
def onednn_subset(model: torch.nn.Module, rows: int, select: Callable[[str], bool] | None) -> Iterator[None]:
    """Prepack only the packable linears whose name ``select`` accepts (all when ``select`` is None)."""
    if select is None:
        with onednn_prepacked_linears(model, rows):
            yield
        return
    names = {id(m): n for n, m in model.named_modules()}
    keep = [m for m in packable_linears(model) if not select(names[id(m)])]
    for m in keep:  # a placeholder in __dict__ makes packable_linears skip the layer
        m.forward = m.forward
    try:
        with onednn_prepacked_linears(model, rows):
            yield
    finally:
        for m in keep:
            del m.forward


SUBSETS: dict[str, Callable[[str], bool] | None] = {
    "onednn_head": lambda n: n == "lm_head",
    "onednn_mlp_head": lambda n: n == "lm_head" or ".mlp." in n,
    "onednn_all": None,
}


# ---- whole-generate variants -------------------------------------------------------------------------


def _generator(share_prefix: bool, prepack: bool, lean: bool = False) -> Variant:
    def run(model, config, ids, mask):
        gen = TransformersGenerator(
            lambda: model, config, share_prefix=share_prefix, prepack_weights=prepack, lean=lean
        )
        out = gen.generate(ids, mask).completion_ids
        expected = ("lean+shared_prefix" if share_prefix else "lean") if lean else None
        assert expected is None or gen.path.taken == expected, (gen.path.taken, gen.path.lean_blocker)
        return out

    return run


def _subset(name: str) -> Variant:
    def run(model, config, ids, mask):
        with onednn_subset(model, ids.shape[0], SUBSETS[name]):
            return _generator(False, False)(model, config, ids, mask)

    return run


def _inference_mode(model, config, ids, mask):
    with torch.inference_mode():
        out = _generator(False, False)(model, config, ids, mask)
    return out.clone()  # a normal tensor again, usable in the training forward


def _static_cache(model, config, ids, mask):
    config = GenerationConfig(**{**config.to_dict(), "cache_implementation": "static"})
    return _generator(False, False)(model, config, ids, mask)


def _without_stopping(config: GenerationConfig) -> GenerationConfig:
    """The config without EOS and minimum length: exactly ``max_new_tokens`` tokens either way.

    Continuous batching drops ``min_new_tokens``, so its comparison forces the length this way.
    """
    return GenerationConfig(**{**config.to_dict(), "eos_token_id": None, "min_new_tokens": None})


def _plain_no_eos(model, config, ids, mask):
    return _generator(False, False)(model, _without_stopping(config), ids, mask)


def _continuous_batching(model, config, ids, mask):
    gen = ContinuousBatchingGenerator(lambda: model, _without_stopping(config))
    return gen.generate(ids, mask).completion_ids


VARIANTS: dict[str, Variant] = {
    "plain": _generator(False, False),
    "shared_prefix": _generator(True, False),
    "prepacked": _generator(False, True),
    "shared_prefix+prepacked": _generator(True, True),  # generate with both speed-ups
    "lean": _generator(True, True, lean=True),  # TransformersGenerator's defaults: decode.lean_generate
    "lean_plain": _generator(False, False, lean=True),  # the lean loop alone
    **{name: _subset(name) for name in SUBSETS},
    "inference_mode": _inference_mode,
    "static_cache": _static_cache,
    "plain_no_eos": _plain_no_eos,
    "continuous_batching": _continuous_batching,
}


# ---- exactness ---------------------------------------------------------------------------------------


def generate_logit_diff(model, config, ids, mask, share_prefix: bool, prepack: bool) -> float:
    """Largest |logit| difference over the sampled steps of ``generate``, variant against plain."""
    config = GenerationConfig(**{**config.to_dict(), "output_logits": True, "return_dict_in_generate": True})
    with torch.no_grad():
        torch.manual_seed(0)
        plain = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        kwargs = {"cache": prefill_shared_prefix(model, group_prompts(ids, mask))} if share_prefix else {}
        torch.manual_seed(0)
        with onednn_prepacked_linears(model, ids.shape[0]) if prepack else contextlib.nullcontext():
            other = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **kwargs)
    if not torch.equal(plain.sequences, other.sequences):
        return float("inf")  # the tokens differ: logits of different prefixes are not comparable
    return max((a - b).abs().max().item() for a, b in zip(plain.logits, other.logits, strict=True))


# ---- step-level measurements -------------------------------------------------------------------------


def _timed_step(model, step_ids: torch.Tensor, step_mask: torch.Tensor, cache) -> float:
    """CPU seconds of one decode forward; the cache is cropped back to the prompt afterwards."""
    start = time.process_time()
    model(step_ids, attention_mask=step_mask, cache=cache, use_cache=True)
    elapsed = time.process_time() - start
    cache.crop(-1)
    return elapsed


def decode_step_bench(model, ids: torch.Tensor, mask: torch.Tensor, repeats: int) -> None:
    """One decode step per variant, alternating step by step; packing runs outside the timed step."""
    steps: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "plain": contextlib.nullcontext,
        **{name: (lambda s=s: onednn_subset(model, ids.shape[0], s)) for name, s in SUBSETS.items()},
        "inference_mode": torch.inference_mode,
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        cache = out.cache
        step_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [N, 1]
        step_mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
        for _ in range(repeats):
            for name, context in steps.items():
                with context():
                    times[name].append(_timed_step(model, step_ids, step_mask, cache))
    base = statistics.median(times["plain"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"decode step {name:16s} {med * 1e3:7.1f} ms CPU  ratio {med / base:.3f}")
    for name, select in SUBSETS.items():
        start = time.process_time()
        with onednn_subset(model, ids.shape[0], select):
            pack = time.process_time() - start
        print(f"packing {name:16s} {pack * 1e3:7.1f} ms CPU per generate call")


def prefill_bench(model, ids: torch.Tensor, mask: torch.Tensor, repeats: int) -> None:
    """The prompt prefill: every row (plain) against each distinct prompt once plus the cache copy."""
    times: dict[str, list[float]] = {"plain prefill": [], "shared prefill": []}
    with torch.no_grad():
        for _ in range(repeats):
            start = time.process_time()
            model(ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
            times["plain prefill"].append(time.process_time() - start)
            start = time.process_time()
            prefill_shared_prefix(model, group_prompts(ids, mask))
            times["shared prefill"].append(time.process_time() - start)
    for name, values in times.items():
        print(f"{name:16s} {statistics.median(values) * 1e3:7.1f} ms CPU")


def lm_head_microbench(model: torch.nn.Module, rows: int, repeats: int = 20) -> None:
    """The LM head alone: ``F.linear`` against the oneDNN prepacked product, alternating."""
    w = model.lm_head.weight.detach()
    x = torch.randn(rows, w.shape[1])
    start = time.process_time()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
    pack_s = time.process_time() - start
    fns = {
        "F.linear": lambda: F.linear(x, w),
        "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
    }
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.process_time()
            fn()
            times[name].append(time.process_time() - start)
    for name, values in times.items():
        print(f"lm_head {name}: {statistics.median(values) * 1e3:.1f} ms CPU per call")
    print(f"lm_head packing: {pack_s * 1e3:.1f} ms CPU")


# ---- whole-generate rounds ---------------------------------------------------------------------------


def measure(variant: Variant, model, config, ids, mask) -> tuple[float, float, torch.Tensor]:
    """One seeded call: (wall seconds, process CPU seconds, completions)."""
    torch.manual_seed(0)
    wall, cpu = time.perf_counter(), time.process_time()
    out = variant(model, config, ids, mask)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def run_rounds(opts: argparse.Namespace, model, config, ids, mask) -> None:
    """Alternate the variants, then print medians, ratios, token equality and logit differences."""
    walls: dict[str, list[float]] = {v: [] for v in opts.variants}
    cpus: dict[str, list[float]] = {v: [] for v in opts.variants}
    outs: dict[str, torch.Tensor] = {}
    for name in opts.variants:  # warm-up: first-call costs (oneDNN primitives, allocator) not counted
        measure(VARIANTS[name], model, config, ids[:2], mask[:2])
    for r in range(opts.rounds):
        for name in opts.variants:
            wall, cpu, outs[name] = measure(VARIANTS[name], model, config, ids, mask)
            walls[name].append(wall)
            cpus[name].append(cpu)
            print(f"round {r} {name:24s} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    base = opts.variants[0]
    w0, c0 = statistics.median(walls[base]), statistics.median(cpus[base])
    print(f"\n{'variant':24s} {'wall s':>7s} {'cpu s':>7s} {'wall/base':>9s} {'cpu/base':>8s} same")
    for name in opts.variants:
        w, c = statistics.median(walls[name]), statistics.median(cpus[name])
        same = torch.equal(outs[name], outs[base])
        print(f"{name:24s} {w:7.2f} {c:7.2f} {w / w0:9.3f} {c / c0:8.3f} {same}")


def report_exactness(model, config, ids, mask) -> None:
    """Logit differences of the kept paths against plain ``generate``."""
    for share, pack in ((True, False), (False, True), (True, True)):
        diff = generate_logit_diff(model, config, ids, mask, share, pack)
        steps = config.max_new_tokens
        print(f"max |dlogit| over {steps} sampled steps, shared_prefix={share} prepacked={pack}: {diff:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=MODEL)
    parser.add_argument(
        "--variants", nargs="+", default=["plain", "shared_prefix+prepacked"], choices=list(VARIANTS)
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--microbench", action="store_true", help="also time the LM head alone")
    parser.add_argument("--step_repeats", type=int, default=0, help="time prefills and decode steps N times")
    parser.add_argument("--exactness", action="store_true", help="print logit differences of the kept paths")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    tok = AutoTokenizer.from_pretrained(opts.model)
    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": QUESTION}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = prompt["input_ids"].repeat(opts.rows, 1)
    mask = torch.ones_like(ids)
    config = GenerationConfig(
        max_new_tokens=opts.new_tokens,
        min_new_tokens=opts.new_tokens,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        use_cache=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    print(f"rows={opts.rows} prompt_len={ids.shape[1]} new_tokens={opts.new_tokens} threads={opts.threads}")
    if opts.microbench:
        lm_head_microbench(model, opts.rows)
    if opts.step_repeats:
        prefill_bench(model, ids, mask, opts.step_repeats)
        decode_step_bench(model, ids, mask, opts.step_repeats)
    if opts.exactness:
        report_exactness(model, config, ids, mask)
    if opts.rounds:
        run_rounds(opts, model, config, ids, mask)


if __name__ == "__main__":
    main()
