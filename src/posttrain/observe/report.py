"""A self-contained HTML report of a run: metric curves and a browsable table of completions.

The page has no external reference: the plots are embedded as base64 ``data:`` URIs and the
CSS and JavaScript are inline, so the single file can be mailed or archived. All text from the
run (prompts, completions, reward names, extra columns) is HTML-escaped; the script only moves
and hides the rows the server side rendered, it never builds HTML from data.

The completions come from ``<run_dir>/completions.jsonl`` (format in docs/observability.md),
read by ``observe/report_rows.py``; its public names are imported here.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import html
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from posttrain.observe import plots
from posttrain.observe.report_rows import (  # noqa: F401  (re-exported)
    COMPLETIONS_FILE,
    DEFAULT_MAX_ROWS,
    EVAL_COMPLETIONS_FILE,
    REQUIRED_KEYS,
    RESERVED_KEYS,
    CompletionRow,
    Completions,
    parse_row,
    read_completions,
)

# ---- HTML -------------------------------------------------------------------------------------


# C0 controls (but tab, newline, carriage return) and DEL are invalid in HTML text: shown as their
# Unicode "control pictures"; lone surrogates (JSON "\ud800") cannot be encoded: shown as U+FFFD.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|[\ud800-\udfff]")


def _visible(match: re.Match[str]) -> str:
    code = ord(match.group(0))
    if code == 0x7F:
        return "\u2421"
    return chr(0x2400 + code) if code < 0x20 else "\ufffd"


def _e(value: Any) -> str:
    """``value`` as HTML text or attribute value: escaped, and printable."""
    return _UNPRINTABLE.sub(_visible, html.escape(str(value), quote=True))


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "–"
    if value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"


def _data_value(value: float | None) -> str:
    """A sort key for a ``data-v`` attribute: a plain number, or empty for missing."""
    if value is None or math.isnan(value) or math.isinf(value):
        return ""
    return repr(float(value))


def _extra_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return _fmt(float(value))
    return json.dumps(value, ensure_ascii=False)


CSS = """
:root { --fg:#1d2330; --muted:#5c6578; --line:#d9dee8; --bg:#f6f7fb; --accent:#2f5fd0; }
* { box-sizing: border-box; }
[hidden] { display: none !important; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); margin: 0; padding: 24px 32px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 10px; }
.meta, .note { color: var(--muted); }
.note { background: #fff8e1; border: 1px solid #f0dca0; padding: 8px 12px; border-radius: 6px; color: #5a4a12; }
.summary { border-collapse: collapse; background: #fff; }
.summary td, .summary th { border: 1px solid var(--line); padding: 4px 10px; text-align: left; }
.summary td.num { text-align: right; font-variant-numeric: tabular-nums; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure.wide { grid-column: 1 / -1; }
figure { margin: 0; background: #fff; border: 1px solid var(--line); border-radius: 6px; padding: 8px; }
figure img { width: 100%; height: auto; display: block; }
figcaption { color: var(--muted); font-size: 12px; margin-top: 4px; }
.controls { display: flex; flex-wrap: wrap; gap: 12px; align-items: center; margin-bottom: 10px; }
.controls input[type=search] { width: 320px; padding: 5px 8px; border: 1px solid var(--line); border-radius: 4px; }
.controls select, .controls button { padding: 4px 8px; }
table.completions { border-collapse: collapse; width: 100%; background: #fff; table-layout: auto; }
table.completions th, table.completions td { border: 1px solid var(--line); padding: 4px 6px; vertical-align: top; }
table.completions th { background: #eef1f7; position: sticky; top: 0; white-space: nowrap; }
th.sortable { cursor: pointer; color: var(--accent); user-select: none; }
th.sortable[aria-sort=ascending]::after { content: " \\25B2"; }
th.sortable[aria-sort=descending]::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.pos { color: #1b7a36; } td.neg { color: #b3261e; }
.text { white-space: pre-wrap; word-break: break-word; max-height: 11em; overflow: auto;
        font: 12.5px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
td.prompt { min-width: 220px; max-width: 420px; } td.completion { min-width: 320px; }
.pager { margin: 10px 0; display: flex; gap: 8px; align-items: center; }
"""

# The script reorders, hides and pages the server-rendered rows; it reads values from data-*
# attributes and text with textContent and never writes HTML.
SCRIPT = """
(function () {
  "use strict";
  const body = document.body;
  const table = document.getElementById("completions");
  if (table) {
    const tbody = table.tBodies[0];
    const all = Array.from(tbody.rows);
    all.forEach(function (row, i) {
      row._order = i;
      row._search = (row.querySelector(".prompt").textContent + "\\n" +
                     row.querySelector(".completion").textContent).toLowerCase();
    });
    const textBox = document.getElementById("filter-text");
    const stepBox = document.getElementById("filter-step");
    const splitBox = document.getElementById("filter-split");
    const sizeBox = document.getElementById("page-size");
    const prev = document.getElementById("page-prev");
    const next = document.getElementById("page-next");
    const info = document.getElementById("page-info");
    const pager = document.getElementById("pager");
    const headers = Array.from(table.tHead.rows[0].cells);
    const state = { text: "", step: "", split: "", sortCol: -1, sortDir: 1, page: 0 };

    function value(row, col) {
      const raw = row.cells[col].dataset.v;
      return raw === undefined || raw === "" ? null : parseFloat(raw);
    }

    function render() {
      let rows = all.filter(function (row) {
        return (state.step === "" || row.dataset.step === state.step) &&
               (state.split === "" || row.dataset.split === state.split) &&
               (state.text === "" || row._search.indexOf(state.text) !== -1);
      });
      if (state.sortCol >= 0) {
        const col = state.sortCol, dir = state.sortDir;
        rows.sort(function (a, b) {
          const x = value(a, col), y = value(b, col);
          if (x === null && y === null) return a._order - b._order;
          if (x === null) return 1;
          if (y === null) return -1;
          return x === y ? a._order - b._order : (x - y) * dir;
        });
      }
      const size = sizeBox.value === "all" ? Math.max(rows.length, 1) : parseInt(sizeBox.value, 10);
      const pages = Math.max(1, Math.ceil(rows.length / size));
      state.page = Math.min(state.page, pages - 1);
      const start = state.page * size;
      const shown = rows.slice(start, start + size);
      const fragment = document.createDocumentFragment();
      shown.forEach(function (row) { fragment.appendChild(row); });
      tbody.replaceChildren(fragment);
      pager.hidden = rows.length <= size;
      prev.disabled = state.page === 0;
      next.disabled = state.page >= pages - 1;
      info.textContent = rows.length === 0
        ? "no completion matches the filters"
        : "rows " + (start + 1) + "\\u2013" + (start + shown.length) + " of " + rows.length +
          (rows.length !== all.length ? " (filtered from " + all.length + ")" : "") +
          (pages > 1 ? ", page " + (state.page + 1) + " of " + pages : "");
      body.dataset.rows = String(shown.length);
    }

    textBox.addEventListener("input", function () {
      state.text = textBox.value.toLowerCase(); state.page = 0; render();
    });
    stepBox.addEventListener("change", function () { state.step = stepBox.value; state.page = 0; render(); });
    if (splitBox) {
      splitBox.addEventListener("change", function () { state.split = splitBox.value; state.page = 0; render(); });
    }
    sizeBox.addEventListener("change", function () { state.page = 0; render(); });
    prev.addEventListener("click", function () { state.page -= 1; render(); });
    next.addEventListener("click", function () { state.page += 1; render(); });
    headers.forEach(function (th, col) {
      if (!th.classList.contains("sortable")) return;
      th.tabIndex = 0;
      function sort() {
        if (state.sortCol === col) {
          state.sortDir = -state.sortDir;
        } else {
          state.sortCol = col;
          state.sortDir = th.dataset.firstDir === "asc" ? 1 : -1;
        }
        headers.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", state.sortDir === 1 ? "ascending" : "descending");
        state.page = 0;
        render();
      }
      th.addEventListener("click", sort);
      th.addEventListener("keydown", function (ev) { if (ev.key === "Enter") sort(); });
    });
    render();
  } else {
    body.dataset.rows = "0";
  }
  window.addEventListener("load", function () {
    const images = Array.from(document.images);
    body.dataset.imagesTotal = String(images.length);
    body.dataset.imagesLoaded = String(images.filter(function (img) {
      return img.complete && img.naturalWidth > 0;
    }).length);
  });
})();
"""


def _summary_html(history: plots.History) -> str:
    """The last logged value of the headline metrics, train and evaluation side by side."""
    metrics = history.metrics()
    names = ["reward", "reward_std"]
    names += [f"rewards/{n}/mean" for n in plots._reward_names(metrics)]
    names += ["loss", "kl", "entropy", "completions/mean_length", "completions/clipped_ratio", "step_time"]
    names = [n for n in names if n in metrics]
    if not names:
        return ""
    sources = history.sources()
    head = "".join(f"<th>{_e(plots._source_label(s))} (last)</th>" for s in sources)
    rows = []
    for name in names:
        cells = "".join(f'<td class="num">{_e(_fmt(history.last(s, name)))}</td>' for s in sources)
        rows.append(f"<tr><th>{_e(name)}</th>{cells}</tr>")
    return f'<table class="summary"><thead><tr><th>metric</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _plots_html(history: plots.History | None, history_error: str | None) -> str:
    if history is None:
        return f'<p class="note">No curves: {_e(history_error)}</p>'
    rendered = plots.render_history(history)
    if not rendered:
        return '<p class="note">The log history has none of the plotted metrics.</p>'
    figures = []
    panels = {family.name: len(family_panels) for family, family_panels in plots.plan(history)}
    for family, png in rendered:
        wide = ' class="wide"' if panels.get(family.name, 1) > 1 else ""
        data = base64.b64encode(png).decode("ascii")
        figures.append(
            f'<figure id="plot-{_e(family.name)}"{wide}><img alt="{_e(family.title)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{_e(family.title)} '
            f"({_e(family.name)}.png)</figcaption></figure>"
        )
    return f'<div class="plots">{"".join(figures)}</div>'


def _column_names(rows: list[tuple[str, CompletionRow]]) -> tuple[list[str], list[str], set[str]]:
    """The reward names, the extra names (first-seen order) and the extra names holding only numbers."""
    reward_names: list[str] = []
    extra_names: list[str] = []
    for _, row in rows:
        for name in row.rewards:
            if name not in reward_names:
                reward_names.append(name)
        for name in row.extra:
            if name not in extra_names:
                extra_names.append(name)
    numeric_extra = {
        name
        for name in extra_names
        if all(
            name not in r.extra
            or r.extra[name] is None
            or (isinstance(r.extra[name], (int, float)) and not isinstance(r.extra[name], bool))
            for _, r in rows
        )
    }
    return reward_names, extra_names, numeric_extra


def _th(label: str, sortable: bool, first_dir: str = "desc", title: str = "") -> str:
    """One header cell, marked sortable (with its first sort direction) when asked."""
    attrs = ' class="sortable" data-first-dir="' + first_dir + '"' if sortable else ""
    if title:
        attrs += f' title="{_e(title)}"'
    return f"<th{attrs}>{_e(label)}</th>"


def _table_head(
    several: bool, reward_names: list[str], extra_names: list[str], numeric_extra: set[str]
) -> list[str]:
    """The header cells of the completions table."""
    head = [_th("#", True, "asc", "line in the completions file")]
    if several:
        head.append(_th("split", False))
    head += [
        _th("step", True, "asc"),
        _th("prompt", False),
        _th("completion", False),
        _th("reward", True, "desc", "the row's total reward, else the sum of its rewards; click to sort"),
    ]
    head += [_th(name, True, "desc", f"reward function {name}") for name in reward_names]
    head.append(_th("advantage", True, "desc"))
    head += [_th(name, name in numeric_extra, "desc") for name in extra_names]
    return head


def _num_cell(value: float | None, signed: bool = False) -> str:
    """One numeric cell carrying its sort value, coloured by sign when ``signed``."""
    cls = "num"
    if signed and value is not None and not math.isnan(value) and value != 0:
        cls += " pos" if value > 0 else " neg"
    return f'<td class="{cls}" data-v="{_data_value(value)}">{_e(_fmt(value))}</td>'


def _table_row(
    split: str,
    row: CompletionRow,
    several: bool,
    reward_names: list[str],
    extra_names: list[str],
    numeric_extra: set[str],
) -> str:
    """The ``<tr>`` of one completion row."""
    cells = [_num_cell(float(row.index))]
    if several:
        cells.append(f"<td>{_e(split)}</td>")
    cells += [
        _num_cell(float(row.step)),
        f'<td class="prompt"><div class="text">{_e(row.prompt)}</div></td>',
        f'<td class="completion"><div class="text">{_e(row.completion)}</div></td>',
        _num_cell(row.reward),
    ]
    cells += [_num_cell(row.rewards.get(name)) for name in reward_names]
    cells.append(_num_cell(row.advantage, signed=True))
    for name in extra_names:
        value = row.extra.get(name)
        if name in numeric_extra:
            cells.append(_num_cell(None if value is None else float(value)))
        elif name not in row.extra:
            cells.append("<td></td>")
        else:
            cells.append(f'<td><div class="text">{_e(_extra_text(value))}</div></td>')
    return f'<tr data-step="{row.step}" data-split="{_e(split)}">{"".join(cells)}</tr>'


def _table_controls(files: list[Completions], steps: list[int], page_size: int) -> str:
    """The filter, step, split and page-size controls above the completions table."""
    step_options = '<option value="">all steps</option>' + "".join(
        f'<option value="{s}">step {s}</option>' for s in steps
    )
    split_select = ""
    if len(files) > 1:
        split_options = '<option value="">train and eval</option>' + "".join(
            f'<option value="{_e(f.split)}">{_e(f.split)}</option>' for f in files
        )
        split_select = f'<label>Split <select id="filter-split">{split_options}</select></label>'
    sizes = sorted({25, 50, 100, 200, page_size})
    size_options = "".join(
        f'<option value="{s}"{" selected" if s == page_size else ""}>{s}</option>' for s in sizes
    )
    size_options += '<option value="all">all</option>'
    return (
        '<div class="controls">'
        '<label>Filter <input type="search" id="filter-text" '
        'placeholder="text in the prompt or completion"></label>'
        f'<label>Step <select id="filter-step">{step_options}</select></label>'
        f"{split_select}"
        f'<label>Rows per page <select id="page-size">{size_options}</select></label>'
        '<span class="meta">Click a blue column header to sort.</span>'
        "</div>"
    )


_PAGER = (
    '<div class="pager" id="pager"><button type="button" id="page-prev">&larr; previous</button>'
    '<button type="button" id="page-next">next &rarr;</button></div>'
    '<div class="meta" id="page-info"></div>'
)


def _table_html(files: list[Completions], page_size: int) -> str:
    """The completions table with its controls and pager."""
    rows = [(f.split, row) for f in files for row in f.rows]
    several = len(files) > 1
    reward_names, extra_names, numeric_extra = _column_names(rows)
    head = _table_head(several, reward_names, extra_names, numeric_extra)
    body = [_table_row(split, row, several, reward_names, extra_names, numeric_extra) for split, row in rows]
    steps = sorted({row.step for _, row in rows})
    controls = _table_controls(files, steps, page_size)
    table = (
        f'<table class="completions" id="completions"><thead><tr>{"".join(head)}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )
    return controls + _PAGER + table


def _completions_html(run_dir: Path, files: list[Completions], page_size: int) -> str:
    if not files:
        return (
            f'<p class="note">No completions: {_e(run_dir / COMPLETIONS_FILE)} does not exist. The trainer '
            "writes it with <code>log_completions=True</code>; its format is described in "
            "docs/observability.md.</p>"
        )
    notes = []
    for f in files:
        if len(f.rows) < f.total:
            text = (
                f"{_e(f.path.name)}: a uniform sample of {len(f.rows)} of the {f.total} completions "
                "in the file, in file order."
            )
        else:
            text = f"{_e(f.path.name)}: {f.total} completion(s)."
        if f.invalid:
            text += f" {f.invalid} unreadable line(s) skipped (first: {_e(f.first_error)})."
        notes.append(text)
    note = "".join(f'<p class="meta">{text}</p>' for text in notes)
    if not any(f.rows for f in files):
        return note + '<p class="note">The completions file holds no readable row.</p>'
    return note + _table_html([f for f in files if f.rows], page_size)


def build_report(run_dir: str | Path, max_rows: int = DEFAULT_MAX_ROWS, page_size: int = 50) -> str:
    """The report page of ``run_dir`` as an HTML string (see :func:`write_report`)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run directory {str(run)!r} does not exist or is not a folder")
    files = [
        read_completions(run / name, max_rows, split=split)
        for name, split in ((COMPLETIONS_FILE, "train"), (EVAL_COMPLETIONS_FILE, "eval"))
        if (run / name).is_file()
    ]
    history: plots.History | None = None
    history_error = None
    try:
        history = plots.load_history(run)
    except (FileNotFoundError, ValueError) as err:
        if not files:
            raise
        history_error = str(err)  # completions alone still make a useful page (a run in progress)
    if history is not None:
        plots._matplotlib()

    title = f"posttrain report: {run.resolve().name}"
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    meta = [f"run folder {_e(run.resolve())}", f"generated {_e(generated)}"]
    if history is not None:
        meta.append(
            f"log history from {_e(history.source_file.name)} of {_e(history.source_file.parent.name)}"
        )
        meta.append(f"last logged step {history.last_step}")
    summary = _summary_html(history) if history is not None else ""
    sections = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="meta">{" &middot; ".join(meta)}</p>',
    ]
    if summary:
        sections.append(f"<h2>Last values</h2>{summary}")
    sections.append(f"<h2>Curves</h2>{_plots_html(history, history_error)}")
    sections.append(f"<h2>Completions</h2>{_completions_html(run, files, page_size)}")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>"
        f"<body>{''.join(sections)}<script>{SCRIPT}</script></body></html>\n"
    )


def write_report(
    run_dir: str | Path,
    out_path: str | Path | None = None,
    max_rows: int = DEFAULT_MAX_ROWS,
    page_size: int = 50,
) -> Path:
    """Write one self-contained HTML page with the run's curves and a table of its completions.

    Args:
        run_dir: a training ``output_dir``; its ``trainer_state.json`` (or its newest
            checkpoint's) gives the curves, its ``completions.jsonl`` the table.
        out_path: the file to write; defaults to ``run_dir/report.html``.
        max_rows: at most this many completions are embedded (a uniform sample beyond it).
        page_size: rows per page of the table at first.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: no run folder, or neither a log history nor ``completions.jsonl``.
        ValueError: the log history is unreadable or empty and there is no ``completions.jsonl``.
        ImportError: matplotlib is not installed (``pip install 'posttrain[plot]'``).
    """
    if max_rows < 1 or page_size < 1:
        raise ValueError(f"max_rows and page_size must be >= 1, got {max_rows} and {page_size}")
    page = build_report(run_dir, max_rows=max_rows, page_size=page_size)
    out = Path(run_dir) / "report.html" if out_path is None else Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


def main_report(argv: list[str]) -> None:
    """``posttrain report RUN_DIR [--out FILE] [--max-rows N]`` (RUN_DIR a run's or a sweep's folder)."""
    parser = argparse.ArgumentParser(
        prog="posttrain report",
        description="Write one self-contained HTML page with a run's curves and completions.",
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="the output_dir of a training run, or a sweep's folder (runs compared)",
    )
    parser.add_argument(
        "--out", metavar="FILE", default=None, help="output file (default: RUN_DIR/report.html)"
    )
    parser.add_argument(
        "--max-rows",
        type=int,
        default=DEFAULT_MAX_ROWS,
        metavar="N",
        help=f"embed at most N completions, a uniform sample (default {DEFAULT_MAX_ROWS})",
    )
    args = parser.parse_args(argv)
    from posttrain.observe.sweep_report import is_sweep_folder, write_sweep_report

    try:
        if is_sweep_folder(args.run_dir):  # a sweep's folder: its runs side by side
            path = write_sweep_report(args.run_dir, args.out)
        else:
            path = write_report(args.run_dir, args.out, max_rows=args.max_rows)
    except (FileNotFoundError, ValueError, ImportError, OSError) as err:
        print(f"posttrain report: {err}", file=sys.stderr)
        raise SystemExit(2) from err
    print(path)
