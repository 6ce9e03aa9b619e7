"""Completion logging (``log_completions``): a rich table at each logging step and a JSON-lines file.

The trainer hands over, once per generation, every (prompt, completion) pair with its rewards,
its advantage and the columns reward functions sent through ``log_extra``. Rows are kept in two
buffers: one for the file, emptied by :meth:`CompletionLog.flush_to_file` (called at each logging
step and at the end of training, so no sample is lost), and one for display, emptied by
:meth:`CompletionLog.table` / :meth:`CompletionLog.print_table`.

File format (``<output_dir>/completions.jsonl``), one JSON object per line::

    {"step": int, "prompt": <str or list of messages>, "completion": <str or list of messages>,
     "rewards": {"<reward name>": float | null, ...}, "advantage": float | null,
     "<extra column>": value, ...}

Extra columns sit at the top level; one whose name is a fixed key (``step``, ``prompt``, ...)
is written as ``extra/<name>``. A reward that is ``None`` or not finite (NaN: the function
skipped the sample) is written as ``null``; so is any other non-finite float.

Only the main process keeps rows and writes: under distributed training the trainer gathers
the rows of all processes first and adds them on the main process.

Message contents made of parts are kept as they are in the file (values JSON cannot hold become
strings) and shown by their text parts, other parts as ``<type>``, in the table. Multimodal
content (``log_multimodal``): the image of an ``{"type": "image", "image": <PIL image>}`` block (a
vision-language prompt's images, an image a tool returned) is saved as a PNG file in the log's
image folder (``<output_dir>/completion_images``, named by a hash of its pixels, so an image
logged again is written once) and the block's ``"image"`` becomes the file's path relative to
``output_dir``; without an image folder (``log_multimodal=False``) the image is left out of the
block.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

COMPLETIONS_FILE = "completions.jsonl"
#: The folder of ``output_dir`` where ``log_multimodal`` saves the logged images.
IMAGES_FOLDER = "completion_images"
FIXED_KEYS = ("step", "prompt", "completion", "rewards", "advantage")
EXTRA_PREFIX = "extra/"
MISSING = "—"

Row = dict[str, Any]


def is_rich_available() -> bool:
    """Whether ``rich`` can be imported (it is optional)."""
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def extra_key(name: str, taken: Iterable[str] = ()) -> str:
    """The top-level key of an extra column: its name, prefixed with ``extra/`` (again, if need be)
    while it collides with a fixed key or one of ``taken``."""
    taken = set(taken)
    key = str(name)
    while key in FIXED_KEYS or key in taken:
        key = EXTRA_PREFIX + key
    return key


class CompletionLog:
    """Buffers completion rows for the completions file and the rich table.

    Args:
        is_main_process: only the main process keeps rows and writes; elsewhere every method
            is a no-op (``table`` then returns an empty table).
        display_limit: the table shows at most the latest ``display_limit`` rows since the last
            table (TRL keeps one generation batch: pass ``generation_batch_size``); ``None``
            keeps them all. The file always gets every row.
        image_folder: where the images of image blocks are saved as PNG files (``log_multimodal``;
            the rows give their paths relative to its parent); ``None`` leaves them out.
    """

    def __init__(
        self, is_main_process: bool = True, display_limit: int | None = None, image_folder: str | None = None
    ) -> None:
        self.is_main_process = is_main_process
        self.display_limit = display_limit
        self.image_folder = image_folder
        self.rows: list[Row] = []  # rows not yet written to the file
        self._display: list[Row] = []  # rows not yet shown in a table

    # ---- input -------------------------------------------------------------------------------

    def add(
        self,
        step: int,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        rewards: Mapping[str, Iterable[float | None]],
        advantages: Iterable[float],
        extra: Mapping[str, Iterable[Any]] | None = None,
    ) -> None:
        """Buffer one row per completion (all sequences in the same order, of the same length).

        Args:
            step: the global step the completions were generated at.
            prompts, completions: strings or lists of chat messages.
            rewards: per reward function name, one value per completion (``None``/NaN when the
                function skipped it).
            advantages: one value per completion.
            extra: per ``log_extra`` column, one value per completion.
        """
        if not self.is_main_process:
            return
        n = len(prompts)
        columns: dict[str, list[Any]] = {
            "completions": list(completions),
            "advantages": list(advantages),
        }
        columns.update({f"rewards[{name!r}]": list(v) for name, v in rewards.items()})
        columns.update({f"extra[{name!r}]": list(v) for name, v in (extra or {}).items()})
        for what, values in columns.items():
            if len(values) != n:
                raise ValueError(
                    f"CompletionLog.add got {n} prompts but {len(values)} {what}; every column needs "
                    f"one value per completion."
                )
        reward_lists = {str(name): columns[f"rewards[{name!r}]"] for name in rewards}
        extra_lists: dict[str, list[Any]] = {}
        for name in extra or {}:
            extra_lists[extra_key(name, taken=extra_lists)] = columns[f"extra[{name!r}]"]
        new = []
        for i in range(n):
            row: Row = {
                "step": int(step),
                "prompt": save_images(prompts[i], self.image_folder),
                "completion": save_images(columns["completions"][i], self.image_folder),
                "rewards": {name: _number(values[i]) for name, values in reward_lists.items()},
                "advantage": _number(columns["advantages"][i]),
            }
            for key, values in extra_lists.items():
                row[key] = values[i]
            new.append(row)
        self.add_rows(new)

    def add_rows(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Buffer rows already in the file format (e.g. rows gathered from other processes).

        Values are copied into JSON-safe form (non-finite floats become ``None``).
        """
        if not self.is_main_process:
            return
        rows = [_jsonable(row) for row in rows]
        for row in rows:
            missing = [k for k in FIXED_KEYS if k not in row]
            if missing:
                raise ValueError(
                    f"CompletionLog.add_rows: a row lacks {missing}; rows need the keys {FIXED_KEYS}."
                )
        self.rows.extend(rows)
        self._display.extend(rows)
        if self.display_limit is not None and len(self._display) > self.display_limit:
            del self._display[: len(self._display) - self.display_limit]

    # ---- file --------------------------------------------------------------------------------

    def flush_to_file(self, path: str | os.PathLike) -> int:
        """Append the buffered rows to the completions file and clear the file buffer.

        Args:
            path: the output directory (rows go to ``<path>/completions.jsonl``, the directory is
                created if needed), or a file path ending in ``.jsonl``.

        Returns:
            The number of rows written (0 off the main process or when nothing is buffered).
        """
        if not self.is_main_process or not self.rows:
            return 0
        file = completions_path(path)
        folder = os.path.dirname(file)
        if folder:
            os.makedirs(folder, exist_ok=True)
        lines = [json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in self.rows]
        with open(file, "a", encoding="utf-8") as f:
            f.writelines(lines)
        written = len(self.rows)
        self.rows = []
        return written

    # ---- display -----------------------------------------------------------------------------

    def table(self, num_to_print: int | None = None, unique_prompts: bool = False, seed: int | None = None):
        """A ``rich.table.Table`` of the rows since the last table, then clear the display buffer.

        Args:
            num_to_print: show at most this many rows, drawn at random (kept in order); ``None``
                shows them all.
            unique_prompts: show each distinct prompt once (its first row).
            seed: seed of the random draw, for a reproducible table.

        Columns: step, prompt, completion, one per reward, advantage, then the extra columns.
        """
        from rich.table import Table
        from rich.text import Text

        rows = self._take_display(num_to_print, unique_prompts, seed)
        reward_names = _ordered_keys(row["rewards"] for row in rows)
        extra_names = _ordered_keys({k: None for k in row if k not in FIXED_KEYS} for row in rows)
        steps = sorted({row["step"] for row in rows})
        if not steps:
            title = "Completions"
        elif len(steps) == 1:
            title = f"Completions, step {steps[0]}"
        else:
            title = f"Completions, steps {steps[0]}-{steps[-1]}"
        table = Table(title=title, show_lines=True)
        table.add_column("step", justify="right")
        table.add_column("prompt", style="bright_yellow")
        table.add_column("completion", style="bright_green")
        for name in reward_names:
            table.add_column(name, justify="right", style="bold cyan")
        table.add_column("advantage", justify="right", style="bold magenta")
        for name in extra_names:
            table.add_column(name)
        for row in rows:
            cells = [str(row["step"]), render_messages(row["prompt"]), render_messages(row["completion"])]
            cells += [_format_value(row["rewards"].get(name)) for name in reward_names]
            cells.append(_format_value(row["advantage"]))
            cells += [_format_value(row.get(name)) for name in extra_names]
            table.add_row(*(Text(cell) for cell in cells))  # Text: no rich markup in completions
        return table

    def print_table(
        self,
        num_to_print: int | None = None,
        unique_prompts: bool = False,
        seed: int | None = None,
        console: Any = None,
    ) -> bool:
        """Print :meth:`table` with a rich ``Console``; returns whether a table was printed.

        Without ``rich`` installed, or with nothing to show, nothing is printed and the display
        buffer is cleared.
        """
        if not self.is_main_process or not self._display or not is_rich_available():
            self._display = []
            return False
        from rich.console import Console

        table = self.table(num_to_print, unique_prompts, seed)
        (console or Console()).print(table)
        return True

    def _take_display(self, num_to_print: int | None, unique_prompts: bool, seed: int | None) -> list[Row]:
        rows, self._display = self._display, []
        if not self.is_main_process:
            return []
        if unique_prompts:
            rows = unique_prompt_rows(rows)
        if num_to_print is not None and num_to_print < len(rows):
            keep = sorted(random.Random(seed).sample(range(len(rows)), max(num_to_print, 0)))
            rows = [rows[i] for i in keep]
        return rows


