"""RSO pair selection (``posttrain.data.rso``): the rejection sampler against a hand trace and
against its target distribution, pairing by reward, the dataset mapping, its errors, and one
hinge-loss DPO step on the pairs it produces."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset
from helpers import CPU_TEST_ARGS

from posttrain import DPOConfig, DPOTrainer
from posttrain.data.rso import (
    RSO_BETA,
    RSO_NUM_SAMPLES,
    pair_by_reward,
    rso_pairs,
    rso_preference_dataset,
    rso_sample,
)


class ScriptedRandom(random.Random):
    """A ``random.Random`` whose ``randrange`` and ``random`` return scripted values, in order."""

    def __init__(self, picks: list[int], uniforms: list[float]) -> None:
        super().__init__(0)
        self.picks = list(picks)
        self.uniforms = list(uniforms)

    def randrange(self, n, *args, **kwargs):  # type: ignore[override]
        pick = self.picks.pop(0)
        assert 0 <= pick < n, (pick, n)
        return pick

    def random(self) -> float:
        return self.uniforms.pop(0)


def softmax(rewards: list[float], beta: float) -> list[float]:
    top = max(rewards)
    weights = [math.exp((r - top) / beta) for r in rewards]
    total = sum(weights)
    return [w / total for w in weights]


# ---- rso_sample ----------------------------------------------------------------------------------


def test_the_paper_defaults():
    assert RSO_BETA == 0.5 and RSO_NUM_SAMPLES == 8


def test_hand_trace_with_scripted_draws():
    # rewards 0, 1, 2 and beta 1: acceptance probabilities e^-2 = 0.135, e^-1 = 0.368, 1.
    rng = ScriptedRandom(picks=[0, 1, 0, 0], uniforms=[0.5, 0.3, 0.1, 0.99])
    # pool [0, 1, 2]: propose 0 (u 0.5 >= 0.135, reject), propose 1 (u 0.3 < 0.368, accept);
    # pool [0, 2]: propose 0 (u 0.1 < 0.135, accept); pool [2]: propose 2 (p 1, accept).
    assert rso_sample([0.0, 1.0, 2.0], num_samples=3, beta=1.0, generator=rng) == [1, 0, 2]
    assert rng.picks == [] and rng.uniforms == []


def test_r_max_is_over_the_candidates_not_yet_accepted():
    # After the best (reward 5) is accepted, the one left is the pool's maximum: accepted with
    # probability 1 (u = 0.99). With r_max over every candidate it would be e^-5 and rejected.
    rng = ScriptedRandom(picks=[1, 0], uniforms=[0.99, 0.99])
    assert rso_sample([0.0, 5.0], num_samples=2, beta=1.0, generator=rng) == [1, 0]


def test_stops_at_num_samples_or_when_the_pool_is_empty():
    rewards = [0.1, 0.4, 0.2, 0.9, 0.5]
    assert len(rso_sample(rewards, num_samples=3, beta=0.5, generator=1)) == 3
    everything = rso_sample(rewards, num_samples=10, beta=0.5, generator=1)
    assert sorted(everything) == list(range(5))
    assert rso_sample([], num_samples=2, beta=0.5) == []


def test_a_tiny_beta_accepts_the_best_first():
    rewards = [0.3, 0.9, 0.1, 0.5]
    for seed in range(5):
        assert rso_sample(rewards, num_samples=4, beta=1e-6, generator=seed) == [1, 3, 0, 2]


def test_seeded_and_reproducible():
    rewards = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert rso_sample(rewards, 4, 0.5, 7) == rso_sample(rewards, 4, 0.5, random.Random(7))
    draws = {tuple(rso_sample(rewards, 4, 0.5, seed)) for seed in range(20)}
    assert len(draws) > 1


def test_first_accepted_follows_the_softmax_of_reward_over_beta():
    """The method's key property: P(first accepted = i) = exp(r_i/β) / Σ_j exp(r_j/β)."""
    rewards, beta, trials = [0.0, 0.5, 1.0, 2.0], 1.0, 4000
    rng = random.Random(0)
    counts = Counter(rso_sample(rewards, 1, beta, rng)[0] for _ in range(trials))
    expected = softmax(rewards, beta)  # 0.078, 0.129, 0.212, 0.580
    for i, p in enumerate(expected):
        assert abs(counts[i] / trials - p) < 0.03, (i, counts[i] / trials, p)


def test_second_accepted_follows_the_softmax_over_the_rest():
    """Accepted in order (i, j) with probability p_i · p_j / (1 − p_i): sampling without replacement."""
    rewards, beta, trials = [0.0, 0.5, 1.0], 0.5, 4000
    rng = random.Random(1)
    counts = Counter(tuple(rso_sample(rewards, 2, beta, rng)) for _ in range(trials))
    p = softmax(rewards, beta)
    for i in range(3):
        for j in range(3):
            if i != j:
                expected = p[i] * p[j] / (1 - p[i])
                assert abs(counts[(i, j)] / trials - expected) < 0.03, (
                    (i, j),
                    counts[(i, j)] / trials,
                    expected,
                )


