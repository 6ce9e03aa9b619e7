"""RSO pair selection: preference pairs sampled from the optimal policy by rejection sampling.

Statistical Rejection Sampling Optimization (Liu et al. 2023, "Statistical Rejection Sampling
Improves Preference Optimization", arXiv 2309.06657) trains on pairs whose responses come from
the policy that the KL-constrained reward maximisation targets,

    π*(y | x) ∝ π_sft(y | x) · exp(r(x, y) / β),

instead of from the SFT policy (SLiC) or from whatever produced a human preference set (DPO).
Offline, with a reward (or reward-ranking) model r:

1. sample N candidate responses per prompt from the SFT policy and score each, r(x, y);
2. *rejection sampling* (``rso_sample``): a candidate y is proposed uniformly among those not
   yet accepted and accepted with probability exp((r(x, y) − r_max) / β), r_max the largest
   reward among the candidates not yet accepted; accepted candidates leave the pool; this stops
   at ``num_samples`` accepted (or when the pool is empty);
3. *pairing and labelling* (``pair_by_reward``): the accepted responses in acceptance order
   are paired (y1, y2), (y3, y4), ... and each pair is labelled by the reward: the higher one
   is chosen, the lower one rejected; a tie carries no preference and is dropped;
4. train on those pairs with a preference loss; the paper's hinge-norm loss is
   ``DPOConfig(loss_type="hinge", beta=0.05)`` (DPOConfig's ``beta`` is the paper's γ).

The candidates are draws from π_sft, so weighting them by exp(r/β) re-weights π_sft towards π*.
With a uniform proposal over a finite pool and the constant bound exp(r_max/β) (r_max of the
pool), rejection sampling is exact: each accepted candidate is a draw from the softmax of r/β
over the pool, so the first accepted index i has probability exp(r_i/β) / Σ_j exp(r_j/β), and
the accepted sequence is a draw without replacement from those weights. Taking r_max over the
candidates not yet accepted (the paper's Theorem 1) rather than over all N leaves that distribution unchanged and keeps
the acceptance rate up: the best remaining candidate is always accepted when proposed, so
every acceptance takes at most as many proposals on average as the pool has candidates.

What this module follows from the paper, and where it differs:

* the acceptance rule exp((r − r_max)/β) with r_max over the candidates not yet accepted, and
  sampling without replacement until ``num_samples`` are accepted (Section 3 and Algorithm 1);
* the paper's settings as defaults: β = 0.5 (``RSO_BETA``) and 8 accepted samples
  (``RSO_NUM_SAMPLES``) out of 64 candidates per prompt (the 64 are the caller's; nothing here
  generates), and γ = 0.05 for the loss (``recipes/dpo/rso.yaml``);
* pairing: ``"first_round"`` (default) labels the consecutive pairs of accepted samples;
  ``"tournament"`` continues as a single-elimination bracket (the winners of one round are paired
  in the next: 4 + 2 + 1 = 7 pairs from 8 samples; a tie is dropped and its first response goes
  on, an odd one out goes on unpaired);
* the paper's listing sweeps the remaining candidates in order within a pass; here each proposal
  is uniform over the remaining pool, which makes every acceptance exact for any pool size
  rather than only as N grows.

Every function is pure and seeded (``random.Random``); ``rso_preference_dataset`` seeds each row
from ``seed`` and the row's index, so a row's pairs do not depend on the other rows.
"""

from __future__ import annotations

import math
import numbers
import random
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

#: β of the paper's experiments: the KL coefficient of the optimal policy that rejection sampling
#: targets (not DPOConfig's ``beta``, which is the loss's γ = 0.05).
RSO_BETA = 0.5
#: Responses the paper accepts per prompt (from 64 SFT candidates).
RSO_NUM_SAMPLES = 8
#: How the accepted responses are paired.
PAIRINGS = ("first_round", "tournament")
#: The input columns ``rso_preference_dataset`` reads besides the candidates and their rewards.
PROMPT_COLUMN = "prompt"

Pairing = Literal["first_round", "tournament"]
T = TypeVar("T")


# ----------------------------------------------------------------------------- checks


def _check_beta(beta: float) -> None:
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(
            f"beta={beta!r} must be a positive finite number: the temperature of the optimal policy "
            f"π*(y|x) ∝ π_sft(y|x)·exp(r/β) (the RSO paper uses β = {RSO_BETA})."
        )


