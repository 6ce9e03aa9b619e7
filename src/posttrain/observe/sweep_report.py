"""One page comparing the runs of a sweep (``posttrain report SWEEP_DIR``).

A sweep's folder holds ``sweep.json`` (each run's status, step, folder and, from ``posttrain
sweep``, its held-out accuracy before and after) and one folder per run with its
``trainer_state.json``. The page overlays the runs' curves (total reward, each reward function,
KL and entropy where logged) and tabulates the runs; like a run's report it is one
self-contained HTML file.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

from posttrain.observe import plots

#: The sweep's summary file, written by ``GRPOSweep.train``.
SUMMARY_FILE = "sweep.json"

#: The metrics overlaid, in this order, when at least one run logged them.
COMPARED = ("reward", "kl", "entropy", "completions/mean_length")


def is_sweep_folder(folder: str | Path) -> bool:
    """Whether ``folder`` is a sweep's (it holds ``sweep.json``)."""
    return (Path(folder) / SUMMARY_FILE).is_file()


def read_summary(folder: str | Path) -> list[dict[str, Any]]:
    """The runs listed in ``folder/sweep.json``.

    Raises:
        ValueError: the file is not JSON or has no ``runs`` list.
    """
    path = Path(folder) / SUMMARY_FILE
    try:
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"{str(path)!r} could not be read as a sweep summary: {err}") from err
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{str(path)!r} lists no runs")
    return runs


def _histories(folder: Path, runs: list[dict[str, Any]]) -> dict[str, plots.History | None]:
    found: dict[str, plots.History | None] = {}
    for run in runs:
        try:
            found[run["name"]] = plots.load_history(folder / run.get("output_dir", run["name"]))
        except (FileNotFoundError, ValueError):
            found[run["name"]] = None  # a run that failed before logging
    return found


def _metrics(histories: dict[str, plots.History | None]) -> list[str]:
    logged = set().union(*(h.metrics() for h in histories.values() if h is not None))
    rewards = sorted(m for m in logged if m.startswith("rewards/") and m.endswith("/mean"))
    return [m for m in COMPARED if m in logged] + rewards


def overlay_png(metric: str, histories: dict[str, plots.History | None]) -> bytes:
    """A PNG of ``metric``'s training curve for every run that logged it, one line each."""
    figure_class, canvas_class = plots._matplotlib()
    figure = figure_class(figsize=(7.0, 3.6), dpi=100)
    canvas_class(figure)
    ax = figure.add_subplot(1, 1, 1)
    for index, (name, history) in enumerate(histories.items()):
        points = history.series.get(plots.TRAIN, {}).get(metric) if history is not None else None
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, color=f"C{index % 10}", alpha=0.35, linewidth=1)
        smooth = plots.rolling_mean(list(values), plots.rolling_window(len(values)))
        ax.plot(steps, smooth, color=f"C{index % 10}", linewidth=2, label=name)
    ax.set_title(metric)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape("" if value is None else str(value))


def _table(runs: list[dict[str, Any]], histories: dict[str, plots.History | None]) -> str:
    accuracy_names = sorted({key for run in runs for key in ((run.get("accuracy") or {}).get("after") or {})})
    head = ["run", "status", "steps", "final reward"]
    head += [f"held-out {name} before → after" for name in accuracy_names]
    head += ["error"]
    rows = []
    for run in runs:
        history = histories.get(run["name"])
        reward = history.last(plots.TRAIN, "reward") if history is not None else None
        cells = [run["name"], run.get("status"), run.get("global_step"), reward]
        accuracy = run.get("accuracy") or {}
        for name in accuracy_names:
            before = (accuracy.get("before") or {}).get(name)
            after = (accuracy.get("after") or {}).get(name)
            cells.append(f"{_cell(before)} → {_cell(after)}" if after is not None else "")
        cells.append(run.get("error"))
        rows.append(
            "<tr>"
            + "".join(f"<td>{c if isinstance(c, str) and '→' in c else _cell(c)}</td>" for c in cells)
            + "</tr>"
        )
    header = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def build_sweep_report(folder: str | Path) -> str:
    """The HTML page comparing the runs of the sweep in ``folder``."""
    folder = Path(folder)
    runs = read_summary(folder)
    histories = _histories(folder, runs)
    images = "".join(
        f'<img alt="{html.escape(metric)}" src="data:image/png;base64,'
        f'{base64.b64encode(overlay_png(metric, histories)).decode()}">'
        for metric in _metrics(histories)
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>sweep {html.escape(folder.name)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}img{max-width:100%;display:block;margin:1em 0}"
        "</style></head><body>"
        f"<h1>Sweep {html.escape(folder.name)}: {len(runs)} runs on one base model</h1>"
        f"{_table(runs, histories)}<h2>Curves (faint: each step; bold: rolling mean)</h2>{images}"
        "</body></html>"
    )


def write_sweep_report(folder: str | Path, out_path: str | Path | None = None) -> Path:
    """Write the comparison page to ``out_path`` (default ``folder/report.html``) and return its path."""
    page = build_sweep_report(folder)
    out = Path(folder) / "report.html" if out_path is None else Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
