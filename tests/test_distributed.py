"""Two CPU processes under torchrun (gloo): groups stay whole, ranks stay in sync."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from helpers import run_torchrun

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "ddp_train.py")


@pytest.mark.slow
def test_two_processes_keep_groups_whole_and_parameters_identical(tmp_path):
    proc = run_torchrun(SCRIPT, str(tmp_path), 29533)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"]) == 2
    for step in range(2):
        a, b = ranks[0]["seen"][step], ranks[1]["seen"][step]
        assert len(a) == len(b) == 2
        # one prompt per step, its 4 completions split 2 + 2 across the ranks
        counts = Counter(a + b)
        assert list(counts.values()) == [4]
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]
    assert ranks[0]["params"] == ranks[1]["params"]
    # metrics are reduced across processes, so both ranks log the same values (but their own timings)
    logs = [[{k: v for k, v in h.items() if k != "step_time"} for h in r["logs"]] for r in ranks]
    assert logs[0] == logs[1]
    assert any(h["grad_norm"] > 0 for h in logs[0])
