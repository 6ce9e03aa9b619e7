"""A sweep's shared generation call against each run sampling alone, on the default task.

Usage (posttrain's environment, nothing else running)::

    .venv/bin/python benchmarks/sweep_generation.py [--runs 4] [--rows 8] [--tokens 64] [--repeats 3]
        [--precision float32|bf16] [--min_tokens 0]

SmolLM2-135M (float32) with RUNS LoRA adapters (rank 16 on every linear layer, small random
``B`` so each adapter changes the model); each run gets one prompt of the built-in arithmetic
task repeated ROWS times (a GRPO group), sampled at temperature 0.7 for at most TOKENS tokens
(at least MIN_TOKENS: the task's completions end after about 20; 64 shows longer ones).
Alternating, REPEATS times: the runs one after the other, each with its adapter active
(``TransformersGenerator`` as a lone run uses it: lean loop, shared prompt prefix), then one
``SharedGeneration`` call with every row routed through its run's adapter. ``--precision bf16``
samples as bf16 training does on a CPU with bf16 instructions: each lone call from a bf16 copy
with its adapter merged in, the shared call from a bf16 copy of the base with each row block's
LoRA terms (every call builds its copy, as after an optimizer step). Prints the wall times and
the generation paths taken, as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["float32", "bf16"], default="float32")
    parser.add_argument("--min_tokens", type=int, default=0)
    args = parser.parse_args()
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from posttrain.data.tasks import load_task
    from posttrain.generation.transformers_backend import TransformersGenerator
    from posttrain.models.embedded import resolve_embedded
    from posttrain.sweep.generation import Request, SharedGeneration

    path = resolve_embedded("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    lora = LoraConfig(
        r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora, adapter_name="r0"
    )
    for index in range(1, args.runs):
        model.add_adapter(f"r{index}", lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    model.eval()
    data = load_task("arithmetic", n=args.runs, seed=0, few_shot=1, max_value=20, system_prompt=None)
    config = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=args.tokens,
                              min_new_tokens=args.min_tokens or None,
                              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    prompts = []
    for index in range(args.runs):
        text = tok.apply_chat_template(data[index]["prompt"], tokenize=False, add_generation_prompt=True)
        batch = tok([text] * args.rows, return_tensors="pt", padding=True)
        prompts.append((batch["input_ids"], batch["attention_mask"]))
    times: dict[str, list[float]] = {"alone": [], "shared": []}
    paths = {}
    for repeat in range(args.repeats):
        torch.manual_seed(repeat)
        start = time.perf_counter()
        for index, (ids, mask) in enumerate(prompts):
            model.set_adapter(f"r{index}")
            generator = TransformersGenerator(lambda: model, config, sampler_precision=args.precision)
            generator.generate(ids, mask)
        times["alone"].append(time.perf_counter() - start)
        paths["alone"] = generator.path.describe()
        torch.manual_seed(repeat)
        shared = SharedGeneration(hand_over=lambda name: None)
        generators = [
            TransformersGenerator(lambda: model, config, sampler_precision=args.precision) for _ in prompts
        ]
        start = time.perf_counter()
        shared.pending.extend(
            Request(f"r{index}", generators[index], ids, mask, None)
            for index, (ids, mask) in enumerate(prompts)
        )
        shared.serve()
        times["shared"].append(time.perf_counter() - start)
        paths["shared"] = generators[0].path.describe()
        print(repeat, {key: round(value[-1], 2) for key, value in times.items()}, flush=True)
    result = {
        "runs": args.runs, "rows_per_run": args.rows, "max_new_tokens": args.tokens, "min_new_tokens": args.min_tokens,
        "precision": args.precision,
        "alone_s": [round(t, 2) for t in times["alone"]], "shared_s": [round(t, 2) for t in times["shared"]],
        "shared_over_alone_median": round(statistics.median(times["shared"]) / statistics.median(times["alone"]), 3),
        "paths": paths,
    }  # fmt: skip
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
