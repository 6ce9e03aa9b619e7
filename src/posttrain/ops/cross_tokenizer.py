"""Cross-tokenizer distillation math: GOLD's ULD loss and X-Token's projection losses.

A student and a teacher with different vocabularies cannot be compared token by token. The
completion's text is the common ground: ``ops/token_alignment.py`` groups both tokenisations into
spans of identical bytes, and this module compares the two models' distributions per group.

**ULD** (Boizard et al., "Towards Cross-Tokenizer Distillation: the Universal Logit Distillation
Loss for LLMs", arXiv 2402.12030). With uniform cost between ranks, the Wasserstein distance of two
distributions over different vocabularies has a closed form: sort each side's probabilities in
decreasing order, pad the shorter vocabulary with zeros, and take the L1 distance
(``uld_distance``). It ignores token identity, which is what lets it compare any two vocabularies.
GOLD (Hugging Face, "Unlocking On-Policy Distillation for Any Model Family") applies it per aligned
group: per sample ``sum_groups ULD / #groups``, the batch mean times ``uld_distillation_weight``
plus ``uld_crossentropy_weight`` times the student's NLL (``uld_loss``).

**Merging a group** (``merge_group_distributions``). Which rows: ``observed`` takes the model's
output AT the group's tokens (rows ``start .. end-1``, each predicting the token after it);
``bayesian`` takes the rows from ``start - 1`` (the output that predicts the group's first token).
How they merge, a choice the facts leave open:

- ``chain`` (the default): the first row's distribution, multiplied by the probability each later
  row gives the token that follows it: ``log m(v) = log p_r0(v) + sum_{r > r0} log p_r(y_{r+1})``.
  With ``bayesian`` rows this is the chain rule: the entry of the group's actual first token is the
  probability of the group's whole text, on both sides, whatever the tokenisation; so a group of
  two student tokens and one of three teacher tokens still compare like with like. This is how we
  read the GOLD authors' merge (summing the log-probabilities of the merged tokens). The result
  no longer sums to 1; ULD compares it as it is.
- ``first``: the first row's distribution alone (cheaper; the later rows are ignored).
- ``mean``: the mean of the rows' log-probabilities, unnormalised (X-Token's per-span average).

A group whose rows (or, for ``chain``, whose following tokens) fall outside the sequence is
reported invalid: ``bayesian`` at the sequence's first token, ``observed`` with ``chain`` for a
multi-token group that ends the sequence. GOLD skips the completion's last token; the trainer drops
the last group (``SpanAlignment.drop_last``), whose ``observed`` row predicts past the completion.

**Hybrid** (GOLD's ``uld_use_hybrid_loss``; X-Token's H-KL). Given a map from student tokens to
teacher tokens (``common_map``), the common part is compared by forward KL of the two
distributions renormalised over the common teacher tokens (student tokens mapped to one teacher
token add up), the rest by ULD on the raw probabilities of the uncommon tokens (``hybrid_terms``).
GOLD's map is ``matched_tokens`` (identical token text); X-Token's is the top-1 column of the
projection matrix where its weight is at least 0.6 (``common_map_from_projection``).

**X-Token** (arXiv 2605.21699). A sparse ``W [Vs, Vt]`` with rows summing to 1 sends each
student token to the teacher tokens it most plausibly is (``build_projection_matrix``: exact text
match, else the teacher's re-tokenisation of the token's text). P-KL (Eq. 4, ``xtoken_p_kl``)
projects the student's full distribution, ``q = p_s W``, and takes the forward KL on the global
top-k teacher tokens of the batch, unrenormalised, so the term can be negative. H-KL (Eq. 3 with
the mapping of Eq. 5, ``xtoken_h_kl``) is the hybrid above with the relaxed common set.

Every loss here detaches the teacher: gradients reach the student only. Distributions are taken
as given; ``tempered_log_softmax`` makes them from logits and a temperature.

The vocabularies' side (``token_bytes``, ``matched_tokens``, the projection matrix's building,
saving and loading) is in ``ops/vocab_projection.py``; those names are imported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.ops.vocab_projection import (
    build_projection_matrix,
    load_projection_matrix,
    matched_tokens,
    save_projection_matrix,
    token_bytes,
)

__all__ = [
    "GROUP_STRATEGIES",
    "MERGES",
    "HybridTerms",
    "build_projection_matrix",
    "common_map_from_projection",
    "hybrid_terms",
    "load_projection_matrix",
    "matched_tokens",
    "merge_group_distributions",
    "per_sample_mean",
    "save_projection_matrix",
    "tempered_log_softmax",
    "token_bytes",
    "uld_distance",
    "uld_loss",
    "xtoken_h_kl",
    "xtoken_p_kl",
]

GROUP_STRATEGIES = {
    "observed": "the rows at the group's tokens (each predicting the token after it)",
    "bayesian": "the rows from start - 1 (the first predicting the group's first token)",
}
MERGES = {
    "chain": "the first row's distribution times the probability of the tokens the later rows predict",
    "first": "the first row's distribution",
    "mean": "the mean of the rows' log-probabilities (unnormalised)",
}


def tempered_log_softmax(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dim, in float32 or wider: [..., V] -> [..., V].

    Normalises as ``divergence.log_softmax`` does, with the argmax excluded (``log p = (z - max) -
    log1p(S)``, exact for the argmax at high confidence), but out of place so that autograd can
    differentiate it (``divergence.log_softmax`` writes in place and serves a custom backward).

    Raises:
        ValueError: ``temperature`` is not positive.
    """
    if not temperature > 0:
        raise ValueError(f"The temperature must be > 0, got {temperature}.")
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    z = z / temperature if temperature != 1.0 else z
    top, where = z.max(dim=-1, keepdim=True)
    u = z - top  # [..., V]
    rest = u.exp().scatter(-1, where, 0.0).sum(dim=-1, keepdim=True)  # [..., 1] the others' mass
    return u - torch.log1p(rest)


