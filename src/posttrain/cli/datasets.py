"""The dataset of a training subcommand: a hub dataset id, or a local data file or folder.

Any trainer's script arguments name a dataset, its configuration and a split; this module
turns them into one ``datasets.Dataset``. A name that looks like a path (it exists, starts
with ``.``, ``/`` or ``~``, or ends with a data file suffix) is read from disk; anything else
goes to ``datasets.load_dataset`` as a hub id. Bad input raises :class:`CLIError`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from posttrain.cli.options import CLIError

#: Local data file suffixes and the ``datasets`` builder that reads each.
DATA_FILE_BUILDERS: dict[str, str] = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

#: Words that mark a file of a dataset folder as belonging to a split.
_SPLIT_WORDS = frozenset({"train", "test", "validation", "valid", "val", "dev", "eval", "evaluation"})


def load_dataset_split(
    name: str, config: str | None, split: str, *, split_flag: str = "--dataset_train_split"
) -> Any:
    """One split of a hub dataset, or of a local data file or folder.

    Args:
        name: a hub dataset id, or a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file or a
            folder of such files.
        config: the hub dataset's configuration name (unused for local data).
        split: the split to load; in a local folder, the files whose path names it.
        split_flag: the flag that chooses ``split``, named when a folder has no such file.

    Returns:
        The split, a ``datasets.Dataset``.

    Raises:
        CLIError: a local dataset that is missing, empty, of mixed formats or unreadable, or a
            folder without the split.
    """
    if _looks_local(name):
        return _load_local_dataset(name, split, split_flag=split_flag)
    from datasets import load_dataset

    return load_dataset(name, config, split=split)


def _looks_local(name: str) -> bool:
    """Whether a dataset name is meant as a local path rather than a hub id."""
    return (
        os.path.exists(os.path.expanduser(name))
        or name.startswith((".", "/", "~"))
        or Path(name).suffix.lower() in DATA_FILE_BUILDERS
    )


def _split_files(
    folder: Path, files: list[Path], split: str, split_flag: str = "--dataset_train_split"
) -> list[Path]:
    """The files of ``folder`` holding ``split``: those whose relative path names it as a word.

    When no file names any split (``data-0.jsonl``, ``part1.csv``), every file is the train split.
    """

    def words(path: Path) -> set[str]:
        return set(re.split(r"[^a-z0-9]+", str(path.relative_to(folder)).lower()))

    chosen = [f for f in files if split.lower() in words(f)]
    if chosen:
        return chosen
    if split == "train" and not any(words(f) & _SPLIT_WORDS for f in files):
        return files
    named = sorted({w for f in files for w in words(f) & _SPLIT_WORDS})
    raise CLIError(
        f"no file in the dataset folder {str(folder)!r} belongs to the split {split!r} (a file belongs to a "
        f"split when its path names it, e.g. {split}.jsonl); the files name the splits {named}. Choose one "
        f"with {split_flag}."
    )


def _data_files(name: str, split: str, split_flag: str) -> list[Path]:
    """The data files of a local dataset: the file itself, or the ``split`` files of a folder."""
    path = Path(os.path.expanduser(name))
    suffixes = "/".join(DATA_FILE_BUILDERS)
    if path.is_file():
        if path.suffix.lower() not in DATA_FILE_BUILDERS:
            raise CLIError(f"dataset file {name!r} is not a {suffixes} file.")
        return [path]
    if path.is_dir():
        found = sorted(
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in DATA_FILE_BUILDERS
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
        if not found:
            raise CLIError(f"dataset folder {name!r} holds no {suffixes} files.")
        return _split_files(path, found, split, split_flag)
    raise CLIError(
        f"dataset {name!r} does not exist: pass a hub dataset id, or an existing {suffixes} file or a "
        "folder of such files."
    )


def _load_local_dataset(name: str, split: str, *, split_flag: str = "--dataset_train_split") -> Any:
    """A local data file, or the ``split`` files of a folder, read with ``datasets.load_dataset``."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    files = _data_files(name, split, split_flag)
    builders = {DATA_FILE_BUILDERS[f.suffix.lower()] for f in files}
    if len(builders) > 1:
        raise CLIError(
            f"dataset {name!r} mixes file formats ({', '.join(sorted(builders))}); use files of one format."
        )
    try:
        return load_dataset(builders.pop(), data_files=[str(f) for f in files], split="train")
    except DatasetGenerationError as exc:
        cause = exc.__cause__ or exc
        raise CLIError(f"cannot read the dataset {name!r}: {cause}") from exc
