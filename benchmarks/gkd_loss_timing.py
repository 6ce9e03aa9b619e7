"""The GKD loss alone: posttrain's chunked JSD against full [T, V] logits, forward and backward.

Usage::

    benchmarks/.venv/bin/python benchmarks/gkd_loss_timing.py --positions 208 976

Where a GKD step's time goes beyond the two models' layers (``gkd_compare.py`` measures whole
steps). For ``N`` completion positions of one row: the student's final hidden states ``[N, H]``
(with gradient) and the teacher's, the embedded SmolLM2's tied head ``[V, H]`` for both (the
teacher's a separate copy), ``beta=0.5``. posttrain: ``ops.divergence.token_divergence``
(projects a chunk of positions at a time, recomputes them in backward). Full logits: both
``[1, N, V]`` logits built by the head, then TRL's own ``GKDTrainer.generalized_jsd_loss``
(called, not copied), as its ``compute_loss`` does. Each timing is the median of ``--repeats``
forward + backward passes, with the student head's gradient included. Peak memory: the largest rise
of the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` before each
pass) over its resident set at the pass's start, in MB; it counts what the pass leaves (the head's
gradient) and what it frees before returning.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import time


def _status_kb(field: str) -> int:
    """A ``/proc/self/status`` field in kB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+)", f.read()).group(1))


def _peak_rise_mb(fn) -> float:
    """Run ``fn`` and return how far the resident set's peak rose above its level at the start (MB)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--positions", type=int, nargs="+", default=[208, 976])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    opts = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from trl.experimental.gkd import GKDTrainer

    from posttrain.models.loading import resolve_model_path
    from posttrain.ops.divergence import HeadInputs, token_divergence

    folder = opts.model or resolve_model_path("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    weight = model.get_output_embeddings().weight.detach().clone().requires_grad_(True)  # [V, H]
    teacher_weight = weight.detach().clone() * 1.5  # the sharpened teacher of gkd_step.py
    del model
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> tuple[float, float]:
        """The median time of ``--repeats`` passes (s), then the peak memory rise of one more (MB)."""
        times = []
        for _ in range(opts.repeats):
            weight.grad = None
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        weight.grad = None
        return statistics.median(times), _peak_rise_mb(fn)

    print(f"threads {torch.get_num_threads()}, vocabulary {weight.shape[0]}, hidden {weight.shape[1]}")
    print(
        "| positions | posttrain chunked JSD (s) | full logits + TRL's JSD (s) | ratio | values "
        "| posttrain peak (MB) | full logits peak (MB) |"
    )
    print("|---|---|---|---|---|---|---|")

    def chunked(s_x, t_x, n: int, values: dict) -> None:
        div, _ = token_divergence(HeadInputs(s_x, weight), HeadInputs(t_x, teacher_weight), 0.5)
        loss = div.sum() / n
        loss.backward()
        values["posttrain"] = loss.item()

    def full(s_x, t_x, n: int, values: dict) -> None:
        student_logits = (s_x @ weight.t()).unsqueeze(0)  # [1, N, V]
        with torch.no_grad():
            teacher_logits = (t_x @ teacher_weight.t()).unsqueeze(0)
        labels = torch.zeros(1, n, dtype=torch.long)  # every position counts
        loss = GKDTrainer.generalized_jsd_loss(student_logits, teacher_logits, labels=labels, beta=0.5)
        loss.backward()
        values["full"] = loss.item()

    for n in opts.positions:
        hidden = torch.randn(n, weight.shape[1], generator=gen)
        hidden = hidden / hidden.norm(dim=-1, keepdim=True) * 20.0
        s_x = hidden.clone().requires_grad_(True)
        t_x = hidden.clone()
        values: dict[str, float] = {}
        a, a_mb = timed(functools.partial(chunked, s_x, t_x, n, values))
        b, b_mb = timed(functools.partial(full, s_x, t_x, n, values))
        print(
            f"| {n} | {a:.2f} | {b:.2f} | {a / b:.2f} | {values['posttrain']:.6f} / {values['full']:.6f} "
            f"| {a_mb:.0f} | {b_mb:.0f} |"
        )


if __name__ == "__main__":
    main()
