"""The DPO losses' checks: ``check_loss_settings`` (a configuration, up front) and ``dpo_loss``'s inputs.

Each check fails with the parameter at fault and its fix; the loss types and f-divergences are
those of the table in ``dpo/loss_table.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields

from torch import Tensor

from posttrain.dpo.loss_table import F_DIVERGENCE_TYPES, LOSS_TYPES, _at_least_float32, _unknown_f_divergence
from posttrain.pairs.logps import PairLogps

# --------------------------------------------------------------------------- settings


def check_loss_settings(
    loss_type: str | Sequence[str],
    loss_weights: Sequence[float] | None,
    f_divergence_type: str,
    label_smoothing: float,
    ld_alpha: float | None,
    use_weighting: bool,
) -> tuple[list[str], list[float]]:
    """Validate a DPO loss configuration; fail early with the parameter at fault and its fix.

    Args:
        loss_type: a name of ``LOSS_TYPES`` or a list of them (each at most once).
        loss_weights: one weight per loss type, or ``None`` for 1.0 each.
        f_divergence_type: one of ``F_DIVERGENCE_TYPES``.
        label_smoothing: ε.
        ld_alpha: LD-DPO's α, ``None`` when off.
        use_weighting: whether WPO weights multiply the per-pair losses.

    Returns:
        The loss types as a list and their weights.

    Raises:
        ValueError: an unknown loss type (the message lists the valid ones), a loss type given
            twice, an unknown f-divergence, ``loss_weights`` of the wrong length or with a
            non-finite weight, ``ld_alpha`` outside [0, 1], ``label_smoothing`` outside [0, 1],
            ``exo_pair`` with ``label_smoothing`` not in (0, 1), ``robust`` or ``udpo`` with
            ``label_smoothing >= 0.5`` (both divide by a quantity that vanishes at 0.5; the
            reference only warns for ``robust``), or a non-default ``f_divergence_type`` with a
            loss type that does not accept it.
        NotImplementedError: ``use_weighting`` with ``aot`` or ``aot_unpaired`` (they sort the
            batch, so per-pair weights would not line up with the sorted pairs), as the reference.
    """
    types = _checked_loss_types(loss_type)
    weights = _checked_loss_weights(loss_weights, types)
    _check_f_divergence(f_divergence_type, types)
    _check_ld_alpha(ld_alpha)
    _check_label_smoothing(label_smoothing, types)
    _check_weighting(use_weighting, types)
    return types, weights


def _checked_loss_types(loss_type: str | Sequence[str]) -> list[str]:
    """The loss types as a list, each known and given once."""
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    if not types:
        raise ValueError(f"loss_type is empty; give one of {list(LOSS_TYPES)} or a list of them.")
    for name in types:
        if name not in LOSS_TYPES:
            raise ValueError(f"loss_type={name!r} is not supported; use one of {list(LOSS_TYPES)}.")
    repeated = sorted({name for name in types if types.count(name) > 1})
    if repeated:
        raise ValueError(
            f"loss_type={types} lists {repeated} more than once; give each loss type once and add their "
            "loss_weights together."
        )
    return types


def _checked_loss_weights(loss_weights: Sequence[float] | None, types: list[str]) -> list[float]:
    """The weights as floats, one finite weight per loss type (1.0 each for ``None``)."""
    if loss_weights is None:
        return [1.0] * len(types)
    weights = [float(w) for w in loss_weights]
    if len(weights) != len(types):
        raise ValueError(
            f"loss_weights has {len(weights)} weight(s) for {len(types)} loss type(s) {types}; give one "
            "weight per loss type, or loss_weights=None for 1.0 each."
        )
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"loss_weights={weights} must be finite numbers.")
    return weights


def _check_f_divergence(f_divergence_type: str, types: list[str]) -> None:
    """None, once ``f_divergence_type`` is known and accepted by every loss type."""
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(_unknown_f_divergence(f_divergence_type))
    if f_divergence_type != "reverse_kl":
        refusing = [name for name in types if not LOSS_TYPES[name].accepts_f_divergence]
        if refusing:
            accepting = [name for name, spec in LOSS_TYPES.items() if spec.accepts_f_divergence]
            raise ValueError(
                f"f_divergence_type={f_divergence_type!r} is not supported by loss_type {refusing}; use "
                f"f_divergence_type='reverse_kl' with them, or a loss type among {accepting}."
            )


def _check_ld_alpha(ld_alpha: float | None) -> None:
    """None, once LD-DPO's α is off or in [0, 1]."""
    if ld_alpha is not None and not 0.0 <= ld_alpha <= 1.0:
        raise ValueError(
            f"ld_alpha={ld_alpha} must lie in [0, 1] (1.0 weighs every token fully, 0.0 drops the tokens past "
            "the shared length), or be None to turn LD-DPO off."
        )


