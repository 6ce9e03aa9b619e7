"""Run by tests/test_online_dpo.py under torchrun: 2 CPU processes (gloo), 2 online DPO steps.

Each process samples one prompt's pair; the one-process run of the test samples both pairs.
Each rank answers from the same script at its own rows (every prompt is the same), and saves
its final parameters and logs to OUT_DIR/rank{r}.pt.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from test_online_dpo import ddp_comparable_trainer  # noqa: E402
from test_rloo import SCRIPT, RankScriptedGenerator  # noqa: E402

from posttrain.models.distributed import end_process_group  # noqa: E402


def main() -> None:
    out_dir = sys.argv[1]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    trainer = ddp_comparable_trainer(out_dir, prompts_per_device=1, ddp_backend="gloo")
    trainer.generator = RankScriptedGenerator(SCRIPT, offset=2 * rank, stride=4)
    trainer.train()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    logs = [
        {k: v for k, v in h.items() if k != "step_time"} for h in trainer.state.log_history if "loss" in h
    ]
    torch.save({"params": params, "logs": logs}, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


if __name__ == "__main__":
    main()
    # leave without the interpreter's teardown, where gloo's threads can abort the process
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