def _check_num_samples(num_samples: int, minimum: int) -> None:
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < minimum:
        why = "a pair needs two accepted responses" if minimum > 1 else "at least one sample"
        raise ValueError(
            f"num_samples={num_samples!r} must be an integer >= {minimum} ({why}); the RSO paper "
            f"accepts {RSO_NUM_SAMPLES} per prompt."
        )


def _check_pairing(pairing: str) -> None:
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r} is not one of {PAIRINGS}.")


def _reward_error(rewards: Sequence[Any], where: str, column: str) -> str | None:
    """Why ``rewards`` cannot be sampled from (``None`` when it can)."""
    for j, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            return (
                f"{where}column {column!r} holds {r!r} ({type(r).__name__}) at position {j}: every reward "
                "must be a number. Score every candidate, or drop the ones without a score."
            )
        if not math.isfinite(r):
            return (
                f"{where}column {column!r} holds the non-finite reward {r!r} at position {j}: the acceptance "
                "probability exp((r - r_max) / beta) needs finite rewards. Drop or rescore that candidate."
            )
    return None


def _as_rng(generator: random.Random | int) -> random.Random:
    if isinstance(generator, random.Random):
        return generator
    if isinstance(generator, bool) or not isinstance(generator, int):
        raise ValueError(f"generator={generator!r} must be a random.Random or an integer seed.")
    return random.Random(generator)


# ----------------------------------------------------------------------------- one prompt


def rso_sample(
    rewards: Sequence[float],
    num_samples: int = RSO_NUM_SAMPLES,
    beta: float = RSO_BETA,
    generator: random.Random | int = 0,
) -> list[int]:
    """Statistical rejection sampling of one prompt's candidates.

    Repeatedly proposes a candidate uniformly among those not yet accepted and accepts it with
    probability exp((r − r_max) / β), r_max the largest reward among the candidates not yet
    accepted; an accepted candidate leaves the pool. Each accepted index is an exact draw from
    softmax(r/β) over the pool left at that moment.

    Args:
        rewards: the reward of each candidate, r(x, y_i).
        num_samples: how many candidates to accept (fewer when the pool runs out).
        beta: β of the optimal policy π* ∝ π_sft · exp(r/β); small β approaches picking the best
            candidates in order, large β uniform picking. The paper's is 0.5.
        generator: a ``random.Random`` (advanced in place) or an integer seed.

    Returns:
        The accepted candidates' indices in acceptance order, ``min(num_samples, len(rewards))``
        of them, all distinct.

    Raises:
        ValueError: a non-finite or non-numeric reward, ``beta`` not positive and finite, or
            ``num_samples`` < 1.
    """
    _check_num_samples(num_samples, 1)
    _check_beta(beta)
    error = _reward_error(rewards, "", "rewards")
    if error:
        raise ValueError(error)
    rng = _as_rng(generator)
    values = [float(r) for r in rewards]
    pool = list(range(len(values)))
    accepted: list[int] = []
    while pool and len(accepted) < num_samples:
        r_max = max(values[i] for i in pool)
        while True:
            position = rng.randrange(len(pool))
            index = pool[position]
            if rng.random() < math.exp((values[index] - r_max) / beta):
                break
        accepted.append(index)
        pool.pop(position)
    return accepted


def pair_by_reward(
    order: Sequence[int], rewards: Sequence[float], pairing: Pairing = "first_round"
) -> list[tuple[int, int]]:
    """Pair accepted candidates and label each pair by reward.

    Args:
        order: candidate indices in acceptance order (``rso_sample``'s output).
        rewards: every candidate's reward (indexed by the entries of ``order``).
        pairing: ``"first_round"``: (order[0], order[1]), (order[2], order[3]), ...; an odd last
            one is left out. ``"tournament"``: the first round, then the winners paired the same
            way, round after round, until one is left (n − 1 pairs from n without ties); a tie
            goes on with its first response, an odd one out goes on unpaired.

    Returns:
        ``(chosen, rejected)`` index pairs, the higher reward chosen; pairs with equal rewards
        are dropped.
    """
    _check_pairing(pairing)
    pairs: list[tuple[int, int]] = []
    current = list(order)
    while len(current) >= 2:
        winners = []
        for a, b in zip(current[0::2], current[1::2], strict=False):
            if rewards[a] == rewards[b]:
                winners.append(a)
                continue
            chosen, rejected = (a, b) if rewards[a] > rewards[b] else (b, a)
            pairs.append((chosen, rejected))
            winners.append(chosen)
        if pairing == "first_round":
            break
        if len(current) % 2:
            winners.append(current[-1])
        current = winners
    return pairs