def unique_prompt_rows(rows: Iterable[Row]) -> list[Row]:
    """The first row of each distinct prompt, in order."""
    seen: set[str] = set()
    unique = []
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def flat_records(rows: Iterable[Row], unique_prompts: bool = False) -> list[dict[str, Any]]:
    """Rows as flat records for a wandb / trackio table (``pandas.DataFrame(records)``).

    Prompts and completions are rendered as text; each reward gets its own column, named after
    the reward (``rewards/<name>`` where that would collide with another column).
    """
    rows = unique_prompt_rows(rows) if unique_prompts else list(rows)
    records = []
    for row in rows:
        record: dict[str, Any] = {
            "step": row["step"],
            "prompt": render_messages(row["prompt"]),
            "completion": render_messages(row["completion"]),
        }
        others = {k for k in row if k not in ("rewards",)}
        for name, value in row["rewards"].items():
            record["rewards/" + name if name in others or name in record else name] = value
        record["advantage"] = row["advantage"]
        record.update({k: v for k, v in row.items() if k not in FIXED_KEYS})
        records.append(record)
    return records


def save_images(value: Any, folder: str | None) -> Any:
    """A prompt or completion whose image blocks hold file paths instead of images.

    The image of each ``{"type": "image", "image": <PIL image>}`` block of a message's content is
    saved as ``<folder>/<hash>.png`` (a hash of its mode, size and pixels: the same image is written
    once) and replaced by that path relative to the folder's parent (the run's ``output_dir``,
    where the completions file is); with ``folder=None`` the ``"image"`` key is dropped. Anything
    else is returned as it is.
    """
    if not isinstance(value, list):
        return value
    out = []
    for message in value:
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        blocks = [_saved_block(b, folder) if _is_image_block(b) else b for b in content]
        out.append({**message, "content": blocks})
    return out


