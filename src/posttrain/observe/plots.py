"""PNG plots of a run's logged metrics.

The history comes from ``trainer_state.json`` (its ``log_history``), read from the run folder
or, when the run folder has none, from its newest ``checkpoint-*`` folder. Each metric family
(rewards per function, total reward, KL, entropy, completion lengths, clip ratios, step time,
loss) gets one PNG, with evaluation values (``eval_``-prefixed keys) drawn on the same axes as
their training counterparts. A family that was never logged gets no plot.

matplotlib is optional (``pip install 'posttrain[plot]'``) and imported only when drawing; the
figures are drawn with the Agg canvas, without pyplot, so no global backend is changed.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRAINER_STATE = "trainer_state.json"
PLOT_EXTRA_HINT = "pip install 'posttrain[plot]'"

TRAIN = "train"

# ---- the logged history -------------------------------------------------------------------------


@dataclass
class History:
    """Metric series of a run, by source (``"train"``, ``"eval"``, or ``"eval_<dataset>"``).

    Attributes:
        source_file: the ``trainer_state.json`` that was read.
        series: ``series[source][metric]`` is a list of ``(step, value)`` pairs in log order.
    """

    source_file: Path
    series: dict[str, dict[str, list[tuple[float, float]]]] = field(default_factory=dict)

    def metrics(self) -> set[str]:
        """Every metric name logged by any source."""
        return {name for by_name in self.series.values() for name in by_name}

    def sources(self) -> list[str]:
        """Sources in drawing order: train first, then evaluation sources by name."""
        return sorted(self.series, key=lambda s: (s != TRAIN, s))

    def last(self, source: str, metric: str) -> float | None:
        """The last logged value of ``metric`` from ``source``, or None."""
        points = self.series.get(source, {}).get(metric)
        return points[-1][1] if points else None

    @property
    def last_step(self) -> int:
        steps = [step for by_name in self.series.values() for pts in by_name.values() for step, _ in pts]
        return int(max(steps)) if steps else 0


def find_trainer_state(run_dir: str | Path) -> Path:
    """The ``trainer_state.json`` of a run: in ``run_dir``, else in its newest checkpoint.

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder, or neither it nor any
            ``checkpoint-<step>`` folder in it holds a ``trainer_state.json``.
    """
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {str(run)!r} does not exist or is not a folder")
    direct = run / TRAINER_STATE
    if direct.is_file():
        return direct
    checkpoints = []
    for child in run.glob("checkpoint-*"):
        match = re.fullmatch(r"checkpoint-(\d+)", child.name)
        if match and (child / TRAINER_STATE).is_file():
            checkpoints.append((int(match.group(1)), child))
    if not checkpoints:
        raise FileNotFoundError(
            f"no {TRAINER_STATE} in {str(run)!r} nor in any checkpoint-<step> folder inside it; expected "
            f"the output_dir of a training run (trainer.save_state() writes {TRAINER_STATE} there, "
            f"and every checkpoint holds one)"
        )
    return max(checkpoints, key=lambda item: item[0])[1] / TRAINER_STATE


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def eval_prefix(entry: dict[str, Any]) -> str | None:
    """The key prefix of an evaluation log entry (``eval_`` or ``eval_<dataset>_``), else None."""
    loss = next((k for k in entry if k.startswith("eval") and k.endswith("_loss")), None)
    if loss is not None:
        return loss[: -len("loss")]
    if any(k.startswith("eval_") for k in entry):
        return "eval_"
    return None


def parse_log_history(log_history: Sequence[dict[str, Any]], source_file: Path | str = "") -> History:
    """Split a ``log_history`` list into per-source metric series.

    Evaluation entries (keys prefixed ``eval_`` or, with a dict of eval datasets,
    ``eval_<name>_``) become the sources ``"eval"`` / ``"eval_<name>"`` with the prefix removed,
    so ``eval_reward`` is the evaluation counterpart of ``reward``. Entries without a ``step``
    and non-numeric values are skipped; NaN is kept (drawn as a gap).
    """
    history = History(source_file=Path(source_file))
    for entry in log_history:
        if not isinstance(entry, dict) or not _is_number(entry.get("step")):
            continue
        step = float(entry["step"])
        prefix = eval_prefix(entry)
        source = TRAIN if prefix is None else prefix.rstrip("_")
        for key, value in entry.items():
            if key == "step" or not _is_number(value):
                continue
            if prefix is not None:
                if not key.startswith(prefix):
                    continue  # epoch and the like, logged next to the evaluation metrics
                key = key[len(prefix) :]
            history.series.setdefault(source, {}).setdefault(key, []).append((step, float(value)))
    return history


def load_history(run_dir: str | Path) -> History:
    """Read and parse the log history of a run.

    Raises:
        FileNotFoundError: see :func:`find_trainer_state`.
        ValueError: the file is not valid JSON, has no ``log_history`` list, or logged no metric.
    """
    path = find_trainer_state(run_dir)
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{str(path)!r} could not be read as JSON: {err}") from err
    log_history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(log_history, list) or not log_history:
        raise ValueError(
            f"{str(path)!r} has no log history: expected a non-empty 'log_history' list of dicts with "
            f"'step' and metric keys (set logging_steps so that the run logs before it saves)"
        )
    history = parse_log_history(log_history, path)
    if not history.series:
        raise ValueError(
            f"{str(path)!r}: 'log_history' holds no entry with a 'step' and numeric metric values"
        )
    return history


# ---- which plots ------------------------------------------------------------------------------


@dataclass
class Line:
    """One curve: ``metric`` and, optionally, a ``band`` metric drawn as ±band around it.

    With ``smooth``, the training curve also gets its rolling mean (:func:`rolling_mean`) drawn
    on top of the raw per-step values.
    """

    metric: str
    label: str
    band: str | None = None
    smooth: bool = False


@dataclass
class Panel:
    title: str
    lines: list[Line]


@dataclass
class Family:
    """A group of related metrics drawn in one PNG (``<name>.png``)."""

    name: str
    title: str
    panels: Callable[[set[str]], list[Panel]]


def _reward_names(metrics: set[str]) -> list[str]:
    names = []
    for m in metrics:
        match = re.fullmatch(r"rewards/(.+)/mean", m)
        if match:
            names.append(match.group(1))
    return sorted(names)


def _rewards_panels(metrics: set[str]) -> list[Panel]:
    return [
        Panel(name, [Line(f"rewards/{name}/mean", "mean ± std", f"rewards/{name}/std", smooth=True)])
        for name in _reward_names(metrics)
    ]


def _reward_panels(metrics: set[str]) -> list[Panel]:
    panels = []
    if "reward" in metrics:
        band = "reward_std" if "reward_std" in metrics else None
        panels.append(Panel("reward", [Line("reward", "mean ± std" if band else "mean", band, smooth=True)]))
    if "reward_std" in metrics:
        panels.append(Panel("reward_std", [Line("reward_std", "std within the batch")]))
    return panels


def _single(metric: str, title: str | None = None) -> Callable[[set[str]], list[Panel]]:
    def panels(metrics: set[str]) -> list[Panel]:
        return [Panel(title or metric, [Line(metric, metric)])] if metric in metrics else []

    return panels


LENGTH_METRICS = [
    ("completions/mean_length", "mean"),
    ("completions/min_length", "min"),
    ("completions/max_length", "max"),
    ("completions/mean_terminated_length", "mean of terminated"),
]


def _length_panels(metrics: set[str]) -> list[Panel]:
    lines = [Line(m, label) for m, label in LENGTH_METRICS if m in metrics]
    return [Panel("completion length (tokens)", lines)] if lines else []


def _clip_panels(metrics: set[str]) -> list[Panel]:
    keys = sorted(m for m in metrics if m.startswith("clip_ratio/"))
    return [Panel("clip ratios", [Line(k, k.split("/", 1)[1]) for k in keys])] if keys else []


FAMILIES: list[Family] = [
    Family("rewards", "Reward per reward function", _rewards_panels),
    Family("reward", "Total reward", _reward_panels),
    Family("loss", "Loss", _single("loss")),
    Family("kl", "KL to the reference model", _single("kl")),
    Family("entropy", "Entropy of the policy (nats per token)", _single("entropy")),
    Family("completion_lengths", "Completion lengths", _length_panels),
    Family("clip_ratio", "Clip ratios", _clip_panels),
    Family("step_time", "Step time (seconds)", _single("step_time")),
]


def plan(history: History) -> list[tuple[Family, list[Panel]]]:
    """The families that have at least one logged metric, with their panels."""
    metrics = history.metrics()
    planned = []
    for family in FAMILIES:
        panels = family.panels(metrics)
        if panels:
            planned.append((family, panels))
    return planned


# ---- smoothing --------------------------------------------------------------------------------

#: The widest rolling-mean window, in logged points.
MAX_ROLLING_WINDOW = 10


def rolling_window(num_points: int) -> int:
    """The rolling-mean window for a curve of ``num_points`` logged steps.

    A sixth of the points, at most :data:`MAX_ROLLING_WINDOW`: 10 for the 60 steps of the
    default ``posttrain grpo`` run, 5 for 30; 1 (no smoothing) under 12 points.
    """
    return max(1, min(MAX_ROLLING_WINDOW, num_points // 6))


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """The centred rolling mean of ``values``, one value per point.

    Point ``i`` is the mean of ``values[i - window // 2 : i - window // 2 + window]``, the window
    cut at both ends (so the first and last points average fewer values), with NaN values left
    out; NaN where the window holds no number. Centred, the curve does not lag the raw values.

    Args:
        values: the raw per-step values.
        window: points per window, at least 1 (1 returns the values unchanged).

    Returns:
        A list as long as ``values``.

    Raises:
        ValueError: ``window`` is below 1.
    """
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    means = []
    for index in range(len(values)):
        start = max(0, index - window // 2)
        numbers = [v for v in values[start : index - window // 2 + window] if not math.isnan(v)]
        means.append(sum(numbers) / len(numbers) if numbers else math.nan)
    return means


# ---- drawing ----------------------------------------------------------------------------------


def _matplotlib() -> tuple[Any, Any]:
    """``(Figure, FigureCanvasAgg)``, or an ImportError that says how to install matplotlib."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plots need matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from err
    return Figure, FigureCanvasAgg


def _source_label(source: str) -> str:
    if source == TRAIN:
        return "train"
    if source == "eval":
        return "eval"
    return f"eval ({source[len('eval_') :]})"


def _draw_panel(ax: Any, panel: Panel, history: History, title: bool) -> None:
    from matplotlib.ticker import MaxNLocator

    colors = [f"C{i}" for i in range(10)]
    sources = history.sources()
    several_sources = sum(any(line.metric in history.series[s] for line in panel.lines) for s in sources) > 1
    for i, line in enumerate(panel.lines):
        color = colors[i % len(colors)]
        for source in sources:
            points = history.series[source].get(line.metric)
            if not points:
                continue
            points = sorted(points, key=lambda p: p[0])
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            is_eval = source != TRAIN
            label = line.label
            if several_sources or is_eval:
                label = f"{label} [{_source_label(source)}]"
            style = {"linestyle": "--", "marker": "o", "markersize": 3} if is_eval else {"linewidth": 1.5}
            if len(xs) == 1:
                style["marker"] = "o"
            window = rolling_window(len(ys)) if line.smooth and not is_eval else 1
            if window > 1:  # the noisy raw values thin and faint, their rolling mean on top
                style = {"linewidth": 0.8, "alpha": 0.45}
                smooth = rolling_mean(ys, window)
                ax.plot(
                    xs,
                    smooth,
                    color=color,
                    linewidth=2.2,
                    zorder=3,
                    label=f"rolling mean ({window} logged steps)",
                )
            ax.plot(xs, ys, color=color, label=label, **style)
            band = history.series[source].get(line.band) if line.band else None
            if band:
                by_step = {step: value for step, value in band}
                lows, highs = [], []
                for x, y in zip(xs, ys, strict=True):
                    s = by_step.get(x, math.nan)
                    lows.append(y - s)
                    highs.append(y + s)
                ax.fill_between(
                    xs, lows, highs, color=color, alpha=0.15 if not is_eval else 0.08, linewidth=0
                )
    if title:
        ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def render_png(family: Family, panels: list[Panel], history: History) -> bytes:
    """One family's figure as PNG bytes."""
    Figure, FigureCanvasAgg = _matplotlib()
    cols = 1 if len(panels) == 1 else 2
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(6.4 * cols, 3.6 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index < len(panels):
            _draw_panel(ax, panels[index], history, title=len(panels) > 1 or family.name == "rewards")
        else:
            ax.set_visible(False)
    fig.suptitle(family.title, fontsize=12)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()


def render_history(history: History) -> list[tuple[Family, bytes]]:
    """Every logged family's figure as ``(family, png_bytes)``, in :data:`FAMILIES` order."""
    return [(family, render_png(family, panels, history)) for family, panels in plan(history)]


def plot_history(history: History, out_dir: str | Path) -> list[Path]:
    """Write one ``<family>.png`` per logged family into ``out_dir``; returns the paths."""
    rendered = render_history(history)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for family, png in rendered:
        path = out / f"{family.name}.png"
        path.write_bytes(png)
        paths.append(path)
    return paths


def write_plots(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Plot the logged metrics of a run as PNG files.

    Args:
        run_dir: a training ``output_dir`` (or one checkpoint folder) holding ``trainer_state.json``,
            directly or in its newest ``checkpoint-<step>`` folder.
        out_dir: where to write; defaults to ``run_dir/plots``.

    Returns:
        The written paths, one ``<family>.png`` per metric family that was logged
        (``rewards``, ``reward``, ``loss``, ``kl``, ``entropy``, ``completion_lengths``,
        ``clip_ratio``, ``step_time``).

    Raises:
        FileNotFoundError: no run folder, or no ``trainer_state.json`` in it or its checkpoints.
        ValueError: the log history is missing or empty.
        ImportError: matplotlib is not installed.
    """
    history = load_history(run_dir)
    _matplotlib()  # fail on a missing matplotlib before creating any folder
    return plot_history(history, Path(run_dir) / "plots" if out_dir is None else out_dir)


def write_plots_from_log_history(log_history: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """:func:`write_plots` for an in-memory ``log_history`` (``trainer.state.log_history``)."""
    return plot_history(parse_log_history(log_history), out_dir)


# ---- command line -----------------------------------------------------------------------------


def main_plot(argv: list[str]) -> None:
    """``posttrain plot RUN_DIR [--out DIR]``."""
    parser = argparse.ArgumentParser(
        prog="posttrain plot",
        description="Write PNG plots of a run's logged metrics (from trainer_state.json).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the output_dir of a training run")
    parser.add_argument("--out", metavar="DIR", default=None, help="output folder (default: RUN_DIR/plots)")
    args = parser.parse_args(argv)
    try:
        paths = write_plots(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as err:
        print(f"posttrain plot: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    for path in paths:
        print(path)
    if not paths:
        print(
            f"posttrain plot: the log history of {args.run_dir} has no metric that is plotted",
            file=sys.stderr,
        )
