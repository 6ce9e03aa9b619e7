"""math-verify behind the math rewards: imported on first use, answers read and compared per batch.

``_MathVerifier`` reads gold and predicted answers and compares them as ``rewards/library.py``
describes (LaTeX first, else a plain expression that is the whole text; ``\\boxed{}`` wins), with
math-verify's 5-second limit in the main thread and none elsewhere.
"""

from __future__ import annotations

import math
import threading
from decimal import Decimal
from typing import Any

_TIMEOUT_S = 5  # math-verify's own default for parse and verify


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The math rewards of posttrain (accuracy_reward, reasoning_accuracy_reward, "
            "get_cosine_scaled_reward) need the math-verify package. Install it with "
            "pip install 'posttrain[math]' (or pip install math-verify)."
        ) from exc
    return math_verify


class _MathVerifier:
    """Reads gold and predicted answers with math-verify and compares them, for one batch.

    Gold answers are cached by their text, since a group's completions share one solution.
    """

    def __init__(self) -> None:
        mv = _import_math_verify()
        self._parse = mv.parse
        self._verify = mv.verify
        # A \boxed{} answer wins over every other candidate (priority 0), in gold and completion.
        self._latex_config = [mv.LatexExtractionConfig(boxed_match_priority=0)]
        self._plain_config = [mv.ExprExtractionConfig()]
        self._answer_config = [*self._latex_config, *self._plain_config]
        in_main_thread = threading.current_thread() is threading.main_thread()
        self._timeout = _TIMEOUT_S if in_main_thread else None
        self._gold_cache: dict[str, list[Any] | None] = {}

    def gold(self, solution: Any) -> list[Any] | None:
        """The parsed gold answer, or None if math-verify finds none."""
        if solution is None or isinstance(solution, bool):
            return None
        if isinstance(solution, float) and not math.isfinite(solution):
            return None
        if isinstance(solution, str):
            text = solution
        elif isinstance(solution, float):
            text = format(Decimal(repr(float(solution))), "f")  # no exponent: 1e-07 -> 0.0000001
        else:
            text = str(solution)
        if text not in self._gold_cache:
            self._gold_cache[text] = self._read_gold(text)
        return self._gold_cache[text]

    def _read_gold(self, text: str) -> list[Any] | None:
        parsed = self._run_parse(text, self._latex_config)
        if parsed:
            return parsed
        # No LaTeX: a plain expression, accepted only if it is the whole text, so that "1e3",
        # "(1, 2)" or "x = 3" are not silently read as the single number math-verify finds in them.
        parsed = self._run_parse(text, self._plain_config)
        if parsed and isinstance(parsed[-1], str) and _bare(parsed[-1]) == _bare(text):
            return parsed
        return None

    def _run_parse(self, text: str, config: list[Any]) -> list[Any] | None:
        parsed = self._parse(
            text, extraction_config=config, extraction_mode="first_match", parsing_timeout=self._timeout
        )
        return list(parsed) if parsed else None

    def answer(self, text: str | None) -> list[Any] | None:
        """The parsed answer of a completion's text, or None if there is none."""
        if not text:
            return None
        return self._run_parse(text, self._answer_config)

    def equal(self, gold: list[Any], answer: list[Any] | None) -> bool:
        """Whether the answer is equivalent to the gold answer (False when there is no answer)."""
        if not answer:
            return False
        return bool(self._verify(gold, answer, timeout_seconds=self._timeout))


def _bare(text: str) -> str:
    """A plain expression without spaces, thousands commas and a final period, for comparison."""
    return "".join(text.split()).replace(",", "").rstrip(".")


def _shown(parsed: list[Any] | None) -> str | None:
    """The text math-verify extracted (its last element), for the log columns."""
    if not parsed:
        return None
    last = parsed[-1]
    return last if isinstance(last, str) else str(parsed[0])
