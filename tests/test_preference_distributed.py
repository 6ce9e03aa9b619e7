"""Preference trainers on two CPU processes (DDP) give the update of one process on the same rows.

``tests/scripts/preference_ddp_train.py`` trains under torchrun; each process sees 2 rows per
step (pairs; KTO's examples), and the single-process run here sees the same 4 rows per step
(batch size 4). Both draw from one seeded permutation of the dataset (12 pairs; KTO's 24
examples, chosen ones first): the distributed sampler deals its consecutive slices of 2 rows to
the ranks in turn, so step k's rows are the permutation's rows 4k..4k+3 in both runs, whatever
the dataset's order. SGD without clipping makes any wrong loss scale between processes visible
in the parameters (atol 1e-6; the losses to rel 1e-5).

KTO (``loss_type="kto"``) is the one loss with a term that is not a sum over rows: its reference
point z₀ = max(0, mean log-ratio of mismatched prompt/completion pairs), built inside each
micro-batch (row i's prompt with row i-1's completion) and averaged over every process's pairs.
On two processes the pairs come from each rank's 2 rows; one process with 4 rows pairs them
across the whole batch, so z₀ differs (step 3: 0.858 on the ranks, 0.842 on one process; the
parameters then differ by up to 1.8e-4 and step 3's loss by 5e-4 relative). That is KTO's
definition (z₀ is a property of the micro-batch), not a normalisation error. So for ``kto``:

* the ranks agree exactly, ``kl`` (z₀) included, and z₀ > 0 at some step: the all-reduced
  estimate is exercised, not only its clamp at 0;
* the single process pairs each row inside its rank's half of the batch (``kl_partners(4, 2)``,
  through ``kl_completion_ids``, which the collator honours); with the ranks' pairs, z₀ and the
  update are one process's again.

``kto_apo_zero_unpaired`` (no z₀) checks the same normalisation with the default collation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from scripts.preference_ddp_train import FAMILIES, NUM_ROWS, run_once, train

RANKS = 2
PER_RANK = 2


def kl_pairs_per_rank() -> type:
    """A KTOTrainer whose micro-batch of ``RANKS * PER_RANK`` rows pairs rows as the ranks do."""
    from posttrain import KTOTrainer
    from posttrain.data import unpaired

    class RankPairedKTOTrainer(KTOTrainer):
        def _collate(self, rows: list[dict[str, Any]]) -> Any:
            partners = unpaired.kl_partners(len(rows), PER_RANK)
            rows = [
                {**row, unpaired.KL_COLUMN: list(rows[p]["completion_ids"])}
                for row, p in zip(rows, partners, strict=True)
            ]
            return super()._collate(rows)

    return RankPairedKTOTrainer


#: family -> the single-process trainer class that reproduces what each rank builds per micro-batch
SINGLE_PROCESS_TRAINERS = {"kto": kl_pairs_per_rank}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_processes_equal_one_process_on_the_same_pairs(tmp_path_factory, family):
    out = run_once(tmp_path_factory.getbasetemp(), family)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["logs"] == ranks[1]["logs"]
    assert len(ranks[0]["logs"]) == 3
    if family == "kto":
        assert any(h["kl"] > 0 for h in ranks[0]["logs"]), ranks[0]["logs"]
    ddp = torch.load(out / "ddp.pt")
    trainer_class = SINGLE_PROCESS_TRAINERS[family]() if family in SINGLE_PROCESS_TRAINERS else None
    single = train(
        str(tmp_path_factory.mktemp("single")),
        family,
        trainer_class=trainer_class,
        per_device_train_batch_size=RANKS * PER_RANK,
    )
    assert len(single.train_dataset) == (2 * NUM_ROWS if family.startswith("kto") else NUM_ROWS)
    for name, value in single.model.state_dict().items():
        torch.testing.assert_close(value, ddp[name], rtol=0, atol=1e-6, msg=name)
    single_logs = [h for h in single.state.log_history if "loss" in h]
    assert [h["loss"] for h in ranks[0]["logs"]] == pytest.approx([h["loss"] for h in single_logs], rel=1e-5)
    if family == "kto":
        assert [h["kl"] for h in ranks[0]["logs"]] == pytest.approx([h["kl"] for h in single_logs], rel=1e-5)
