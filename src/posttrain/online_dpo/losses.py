"""Online DPO: pure tensor math.

Online DPO (Guo et al. 2024, "Direct Language Model Alignment from Online AI Feedback", arXiv
2402.04792) samples two completions of each prompt from the policy, asks a reward (or a judge)
which is better, and applies a DPO loss to that pair. Rows come in pairs: rows ``2k`` and
``2k + 1`` are the two completions of prompt ``k``.

The score of a completion is its weighted reward, minus ``missing_eos_penalty`` when it ends
without EOS; the completion with the higher score is chosen, the first one on a tie (as the
reference does). The loss is a row of DPO's loss table (``dpo/losses.py``) on the pair's summed
log-probabilities ``l`` and the reference's ``l_ref``, with ``z = (l_w - l_ref_w) - (l_l -
l_ref_l)``: ``sigmoid`` is ``-log sigmoid(beta z)``; ``ipo`` is ``(z - 1/(2 beta))^2`` on the summed
log-probabilities, as the reference's online DPO computes it (DPOTrainer's ``ipo`` divides each
side by its length; here the lengths are given as 1).
"""

from __future__ import annotations

import torch

from posttrain.dpo.losses import DPOLossOutput, dpo_loss
from posttrain.pairs.logps import PairLogps
from posttrain.rewards.runner import weighted_sum


def completion_scores(
    rewards: torch.Tensor, weights: torch.Tensor, terminated: torch.Tensor, missing_eos_penalty: float | None
) -> torch.Tensor:
    """Each completion's score: the weighted reward, less the penalty when it has no EOS.

    Args:
        rewards: [N, F] per-function rewards, NaN where a function returned ``None``.
        weights: [F] reward weights.
        terminated: [N] bool, whether the completion ended with EOS.
        missing_eos_penalty: subtracted from the score of an unterminated completion (``None``: 0).

    Returns:
        [N] scores.
    """
    scores = weighted_sum(rewards, weights)
    if missing_eos_penalty is not None:
        scores = scores - missing_eos_penalty * (~terminated.bool()).to(scores.dtype)
    return scores


def first_is_chosen(scores: torch.Tensor) -> torch.Tensor:
    """[N] scores of consecutive pairs -> [N / 2] bool: the first completion wins (ties included)."""
    if scores.shape[0] % 2 != 0:
        raise ValueError(
            f"{scores.shape[0]} completions do not form pairs (rows 2k and 2k + 1 of each prompt)."
        )
    pairs = scores.view(-1, 2)
    return pairs[:, 0] >= pairs[:, 1]


def pair_logps(
    logps: torch.Tensor, ref_logps: torch.Tensor, first_chosen: torch.Tensor, lengths_one: bool = True
) -> PairLogps:
    """Order each consecutive pair of rows as (chosen, rejected).

    Args:
        logps: [B] the policy's summed log-probs of each completion (B even, pairs consecutive).
        ref_logps: [B] the reference's.
        first_chosen: [B / 2] bool from ``first_is_chosen``.
        lengths_one: give every side length 1, so that ``ipo`` uses the summed log-probs.

    Returns:
        The ``PairLogps`` of the ``B / 2`` pairs.
    """
    policy, ref = logps.view(-1, 2), ref_logps.view(-1, 2)  # [P, 2]
    pick = torch.stack([(~first_chosen).long(), first_chosen.long()], dim=1)  # [P, 2]: (chosen, rejected)
    chosen_col, rejected_col = pick[:, :1], pick[:, 1:]
    ones = torch.ones(policy.shape[0], dtype=logps.dtype, device=logps.device) if lengths_one else None
    return PairLogps(
        chosen=policy.gather(1, chosen_col).squeeze(1),
        rejected=policy.gather(1, rejected_col).squeeze(1),
        ref_chosen=ref.gather(1, chosen_col).squeeze(1),
        ref_rejected=ref.gather(1, rejected_col).squeeze(1),
        chosen_lengths=ones,
        rejected_lengths=ones,
    )


def online_dpo_loss(logps: PairLogps, loss_type: str, beta: float) -> DPOLossOutput:
    """DPO's loss table on the judged pairs: the mean over pairs of the ``loss_type`` row."""
    return dpo_loss(logps, loss_type, beta=beta)
