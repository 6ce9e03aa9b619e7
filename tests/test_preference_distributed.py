"""Preference trainers on two CPU processes (DDP) give the update of one process on the same pairs.

``tests/scripts/preference_ddp_train.py`` trains under torchrun; each process sees 2 pairs per
step, and the single-process run here sees the same 4 pairs per step (batch size 4, the ranks'
rows interleaved as the distributed sampler deals them). SGD without clipping makes any wrong
loss scale between processes visible in the parameters.
"""

from __future__ import annotations

import json

import pytest
import torch
from scripts.preference_ddp_train import FAMILIES, run_once, train


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_processes_equal_one_process_on_the_same_pairs(tmp_path_factory, family):
    out = run_once(tmp_path_factory.getbasetemp(), family)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["logs"] == ranks[1]["logs"]
    ddp = torch.load(out / "ddp.pt")
    single = train(str(tmp_path_factory.mktemp("single")), family, per_device_train_batch_size=4)
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(value, ddp[name], rtol=0, atol=1e-6, msg=name)
    single_losses = [h["loss"] for h in single.state.log_history if "loss" in h]
    assert [h["loss"] for h in ranks[0]["logs"]] == pytest.approx(single_losses, rel=1e-5)
