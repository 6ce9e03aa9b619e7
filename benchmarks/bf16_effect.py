"""What ``bf16=True`` (CPU autocast to bfloat16) does to the completion log-probs.

Usage::

    .venv/bin/python benchmarks/bf16_effect.py [--completion_length 64] [--rows 8]

Samples ``rows`` completions of the anchor prompt from the float32 embedded model, then scores
them with ``completion_logps`` (the trainer's function) in float32 and under
``torch.autocast("cpu", dtype=torch.bfloat16)``, as the trainer's loss does with ``bf16=True``.
Prints, over the completion tokens: the absolute log-prob difference (mean, median, 99th
percentile, max), the importance ratio ``exp(logp_bf16 - logp_fp32)`` that a bf16 policy would
see against float32 sampler log-probs (mean absolute deviation from 1, and the share of tokens
outside PPO's clip range [0.8, 1.28]), and the entropy difference. Also the time of one
forward + backward in each precision (the second of two).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completion_length", type=int, default=64)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    opts = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.models.embedded import resolve_embedded
    from posttrain.ops.logprobs import completion_logps

    path = resolve_embedded("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    question = "What is 17 + 25? Think briefly, then give the answer inside <answer></answer>."
    text = tok.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    prompt = tok([text] * opts.rows, return_tensors="pt", add_special_tokens=False)
    torch.manual_seed(opts.seed)
    model.eval()
    with torch.no_grad():
        out = model.generate(
            **prompt,
            do_sample=True,
            temperature=1.0,
            top_k=None,
            max_new_tokens=opts.completion_length,
            min_new_tokens=opts.completion_length,
            pad_token_id=tok.pad_token_id,
        )
    completion = out[:, prompt["input_ids"].shape[1] :]
    inputs = {
        "prompt_ids": prompt["input_ids"],
        "prompt_mask": prompt["attention_mask"],
        "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
    }
    model.train()
    results, seconds = {}, {}
    for name, context in (
        ("fp32", torch.autocast("cpu", enabled=False)),
        ("bf16", torch.autocast("cpu", dtype=torch.bfloat16)),
    ):
        for _ in range(2):  # the second, warm, run is timed
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with context:
                scored = completion_logps(model, **inputs, with_entropy=True)
                loss = -scored.logps.mean()
            loss.backward()
            seconds[name] = time.perf_counter() - start
        results[name] = (scored.logps.detach().float(), scored.entropy.detach().float())
    diff = (results["bf16"][0] - results["fp32"][0]).flatten()
    ratio = diff.exp()
    quantiles = torch.quantile(diff.abs(), torch.tensor([0.5, 0.99]))
    report = {
        "tokens": diff.numel(),
        "abs_logp_diff_mean": diff.abs().mean().item(),
        "abs_logp_diff_median": quantiles[0].item(),
        "abs_logp_diff_p99": quantiles[1].item(),
        "abs_logp_diff_max": diff.abs().max().item(),
        "ratio_abs_dev_mean": (ratio - 1).abs().mean().item(),
        "ratio_outside_clip_share": ((ratio < 0.8) | (ratio > 1.28)).float().mean().item(),
        "abs_entropy_diff_mean": (results["bf16"][1] - results["fp32"][1]).abs().mean().item(),
        "fp32_forward_backward_s": seconds["fp32"],
        "bf16_forward_backward_s": seconds["bf16"],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
