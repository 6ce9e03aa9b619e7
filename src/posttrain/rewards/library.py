"""Reward functions for math reasoning, with the names and signatures TRL's users call.

Every reward here takes the batch as keyword arguments, as the trainer passes it (``completions``,
``completion_ids``, the dataset columns such as ``solution``, ...), ignores the arguments it does not
use, and returns one float (or None) per completion, in order. A completion is either a string
(standard format) or a list of message dicts (conversational format); the text scored is the one
:func:`posttrain.rewards.answer.completion_text` reads (the last assistant message with content).

Plain functions:

- :func:`accuracy_reward`: the final answer equals the gold ``solution`` (math-verify), 1.0 / 0.0.
- :func:`reasoning_accuracy_reward`: the same, on the text after the reasoning (``</think>``).
- :func:`think_format_reward`: the completion is ``<think>reasoning</think>answer``, 1.0 / 0.0.

Factories, each returning a picklable callable whose ``__name__`` is its metric name:

- :func:`get_soft_overlong_punishment` -> ``soft_overlong_punishment`` (DAPO, eq. 13).
- :func:`get_cosine_scaled_reward` -> ``cosine_scaled_reward`` (Demystifying Long CoT, App. C.1).
- :func:`get_repetition_penalty_reward` -> ``repetition_penalty_reward`` (same paper, App. C.2).

The math rewards need the ``math-verify`` package (``pip install 'posttrain[math]'``); it is imported
when one of them is first called, so the rest of posttrain works without it.

How answers are read by math-verify (:class:`_MathVerifier`):

- the gold ``solution`` is read as LaTeX (``$\\frac{1}{2}$``, ``\\(x^2\\)``, ``\\boxed{3}``; the
  ``\\boxed{}`` of a worked solution), and else as a plain number or arithmetic expression that
  must make up the whole text (``42``, ``-0.5``, ``1,234``, ``1/2``, ``2^10``); a number
  (``int``/``float``) is written out in decimal first (``1e-07`` as ``0.0000001``). A solution with nothing math-verify can read
  (``"n/a"``, ``""``, ``None``, a bare ``\\frac12`` without ``$``), or plain text that is more than
  one number or expression (``"1e3"``, ``"(1, 2)"``, ``"x = 3"``, ``"5 apples"``: write these in
  LaTeX), has no gold answer, and the reward is None for that sample.
- the completion's answer is, in this order of preference, its ``\\boxed{...}``, then LaTeX or a
  plain expression after an answer phrase ("The final answer is ..."), then the last LaTeX or
  expression in the text. No answer found counts as a wrong answer (0.0).
- several ``\\boxed{}`` in one text (gold or completion) are read together, as the set of their
  contents: a hedged ``"\\boxed{3} ... no, \\boxed{5}"`` is ``{3, 5}``, which does not equal ``5``,
  while a two-part gold ``"\\boxed{2}, \\boxed{3}"`` is matched by a completion boxing both.
- the two are compared with ``math_verify.verify(gold, answer)``: symbolic and numeric equality
  (``0.5`` equals ``\\frac{1}{2}``, ``x = 3`` equals ``3``), sets, intervals and matrices.

math-verify bounds each parse and comparison with a 5-second ``signal.alarm``, which only works in
the main thread; called from any other thread, these rewards run without that time limit.

:class:`_MathVerifier` and math-verify's import are in ``rewards/verifier.py``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

from posttrain.rewards.answer import completion_text
from posttrain.rewards.verifier import _MathVerifier, _shown

#: The ``log_extra`` column holding the gold answer that math-verify read from ``solution``.
GOLDEN_ANSWER_COLUMN = "golden_answer"
#: The ``log_extra`` column holding the answer that math-verify read from each completion.
PREDICTED_ANSWER_COLUMN = "predicted_answer"
#: The closing delimiters :func:`reasoning_accuracy_reward` looks for when none are given.
DEFAULT_REASONING_DELIMITERS = ("</think>",)
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


# ---------------------------------------------------------------------------------------------------
# math-verify
# ---------------------------------------------------------------------------------------------------


def _check_lengths(completions: Sequence[Any], name: str, other: Sequence[Any]) -> None:
    if len(completions) != len(other):
        raise ValueError(f"got {len(completions)} completions but {len(other)} values of {name!r}")


def _score_answers(
    answers: Sequence[str | None], solution: Sequence[Any], log_extra: Any
) -> list[float | None]:
    """1.0 / 0.0 / None per answer text (None: the reasoning never ended), and the log columns."""
    checker = _MathVerifier()
    rewards: list[float | None] = []
    golds: list[str | None] = []
    predicted: list[str | None] = []
    for text, reference in zip(answers, solution, strict=True):
        gold = checker.gold(reference)
        answer = checker.answer(text)
        golds.append(_shown(gold))
        predicted.append(_shown(answer))
        if gold is None:
            rewards.append(None)
        else:
            rewards.append(1.0 if checker.equal(gold, answer) else 0.0)
    if log_extra is not None:
        log_extra(GOLDEN_ANSWER_COLUMN, golds)
        log_extra(PREDICTED_ANSWER_COLUMN, predicted)
    return rewards


# ---------------------------------------------------------------------------------------------------
# Accuracy and format
# ---------------------------------------------------------------------------------------------------


def accuracy_reward(
    completions: Sequence[Any], solution: Sequence[Any], log_extra: Any = None, **kwargs: Any
) -> list[float | None]:
    """Whether the completion's final answer is mathematically equal to the gold solution.

    Rule, per completion ``c`` with gold solution ``s`` (both read by math-verify, see the module
    docstring)::

        reward = None  if no answer can be read from s
                 1.0   if verify(parse(s), parse(c)) is True
                 0.0   otherwise (no answer in c, or a different one)

    Worked examples: ``"so \\boxed{\\frac{1}{2}}"`` with ``s = "$0.5$"`` gives 1.0; ``"The answer
    is 3"`` with ``s = "$4$"`` gives 0.0; anything with ``s = "n/a"`` gives None.

    The whole completion is searched, reasoning included; for a ``<think>`` model, where a guess in
    the reasoning could be taken for the answer, use :func:`reasoning_accuracy_reward`.

    Args:
        completions: The generated completions (strings, or lists of message dicts).
        solution: The gold answers, one per completion (the dataset's ``solution`` column): LaTeX
            (``"$\\frac{1}{2}$"``, ``"\\boxed{3}"``) or a plain expression (``"42"``), or a number.
        log_extra: The trainer's ``log_extra(column, values)``. When given, two columns are logged,
            one value per completion: ``"golden_answer"`` (the gold answer as math-verify extracted
            it, None if unreadable) and ``"predicted_answer"`` (the completion's extracted answer,
            None if none was found).
        **kwargs: The other dataset columns and trainer arguments; ignored.

    Returns:
        One reward per completion; None where the gold solution cannot be read, which the trainer
        treats as "this reward does not apply to the sample" rather than as a wrong answer.

    Raises:
        ImportError: If math-verify is not installed (``pip install 'posttrain[math]'``).
        ValueError: If ``completions`` and ``solution`` differ in length.
    """
    _check_lengths(completions, "solution", solution)
    answers = [completion_text(c) for c in completions]
    return _score_answers(answers, solution, log_extra)


def _normalize_delimiters(reasoning_delimiters: Any) -> tuple[str, ...]:
    if reasoning_delimiters is None:
        return DEFAULT_REASONING_DELIMITERS
    delimiters = (reasoning_delimiters,) if isinstance(reasoning_delimiters, str) else reasoning_delimiters
    delimiters = tuple(delimiters)
    if not delimiters or not all(isinstance(d, str) and d for d in delimiters):
        raise ValueError(
            f"reasoning_delimiters must be a non-empty list of non-empty strings, got {reasoning_delimiters!r}"
        )
    return delimiters


def text_after_reasoning(text: str, delimiters: Iterable[str] = DEFAULT_REASONING_DELIMITERS) -> str | None:
    """The text after the reasoning: everything after the last occurrence of any closing delimiter.

    Args:
        text: The completion's text.
        delimiters: The closing delimiters of the reasoning (e.g. ``["</think>"]``).

    Returns:
        The text after the delimiter that ends last in ``text`` (possibly empty), or None if no
        delimiter occurs (the reasoning never ended).
    """
    end = -1
    for delimiter in delimiters:
        at = text.rfind(delimiter)
        if at >= 0:
            end = max(end, at + len(delimiter))
    return None if end < 0 else text[end:]


def reasoning_accuracy_reward(
    completions: Sequence[Any],
    solution: Sequence[Any],
    reasoning_delimiters: list[str] | None = None,
    log_extra: Any = None,
    **kwargs: Any,
) -> list[float | None]:
    """:func:`accuracy_reward` on the final answer only, after the reasoning is dropped.

    The reasoning is everything up to and including the last occurrence of a closing delimiter
    (the one that ends last, when several are given); the rest is scored as in
    :func:`accuracy_reward`. Rule, per completion ``c`` with gold solution ``s``::

        reward = None  if no answer can be read from s
                 0.0   if c contains none of the delimiters (the reasoning never ended, e.g. a
                       completion cut at max_completion_length: an answer inside unfinished
                       reasoning is a guess, not the model's final answer)
                 1.0   if the text after the last delimiter holds an answer equal to s
                 0.0   otherwise

    Worked examples with ``s = "$5$"``: ``"<think>maybe 4</think>\\boxed{5}"`` gives 1.0;
    ``"<think>it is 5</think>\\boxed{4}"`` gives 0.0 (the 5 in the reasoning does not count);
    ``"<think>it is \\boxed{5}"`` gives 0.0 (no closing delimiter).

    The delimiter must survive decoding: the trainer decodes with ``skip_special_tokens=True``, so a
    ``</think>`` registered as a *special* token is removed from the text; check your tokenizer
    (Qwen3's and DeepSeek-R1's add it as a regular token, so it stays).

    Args:
        completions: The generated completions (strings, or lists of message dicts).
        solution: The gold answers, one per completion (see :func:`accuracy_reward`).
        reasoning_delimiters: The strings that close the reasoning; default ``["</think>"]``. A
            single string is taken as a list of one.
        log_extra: The trainer's ``log_extra``; logs ``"golden_answer"`` and ``"predicted_answer"``
            as :func:`accuracy_reward` does (``predicted_answer`` is None where the reasoning never
            ended). Used together with :func:`accuracy_reward`, the function called last fills them.
        **kwargs: The other dataset columns and trainer arguments; ignored.

    Returns:
        One reward per completion; None where the gold solution cannot be read.

    Raises:
        ImportError: If math-verify is not installed (``pip install 'posttrain[math]'``).
        ValueError: If the lengths differ, or ``reasoning_delimiters`` is empty or holds an empty
            or non-string delimiter.
    """
    delimiters = _normalize_delimiters(reasoning_delimiters)
    _check_lengths(completions, "solution", solution)
    answers = [text_after_reasoning(completion_text(c), delimiters) for c in completions]
    return _score_answers(answers, solution, log_extra)


def _think_format_ok(text: str) -> bool:
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return False
    if body.count(THINK_OPEN) != 1 or body.count(THINK_CLOSE) != 1:
        return False
    answer = body.split(THINK_CLOSE, 1)[1]
    return bool(answer.strip())


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """Whether the completion is one ``<think>...</think>`` block followed by an answer.

    Rule, per completion text ``c`` (a strict 0/1 reward)::

        reward = 1.0  if, after leading whitespace, c starts with "<think>",
                      c contains exactly one "<think>" and exactly one "</think>",
                      and the text after "</think>" is not only whitespace
                 0.0  otherwise

    The reasoning inside the block may be empty (``"<think></think>42"`` scores 1.0): this reward
    checks the shape, not the thinking. The tags are matched exactly (case-sensitive). Worked
    examples: ``"<think>2+2=4</think> 4"`` gives 1.0; ``"<think>2+2=4</think>"`` (no answer),
    ``"4 <think>2+2</think> 4"`` (not at the start), ``"<think>a</think><think>b</think> 4"`` (two
    blocks) and ``"2+2=4</think> 4"`` (no opening tag) give 0.0.

    A chat template that writes ``<think>`` into the prompt (the generation prompt of some reasoning
    models) leaves completions without the opening tag, which this reward scores 0.0; and the tags
    must survive decoding with ``skip_special_tokens=True``.

    Args:
        completions: The generated completions (strings, or lists of message dicts).
        **kwargs: The dataset columns and trainer arguments; ignored.

    Returns:
        One reward (0.0 or 1.0) per completion.
    """
    return [1.0 if _think_format_ok(completion_text(c)) else 0.0 for c in completions]


# ---------------------------------------------------------------------------------------------------
# Length and repetition shaping (factories)
# ---------------------------------------------------------------------------------------------------


def _token_list(ids: Any) -> list[Any]:
    """A completion's token ids as a list (a tensor or array row becomes Python ints)."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _require_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _require_finite(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


class SoftOverlongPunishment:
    """DAPO's soft overlong punishment; build it with :func:`get_soft_overlong_punishment`."""

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        self.max_completion_len = _require_int("max_completion_len", max_completion_len, 1)
        self.soft_punish_cache = _require_int("soft_punish_cache", soft_punish_cache, 0)
        if self.soft_punish_cache > self.max_completion_len:
            raise ValueError(
                f"soft_punish_cache ({soft_punish_cache}) must not exceed max_completion_len "
                f"({max_completion_len}): the punishment interval lies inside the length budget"
            )
        self.__name__ = "soft_overlong_punishment"

    def penalty(self, length: int) -> float:
        """The punishment of a completion of ``length`` tokens (DAPO eq. 13)."""
        start = self.max_completion_len - self.soft_punish_cache
        if length <= start:
            return 0.0
        if length <= self.max_completion_len:
            return (start - length) / self.soft_punish_cache
        return -1.0

    def __call__(self, completion_ids: Sequence[Any], **kwargs: Any) -> list[float]:
        return [self.penalty(len(_token_list(ids))) for ids in completion_ids]

    def __repr__(self) -> str:
        return (
            f"SoftOverlongPunishment(max_completion_len={self.max_completion_len}, "
            f"soft_punish_cache={self.soft_punish_cache})"
        )


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> SoftOverlongPunishment:
    """DAPO's length-aware penalty for completions that run into the length budget.

    DAPO (Yu et al., 2025, arXiv 2503.14476), Sec. 3.4, eq. 13, with ``L = len(completion_ids)``,
    ``L_max = max_completion_len`` and ``L_cache = soft_punish_cache``::

        R(L) = 0                                   if L <= L_max - L_cache
               ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
               -1                                  if L > L_max

    The penalty falls linearly from 0 to -1 over the last ``L_cache`` tokens of the budget. The paper
    adds it to the accuracy reward and uses ``L_max = 20480``, ``L_cache = 4096``. Worked example with
    ``L_max = 10``, ``L_cache = 4``: L = 6 gives 0.0, L = 7 gives -0.25, L = 8 gives -0.5, L = 10 gives
    -1.0, L = 11 gives -1.0. With ``L_cache = 0`` it is a hard cut: 0 up to ``L_max``, -1 beyond.

    ``L`` counts the ids the trainer passes, the EOS token included when one was generated. Set
    ``max_completion_len`` to the trainer's ``max_completion_length``, as DAPO does: the trainer
    never generates more, so a completion cut at the budget has ``L = L_max`` and scores -1.0, and
    the ``L > L_max`` case only matters for a larger generation budget (or your own rollouts).

    Args:
        max_completion_len: ``L_max``, the largest length in tokens (an integer >= 1).
        soft_punish_cache: ``L_cache``, the length of the punishment interval (an integer,
            ``0 <= L_cache <= L_max``).

    Returns:
        A picklable reward function ``f(completion_ids, **kwargs) -> list[float]`` named
        ``"soft_overlong_punishment"``.

    Raises:
        ValueError: If ``max_completion_len < 1``, ``soft_punish_cache < 0``,
            ``soft_punish_cache > max_completion_len``, or either is not an integer.
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class CosineScaledReward:
    """The length-scaled correctness reward; build it with :func:`get_cosine_scaled_reward`."""

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float,
        max_value_wrong: float,
        min_value_correct: float,
        max_value_correct: float,
    ) -> None:
        self.max_len = _require_int("max_len", max_len, 1)
        self.min_value_wrong = _require_finite("min_value_wrong", min_value_wrong)
        self.max_value_wrong = _require_finite("max_value_wrong", max_value_wrong)
        self.min_value_correct = _require_finite("min_value_correct", min_value_correct)
        self.max_value_correct = _require_finite("max_value_correct", max_value_correct)
        for kind in ("wrong", "correct"):
            low, high = getattr(self, f"min_value_{kind}"), getattr(self, f"max_value_{kind}")
            if low > high:
                raise ValueError(f"min_value_{kind} ({low}) must not exceed max_value_{kind} ({high})")
        self.__name__ = "cosine_scaled_reward"

    def value(self, length: int, correct: bool) -> float:
        """The reward of a completion of ``length`` tokens, right or wrong (see the factory)."""
        progress = min(length, self.max_len) / self.max_len
        weight = 0.5 * (1.0 + math.cos(math.pi * progress))  # 1 at L = 0, 0 at L >= max_len
        if correct:
            at_max_len, at_zero = self.min_value_correct, self.max_value_correct
        else:  # swapped: a wrong answer is punished less the longer it is
            at_max_len, at_zero = self.max_value_wrong, self.min_value_wrong
        return at_max_len + (at_zero - at_max_len) * weight

    def __call__(
        self,
        completions: Sequence[Any],
        solution: Sequence[Any],
        completion_ids: Sequence[Any],
        **kwargs: Any,
    ) -> list[float | None]:
        _check_lengths(completions, "solution", solution)
        _check_lengths(completions, "completion_ids", completion_ids)
        checker = _MathVerifier()
        rewards: list[float | None] = []
        for completion, reference, ids in zip(completions, solution, completion_ids, strict=True):
            gold = checker.gold(reference)
            if gold is None:
                rewards.append(None)
                continue
            correct = checker.equal(gold, checker.answer(completion_text(completion)))
            rewards.append(self.value(len(_token_list(ids)), correct))
        return rewards

    def __repr__(self) -> str:
        return (
            f"CosineScaledReward(max_len={self.max_len}, min_value_wrong={self.min_value_wrong}, "
            f"max_value_wrong={self.max_value_wrong}, min_value_correct={self.min_value_correct}, "
            f"max_value_correct={self.max_value_correct})"
        )


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> CosineScaledReward:
    """A correctness reward scaled by length on a cosine schedule (Demystifying Long CoT).

    Yeo et al., 2025, "Demystifying Long Chain-of-Thought Reasoning in LLMs" (arXiv 2502.03373),
    Sec. 4.2 and App. C.1: ``CosFn(t, T, eta_min, eta_max) = eta_min + 0.5 (eta_max - eta_min)
    (1 + cos(t pi / T))``, which is ``eta_max`` at ``t = 0`` and ``eta_min`` at ``t = T``. With
    ``L = min(len(completion_ids), max_len)``::

        r = min_v + 0.5 * (max_v - min_v) * (1 + cos(pi * L / max_len))

        correct answer: (min_v, max_v) = (min_value_correct, max_value_correct)
                        -> max_value_correct at L = 0, falling to min_value_correct at max_len:
                           a correct answer earns more the shorter it is;
        wrong answer:   (min_v, max_v) = (max_value_wrong, min_value_wrong)   (swapped)
                        -> min_value_wrong at L = 0, rising to max_value_wrong at max_len:
                           a wrong answer is punished less the longer it is (keep exploring).

    In the paper's notation, ``max_value_correct = r_0^c``, ``min_value_correct = r_L^c``,
    ``min_value_wrong = r_0^w`` and ``max_value_wrong = r_L^w``; the authors' runs use
    ``r_0^c = 2, r_L^c = 1, r_0^w = -10, r_L^w = 0`` with ``max_len`` = the generation budget. The
    paper's separate exceed-length reward ``r_e`` (for completions that hit the budget) is not part
    of this function; add :func:`get_soft_overlong_punishment` for a length-budget penalty.

    Worked example with the defaults and ``max_len = 100``: a correct answer of 0 tokens gets 1.0,
    of 50 tokens 0.75, of 100 (or more) tokens 0.5; a wrong answer of 0 tokens gets -1.0, of 50
    tokens -0.75, of 100 tokens -0.5.

    Correctness is decided as in :func:`accuracy_reward` (math-verify, whole completion); where the
    gold ``solution`` cannot be read the reward is None. ``L`` counts the ids the trainer passes,
    EOS included.

    Args:
        max_len: The length (in tokens) where the schedule ends; set it to the generation budget
            (``max_completion_length``). An integer >= 1.
        min_value_wrong: The reward of a wrong answer of length 0 (the lowest).
        max_value_wrong: The reward of a wrong answer of length ``max_len``.
        min_value_correct: The reward of a correct answer of length ``max_len``.
        max_value_correct: The reward of a correct answer of length 0 (the highest).

    Returns:
        A picklable reward function ``f(completions, solution, completion_ids, **kwargs) ->
        list[float | None]`` named ``"cosine_scaled_reward"``.

    Raises:
        ValueError: If ``max_len`` is not an integer >= 1, a value is not a finite number, or
            ``min_value_wrong > max_value_wrong`` or ``min_value_correct > max_value_correct``.
    """
    return CosineScaledReward(max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct)


class RepetitionPenaltyReward:
    """The n-gram repetition penalty; build it with :func:`get_repetition_penalty_reward`."""

    def __init__(self, ngram_size: int, max_penalty: float) -> None:
        self.ngram_size = _require_int("ngram_size", ngram_size, 1)
        self.max_penalty = _require_finite("max_penalty", max_penalty)
        if self.max_penalty > 0:
            raise ValueError(f"max_penalty must be <= 0 (it is a penalty), got {max_penalty}")
        self.__name__ = "repetition_penalty_reward"

    def penalty(self, ids: Sequence[Any]) -> float:
        """The penalty of one completion's token ids (see the factory)."""
        total = len(ids) - self.ngram_size + 1
        if total <= 0:
            return 0.0
        unique = len({tuple(ids[i : i + self.ngram_size]) for i in range(total)})
        return (1.0 - unique / total) * self.max_penalty + 0.0  # + 0.0 turns -0.0 into 0.0

    def __call__(self, completion_ids: Sequence[Any], **kwargs: Any) -> list[float]:
        return [self.penalty(_token_list(ids)) for ids in completion_ids]

    def __repr__(self) -> str:
        return f"RepetitionPenaltyReward(ngram_size={self.ngram_size}, max_penalty={self.max_penalty})"


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenaltyReward:
    """A penalty for repeated n-grams of token ids (Demystifying Long CoT, App. C.2).

    With the completion's token ids split into its ``total = len(ids) - n + 1`` overlapping n-grams
    (``n = ngram_size``), of which ``unique`` are distinct::

        penalty = (1 - unique / total) * max_penalty      (0.0 if len(ids) < n)

    so a completion without a repeated n-gram gets 0 and one made of a single repeated n-gram
    approaches ``max_penalty``. Worked examples with ``n = 3``, ``max_penalty = -1``: ids
    ``[1, 2, 3, 1, 2, 3]`` have the 3-grams (1,2,3), (2,3,1), (3,1,2), (1,2,3): total 4, unique 3,
    penalty -0.25; ``[7, 7, 7, 7, 7]``: total 3, unique 1, penalty -2/3; ``[1, 2]``: 0.0.

    The paper pairs this penalty with :func:`get_cosine_scaled_reward`, whose length incentive
    otherwise invites repetition. Its Appendix C.2 applies the penalty densely, on the tokens of
    each repeated n-gram; this is the sequence-level form (one scalar per completion, as a GRPO
    reward must be), which the authors' code also provides, here over token ids rather than words.

    Args:
        ngram_size: ``n``, the number of tokens per n-gram (an integer >= 1).
        max_penalty: The penalty approached by a fully repetitive completion (a number <= 0).

    Returns:
        A picklable reward function ``f(completion_ids, **kwargs) -> list[float]`` named
        ``"repetition_penalty_reward"``.

    Raises:
        ValueError: If ``max_penalty > 0`` or is not a finite number, or ``ngram_size`` is not an
            integer >= 1.
    """
    return RepetitionPenaltyReward(ngram_size, max_penalty)


__all__ = [
    "DEFAULT_REASONING_DELIMITERS",
    "GOLDEN_ANSWER_COLUMN",
    "PREDICTED_ANSWER_COLUMN",
    "CosineScaledReward",
    "RepetitionPenaltyReward",
    "SoftOverlongPunishment",
    "accuracy_reward",
    "get_cosine_scaled_reward",
    "get_repetition_penalty_reward",
    "get_soft_overlong_punishment",
    "reasoning_accuracy_reward",
    "text_after_reasoning",
    "think_format_reward",
]
