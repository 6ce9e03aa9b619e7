"""Tests for the TRL-named reward library: accuracy (math-verify), format, length and repetition shaping.

Every expected value below is worked out by hand in the test's docstring or next to the case. Tests of
the math rewards request the ``math_verify`` fixture, which skips them when math-verify is not installed.
"""

from __future__ import annotations

import math
import pickle
import sys
import threading

import pytest
import torch

from posttrain.rewards import (
    accuracy_reward,
    get_cosine_scaled_reward,
    get_repetition_penalty_reward,
    get_soft_overlong_punishment,
    reasoning_accuracy_reward,
    think_format_reward,
)
from posttrain.rewards.library import (
    GOLDEN_ANSWER_COLUMN,
    PREDICTED_ANSWER_COLUMN,
    text_after_reasoning,
)
from posttrain.rewards.runner import RewardRunner


@pytest.fixture
def math_verify():
    return pytest.importorskip("math_verify")


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


class _Columns:
    """A stand-in for the trainer's ``log_extra``: keeps the last values of each column."""

    def __init__(self) -> None:
        self.columns: dict[str, list] = {}

    def __call__(self, column, values):
        self.columns[column] = list(values)


# ---------------------------------------------------------------------------------------------------
# accuracy_reward
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "solution", "expected"),
    [
        ("So the result is \\boxed{\\frac{1}{2}}.", "$\\frac{1}{2}$", 1.0),
        ("So the result is \\boxed{0.5}.", "$\\frac{1}{2}$", 1.0),  # 0.5 == 1/2
        ("So the result is \\boxed{\\frac{2}{4}}.", "\\boxed{\\frac{1}{2}}", 1.0),  # 2/4 == 1/2
        ("So the result is \\boxed{\\frac{1}{3}}.", "$\\frac{1}{2}$", 0.0),
        ("The final answer is $42$.", "42", 1.0),  # plain gold, LaTeX answer
        ("The answer is 42", "$42$", 1.0),  # plain answer after an answer phrase
        ("First $3$, then \\boxed{5}.", "$5$", 1.0),  # the boxed answer wins
        ("\\boxed{5}, or maybe $3$.", "$3$", 0.0),  # ... also over a later LaTeX number
        ("We get $x = 3$", "$3$", 1.0),  # an equation's right-hand side
        ("The answer is \\boxed{2x+1}", "$1+2x$", 1.0),  # symbolic equality
        ("The answer is \\boxed{12}", 12, 1.0),  # a numeric solution column
        ("The answer is \\boxed{0.0000001}", 1e-07, 1.0),  # a float, written out in decimal
        ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),  # plain golds: a whole number or expression
        ("\\boxed{1234}", "1,234", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("\\boxed{1024}", "2^10", 1.0),
        ("so \\boxed{5}", "We find $x = 2$, hence $\\boxed{5}$.", 1.0),  # a worked gold solution
        ("\\boxed{3} ... no, \\boxed{5}", "$5$", 0.0),  # two boxes read as the set {3, 5}
        ("x = \\boxed{2}, y = \\boxed{3}", "\\boxed{2}, \\boxed{3}", 1.0),  # ... matching a two-part gold
        ("I have no idea.", "$7$", 0.0),  # no answer at all
        ("", "$7$", 0.0),
    ],
)
def test_accuracy_cases(math_verify, completion, solution, expected):
    """Each case: the answer math-verify reads from the completion against the gold, 1.0 iff equal."""
    assert accuracy_reward([completion], [solution]) == [expected]
    assert accuracy_reward([_assistant(completion)], solution=[solution]) == [expected]


@pytest.mark.parametrize(
    "solution",
    # unreadable, or plain text that is more than one number (math-verify alone would read 1e3 as 1,
    # (1, 2) as 2 and "5 apples" as 5): these must be written in LaTeX
    ["n/a", "", "no answer here", None, float("nan"), "1e3", "(1, 2)", "x = 3", "5 apples", "1,2"],
)
def test_accuracy_is_none_when_the_gold_cannot_be_parsed(math_verify, solution):
    """No gold answer: the reward does not apply (None), whatever the completion says."""
    assert accuracy_reward(["\\boxed{1}"], [solution]) == [None]
    assert accuracy_reward([_assistant("\\boxed{1}")], [solution]) == [None]