def _is_image_block(block: Any) -> bool:
    return (
        isinstance(block, Mapping) and block.get("type") == "image" and hasattr(block.get("image"), "tobytes")
    )


def _saved_block(block: Mapping[str, Any], folder: str | None) -> dict[str, Any]:
    """An image block with its image saved under ``folder`` (its path instead), or without it."""
    out = {k: v for k, v in block.items() if k != "image"}
    if folder is None:
        return out
    image = block["image"]
    digest = hashlib.sha1(f"{image.mode}{image.size}".encode() + image.tobytes()).hexdigest()[:16]
    file = os.path.join(folder, f"{digest}.png")
    if not os.path.exists(file):
        os.makedirs(folder, exist_ok=True)
        image.save(file, format="PNG")
    out["image"] = os.path.join(os.path.basename(os.path.normpath(folder)), f"{digest}.png")
    return out


def completions_path(path: str | os.PathLike) -> str:
    """The completions file for ``path``: itself if it ends in ``.jsonl``, else ``<path>/completions.jsonl``."""
    path = os.fspath(path)
    return path if path.endswith(".jsonl") else os.path.join(path, COMPLETIONS_FILE)


def read_completions(path: str | os.PathLike) -> list[Row]:
    """The rows of a completions file (or of ``<dir>/completions.jsonl``)."""
    with open(completions_path(path), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def render_messages(value: Any) -> str:
    """A prompt or completion as display text: a string as is, messages as ``role: content`` lines."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        value = [value]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return "\n".join(f"{m.get('role', '?')}: {_render_content(m.get('content', ''))}" for m in value)
    return str(value)


def _render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping):
                kind = part.get("type", "text")
                parts.append(str(part.get("text", "")) if kind == "text" else f"<{kind}>")
            else:
                parts.append(str(part))
        return " ".join(parts)
    return str(content)


def _number(value: Any) -> float | None:
    """A reward or advantage as a finite float, or None (None, NaN, inf)."""
    if value is None:
        return None
    if hasattr(value, "item"):
        value = value.item()
    value = float(value)
    return value if math.isfinite(value) else None


def _jsonable(value: Any) -> Any:
    """A copy of ``value`` that JSON can hold: non-finite floats become None, unknown objects strings."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return _jsonable(value.tolist())
    return str(value)


def _ordered_keys(mappings: Iterable[Mapping[str, Any]]) -> list[str]:
    """Keys of all the mappings, in order of first appearance."""
    keys: dict[str, None] = {}
    for m in mappings:
        for k in m:
            keys.setdefault(k, None)
    return list(keys)


def _format_value(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float):
        return MISSING if not math.isfinite(value) else f"{value:.3f}"
    if isinstance(value, (str, int)):
        return str(value)
    return json.dumps(value, ensure_ascii=False)
