"""The ``two_processes`` case of the GRPO regression fixture, run by torchrun on 2 gloo processes.

Rank 0 writes ``summary()`` of its trainer to OUT_DIR/rank0.json (metrics are reduced across
processes and the parameters stay identical, so rank 0 speaks for both).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from conftest import build_tiny_model, build_tiny_tokenizer  # noqa: E402
from helpers import leave_without_teardown, make_trainer  # noqa: E402
from regression_cases import _config, _reward, summary  # noqa: E402

from posttrain.models.distributed import end_process_group  # noqa: E402


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    tok = build_tiny_tokenizer()
    # 2 completions per process, 4 per prompt: every group straddles the two processes
    args = _config(out_dir, per_device_train_batch_size=2, ddp_backend="gloo")
    trainer = make_trainer(tok, _reward, args, model=build_tiny_model(tok, seed=3))
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump(summary(trainer), f)
    end_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()