def rso_pairs(
    candidates: Sequence[T],
    rewards: Sequence[float],
    num_samples: int = RSO_NUM_SAMPLES,
    beta: float = RSO_BETA,
    generator: random.Random | int = 0,
    pairing: Pairing = "first_round",
) -> list[tuple[T, T]]:
    """One prompt's candidates to RSO preference pairs: rejection sampling, then pairing by reward.

    Args:
        candidates: the candidate responses (sampled from the SFT policy), any values.
        rewards: one reward per candidate.
        num_samples: responses to accept before pairing (>= 2); the paper's is 8.
        beta: β of the optimal policy (the paper's is 0.5).
        generator: a ``random.Random`` (advanced in place) or an integer seed.
        pairing: ``"first_round"`` or ``"tournament"`` (``pair_by_reward``).

    Returns:
        ``(chosen, rejected)`` pairs of candidates; ties are dropped, so it may be empty.

    Raises:
        ValueError: ``candidates`` and ``rewards`` of different lengths, or a bad reward,
            ``beta``, ``num_samples`` (< 2) or ``pairing``.
    """
    if len(candidates) != len(rewards):
        raise ValueError(
            f"{len(rewards)} rewards for {len(candidates)} candidates: give one reward per candidate."
        )
    _check_num_samples(num_samples, 2)
    _check_pairing(pairing)
    order = rso_sample(rewards, num_samples, beta, generator)
    return [(candidates[c], candidates[r]) for c, r in pair_by_reward(order, rewards, pairing)]


# ----------------------------------------------------------------------------- whole datasets


def _row_error(
    completions: Any, rewards: Any, index: int, completions_column: str, rewards_column: str
) -> str | None:
    """Why row ``index`` cannot be sampled from (``None`` when it can)."""
    where = f"Row {index}: "
    if not isinstance(completions, (list, tuple)):
        return (
            f"{where}column {completions_column!r} must hold a list of candidate completions (strings, or "
            f"lists of messages), got {type(completions).__name__}. Put each prompt's candidates in one list."
        )
    if not isinstance(rewards, (list, tuple)):
        return (
            f"{where}column {rewards_column!r} must hold a list of rewards, one per completion, "
            f"got {type(rewards).__name__}."
        )
    if len(completions) != len(rewards):
        return (
            f"{where}column {rewards_column!r} has {len(rewards)} rewards for the {len(completions)} completions "
            f"of column {completions_column!r}. Give one reward per completion, in the same order."
        )
    for j, completion in enumerate(completions):
        if not isinstance(completion, (str, list, tuple)):
            return (
                f"{where}column {completions_column!r} holds {type(completion).__name__} at position {j}: each "
                "completion must be a string (standard) or a list of {'role', 'content'} messages "
                "(conversational)."
            )
    return _reward_error(rewards, where, rewards_column)


def _check_dataset(dataset: Any, completions_column: str, rewards_column: str) -> None:
    """Every check of ``rso_preference_dataset`` on its input, before any sampling."""
    try:
        from datasets import Dataset
    except ImportError:  # pragma: no cover - datasets is a dependency
        Dataset = None  # noqa: N806
    if Dataset is None or not isinstance(dataset, Dataset):
        raise ValueError(
            f"rso_preference_dataset needs a datasets.Dataset, got {type(dataset).__name__}. "
            "Build one with datasets.Dataset.from_list(rows) or Dataset.from_dict(columns)."
        )
    needed = (PROMPT_COLUMN, completions_column, rewards_column)
    missing = [c for c in needed if c not in dataset.column_names]
    if missing:
        raise ValueError(
            f"rso_preference_dataset needs the columns {list(needed)}; column(s) {missing} are missing "
            f"(the dataset has {dataset.column_names}). Rename the columns, or pass "
            "completions_column= and rewards_column= to name the candidates' and the rewards' columns."
        )
    if len(dataset) == 0:
        raise ValueError("The dataset has no rows. Pass at least one prompt with its candidates and rewards.")
    columns = dataset.select_columns([completions_column, rewards_column])
    for index, row in enumerate(columns):
        error = _row_error(
            row[completions_column], row[rewards_column], index, completions_column, rewards_column
        )
        if error:
            raise ValueError(error)


