"""Peak memory and time of the log-prob loss: naive full logits vs chunked hidden states.

For the embedded SmolLM2-135M-Instruct (float32, CPU), B completions of T tokens after a
P-token prompt, one forward + backward of ``-mean(logps)`` with the entropy computed for the
metrics (no entropy gradient), as ``GRPOTrainer.compute_loss`` does by default, gradient
checkpointing on (the trainer's default). Each (variant, T) runs in a fresh process so its
``ru_maxrss`` belongs to it alone; variants alternate within each length.

Before the measured step each process makes the weights and gradient buffers resident and warms
up on a tiny batch. Reported per run: ``step_mb``, the run's peak resident memory minus the
resident memory just before the step (the activations and logits of the forward + backward),
``peak_mb`` (the whole run's ``ru_maxrss``) and ``seconds`` (forward + backward, wall clock).
Machines here are shared: compare the chunked / naive ratios of one invocation.

    .venv/bin/python benchmarks/logprobs_memory.py --lengths 64 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MB = 1024 * 1024


def rss_now_mb() -> float:
    """Resident memory of this process now (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MB


def peak_rss_mb() -> float:
    """``ru_maxrss`` of this process so far (kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_folder() -> str:
    from posttrain.models.embedded import embedded_cache_dir

    return str(embedded_cache_dir("smollm2-135m-instruct"))


def make_inputs(vocab: int, b: int, p: int, t: int) -> tuple:
    """Random prompt and completion ids, no padding: [B, P], [B, P], [B, T], [B, T]."""
    import torch

    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, vocab, (b, p), generator=g)
    completion_ids = torch.randint(0, vocab, (b, t), generator=g)
    return prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids)


def loss_step(model, inputs: tuple, chunk_size: int | None) -> float:
    """Forward + backward of ``-mean(logps)``, entropy computed without gradient (the trainer's default)."""
    from posttrain.ops.logprobs import completion_logps

    out = completion_logps(model, *inputs, temperature=0.7, with_entropy=True, chunk_size=chunk_size)
    mask = inputs[3]
    loss = -(out.logps * mask).sum() / mask.sum()
    loss.backward()
    return float(loss.detach())


def load_model(opts: argparse.Namespace):
    """The model in float32, its weights and gradient buffers resident, warmed up on a tiny batch.

    Done before measuring so the step's memory is its activations and logits only, not the weights
    paged in from the mmapped safetensors or the first allocation of the gradients.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(opts.model, dtype=torch.float32)
    if opts.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # also reads the weights into memory
    chunk_size = opts.chunk_size if opts.variant == "chunked" else None
    loss_step(model, make_inputs(model.config.vocab_size, 1, 4, 4), chunk_size)
    return model


def worker(opts: argparse.Namespace) -> dict:
    """One measured forward + backward of the log-prob loss in this process."""
    model = load_model(opts)
    inputs = make_inputs(model.config.vocab_size, opts.batch, opts.prompt_length, opts.length)
    chunk_size = opts.chunk_size if opts.variant == "chunked" else None
    before_mb = rss_now_mb()
    start = time.perf_counter()
    loss = loss_step(model, inputs, chunk_size)
    seconds = time.perf_counter() - start
    peak_mb = peak_rss_mb()
    return {
        "variant": opts.variant,
        "T": opts.length,
        "step_mb": round(peak_mb - before_mb, 1),
        "peak_mb": round(peak_mb, 1),
        "seconds": round(seconds, 2),
        "loss": round(loss, 6),
    }


def run_one(opts: argparse.Namespace, variant: str, length: int) -> dict:
    """``worker`` in a fresh Python process; its JSON line."""
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--length", str(length)]
    cmd += ["--model", opts.model, "--batch", str(opts.batch), "--prompt_length", str(opts.prompt_length)]
    cmd += [
        "--chunk_size",
        str(opts.chunk_size),
        "--gradient_checkpointing",
        str(opts.gradient_checkpointing),
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(rows: list[dict]) -> None:
    """A markdown table, one line per length, chunked / naive ratios last."""
    print(
        "| T | naive step MB | chunked step MB | ratio | naive peak MB | chunked peak MB | ratio "
        "| naive s | chunked s | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in sorted({r["T"] for r in rows}):
        n = next(r for r in rows if r["T"] == length and r["variant"] == "naive")
        c = next(r for r in rows if r["T"] == length and r["variant"] == "chunked")
        cells = [length]
        for key in ("step_mb", "peak_mb", "seconds"):
            cells += [n[key], c[key], f"{c[key] / n[key]:.2f}"]
        print("| " + " | ".join(str(x) for x in cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[64, 256, 1024], help="completion lengths T"
    )
    parser.add_argument("--batch", type=int, default=8, help="completions B")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument(
        "--chunk_size", type=int, default=None, help="token rows per chunk (default: the library's)"
    )
    parser.add_argument("--gradient_checkpointing", type=int, default=1)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2 cache)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    opts.model = opts.model or model_folder()
    if opts.chunk_size is None:
        from posttrain.ops.chunked import DEFAULT_CHUNK_SIZE

        opts.chunk_size = DEFAULT_CHUNK_SIZE
    if opts.worker:
        print(json.dumps(worker(opts)))
        return
    rows = []
    for length in opts.lengths:
        for variant in ("naive", "chunked"):
            rows.append(run_one(opts, variant, length))
            print(json.dumps(rows[-1]), flush=True)
    if len({r["loss"] for r in rows if r["T"] == rows[0]["T"]}) != 1:
        print("warning: the two variants' losses differ", file=sys.stderr)
    report(rows)


if __name__ == "__main__":
    main()