def test_accuracy_logs_the_extracted_answers(math_verify):
    """Three samples: gold 1/2 vs boxed 0.5 (1.0), gold 4 vs "3" (0.0), unparsable gold (None).

    The columns hold math-verify's extracted strings: its normalisation writes 0.5 as \\frac{1}{2};
    the unparsable gold and the completion without an answer log None.
    """
    log = _Columns()
    rewards = accuracy_reward(
        ["so \\boxed{0.5}", "The answer is 3", "no answer"],
        ["$\\frac{1}{2}$", "$4$", "n/a"],
        log_extra=log,
        prompts=["p"] * 3,
        trainer_state=None,
    )
    assert rewards == [1.0, 0.0, None]
    assert set(log.columns) == {GOLDEN_ANSWER_COLUMN, PREDICTED_ANSWER_COLUMN}
    assert GOLDEN_ANSWER_COLUMN == "golden_answer" and PREDICTED_ANSWER_COLUMN == "predicted_answer"
    assert log.columns["golden_answer"] == ["\\frac{1}{2}", "4", None]
    assert log.columns["predicted_answer"] == ["\\frac{1}{2}", "3", None]


def test_accuracy_checks_lengths_and_works_off_the_main_thread(math_verify):
    """Mismatched lengths are an error; in a worker thread math-verify runs without its alarm."""
    with pytest.raises(ValueError, match="2 completions but 1 values of 'solution'"):
        accuracy_reward(["a", "b"], ["$1$"])
    out = []
    worker = threading.Thread(target=lambda: out.append(accuracy_reward(["\\boxed{2}"], ["$2$"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]


def test_missing_math_verify_names_the_extra(monkeypatch):
    """Without math-verify, the math rewards raise an ImportError that says what to install."""
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` fail
    for call in (
        lambda: accuracy_reward(["\\boxed{1}"], ["$1$"]),
        lambda: reasoning_accuracy_reward(["</think>\\boxed{1}"], ["$1$"]),
        lambda: get_cosine_scaled_reward(10)(["\\boxed{1}"], ["$1$"], [[1]]),
    ):
        with pytest.raises(ImportError, match=r"pip install 'posttrain\[math\]'"):
            call()


# ---------------------------------------------------------------------------------------------------
# reasoning_accuracy_reward
# ---------------------------------------------------------------------------------------------------


def test_text_after_reasoning():
    """The text after the delimiter that ends last; None when no delimiter occurs."""
    assert text_after_reasoning("<think>a</think> b") == " b"
    assert text_after_reasoning("<think>a</think> b </think> c") == " c"  # the last one
    assert text_after_reasoning("<think>a</think>") == ""
    assert text_after_reasoning("<think>a, still thinking") is None
    # several delimiters: the one ending last wins, whichever it is
    assert text_after_reasoning("x</r> y</think> z", ["</think>", "</r>"]) == " z"
    assert text_after_reasoning("x</think> y</r> z", ["</think>", "</r>"]) == " z"


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>maybe 4</think>\\boxed{5}", 1.0),
        ("<think>it is 5</think>\\boxed{4}", 0.0),  # the 5 in the reasoning does not count
        ("<think>it is \\boxed{5}", 0.0),  # the reasoning never ends: 0.0
        ("\\boxed{5}", 0.0),  # no delimiter at all
        ("<think>it is 5</think>", 0.0),  # nothing after the reasoning
        ("<think>4?</think> no, </think> The answer is $5$", 1.0),  # after the last delimiter
    ],
)
def test_reasoning_accuracy_cases(math_verify, completion, expected):
    """Gold 5; only the text after the last </think> is searched for the answer."""
    assert reasoning_accuracy_reward([completion], ["$5$"]) == [expected]
    assert reasoning_accuracy_reward([_assistant(completion)], solution=["$5$"]) == [expected]
    # for comparison, accuracy_reward searches everything: the boxed 5 of case 3 counts there
    if completion == "<think>it is \\boxed{5}":
        assert accuracy_reward([completion], ["$5$"]) == [1.0]


def test_reasoning_accuracy_delimiters_none_and_logs(math_verify):
    """Custom delimiters; None for an unreadable gold (even without a delimiter); log columns."""
    completions = ["<reasoning>3?</reasoning> \\boxed{4}", "\\boxed{4}", "<think>x</think> \\boxed{4}"]
    log = _Columns()
    rewards = reasoning_accuracy_reward(
        completions, ["$4$", "n/a", "$4$"], reasoning_delimiters=["</reasoning>"], log_extra=log
    )
    # case 3 holds no </reasoning>: 0.0; case 2's gold is unreadable: None
    assert rewards == [1.0, None, 0.0]
    # cases 2 and 3 hold no </reasoning>, so no answer is read from them
    assert log.columns == {"golden_answer": ["4", None, "4"], "predicted_answer": ["4", None, None]}
    # a single string is a list of one delimiter
    assert reasoning_accuracy_reward(completions[:1], ["$4$"], reasoning_delimiters="</reasoning>") == [1.0]
    both = ["</think>", "</reasoning>"]
    assert reasoning_accuracy_reward(completions, ["$4$"] * 3, reasoning_delimiters=both) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize("delimiters", [[], [""], ["</think>", ""], [None]])
def test_reasoning_accuracy_rejects_bad_delimiters(delimiters):
    with pytest.raises(ValueError, match="reasoning_delimiters"):
        reasoning_accuracy_reward(["</think>1"], ["$1$"], reasoning_delimiters=delimiters)


# ---------------------------------------------------------------------------------------------------
# think_format_reward
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>2+2=4</think> 4", 1.0),
        ("<think>\nstep 1\nstep 2\n</think>\n\nThe answer is 4.", 1.0),  # multi-line
        ("\n  <think>2+2=4</think>4", 1.0),  # leading whitespace is ignored
        ("<think></think>42", 1.0),  # empty reasoning is allowed: the shape is right
        ("<think>2+2=4</think>", 0.0),  # no answer
        ("<think>2+2=4</think>  \n", 0.0),  # only whitespace after the block
        ("4 <think>2+2</think> 4", 0.0),  # the block is not at the start
        ("<think>a</think><think>b</think> 4", 0.0),  # two blocks
        ("<think>a <think> b</think> 4", 0.0),  # a nested opening tag
        ("<think>a</think> 4 </think>", 0.0),  # a stray closing tag in the answer
        ("2+2=4</think> 4", 0.0),  # no opening tag (e.g. it was in the prompt)
        ("<think>never closed, 4", 0.0),
        ("<THINK>a</THINK> 4", 0.0),  # tags are case-sensitive
        ("", 0.0),
    ],
)
def test_think_format_cases(completion, expected):
    assert think_format_reward([completion]) == [expected]
    assert think_format_reward([_assistant(completion)], solution=["4"]) == [expected]


# ---------------------------------------------------------------------------------------------------
# get_soft_overlong_punishment
# ---------------------------------------------------------------------------------------------------


def test_soft_overlong_worked_cases():
    """L_max = 10, L_cache = 4, so the interval starts at 6 and R = (6 - L) / 4 inside it.

    L = 0 -> 0; L = 6 -> 0 (the boundary is not punished); L = 7 -> -1/4; L = 8 -> -2/4;
    L = 9 -> -3/4; L = 10 -> -4/4 = -1; L = 11, 50 -> -1 (beyond L_max).
    """
    reward = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ids = [[1] * n for n in (0, 6, 7, 8, 9, 10, 11, 50)]
    assert reward(completion_ids=ids) == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    # the text is not used; tensors rows count their elements
    assert reward(completions=["x"], completion_ids=[torch.ones(8, dtype=torch.long)]) == [-0.5]


def test_soft_overlong_edge_settings():
    """L_cache = 0: a hard cut (0 up to L_max, -1 beyond); L_cache = L_max: R = -L / L_max."""
    hard = get_soft_overlong_punishment(5, 0)
    assert hard(completion_ids=[[1] * n for n in (0, 5, 6)]) == [0.0, 0.0, -1.0]
    full = get_soft_overlong_punishment(4, 4)
    assert full(completion_ids=[[1] * n for n in (0, 1, 2, 4, 5)]) == [0.0, -0.25, -0.5, -1.0, -1.0]


@pytest.mark.parametrize(
    ("max_completion_len", "soft_punish_cache", "match"),
    [
        (0, 0, "max_completion_len must be >= 1"),
        (-5, 1, "max_completion_len must be >= 1"),
        (10, 11, "must not exceed max_completion_len"),
        (10, -1, "soft_punish_cache must be >= 0"),
        (10.5, 2, "max_completion_len must be an integer"),
        (10, 2.0, "soft_punish_cache must be an integer"),
        (True, 0, "max_completion_len must be an integer"),
    ],
)
def test_soft_overlong_rejects_bad_arguments(max_completion_len, soft_punish_cache, match):
    with pytest.raises(ValueError, match=match):
        get_soft_overlong_punishment(max_completion_len, soft_punish_cache)


# ---------------------------------------------------------------------------------------------------
# get_cosine_scaled_reward
# ---------------------------------------------------------------------------------------------------


def test_cosine_schedule_values():
    """The formula alone, defaults, max_len = 100: w = (1 + cos(pi L / 100)) / 2.

    L = 0: w = 1; L = 25: w = (1 + 0.70711) / 2 = 0.85355; L = 50: w = 0.5; L = 100: w = 0;
    L = 150: clipped to 100, w = 0.
    correct: 0.5 + 0.5 w -> 1.0, 0.92678, 0.75, 0.5, 0.5 (shorter is better);
    wrong: -0.5 + (-1.0 - -0.5) w = -0.5 - 0.5 w -> -1.0, -0.92678, -0.75, -0.5, -0.5 (longer is better).
    """
    reward = get_cosine_scaled_reward(max_len=100)
    lengths = [0, 25, 50, 100, 150]
    correct = [reward.value(n, True) for n in lengths]
    wrong = [reward.value(n, False) for n in lengths]
    assert correct == pytest.approx([1.0, 0.926777, 0.75, 0.5, 0.5], abs=1e-6)
    assert wrong == pytest.approx([-1.0, -0.926777, -0.75, -0.5, -0.5], abs=1e-6)


def test_cosine_paper_settings():
    """The authors' values r_0^c = 2, r_L^c = 1, r_0^w = -10, r_L^w = 0, max_len = 4:

    L = 2 (w = 0.5): correct 1 + 1 * 0.5 = 1.5, wrong 0 + (-10 - 0) * 0.5 = -5.
    L = 1 (w = (1 + cos(pi/4)) / 2 = 0.85355): correct 1.85355, wrong -8.53553.
    """
    reward = get_cosine_scaled_reward(
        4, min_value_wrong=-10, max_value_wrong=0, min_value_correct=1, max_value_correct=2
    )
    assert reward.value(2, True) == pytest.approx(1.5)
    assert reward.value(2, False) == pytest.approx(-5.0)
    assert reward.value(1, True) == pytest.approx(1.853553, abs=1e-6)
    assert reward.value(1, False) == pytest.approx(-8.535534, abs=1e-6)


def test_cosine_scaled_reward_end_to_end(math_verify):
    """Gold 1/2, max_len = 100: right answers of 0 / 50 / 150 tokens, wrong ones of 0 / 50 / 100.

    Right: 1.0, 0.75, 0.5 (clipped at max_len); wrong: -1.0, -0.75, -0.5; unreadable gold: None.
    """
    reward = get_cosine_scaled_reward(100)
    right, wrong = "so \\boxed{0.5}", "so \\boxed{3}"
    completions = [right, _assistant(right), right, wrong, _assistant(wrong), wrong, right]
    solutions = ["$\\frac{1}{2}$"] * 6 + ["n/a"]
    ids = [[1] * n for n in (0, 50, 150, 0, 50, 100, 10)]
    rewards = reward(completions=completions, solution=solutions, completion_ids=ids, log_extra=None)
    assert rewards[:6] == pytest.approx([1.0, 0.75, 0.5, -1.0, -0.75, -0.5])
    assert rewards[6] is None
    with pytest.raises(ValueError, match="values of 'completion_ids'"):
        reward(completions=[right], solution=["$1$"], completion_ids=[])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_len": 0}, "max_len must be >= 1"),
        ({"max_len": -10}, "max_len must be >= 1"),
        ({"max_len": 10.0}, "max_len must be an integer"),
        ({"max_len": 10, "min_value_wrong": 0.0, "max_value_wrong": -1.0}, "min_value_wrong"),
        ({"max_len": 10, "min_value_correct": 2.0, "max_value_correct": 1.0}, "min_value_correct"),
        ({"max_len": 10, "max_value_correct": math.inf}, "must be a finite number"),
        ({"max_len": 10, "min_value_wrong": "low"}, "must be a finite number"),
    ],
)
def test_cosine_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_cosine_scaled_reward(**kwargs)


# ---------------------------------------------------------------------------------------------------
# get_repetition_penalty_reward
# ---------------------------------------------------------------------------------------------------


def test_repetition_penalty_worked_cases():
    """n = 3, max_penalty = -1; penalty = (1 - unique / total) * max_penalty.

    [1,2,3,4,5]: 3-grams (1,2,3) (2,3,4) (3,4,5), all distinct -> 0.
    [1,2,3,1,2,3]: (1,2,3) (2,3,1) (3,1,2) (1,2,3): total 4, unique 3 -> -(1 - 3/4) = -0.25.
    [7,7,7,7,7]: (7,7,7) x 3: total 3, unique 1 -> -(1 - 1/3) = -2/3.
    [1,2,3]: one 3-gram -> 0.  [1,2] and []: shorter than n -> 0.
    """
    reward = get_repetition_penalty_reward()
    ids = [[1, 2, 3, 4, 5], [1, 2, 3, 1, 2, 3], [7] * 5, [1, 2, 3], [1, 2], []]
    out = reward(completion_ids=ids, completions=["ignored"] * 6)
    assert out == pytest.approx([0.0, -0.25, -2 / 3, 0.0, 0.0, 0.0])
    assert all(math.copysign(1.0, v) == 1.0 for v in (out[0], out[3], out[4]))  # 0.0, not -0.0


def test_repetition_penalty_other_settings():
    """n = 2, max_penalty = -0.5, ids [1,1,1,2]: bigrams (1,1) (1,1) (1,2): total 3, unique 2 ->
    (1 - 2/3) * -0.5 = -1/6. n = 1, ids [4,4,4,4]: total 4, unique 1 -> (1 - 1/4) * -0.5 = -0.375.
    max_penalty = 0 switches the penalty off. Tensor rows are read as token ids.
    """
    assert get_repetition_penalty_reward(2, -0.5)(completion_ids=[[1, 1, 1, 2]]) == pytest.approx([-1 / 6])
    assert get_repetition_penalty_reward(1, -0.5)(completion_ids=[[4, 4, 4, 4]]) == [-0.375]
    assert get_repetition_penalty_reward(3, 0.0)(completion_ids=[[7] * 9]) == [0.0]
    rows = torch.tensor([[1, 2, 3, 1, 2, 3]])
    assert get_repetition_penalty_reward()(completion_ids=list(rows)) == [-0.25]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_penalty": 0.5}, "max_penalty must be <= 0"),
        ({"max_penalty": math.nan}, "max_penalty must be a finite number"),
        ({"ngram_size": 0}, "ngram_size must be >= 1"),
        ({"ngram_size": 2.5}, "ngram_size must be an integer"),
    ],
)
def test_repetition_penalty_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        get_repetition_penalty_reward(**kwargs)


# ---------------------------------------------------------------------------------------------------
# Names, pickling, the trainer's reward runner
# ---------------------------------------------------------------------------------------------------


def test_names_and_pickling():
    """Functions pickle by reference; factory outputs pickle by value and keep their settings."""
    for function, name in [
        (accuracy_reward, "accuracy_reward"),
        (reasoning_accuracy_reward, "reasoning_accuracy_reward"),
        (think_format_reward, "think_format_reward"),
    ]:
        assert function.__name__ == name
        assert pickle.loads(pickle.dumps(function)) is function
    made = [
        (get_soft_overlong_punishment(10, 4), "soft_overlong_punishment", {"completion_ids": [[1] * 8]}),
        (get_cosine_scaled_reward(100), "cosine_scaled_reward", None),
        (
            get_repetition_penalty_reward(2, -0.5),
            "repetition_penalty_reward",
            {"completion_ids": [[1, 1, 1, 2]]},
        ),
    ]
    for reward, name, call in made:
        assert reward.__name__ == name
        copy = pickle.loads(pickle.dumps(reward))
        assert copy.__name__ == name and repr(copy) == repr(reward)
        if call is not None:
            assert copy(**call) == reward(**call)
    assert pickle.loads(pickle.dumps(get_cosine_scaled_reward(100))).value(50, True) == pytest.approx(0.75)


def test_rewards_in_the_reward_runner(math_verify):
    """The trainer's runner passes every argument by keyword; names come from ``__name__``.

    Two completions of gold 2, 3 and 6 tokens long: "<think>1+1</think> \\boxed{2}" (right, well
    formed), "\\boxed{3}" (wrong, no think block).
    accuracy: 1, 0; reasoning accuracy: 1, 0 (no </think>); think format: 1, 0;
    soft overlong (L_max 6, cache 2, interval from 4): L=3 -> 0, L=6 -> (4-6)/2 = -1;
    cosine (max_len 6): right at L=3 -> 0.5 + 0.5 * 0.5 = 0.75, wrong at L=6 -> -0.5;
    repetition (n=3): [5,6,7] -> 0, [1,1,1,1,1,1] -> 4 trigrams, 1 unique -> -0.75.
    """
    funcs = [
        accuracy_reward,
        reasoning_accuracy_reward,
        think_format_reward,
        get_soft_overlong_punishment(6, 2),
        get_cosine_scaled_reward(6),
        get_repetition_penalty_reward(),
    ]
    runner = RewardRunner(funcs)
    assert runner.names == [
        "accuracy_reward",
        "reasoning_accuracy_reward",
        "think_format_reward",
        "soft_overlong_punishment",
        "cosine_scaled_reward",
        "repetition_penalty_reward",
    ]
    log = _Columns()
    metrics = {}
    kwargs = {
        "prompts": ["What is 1+1?"] * 2,
        "completions": ["<think>1+1</think> \\boxed{2}", "\\boxed{3}"],
        "completion_ids": [[5, 6, 7], [1] * 6],
        "solution": ["$2$", "$2$"],
        "trainer_state": None,
        "log_metric": metrics.__setitem__,
        "log_extra": log,
    }
    scores = runner.score(2, kwargs)
    expected = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.75, 0.0], [0.0, 0.0, 0.0, -1.0, -0.5, -0.75]])
    assert torch.allclose(scores, expected)
    # reasoning_accuracy_reward ran after accuracy_reward, so its columns are the ones kept
    assert log.columns["predicted_answer"] == ["2", None]