def test_a_huge_beta_accepts_uniformly():
    rewards, trials = [0.0, 1.0, 3.0, 10.0], 4000
    rng = random.Random(2)
    counts = Counter(rso_sample(rewards, 1, 1e6, rng)[0] for _ in range(trials))
    for i in range(4):
        assert abs(counts[i] / trials - 0.25) < 0.03, counts


# ---- pairing -------------------------------------------------------------------------------------


def test_first_round_pairs_consecutive_samples_labelled_by_reward():
    rewards = [0.5, 0.9, 0.1, 0.7, 0.3]
    # accepted order 3, 0, 1, 2, 4: pairs (3, 0) and (1, 2); 4 is left out
    assert pair_by_reward([3, 0, 1, 2, 4], rewards) == [(3, 0), (1, 2)]
    assert pair_by_reward([0, 3], rewards) == [(3, 0)]


def test_ties_are_dropped():
    rewards = [1.0, 1.0, 2.0, 0.0]
    assert pair_by_reward([0, 1, 2, 3], rewards) == [(2, 3)]
    assert pair_by_reward([0, 1], rewards) == []


def test_tournament_pairs_the_winners_round_after_round():
    rewards = [float(r) for r in (3, 7, 1, 5, 8, 2, 6, 4)]
    pairs = pair_by_reward(list(range(8)), rewards, pairing="tournament")
    # round 1: (1,0) (3,2) (4,5) (6,7); round 2: 1 vs 3, 4 vs 6; final: 4 vs 1
    assert pairs == [(1, 0), (3, 2), (4, 5), (6, 7), (1, 3), (4, 6), (4, 1)]
    # an odd one out goes on unpaired; a tie goes on with its first response and is not a pair
    assert pair_by_reward([0, 1, 2], [1.0, 0.0, 2.0], pairing="tournament") == [(0, 1), (2, 0)]
    assert pair_by_reward([0, 1, 2], [1.0, 1.0, 0.0], pairing="tournament") == [(0, 2)]


def test_rso_pairs_returns_candidates_with_the_higher_reward_chosen():
    candidates = [f"answer {i}" for i in range(8)]
    rewards = [0.1 * i for i in range(8)]
    pairs = rso_pairs(candidates, rewards, num_samples=6, beta=0.5, generator=3)
    assert len(pairs) == 3
    score = dict(zip(candidates, rewards, strict=True))
    assert all(score[c] > score[r] for c, r in pairs)
    assert len({x for pair in pairs for x in pair}) == 6  # distinct accepted samples


# ---- the dataset mapping -------------------------------------------------------------------------


def standard_rows(n: int = 4, k: int = 6) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [f"What is {i} plus {i}?" for i in range(n)],
            "completions": [[f" {2 * i + j}" for j in range(k)] for i in range(n)],
            "rewards": [[float(-abs(j)) for j in range(k)] for i in range(n)],
            "source": ["synthetic"] * n,
        }
    )


def conversational_rows(n: int = 3, k: int = 4) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"What is {i} plus {i}?"}] for i in range(n)],
            "completions": [
                [[{"role": "assistant", "content": str(2 * i + j)}] for j in range(k)] for i in range(n)
            ],
            "rewards": [[1.0 if j == 0 else -float(j) for j in range(k)] for i in range(n)],
        }
    )


def test_standard_dataset_to_pairs():
    data = standard_rows()
    out = rso_preference_dataset(data, num_samples=4, beta=0.5, seed=0)
    assert out.column_names == ["prompt", "chosen", "rejected"]
    assert len(out) == 4 * 2  # two pairs per prompt, no ties
    for row in out:
        i = int(row["prompt"].split()[2])
        candidates = data[i]["completions"]
        reward = dict(zip(candidates, data[i]["rewards"], strict=True))
        assert row["chosen"] in reward and row["rejected"] in reward
        assert reward[row["chosen"]] > reward[row["rejected"]]
    assert out["prompt"][:2] == [data[0]["prompt"]] * 2  # row 0's pairs first
    assert out.to_dict() == rso_preference_dataset(data, num_samples=4, beta=0.5, seed=0).to_dict()


def test_the_seed_changes_the_samples():
    data = standard_rows(n=8)
    drawn = {str(rso_preference_dataset(data, num_samples=2, beta=5.0, seed=s).to_dict()) for s in range(4)}
    assert len(drawn) > 1


