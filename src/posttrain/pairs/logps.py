"""What the loss tables of the preference families read: the pairs' summed log-probabilities.

``PairLogps`` is the input of DPO's, ORPO's and CPO's pure loss functions (``dpo/losses.py``,
``orpo/losses.py``, ``cpo/losses.py``); it lives here, below the families, so none of them
imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

#: The largest exponent an ``exp`` of a log-probability ratio may take (``e^80`` fits float32):
#: f-DPO's alpha divergence and AlphaPO's reward clamp there.
ALPHA_EXPONENT_CLAMP = 80.0


@dataclass(frozen=True)
class PairLogps:
    """Summed completion log-probabilities of a batch of preference pairs (every field ``[N]``).

    Attributes:
        chosen: ℓ_w, the policy's summed log-probabilities of the chosen completions.
        rejected: ℓ_l, the same for the rejected completions.
        ref_chosen: ℓʳ_w, the reference model's; ``None`` for reference-free loss types only.
        ref_rejected: ℓʳ_l, the reference model's; ``None`` for reference-free loss types only.
        chosen_lengths: n_w, completion token counts (float); needed by ``ipo``, ``sigmoid_norm``
            and ``sft``.
        rejected_lengths: n_l, completion token counts (float); needed by ``ipo`` and
            ``sigmoid_norm``.
    """

    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None
    chosen_lengths: Tensor | None = None
    rejected_lengths: Tensor | None = None
