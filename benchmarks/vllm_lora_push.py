"""The weight push to a colocated vLLM engine: merged (every weight) against adapter-only (``vllm_lora_sync``).

Usage (in an environment with vLLM's CPU build beside posttrain, docs/vllm.md)::

    .venv-vllm/bin/python benchmarks/vllm_lora_push.py [--rank 16] [--pushes 5]

SmolLM2-135M (the embedded model, float32) with a LoRA adapter on every linear layer of its
decoder (q, k, v, o, gate, up, down), one engine built with ``enable_lora``: first the merged
pushes, then the base reloaded once and the adapter-only pushes. Each push is timed
the way the trainer makes it (``VLLMColocateGenerator.push_weights``): merged, the adapters merged
into the base, every weight reloaded (``reload_weights``) and unmerged; adapter-only, the adapter
written with PEFT's ``save_pretrained`` and loaded in place (``add_lora`` with ``load_inplace``).
After each push, one generation checks that the engine samples from the trainer's PEFT model
(the largest gap between the engine's and the model's log-probs of the sampled tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "localhost",
                   "MASTER_PORT": "12397", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():  # fmt: skip
    os.environ.setdefault(key, value)

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from posttrain.generation.vllm_backend import reload_engine_weights  # noqa: E402
from posttrain.generation.vllm_common import merged_adapters, weight_items  # noqa: E402
from posttrain.generation.vllm_lora import AdapterSync, base_weight_items, lora_engine_kwargs  # noqa: E402
from posttrain.models.embedded import resolve_embedded  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def gap(llm, model, ids, request) -> float:
    import vllm

    params = vllm.SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, seed=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, lora_request=request, use_tqdm=False)[0].outputs[
        0
    ]
    tokens = list(out.token_ids)
    theirs = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, tokens, strict=True)])
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].log_softmax(-1)
    mine = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return float((mine - theirs).abs().max())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--pushes", type=int, default=5)
    opts = parser.parse_args()
    import vllm
    from vllm.lora.request import LoRARequest

    path = resolve_embedded("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        LoraConfig(r=opts.rank, lora_alpha=2 * opts.rank, target_modules=TARGETS, lora_dropout=0.0),
    )
    llm = vllm.LLM(
        model=path, dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True, seed=0, max_num_seqs=8,
        distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs",
        **lora_engine_kwargs(model),
    )  # fmt: skip
    ids = tok("What is 12 + 30?")["input_ids"]
    folder = tempfile.mkdtemp()
    sync = AdapterSync(folder, LoRARequest)
    times: dict[str, list[float]] = {"merged": [], "adapter": []}
    gaps: dict[str, list[float]] = {"merged": [], "adapter": []}
    for kind in ("merged", "adapter"):  # merged first: its pushes leave a merged base in the engine
        for _ in range(opts.pushes):
            with torch.no_grad():  # an optimizer step's worth of change in every adapter matrix
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.add_(torch.randn_like(p) * 0.01)
            if kind == "adapter" and not sync.base_loaded:  # the base, once, as the trainer does (not timed)
                reload_engine_weights(llm, base_weight_items(model))
                sync.base_loaded = True
            start = time.perf_counter()
            if kind == "merged":
                with merged_adapters(model) as merged:
                    reload_engine_weights(llm, list(weight_items(merged)))
            else:
                sync.push(llm, model)
            llm.reset_prefix_cache()
            times[kind].append(time.perf_counter() - start)
            gaps[kind].append(gap(llm, model, ids, sync.request(model) if kind == "adapter" else None))
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    full = sum(t.numel() * t.element_size() for _, t in weight_items(model))
    report = {
        "rank": opts.rank,
        "merged_push_s": statistics.median(times["merged"]),
        "adapter_push_s": statistics.median(times["adapter"]),
        "ratio": statistics.median(times["adapter"]) / statistics.median(times["merged"]),
        "adapter_mb": size / 2**20,
        "model_mb": full / 2**20,
        "max_gap": {k: max(v) for k, v in gaps.items()},
        "times": times,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