# ---------------------------------------------------------------------------------------------
# Merging the rows of a group
# ---------------------------------------------------------------------------------------------


def _group_rows(groups: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's first and last row (inclusive) under ``strategy``: [G, 2] -> ([G], [G])."""
    if strategy not in GROUP_STRATEGIES:
        raise ValueError(f"Unknown group strategy {strategy!r}; expected one of {sorted(GROUP_STRATEGIES)}.")
    shift = 0 if strategy == "observed" else -1
    return groups[:, 0] + shift, groups[:, 1] - 1 + shift


def merge_group_distributions(
    logps: torch.Tensor,
    token_ids: torch.Tensor,
    groups: torch.Tensor,
    *,
    strategy: str = "observed",
    merge: str = "chain",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One log-distribution per aligned group, from one model's per-position log-probs.

    Args:
        logps: [T, V] log-probs of one sequence, unshifted: row ``t`` is the model's output at
            position ``t`` (its distribution of token ``t + 1``).
        token_ids: [T] the sequence's tokens.
        groups: [G, 2] long ``(start, end)`` token ranges in the same index space
            (``SpanAlignment.student_ranges()`` / ``teacher_ranges()``, shifted by the prompt).
        strategy: ``observed`` or ``bayesian`` (``GROUP_STRATEGIES``).
        merge: ``chain``, ``first`` or ``mean`` (``MERGES``; the module docstring says why).

    Returns:
        ``(merged [G, V], valid [G] bool)``: invalid groups (rows or following tokens outside the
        sequence) hold arbitrary finite values and must be left out.
    """
    if merge not in MERGES:
        raise ValueError(f"Unknown merge {merge!r}; expected one of {sorted(MERGES)}.")
    n_rows = logps.shape[0]
    first, last = _group_rows(groups.to(logps.device), strategy)  # [G], [G]
    valid = (first >= 0) & (last < n_rows) & (last >= first)
    if merge == "chain":  # row r > first needs token r + 1
        valid &= (last == first) | (last + 1 < n_rows)
    first = first.clamp(0, n_rows - 1)
    base = logps[first]  # [G, V]
    if merge == "first":
        return base, valid
    lengths = (last - first + 1).clamp(1, n_rows)  # [G]
    owner = torch.repeat_interleave(torch.arange(len(first), device=logps.device), lengths)  # [R]
    within = torch.arange(len(owner), device=logps.device) - torch.repeat_interleave(
        lengths.cumsum(0) - lengths, lengths
    )
    rows = (first[owner] + within).clamp(0, n_rows - 1)  # [R] every row of every group
    if merge == "mean":
        total = logps.new_zeros(base.shape).index_add(0, owner, logps[rows])
        return total / lengths.unsqueeze(-1).to(logps.dtype), valid
    later = within > 0  # [R] the rows after each group's first
    labels = token_ids.to(logps.device)[(rows + 1).clamp(max=n_rows - 1)]  # [R] the token each row predicts
    label_logps = logps[rows, labels]  # [R]
    picked = torch.where(later, label_logps, torch.zeros_like(label_logps))  # -inf * 0 would be NaN
    return base + logps.new_zeros(len(first)).index_add(0, owner, picked).unsqueeze(-1), valid


# ---------------------------------------------------------------------------------------------
# ULD and the hybrid
# ---------------------------------------------------------------------------------------------


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` to ``width``."""
    return F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def uld_distance(
    student_probs: torch.Tensor, teacher_probs: torch.Tensor, top_k: int | None = None
) -> torch.Tensor:
    """ULD's sorted-probability L1 distance per row: [G, Vs], [G, Vt] -> [G].

    Both rows are sorted in decreasing order, the shorter vocabulary padded with zeros, and
    ``sum |sort(p_s) - sort(p_t)|`` taken. The teacher is detached.

    Args:
        student_probs: [G, Vs] probabilities (a merged group's need not sum to 1).
        teacher_probs: [G, Vt] probabilities.
        top_k: compare only the ``top_k`` largest of each side plus one tail bucket holding the
            rest of the mass, ``|tail_s - tail_t|``: a lower bound of the exact distance, equal
            to it when the tails' sorted entries never cross. ``None`` sorts the whole vocabulary.
    """
    t = teacher_probs.detach()
    width = max(student_probs.shape[-1], t.shape[-1])
    if top_k is None or top_k >= width:
        s_sorted = _pad_to(student_probs.sort(dim=-1, descending=True).values, width)
        t_sorted = _pad_to(t.sort(dim=-1, descending=True).values, width)
        return (s_sorted - t_sorted).abs().sum(dim=-1)
    s_top = _pad_to(student_probs.topk(min(top_k, student_probs.shape[-1]), dim=-1).values, top_k)
    t_top = _pad_to(t.topk(min(top_k, t.shape[-1]), dim=-1).values, top_k)
    s_tail = student_probs.sum(dim=-1) - s_top.sum(dim=-1)  # [G]
    t_tail = t.sum(dim=-1) - t_top.sum(dim=-1)
    return (s_top - t_top).abs().sum(dim=-1) + (s_tail - t_tail).abs()


@dataclass
class HybridTerms:
    """The two parts of a hybrid distance, per row.

    Attributes:
        common: [G] forward KL ``KL(t || s)`` of the two distributions renormalised over the common
            teacher tokens (0 where there is no common mass).
        uncommon: [G] ULD distance of the raw probabilities of the uncommon tokens.
    """

    common: torch.Tensor
    uncommon: torch.Tensor

    def total(self, common_weight: float = 1.0, uncommon_weight: float = 1.0) -> torch.Tensor:
        """[G] ``common_weight * common + uncommon_weight * uncommon``."""
        return common_weight * self.common + uncommon_weight * self.uncommon


def _renormalised_kl(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``KL(t / sum t || s / sum s)`` per row of two [G, C] non-negative tensors; 0 for empty rows."""
    tiny = torch.finfo(s.dtype).tiny
    t_mass = t.sum(dim=-1, keepdim=True)  # [G, 1]
    s_mass = s.sum(dim=-1, keepdim=True)
    t_norm = t / t_mass.clamp_min(tiny)
    log_s = s.clamp_min(tiny).log() - s_mass.clamp_min(tiny).log()
    kl = (torch.xlogy(t_norm, t_norm) - t_norm * log_s).sum(dim=-1)
    return torch.where((t_mass.squeeze(-1) > 0) & (s_mass.squeeze(-1) > 0), kl, torch.zeros_like(kl))


def hybrid_terms(
    student_probs: torch.Tensor, teacher_probs: torch.Tensor, common_map: torch.Tensor
) -> HybridTerms:
    """Split the comparison into common tokens (KL) and uncommon tokens (ULD).

    Args:
        student_probs: [G, Vs] probabilities.
        teacher_probs: [G, Vt] probabilities (detached here).
        common_map: [Vs] long: the teacher token each student token is common with, ``-1`` for
            none (``matched_tokens`` or ``common_map_from_projection``). Student tokens mapped to one
            teacher token add up.

    Returns:
        ``HybridTerms`` with ``common [G]`` and ``uncommon [G]``.
    """
    t = teacher_probs.detach()
    common_map = common_map.to(student_probs.device)
    rows = (common_map >= 0).nonzero().squeeze(-1)  # [C_s] common student tokens
    cols = common_map[rows]  # [C_s] their teacher tokens
    teacher_common = torch.unique(cols)  # [C_t]
    on_teacher = student_probs.new_zeros(student_probs.shape[0], t.shape[-1])
    on_teacher = on_teacher.index_add(1, cols, student_probs[:, rows])  # [G, Vt]
    common = _renormalised_kl(t[:, teacher_common], on_teacher[:, teacher_common])
    # Zeroed entries sort last, which is the same as removing them and padding with zeros.
    s_uncommon = student_probs.index_fill(1, rows, 0.0)
    t_uncommon = t.index_fill(1, teacher_common, 0.0)
    return HybridTerms(common, uld_distance(s_uncommon, t_uncommon))


def per_sample_mean(
    values: torch.Tensor, sample_index: torch.Tensor, num_samples: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean of ``values`` [G] per sample: ``(means [B], present [B] bool)``; 0 where a sample has none."""
    sample_index = sample_index.to(values.device)
    sums = values.new_zeros(num_samples).index_add(0, sample_index, values)
    counts = torch.bincount(sample_index, minlength=num_samples)[:num_samples]
    return sums / counts.clamp_min(1).to(values.dtype), counts > 0


def _batch_mean(per_group: torch.Tensor, sample_index: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Mean over the samples that have groups of each sample's mean over its groups (0 if none)."""
    means, present = per_sample_mean(per_group, sample_index, num_samples)
    return means[present].mean() if bool(present.any()) else per_group.sum() * 0.0


def uld_loss(
    student_probs: torch.Tensor,
    teacher_probs: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    *,
    crossentropy: torch.Tensor | None = None,
    distillation_weight: float = 1.0,
    crossentropy_weight: float = 0.0,
    common_map: torch.Tensor | None = None,
    matched_weight: float | None = None,
    unmatched_weight: float | None = None,
    top_k: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GOLD's ULD loss over the aligned groups of a batch.

    ``distillation_weight * mean_b (sum_{g in b} d_g / #groups_b) + crossentropy_weight * CE``,
    with ``d_g = uld_distance`` or, given ``common_map`` (hybrid), ``matched_weight * KL_common +
    unmatched_weight * ULD_uncommon`` (a weight of ``None`` counts 1). Samples without groups do not
    count in the batch mean (they carry no distillation signal).

    Args:
        student_probs: [G, Vs] the valid merged groups of all samples, probabilities.
        teacher_probs: [G, Vt] the same groups on the teacher's side (detached here).
        sample_index: [G] long, each group's sample in ``range(num_samples)``.
        num_samples: B.
        crossentropy: scalar, the student's NLL of its own tokens (needed when its weight is > 0).
        distillation_weight, crossentropy_weight: GOLD's ``uld_distillation_weight`` and
            ``uld_crossentropy_weight`` (>= 0).
        common_map: [Vs] long, the hybrid's matched teacher token per student token (-1: none).
        matched_weight, unmatched_weight: the hybrid's weights.
        top_k: passed to ``uld_distance``.

    Returns:
        ``(loss, metrics)``: ``distillation_loss``, ``crossentropy`` when given, and
        ``matched_loss`` / ``unmatched_loss`` with the hybrid.
    """
    if distillation_weight < 0 or crossentropy_weight < 0:
        raise ValueError("uld_distillation_weight and uld_crossentropy_weight must be >= 0.")
    if crossentropy_weight > 0 and crossentropy is None:
        raise ValueError("uld_crossentropy_weight > 0 needs the student's cross-entropy.")
    metrics: dict[str, float] = {}
    if common_map is None:
        per_group = uld_distance(student_probs, teacher_probs, top_k)
    else:
        terms = hybrid_terms(student_probs, teacher_probs, common_map)
        w_m = 1.0 if matched_weight is None else matched_weight
        w_u = 1.0 if unmatched_weight is None else unmatched_weight
        per_group = terms.total(w_m, w_u)
        metrics["matched_loss"] = float(_batch_mean(terms.common.detach(), sample_index, num_samples))
        metrics["unmatched_loss"] = float(_batch_mean(terms.uncommon.detach(), sample_index, num_samples))
    distill = _batch_mean(per_group, sample_index, num_samples)
    loss = distillation_weight * distill
    metrics["distillation_loss"] = float(distill.detach())
    if crossentropy is not None:
        metrics["crossentropy"] = float(crossentropy.detach())
        if crossentropy_weight > 0:
            loss = loss + crossentropy_weight * crossentropy
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# X-Token losses
# ---------------------------------------------------------------------------------------------


def common_map_from_projection(projection: torch.Tensor, threshold: float = 0.6) -> torch.Tensor:
    """H-KL's relaxed common set: each student token's top-1 teacher token where its weight >= threshold.

    Returns: [Vs] long, the teacher id, or -1 where the row's largest weight is below ``threshold``.
    """
    matrix = projection.coalesce()
    indices, values = matrix.indices(), matrix.values()
    vs, vt = projection.shape
    best = torch.full((vs,), -math.inf, dtype=values.dtype, device=values.device)
    best = best.scatter_reduce(0, indices[0], values, reduce="amax")  # [Vs] top-1 weight per row
    is_best = values == best[indices[0]]
    # Ties go to the lowest teacher id.
    common = torch.full((vs,), vt, dtype=torch.long, device=values.device)
    common = common.scatter_reduce(0, indices[0][is_best], indices[1][is_best], reduce="amin")
    return torch.where(best >= threshold, common, torch.full_like(common, -1))


def xtoken_p_kl(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, projection: torch.Tensor, top_k: int
) -> torch.Tensor:
    """X-Token's P-KL (Eq. 4): forward KL of the teacher and the projected student on a global top-k.

    ``q = p_s W`` (each row sums to 1 as W's rows do); ``K`` = the ``top_k`` teacher tokens with the
    most teacher mass summed over the N rows (one set for the batch); per row
    ``sum_{v in K} p_t(v) (log p_t(v) - log q(v))``, not renormalised over K, so it can be negative
    (the more so with a span-averaged, unnormalised teacher). ``q`` is floored at the dtype's smallest
    normal number, so a teacher token no student token reaches costs a constant, not infinity.

    Args:
        student_logps: [N, Vs] the student's log-probs at N aligned rows.
        teacher_logps: [N, Vt] the teacher's at the same rows (detached here).
        projection: [Vs, Vt] sparse ``W``.
        top_k: the size of K.

    Returns:
        [N] the per-row KD term.

    Raises:
        ValueError: ``top_k`` < 1.
    """
    if top_k < 1:
        raise ValueError(f"P-KL's top_k must be a positive number of teacher tokens, got {top_k}.")
    t = teacher_logps.detach()
    keep = t.exp().sum(dim=0).topk(min(top_k, t.shape[-1])).indices  # [k] the batch's top-k
    w_k = projection.to(student_logps.device, student_logps.dtype).index_select(1, keep).coalesce()  # [Vs, k]
    q = torch.sparse.mm(w_k.t(), student_logps.exp().t()).t()  # [N, k] = p_s @ W[:, K]
    log_q = q.clamp_min(torch.finfo(q.dtype).tiny).log()
    t_k = t[:, keep]  # [N, k]
    return (t_k.exp() * (t_k - log_q)).sum(dim=-1)


def xtoken_h_kl(
    student_logps: torch.Tensor, teacher_logps: torch.Tensor, projection: torch.Tensor, threshold: float = 0.6
) -> HybridTerms:
    """X-Token's H-KL (Eq. 3 with Eq. 5's mapping): KL on the relaxed common set, ULD on the rest.

    Args:
        student_logps: [N, Vs] the student's log-probs at N aligned rows.
        teacher_logps: [N, Vt] the teacher's (detached here).
        projection: [Vs, Vt] sparse ``W``; a student token is common with its top-1 teacher token
            when that weight is at least ``threshold``.
        threshold: the relaxed matching's bar.

    Returns:
        ``HybridTerms``: ``common [N]`` (renormalised forward KL) and ``uncommon [N]`` (ULD);
        ``.total()`` sums them.
    """
    common_map = common_map_from_projection(projection, threshold)
    return hybrid_terms(student_logps.exp(), teacher_logps.detach().exp(), common_map)
