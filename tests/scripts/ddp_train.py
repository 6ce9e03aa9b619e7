"""Run by tests/test_distributed.py under torchrun: 2 CPU processes (gloo), 2 GRPO steps.

Each rank writes the prompts its reward function saw at each step and a digest of its final
parameters to OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from conftest import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from helpers import leave_without_teardown, make_config, standard_dataset  # noqa: E402

from posttrain import GRPOTrainer  # noqa: E402
from posttrain.models.distributed import end_process_group  # noqa: E402


def main() -> None:
    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    seen: list[list[str]] = []

    def record(prompts, completion_ids, **kwargs):
        seen.append(list(prompts))
        return [float(sum(ids) % 5) for ids in completion_ids]

    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok, seed=0)  # same initial weights on both ranks
    # 2 completions per process, 4 per prompt: every group straddles the two processes
    args = make_config(
        out_dir, per_device_train_batch_size=2, num_generations=4, max_steps=2, ddp_backend="gloo", seed=1
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=record, args=args, train_dataset=standard_dataset(), processing_class=tok
    )
    trainer.train()
    digest = hashlib.sha256()
    for p in trainer.model.parameters():
        digest.update(p.detach().to(torch.float32).numpy().tobytes())
    logs = [h for h in trainer.state.log_history if "reward" in h]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"seen": seen, "params": digest.hexdigest(), "logs": logs}, f)
    end_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()
