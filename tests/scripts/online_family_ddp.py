"""Run under torchrun by the two-process tests of the online families (2 CPU processes, gloo).

Usage: ``online_family_ddp.py OUT_DIR TEST_MODULE SIZE``. ``TEST_MODULE`` (``test_rloo``,
``test_online_dpo``) builds the run with ``ddp_comparable_trainer(out_dir, SIZE, ...)``: the
same prompt everywhere, two SGD steps. Each rank answers from the script of the one-process run
at its own rows (``RankScriptedGenerator``), or with the module's ``ddp_generator(trainer)``
when it has one, and saves its final parameters and logs to
OUT_DIR/rank{r}.pt for the test to compare with one process.
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from helpers import RankScriptedGenerator, leave_without_teardown  # noqa: E402
from test_invariance import SCRIPT  # noqa: E402

from posttrain.models.distributed import end_process_group  # noqa: E402


def main() -> None:
    out_dir, module, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    trainer = importlib.import_module(module).ddp_comparable_trainer(out_dir, size, ddp_backend="gloo")
    completions_per_rank = trainer.args.generation_batch_size // 2
    own = getattr(importlib.import_module(module), "ddp_generator", None)
    trainer.generator = (
        own(trainer)
        if own is not None
        else RankScriptedGenerator(
            SCRIPT, offset=completions_per_rank * rank, stride=2 * completions_per_rank
        )
    )
    trainer.train()
    params = [p.detach().clone() for p in trainer.model.parameters()]
    logs = [
        {k: v for k, v in h.items() if k != "step_time"} for h in trainer.state.log_history if "loss" in h
    ]
    torch.save({"params": params, "logs": logs}, os.path.join(out_dir, f"rank{rank}.pt"))
    end_process_group()


if __name__ == "__main__":
    main()
    leave_without_teardown()
