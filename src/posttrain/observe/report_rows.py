"""The report's rows: a run's ``completions.jsonl`` (or ``eval_completions.jsonl``) read back.

``parse_row`` checks one logged line and makes it a ``CompletionRow``; ``read_completions`` reads
a file into ``Completions``, keeping at most ``max_rows`` of them (a uniform sample, in file order) and
warning about the lines it skips. The format is in docs/observability.md; ``observe/report.py``
renders the rows.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.observe.completions import render_messages

COMPLETIONS_FILE = "completions.jsonl"
EVAL_COMPLETIONS_FILE = "eval_completions.jsonl"
DEFAULT_MAX_ROWS = 2000
REQUIRED_KEYS = ("step", "prompt", "completion", "advantage")
RESERVED_KEYS = {"step", "prompt", "completion", "advantage", "reward", "rewards"}

# ---- the completions file ---------------------------------------------------------------------


@dataclass
class CompletionRow:
    """One line of ``completions.jsonl``, normalised.

    Attributes:
        index: the line number (1-based) in the file.
        step: the training step that generated the completion.
        prompt / completion: display text (conversations rendered as ``role: content`` blocks).
        advantage: the advantage, or None.
        rewards: reward value per reward function name (None: the function returned None).
        reward: the total reward: the row's ``reward`` when given, else the sum of ``rewards``.
        extra: every other column, as given.
    """

    index: int
    step: int
    prompt: str
    completion: str
    advantage: float | None
    rewards: dict[str, float | None]
    reward: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completions:
    """The rows kept for the report and what was left out."""

    path: Path
    rows: list[CompletionRow]
    total: int  # valid rows in the file
    invalid: int = 0
    first_error: str | None = None
    split: str = "train"


def _number(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number or null, got {value!r}")
    return float(value)


def parse_row(obj: Any, index: int) -> CompletionRow:
    """Validate and normalise one decoded line.

    Raises:
        ValueError: the line is not an object, lacks a required key, or has a wrongly typed value.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"missing key(s) {missing}")
    step = obj["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or step != int(step):
        raise ValueError(f"'step' must be an integer, got {step!r}")
    rewards: dict[str, float | None] = {}
    nested = obj.get("rewards")
    if nested is not None:
        if not isinstance(nested, dict):
            raise ValueError(f"'rewards' must be an object of name -> value, got {nested!r}")
        for name, value in nested.items():
            rewards[str(name)] = _number(value, f"rewards[{name!r}]")
    for key, value in obj.items():
        if key.startswith("rewards/"):
            rewards[key[len("rewards/") :]] = _number(value, repr(key))
    total = _number(obj.get("reward"), "'reward'")
    if total is None:
        present = [v for v in rewards.values() if v is not None and not math.isnan(v)]
        total = math.fsum(present) if present else None
    extra = {k: v for k, v in obj.items() if k not in RESERVED_KEYS and not k.startswith("rewards/")}
    return CompletionRow(
        index=index,
        step=int(step),
        prompt=render_messages(obj["prompt"]),
        completion=render_messages(obj["completion"]),
        advantage=_number(obj["advantage"], "'advantage'"),
        rewards=rewards,
        reward=total,
        extra=extra,
    )


def read_completions(
    path: str | Path, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0, split: str = "train"
) -> Completions:
    """Read ``completions.jsonl``; keep at most ``max_rows`` valid rows (a uniform sample, file order).

    Blank lines are ignored; an unreadable line (bad JSON, a missing key, a wrong type; for
    instance the last line of a file still being written) is skipped and counted.
    """
    path = Path(path)
    rng = random.Random(seed)
    kept: list[CompletionRow] = []
    total = invalid = 0
    first_error = None
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = parse_row(json.loads(line), number)
            except ValueError as err:
                invalid += 1
                if first_error is None:
                    first_error = f"line {number}: {err}"
                continue
            total += 1
            if len(kept) < max_rows:
                kept.append(row)
            else:  # reservoir sampling: every valid row is kept with probability max_rows / total
                slot = rng.randrange(total)
                if slot < max_rows:
                    kept[slot] = row
    kept.sort(key=lambda r: r.index)
    if invalid:
        warnings.warn(f"{path}: skipped {invalid} unreadable line(s); first: {first_error}", stacklevel=2)
    return Completions(
        path=path, rows=kept, total=total, invalid=invalid, first_error=first_error, split=split
    )