def _item_feature(feature: Any) -> Any:
    """The feature of one item of a list feature (``None`` when it cannot be read)."""
    if isinstance(feature, list) and len(feature) == 1:
        return feature[0]
    return getattr(feature, "feature", None)


def rso_preference_dataset(
    dataset: Any,
    num_samples: int = RSO_NUM_SAMPLES,
    beta: float = RSO_BETA,
    seed: int = 0,
    completions_column: str = "completions",
    rewards_column: str = "rewards",
    pairing: Pairing = "first_round",
) -> Any:
    """Turn prompts with scored candidates into an RSO preference dataset for ``DPOTrainer``.

    Each row's candidates are rejection-sampled (``rso_sample``) and the accepted ones paired by
    reward (``pair_by_reward``); every pair becomes one row. Use it where the paper index filters
    a dataset on an ``rso_keep`` column, and train with ``DPOConfig(loss_type="hinge",
    beta=0.05)`` (the paper's hinge-norm loss with γ = 0.05).

    Args:
        dataset: a ``datasets.Dataset`` with ``prompt`` (text or a list of messages), the
            candidates (``completions_column``: a list of strings, or of message lists) and
            their rewards (``rewards_column``: a list of numbers, one per candidate).
        num_samples: responses accepted per prompt before pairing (>= 2); the paper's is 8.
        beta: β of the optimal policy the samples are drawn from; the paper's is 0.5.
        seed: the seed; row ``i`` samples with ``random.Random(f"rso/{seed}/{i}")``.
        completions_column: the column of the candidates.
        rewards_column: the column of the rewards.
        pairing: ``"first_round"`` (consecutive accepted samples) or ``"tournament"``
            (``pair_by_reward``).

    Returns:
        A ``datasets.Dataset`` with ``prompt`` (each row's value as given), ``chosen`` and
        ``rejected`` (candidates as given), the pairs of row 0 first; other columns are dropped.

    Raises:
        ValueError: before any sampling, for a missing column, a row whose rewards and
            candidates differ in number, a non-numeric or non-finite reward, a candidate that is
            neither text nor messages (the message names the row, the column and the fix),
            ``beta`` <= 0, ``num_samples`` < 2 or an unknown ``pairing``; after sampling, when
            no pair is left (every accepted pair tied, or fewer than two candidates per prompt).
    """
    _check_rso_settings(num_samples, beta, pairing, seed)
    _check_dataset(dataset, completions_column, rewards_column)
    out = _sampled_pairs(dataset, num_samples, beta, seed, completions_column, rewards_column, pairing)
    if not out["prompt"]:
        raise ValueError(
            f"RSO sampling left no preference pair in {len(dataset)} rows: every accepted pair had equal "
            "rewards, or no prompt had two candidates. Give each prompt at least two candidates with "
            "different rewards."
        )
    return _pairs_dataset(out, dataset, completions_column)


def _check_rso_settings(num_samples: int, beta: float, pairing: Pairing, seed: int) -> None:
    """None, once ``num_samples``, ``beta``, ``pairing`` and ``seed`` are valid."""
    _check_num_samples(num_samples, 2)
    _check_beta(beta)
    _check_pairing(pairing)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed={seed!r} must be an integer.")


def _sampled_pairs(
    dataset: Any,
    num_samples: int,
    beta: float,
    seed: int,
    completions_column: str,
    rewards_column: str,
    pairing: Pairing,
) -> dict[str, list[Any]]:
    """The ``prompt``, ``chosen`` and ``rejected`` columns of every row's RSO pairs, row 0's first."""
    out: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": []}
    columns = dataset.select_columns([PROMPT_COLUMN, completions_column, rewards_column])
    for index, row in enumerate(columns):
        rng = random.Random(f"rso/{seed}/{index}")
        for chosen, rejected in rso_pairs(
            row[completions_column], row[rewards_column], num_samples, beta, rng, pairing
        ):
            out["prompt"].append(row[PROMPT_COLUMN])
            out["chosen"].append(chosen)
            out["rejected"].append(rejected)
    return out


def _pairs_dataset(out: dict[str, list[Any]], dataset: Any, completions_column: str) -> Any:
    """The pairs as a ``datasets.Dataset``, typed like the source columns when their features are known."""
    from datasets import Dataset, Features

    item = _item_feature(dataset.features[completions_column])
    if item is None:
        return Dataset.from_dict(out)
    features = Features({"prompt": dataset.features[PROMPT_COLUMN], "chosen": item, "rejected": item})
    return Dataset.from_dict(out, features=features)
