"""CPOTrainer: Contrastive Preference Optimization, SimPO and AlphaPO on the shared core.

No reference model: everything but the loss is ``orpo.trainer.ReferenceFreeTrainer``'s (one
stacked forward per micro-batch, the step's pairs and chosen tokens as the denominators, the
metrics). The loss is ``cpo/losses.cpo_loss`` for ``args.loss_type``.
"""

from __future__ import annotations

from posttrain.cpo import losses
from posttrain.cpo.config import CPOConfig
from posttrain.orpo.trainer import ReferenceFreeTrainer
from posttrain.pairs.logps import PairLogps
from posttrain.pairs.trainer import StepCounts

__all__ = ["CPOTrainer"]


class CPOTrainer(ReferenceFreeTrainer):
    """Trains a causal LM with CPO, SimPO or AlphaPO; a drop-in for ``trl.experimental.cpo.CPOTrainer``.

    Logs ``rewards/*`` (β times the reward, shaped by ``alpha``), ``logps/*`` (the log-probs the
    loss uses: summed for sigmoid and hinge, token means for ipo, simpo and alphapo),
    ``logits/*``, ``nll_loss``, ``entropy``, ``mean_token_accuracy`` and ``num_tokens``.

    Arguments as ``orpo.trainer.ReferenceFreeTrainer``'s, with ``args`` a ``CPOConfig``
    (default output folder ``<model>-CPO``).
    """

    _tag_names = ["posttrain", "cpo"]
    _config_class = CPOConfig
    _suffix = "CPO"

    def _pair_loss(self, logps: PairLogps, step: StepCounts | None) -> losses.CPOLossOutput:
        a = self.args
        return losses.cpo_loss(
            logps,
            a.loss_type,
            beta=a.beta,
            label_smoothing=a.label_smoothing,
            simpo_gamma=a.simpo_gamma,
            alpha=a.alpha,
            cpo_alpha=a.cpo_alpha,
            num_pairs=step.pairs if step is not None else None,
            num_tokens=step.chosen_tokens if step is not None else None,
        )