def test_conversational_dataset_keeps_prompts_and_messages():
    data = conversational_rows()
    out = rso_preference_dataset(data, num_samples=4, beta=0.5, pairing="tournament")
    assert out.features["prompt"] == data.features["prompt"]
    assert out.features["chosen"] == data.features["completions"].feature
    assert len(out) == 3 * 3
    for row in out:
        assert row["prompt"][0]["role"] == "user"
        assert row["chosen"][0]["role"] == "assistant" and row["rejected"][0]["role"] == "assistant"
    # the best candidate (reward 1, "2i") wins the final of every bracket it reaches
    finals = out.select(range(2, 9, 3))
    for i, row in enumerate(finals):
        assert row["chosen"][0]["content"] == str(2 * i)


def test_no_pair_left_raises():
    tied = Dataset.from_dict({"prompt": ["p"], "completions": [["a", "b"]], "rewards": [[1.0, 1.0]]})
    with pytest.raises(ValueError, match="no preference pair"):
        rso_preference_dataset(tied, num_samples=2)


def _bad(**columns):
    base = {
        "prompt": ["p0", "p1"],
        "completions": [["a", "b"], ["c", "d"]],
        "rewards": [[1.0, 0.0], [0.0, 1.0]],
    }
    base.update(columns)
    return Dataset.from_dict(base)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "pattern"),
    [
        (lambda: _bad().remove_columns("rewards"), {}, r"'rewards'\] are missing.*rewards_column="),
        (
            lambda: _bad().rename_column("completions", "texts"),
            {},
            r"'completions'\] are missing.*completions_column=",
        ),
        (lambda: _bad().remove_columns("prompt"), {}, r"'prompt'\] are missing"),
        (
            lambda: _bad(rewards=[[1.0, 0.0], [0.5]]),
            {},
            r"Row 1: column 'rewards' has 1 rewards for the 2 completions",
        ),
        (
            lambda: _bad(rewards=[[1.0, float("nan")], [0.0, 1.0]]),
            {},
            r"Row 0: column 'rewards' holds the non-finite",
        ),
        (
            lambda: _bad(rewards=[[1.0, 0.0], [float("inf"), 1.0]]),
            {},
            r"Row 1: column 'rewards' holds the non-finite",
        ),
        (lambda: _bad(rewards=[[1.0, 0.0], [None, 1.0]]), {}, r"Row 1: column 'rewards' holds None"),
        (lambda: _bad(completions=["ab", "cd"]), {}, r"Row 0: column 'completions' must hold a list"),
        (lambda: _bad(), {"beta": 0.0}, r"beta=0.0 must be a positive"),
        (lambda: _bad(), {"beta": -1.0}, r"beta=-1.0 must be a positive"),
        (lambda: _bad(), {"num_samples": 1}, r"num_samples=1 must be an integer >= 2"),
        (lambda: _bad(), {"pairing": "round_robin"}, r"pairing='round_robin'"),
        (lambda: [{"prompt": "p"}], {}, r"needs a datasets.Dataset"),
        (lambda: _bad().select([]), {}, r"no rows"),
    ],
)
def test_bad_input_raises_before_sampling(dataset, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        rso_preference_dataset(dataset(), **kwargs)


def test_named_columns_are_used():
    data = _bad().rename_columns({"completions": "texts", "rewards": "scores"})
    out = rso_preference_dataset(data, num_samples=2, completions_column="texts", rewards_column="scores")
    assert out["chosen"] == ["a", "d"] and out["rejected"] == ["b", "c"]


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        (lambda: rso_sample([0.0, float("nan")], 2, 0.5), "non-finite"),
        (lambda: rso_sample([0.0, 1.0], 0, 0.5), "num_samples=0"),
        (lambda: rso_sample([0.0, 1.0], 2, float("inf")), "beta=inf"),
        (lambda: rso_pairs(["a", "b"], [0.0], 2, 0.5), "1 rewards for 2 candidates"),
        (lambda: rso_pairs(["a", "b"], [0.0, 1.0], 1, 0.5), "num_samples=1"),
    ],
)
def test_bad_arguments_of_the_one_prompt_functions(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


# ---- one DPO step on RSO pairs -------------------------------------------------------------------


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("rows", [standard_rows, conversational_rows])
def test_rso_pairs_train_one_hinge_step(rows, tmp_path, one_thread, monkeypatch):
    monkeypatch.setattr(DPOTrainer, "_write_plots", lambda self: None)
    tok = build_tiny_tokenizer()
    pairs = rso_preference_dataset(rows(), num_samples=4, beta=0.5, seed=0)
    model = build_tiny_model(tok)
    before = [p.detach().clone() for p in model.parameters()]
    args = DPOConfig(
        **{**CPU_TEST_ARGS, "output_dir": str(tmp_path), "max_steps": 1, "loss_type": "hinge", "beta": 0.05}
    )
    trainer = DPOTrainer(model, args=args, train_dataset=pairs, processing_class=tok)
    trainer.train()
    assert trainer.state.global_step == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 1 and math.isfinite(losses[0])
    # the hinge loss is 1 at the start (policy = reference): a gradient flows and the model moves
    assert abs(losses[0] - 1.0) < 1e-4
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
