"""Run by tests/test_vllm_backend.py under torchrun: 2 CPU processes (gloo), colocated vLLM with
``vllm_tensor_parallel_size=2`` (the stand-in engine of tests/vllm_standin.py), 2 GRPO steps.

Each rank writes the sizes of its engine's generation calls, the completions its engine made,
the completions its reward function saw and a digest of its final parameters to
OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import vllm_standin  # noqa: E402
from conftest import build_tiny_tokenizer  # noqa: E402
from helpers import leave_without_teardown, make_config, standard_dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

sys.modules.update(vllm_standin.install())

from posttrain import GRPOTrainer  # noqa: E402
from posttrain.models.distributed import end_process_group  # noqa: E402


def main() -> None:
    out_dir, model_dir = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    seen: list[list[list[int]]] = []

    def record(completion_ids, **kwargs):
        seen.append([list(ids) for ids in completion_ids])
        return [float(sum(ids) % 5) for ids in completion_ids]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = make_config(
        out_dir, per_device_train_batch_size=4, num_generations=4, max_steps=2, ddp_backend="gloo", seed=1,
        use_vllm=True, vllm_tensor_parallel_size=2, temperature=0.9,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=record, args=args, train_dataset=standard_dataset(),
        processing_class=build_tiny_tokenizer(),
    )  # fmt: skip
    (engine,) = vllm_standin.LLM.instances
    made: list[list[list[int]]] = []
    generate = engine.generate

    def keep(prompts, params, **kwargs):
        outputs = generate(prompts, params, **kwargs)
        made.append([list(o.outputs[0].token_ids) for o in outputs])
        return outputs

    engine.generate = keep
    trainer.train()
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().numpy().tobytes())
    calls = [c for c in engine.calls if c.startswith("generate")]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": calls, "made": made, "seen": seen, "params": digest.hexdigest()}, f)
    end_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()
