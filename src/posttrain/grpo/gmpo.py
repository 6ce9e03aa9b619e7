"""GMPO's own config and trainer: the reference's experimental ``GMPOConfig`` / ``GMPOTrainer``.

Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv 2507.20673) is GRPO with another
objective: the geometric mean of the token ratios, each clipped in log space. posttrain builds it
as one row of GRPO's objective table (``loss_type="gmpo"``, ``grpo/objectives.py``); this module
gives it the reference's names and defaults, so a script written for
``trl.experimental.gmpo`` runs after changing its import:

    from posttrain import GMPOConfig, GMPOTrainer   # was: from trl.experimental.gmpo import ...

The reference's config only changes ``epsilon``'s default (0.4, in log space: the ratio's range
is ``(exp(-epsilon), exp(epsilon_high))``, as the paper recommends) and ignores ``loss_type``.
Here ``loss_type`` defaults to ``"gmpo"`` and another value is refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.grpo.config import GRPOConfig
from posttrain.grpo.trainer import GRPOTrainer

__all__ = ["GMPOConfig", "GMPOTrainer"]


@dataclass
class GMPOConfig(GRPOConfig):
    """Configuration of :class:`GMPOTrainer`: ``GRPOConfig`` with GMPO's clipping defaults.

    Every parameter of ``GRPOConfig`` (same meaning, same defaults) except:
        epsilon (`float`, defaults to `0.4`): Lower clip of each token's log-ratio, in log
            space: the ratio's lower bound is `exp(-epsilon)`. GMPO recommends 0.4.
        epsilon_high (`float | None`, defaults to `None`): Upper clip in log space (the ratio's
            upper bound is `exp(epsilon_high)`); `None` reuses `epsilon`.
        loss_type (`str`, defaults to `"gmpo"`): GMPO's objective, the only one this config
            trains; for another objective use `GRPOConfig(loss_type=...)`.
    """

    epsilon: float = field(
        default=0.4,
        metadata={
            "help": "Lower clip of each token's log-ratio, in log space (the ratio's lower bound is "
            "exp(-epsilon)); GMPO recommends 0.4."
        },
    )
    loss_type: str = field(
        default="gmpo", metadata={"help": "GMPO's objective; GRPOConfig(loss_type=...) trains the others."}
    )

    def _check_combinations(self) -> None:
        """GMPO's objective only (the reference ignores ``loss_type``; posttrain says so instead)."""
        if self.loss_type != "gmpo":
            raise ValueError(
                f"GMPOConfig(loss_type={self.loss_type!r}): GMPOConfig trains GMPO's objective only. Leave "
                f"loss_type at 'gmpo', or use GRPOConfig(loss_type={self.loss_type!r}) for that objective."
            )
        super()._check_combinations()


class GMPOTrainer(GRPOTrainer):
    """Trainer for GMPO: ``GRPOTrainer`` with GMPO's objective and defaults (see the module docstring).

    Takes ``GRPOTrainer``'s arguments. ``args`` defaults to ``GMPOConfig`` with the output in
    ``<model name>-GMPO``; a ``GRPOConfig`` is accepted when its ``loss_type`` is ``"gmpo"``.

    Raises:
        ValueError: ``args`` trains another objective than GMPO's.
    """

    _tag_names = ["posttrain", "gmpo"]

    def __init__(
        self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, **kwargs: Any
    ) -> None:
        args = args if args is not None else self.default_args(model, GMPOConfig, "GMPO")
        if args.loss_type != "gmpo":
            raise ValueError(
                f"GMPOTrainer trains GMPO's objective, but its args have loss_type={args.loss_type!r}: pass a "
                "GMPOConfig (or GRPOConfig(loss_type='gmpo', epsilon=0.4)), or use GRPOTrainer for that objective."
            )
        super().__init__(model, reward_funcs, args, **kwargs)
