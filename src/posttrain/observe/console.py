"""A compact console for training runs: one line per logging step, every metric in a file.

transformers prints each logging step's whole metric dict (``ProgressCallback.on_log`` above the
progress bar, ``PrinterCallback`` when the bar is off). :func:`use_compact_console` swaps that for
:class:`RunLogCallback`: one line with the figures a user watches (:func:`format_log_line`) and
every dict appended to a JSON Lines file (:func:`json_log_line`). The ``posttrain`` training
commands install it; ``trainer.train()`` in a user's script keeps transformers' behaviour unless
the script calls :func:`use_compact_console` itself.

A line of a GRPO run and of an offline run::

    step  3/60 | reward 1.250 (answer_accuracy_reward 0.375, answer_format_reward 0.875) | length 41.2 | 12.3 s/step
    step 10/30 | loss 0.4321 | token accuracy 0.81 | 4.5 s/step
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from posttrain.observe.plots import eval_prefix

#: The figures of a line after the reward or loss, in order: ``(metric, template)``. A metric
#: that was not logged is left out.
LINE_FIELDS: tuple[tuple[str, str], ...] = (
    ("accuracy", "accuracy {:.2f}"),  # reward models, or a user's metric
    ("rewards/accuracies", "accuracy {:.2f}"),  # preference pairs
    ("mean_token_accuracy", "token accuracy {:.2f}"),
    ("margin", "margin {:.3f}"),
    ("rewards/margins", "margin {:.3f}"),
    ("completions/mean_length", "length {:.1f}"),
    ("step_time", "{:.1f} s/step"),
)

_REWARD_KEY = re.compile(r"rewards/(.+)/mean")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rewards_part(logs: Mapping[str, Any]) -> str | None:
    """``reward 1.250 (f 0.375, g 0.875)``: the total reward, then each function's mean."""
    each = [
        f"{match.group(1)} {value:.3f}"
        for key, value in logs.items()
        if (match := _REWARD_KEY.fullmatch(key)) and _number(value)
    ]
    total = logs.get("reward")
    if not _number(total):
        return f"rewards {', '.join(each)}" if each else None
    return f"reward {total:.3f}" + (f" ({', '.join(each)})" if each else "")


def _duration(seconds: float) -> str:
    """``12.3 s`` under a minute, else ``8 min 16 s``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def _step_part(step: int, max_steps: int) -> str:
    if max_steps > 0:
        return f"step {step:>{len(str(max_steps))}}/{max_steps}"
    return f"step {step}"


def format_log_line(logs: Mapping[str, Any], step: int, max_steps: int) -> str:
    """The console line of one logged metric dict.

    Training entries show the step, then the total reward with each reward function's mean
    (``rewards/<name>/mean``) or, without rewards (offline trainers), the loss, then the
    :data:`LINE_FIELDS` that were logged. Evaluation entries (``eval_`` keys) show the same
    figures after ``eval at``; the summary transformers logs at the end of training shows the
    steps and the training time.

    Args:
        logs: the dict a trainer logs (``Trainer.log``).
        step: the global step it was logged at.
        max_steps: the run's number of steps (0 or less: unknown).

    Returns:
        One line, without a newline.
    """
    if _number(logs.get("train_runtime")):
        return f"done at {_step_part(step, max_steps)} after {_duration(logs['train_runtime'])}"
    head = _step_part(step, max_steps)
    prefix = eval_prefix(dict(logs))
    if prefix is not None:
        logs = {k[len(prefix) :]: v for k, v in logs.items() if k.startswith(prefix)}
        head = f"eval at {head}"
    parts = [head]
    rewards = _rewards_part(logs)
    if rewards is not None:
        parts.append(rewards)
    elif _number(logs.get("loss")):
        parts.append(f"loss {logs['loss']:.4f}")
    parts += [template.format(logs[key]) for key, template in LINE_FIELDS if _number(logs.get(key))]
    return " | ".join(parts)


def _json_value(value: Any) -> Any:
    """``value`` as JSON can hold it: a non-finite float becomes ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def json_log_line(logs: Mapping[str, Any], step: int) -> str:
    """One logged metric dict as a JSON object (``step`` first), for the run's log file.

    NaN and infinite values are written as ``null`` (strict JSON); values JSON cannot hold are
    written as their ``str``.
    """
    entry = {"step": step, **{key: _json_value(value) for key, value in logs.items()}}
    return json.dumps(entry, default=str)


def _lines_up_to(lines: list[str], step: int) -> list[str]:
    """The log lines logged at ``step`` or before (what a run resumed at ``step`` keeps)."""
    kept = []
    for line in lines:
        try:
            logged = json.loads(line).get("step", 0)
        except (ValueError, AttributeError):
            continue
        if _number(logged) and logged <= step:
            kept.append(line)
    return kept


class RunLogCallback(TrainerCallback):
    """Prints one line per log (:func:`format_log_line`) and appends every dict to ``path``.

    A run that starts from step 0 empties the file; a resumed run keeps the lines up to its
    checkpoint's step. Only the main process prints and writes. The line goes through
    ``tqdm.write``, so it lands above a progress bar instead of breaking it.
    """

    def __init__(self, path: str | Path, label: str | None = None) -> None:
        self.path = Path(path)
        self.label = label

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if state.global_step > 0 and self.path.is_file():
            kept = _lines_up_to(self.path.read_text(encoding="utf-8").splitlines(), state.global_step)
        self.path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        from tqdm.auto import tqdm

        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json_log_line(logs, state.global_step) + "\n")
        line = format_log_line(logs, state.global_step, state.max_steps)
        tqdm.write(f"[{self.label}] {line}" if self.label else line)


class _BarOnlyProgressCallback(ProgressCallback):
    """transformers' progress bars, without the metric dict it writes above them at each log."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        pass


def use_compact_console(trainer: Any, path: str | Path, label: str | None = None) -> RunLogCallback:
    """Replace ``trainer``'s printing of each metric dict with :class:`RunLogCallback`.

    transformers' ``ProgressCallback`` is swapped for one that keeps its bars but no longer
    writes the dict, and ``PrinterCallback`` (used when ``disable_tqdm``) is removed, so each
    log is shown once, as the compact line.

    Args:
        trainer: a ``transformers.Trainer``.
        path: the JSON Lines file that receives every logged dict (``output_dir/log.jsonl``).
        label: printed in brackets before each line (a sweep's run name), or nothing.

    Returns:
        The installed callback.
    """
    trainer.pop_callback(RunLogCallback)  # installed once, even when called again
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(_BarOnlyProgressCallback())
    trainer.pop_callback(PrinterCallback)
    callback = RunLogCallback(path, label)
    trainer.add_callback(callback)
    return callback
