"""ORPO's loss: a pure function of summed completion log-probabilities and completion lengths.

ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference Model",
arXiv 2403.07691) adds an odds-ratio term to the supervised loss of the chosen completions; it
needs no reference model. Per pair, with ℓ the summed log-probability of a completion's tokens
and n their number (``w`` chosen, ``l`` rejected):

```
ℓ̄        = ℓ / n                                  mean token log-probability
odds(ℓ̄)  = ℓ̄ - log(1 - e^ℓ̄)                      log odds of the mean token probability
o        = odds(ℓ̄_w) - odds(ℓ̄_l)                  log odds ratio
L        = NLL_w - β · mean_pairs log σ(o)
NLL_w    = -Σ ℓ_w / Σ n_w                          token mean over the chosen completions
```

Choices and departures from the reference (TRL 1.16, experimental ORPO):

- ``NLL_w`` covers the chosen *completion* tokens only, as the paper's L_SFT (the likelihood of
  the response given the prompt). The reference, like the paper's official code, also counts
  the prompt tokens; its NLL then falls with the prompt's length and trains the model to write
  prompts.
- ``log(1 - e^x)`` is computed accurately over the whole range (``log1mexp``: ``log(-expm1(x))``
  near 0, ``log1p(-e^x)`` below ``-log 2``; Mächler 2012), where the reference takes
  ``log1p(-exp(x))`` everywhere (inaccurate near 0, ``-inf`` at 0). ``ℓ̄`` is capped at
  ``LOGP_CEILING`` inside that term, so a completion whose mean token probability rounds to 1
  gives a finite odds ratio; past the cap only that term's gradient stops (``ℓ̄`` itself still
  carries one).
- Both means take their denominators as arguments (``num_pairs``, ``num_tokens``), so a trainer
  can divide by the optimizer step's pairs and chosen tokens over every process: gradient
  accumulation then equals one large batch. By default they are the batch's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.pairs.logps import PairLogps

__all__ = ["LOGP_CEILING", "ORPOLossOutput", "log1mexp", "log_odds", "orpo_loss"]

#: ``ℓ̄`` is capped here inside ``log(1 - e^ℓ̄)`` (a mean token probability of 1 - 1e-6).
LOGP_CEILING = -1e-6


@dataclass(frozen=True)
class ORPOLossOutput:
    """What ``orpo_loss`` returns; every tensor but ``loss`` is detached.

    Attributes:
        loss: the scalar ``NLL_w - β Σ log σ(o) / num_pairs``, with its gradient.
        nll_loss: the scalar ``NLL_w`` part.
        chosen_logps: [N] ℓ̄_w, the mean token log-probabilities of the chosen completions.
        rejected_logps: [N] ℓ̄_l.
        chosen_rewards: [N] β·ℓ̄_w.
        rejected_rewards: [N] β·ℓ̄_l.
        pair_metrics: per-pair values averaged into the logs: ``log_odds_ratio`` (log σ(o))
            and ``log_odds_chosen`` (o), each [N].
    """

    loss: Tensor
    nll_loss: Tensor
    chosen_logps: Tensor
    rejected_logps: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor
    pair_metrics: dict[str, Tensor]


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - e^x)`` for ``x <= 0``, accurate over the whole range (Mächler 2012).

    ``log(-expm1(x))`` for ``x > -log 2``, ``log1p(-e^x)`` below; each branch sees an input
    clamped to its own side, so the branch not taken has a finite gradient (times zero).
    ``x = 0`` gives ``-inf``.
    """
    cut = -math.log(2.0)
    near_zero = torch.log(-torch.expm1(x.clamp(min=cut)))
    far = torch.log1p(-torch.exp(x.clamp(max=cut)))
    return torch.where(x > cut, near_zero, far)


def log_odds(mean_logps: Tensor) -> Tensor:
    """``ℓ̄ - log(1 - e^ℓ̄)``: the log odds of the mean token probability ``p = e^ℓ̄``.

    ``ℓ̄`` is capped at ``LOGP_CEILING`` inside ``log(1 - e^ℓ̄)`` only (no gradient through that
    term past the cap); the first term keeps its gradient.
    """
    return mean_logps - log1mexp(mean_logps.clamp(max=LOGP_CEILING))


def orpo_loss(
    logps: PairLogps,
    beta: float,
    *,
    num_pairs: float | Tensor | None = None,
    num_tokens: float | Tensor | None = None,
) -> ORPOLossOutput:
    """The ORPO loss of a batch of pairs (formula in the module doc).

    Half-precision log-probabilities are computed in float32.

    Args:
        logps: summed completion log-probabilities with ``chosen_lengths`` and
            ``rejected_lengths`` (the reference fields are not read).
        beta: λ, the weight of the odds-ratio term (>= 0; 0 is plain SFT on the chosen side).
        num_pairs: the pairs the odds-ratio term is averaged over (default: this batch's).
        num_tokens: the chosen completion tokens ``NLL_w`` is averaged over (default: this
            batch's ``Σ n_w``).

    Returns:
        An ``ORPOLossOutput``.

    Raises:
        ValueError: a missing length, mismatched shapes, or a negative or non-finite ``beta``.
    """
    if not (math.isfinite(beta) and beta >= 0):
        raise ValueError(f"beta={beta} must be a finite number >= 0 (ORPO's λ; the paper uses 0.1).")
    chosen, rejected, n_w, n_l = checked_pair_logps(logps, "ORPO")
    mean_w, mean_l = chosen / n_w.clamp(min=1.0), rejected / n_l.clamp(min=1.0)  # [N]
    o = log_odds(mean_w) - log_odds(mean_l)  # [N]
    log_sigmoid = F.logsigmoid(o)  # [N]
    pairs = chosen.shape[0] if num_pairs is None else num_pairs
    tokens = n_w.sum().clamp(min=1.0) if num_tokens is None else num_tokens
    nll = -chosen.sum() / tokens
    loss = nll - beta * log_sigmoid.sum() / pairs
    return ORPOLossOutput(
        loss=loss,
        nll_loss=nll.detach(),
        chosen_logps=mean_w.detach(),
        rejected_logps=mean_l.detach(),
        chosen_rewards=(beta * mean_w).detach(),
        rejected_rewards=(beta * mean_l).detach(),
        pair_metrics={"log_odds_ratio": log_sigmoid.detach(), "log_odds_chosen": o.detach()},
    )


def checked_pair_logps(logps: PairLogps, method: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(ℓ_w, ℓ_l, n_w, n_l)``, each ``[N]``, at least float32, the lengths in the log-probs' dtype.

    Raises:
        ValueError: a missing length or a field that is not ``[N]`` like ``chosen``.
    """
    if logps.chosen_lengths is None or logps.rejected_lengths is None:
        raise ValueError(
            f"{method} averages over the completion tokens: give PairLogps chosen_lengths and rejected_lengths."
        )
    chosen = logps.chosen
    if chosen.dim() != 1:
        raise ValueError(f"PairLogps.chosen must be [N]; got {tuple(chosen.shape)}.")
    dtype = torch.float32 if chosen.dtype in (torch.float16, torch.bfloat16) else chosen.dtype
    out = []
    for name in ("chosen", "rejected", "chosen_lengths", "rejected_lengths"):
        value = getattr(logps, name)
        if value.shape != chosen.shape:
            raise ValueError(
                f"PairLogps.{name} {tuple(value.shape)} must have the shape of chosen {tuple(chosen.shape)}."
            )
        out.append(value.to(dtype))
    return out[0], out[1], out[2], out[3]