def _check_label_smoothing(label_smoothing: float, types: list[str]) -> None:
    """None, once ε lies in [0, 1] and in the narrower range each loss type needs."""
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1].")
    if "exo_pair" in types and not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"label_smoothing={label_smoothing} with loss_type 'exo_pair': it must lie in (0, 1) (EXO takes "
            "log ε and log(1-ε)); the EXO paper recommends label_smoothing=1e-3."
        )
    for name in ("robust", "udpo"):
        if name in types and label_smoothing >= 0.5:
            raise ValueError(
                f"label_smoothing={label_smoothing} with loss_type {name!r}: it must lie in [0, 0.5) (the loss "
                "divides by a factor that vanishes at 0.5); the robust DPO paper suggests 0.1."
            )


def _check_weighting(use_weighting: bool, types: list[str]) -> None:
    """None, once WPO weighting is off or no loss type sorts the batch."""
    if use_weighting:
        sorting = [name for name in types if name in ("aot", "aot_unpaired")]
        if sorting:
            raise NotImplementedError(
                f"use_weighting=True is not implemented for loss_type {sorting}: these losses sort the batch, "
                "so per-pair weights would not line up; set use_weighting=False or use another loss type."
            )


# --------------------------------------------------------------------------- dpo_loss's inputs


def _checked_dpo_inputs(
    logps: PairLogps, types: list[str], beta: float, discopop_tau: float, pair_weights: Tensor | None
) -> PairLogps:
    """``_checked_logps(logps)``, once β, τ, the reference and the pair weights are checked."""
    if not beta > 0:
        raise ValueError(f"beta={beta} must be > 0 (0.1 is the usual value).")
    if "discopop" in types and not discopop_tau > 0:
        raise ValueError(f"discopop_tau={discopop_tau} must be > 0 (the DiscoPOP paper uses 0.05).")
    logps = _checked_logps(logps)
    has_reference = logps.ref_chosen is not None and logps.ref_rejected is not None
    if not has_reference:
        needing = [name for name in types if LOSS_TYPES[name].uses_reference]
        if needing:
            raise ValueError(
                f"loss_type {needing} needs the reference log-probabilities: give PairLogps ref_chosen and "
                "ref_rejected."
            )
    if pair_weights is not None and pair_weights.shape != logps.chosen.shape:
        raise ValueError(
            f"pair_weights {tuple(pair_weights.shape)} must have the shape of the pairs {tuple(logps.chosen.shape)}."
        )
    return logps


def _checked_logps(logps: PairLogps) -> PairLogps:
    """``logps`` with half precision raised to float32 and lengths made float, every field checked ``[N]``."""
    shape = logps.chosen.shape
    if logps.chosen.dim() != 1:
        raise ValueError(f"PairLogps.chosen must be [N]; got {tuple(shape)}.")
    dtype = _at_least_float32(logps.chosen).dtype
    values = {}
    for f in fields(logps):
        value = getattr(logps, f.name)
        if value is not None:
            if value.shape != shape:
                raise ValueError(
                    f"PairLogps.{f.name} {tuple(value.shape)} must have the shape of chosen {tuple(shape)}."
                )
            value = value.to(dtype) if f.name.endswith("_lengths") else _at_least_float32(value)
        values[f.name] = value
    return PairLogps(**values)
