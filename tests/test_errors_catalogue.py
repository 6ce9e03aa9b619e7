"""docs/errors.md, the catalogue of bad input, stays in step with the test suite and the messages.

The catalogue lists each bad input with the test that covers it and the start of its message. These
tests parse it and check that it is large enough, that every cited test exists, and that every quoted
message is still in the source, so the page cannot drift from the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
SOURCE = ROOT / "src" / "posttrain"

AREAS = (
    "Configuration",
    "Datasets",
    "Model and tokenizer",
    "Reward functions and reward models",
    "rollout_func",
    "Agents (tools and environments)",
    "Checkpoints and resume",
    "Numerical faults",
    "Command line",
    "Distillation",
    "Not built yet",
)
COLUMNS = ["ID", "Bad input", "Raised", "Exception", "Message starts", "Fix", "Test"]
MIN_ROWS = 40

# `tests/test_x.py::test_name` or `tests/test_x.py::test_name[parameter id]`, in backticks.
TEST_ID = re.compile(r"`(tests/[\w/]+\.py)::(\w+)(\[[^`]*\])?`")
CODE_SPAN = re.compile(r"`([^`]+)`")
PLACEHOLDER = re.compile(r"\{[^{}]*\}")
# The end of one string literal and the start of the next one on the following line.
LITERAL_JOIN = re.compile(r"[\"']\s*\n\s*[rRbBfFuU]{0,2}[\"']")


@dataclass(frozen=True)
class Row:
    area: str
    cells: dict[str, str]


def catalogue_rows() -> list[Row]:
    """The table rows of docs/errors.md, each with its area (the ``##`` heading above it)."""
    rows, area = [], ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            area = line[3:].strip()
            continue
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] == COLUMNS[0]:
            assert cells == COLUMNS, f"unexpected table header in {area!r}: {cells}"
            continue
        assert len(cells) == len(COLUMNS), f"row with {len(cells)} cells instead of {len(COLUMNS)}: {line}"
        rows.append(Row(area, dict(zip(COLUMNS, cells, strict=True))))
    return rows


def source_text() -> str:
    """Every module of the package, with string literals continued on the next line joined up."""
    text = "\n".join(path.read_text() for path in sorted(SOURCE.rglob("*.py")))
    return LITERAL_JOIN.sub("", text)


ROWS = catalogue_rows()


def test_catalogue_has_at_least_40_rows() -> None:
    assert len(ROWS) >= MIN_ROWS, f"docs/errors.md lists {len(ROWS)} bad inputs; it should list {MIN_ROWS}+"


def test_every_area_has_rows_in_order() -> None:
    areas = list(dict.fromkeys(row.area for row in ROWS))
    assert areas == list(AREAS)


def test_row_ids_are_unique() -> None:
    ids = [row.cells["ID"] for row in ROWS]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_every_row_cites_a_test() -> None:
    untested = [row.cells["ID"] for row in ROWS if not TEST_ID.search(row.cells["Test"])]
    assert not untested, f"rows without a test: {untested}"


def test_every_cited_test_exists() -> None:
    """Each `tests/file.py::test_name[...]` in the page names a test function that exists."""
    cited = TEST_ID.findall(DOC.read_text())
    assert cited
    missing = []
    for file, name, param in cited:
        path = ROOT / file
        if not path.is_file() or f"def {name}(" not in path.read_text():
            missing.append(f"{file}::{name}{param}")
    assert not missing, f"docs/errors.md cites tests that do not exist: {missing}"


def test_quoted_messages_are_in_the_source() -> None:
    """The code spans of the message column quote the source: every literal piece is found there.

    A quote may hold run-time values as ``{placeholders}`` and skip text with an ellipsis; the pieces
    between them must appear in ``src/posttrain`` as written. A message in "double quotes" comes
    from a library (argparse) and is not looked up.
    """
    source = source_text()
    stale = []
    for row in ROWS:
        cell = row.cells["Message starts"]
        quotes = CODE_SPAN.findall(cell)
        assert quotes or cell.startswith('"'), f"{row.cells['ID']} quotes no message"
        for quote in quotes:
            for piece in re.split(r"…|\.\.\. ", PLACEHOLDER.sub("\0", quote)):
                for part in piece.split("\0"):
                    if len(part.strip()) >= 3 and part not in source:
                        stale.append(f"{row.cells['ID']}: {part!r}")
    assert not stale, f"quoted messages not found in src/posttrain: {stale}"
