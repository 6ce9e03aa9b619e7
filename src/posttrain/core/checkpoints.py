"""Crash-safe checkpoints: a ``checkpoint-N`` folder is whole or absent.

``transformers.Trainer`` writes a checkpoint folder piece by piece (weights, optimizer,
scheduler, RNG states, ``trainer_state.json``). posttrain has it write them into a hidden
staging folder beside the checkpoints (``.checkpoint-N.partial``), adds the family's state and
its own state file (the completion mark), flushes every file and folder to disk, and only then
renames the folder to ``checkpoint-N`` in one step. A process killed at any moment leaves either
the whole checkpoint or none under that name, so ``get_last_checkpoint`` (transformers), an
evaluation job or a storage sync never see a half-written one. A staging folder left by a killed
run is removed when the next run starts. The final ``save_model`` stages its files the same way
and moves each into place whole.

Folders written otherwise (by an older posttrain, which named them at once, or by another tool)
are checked too: ``resume_from_checkpoint=True`` skips incomplete ones, and a path given
explicitly is refused, naming what is missing, before anything loads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from typing import Any

STATE_FILE = "posttrain_state.json"  # written last: its presence marks a complete checkpoint
TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
#: Staging folders (``.checkpoint-N.partial``, ``.save.partial``) and a replaced one moved aside.
_STAGING = re.compile(r"^\.(checkpoint-\d+|save)\.(partial|replaced)$")
#: How a model's weights may be named in a checkpoint (full model, shards, PEFT adapter, FSDP, DeepSpeed).
_WEIGHTS = re.compile(r"^(model|pytorch_model|adapter_model|tf_model|flax_model)([.-].*)?$|^global_step\d+$")
_OPTIMIZER = re.compile(r"^optimizer")


def staging_folder(run_dir: str, name: str) -> str:
    """The hidden folder ``name`` (``checkpoint-N``, ``save``) is written in before it is published."""
    return os.path.join(run_dir, f".{name}.partial")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str) -> None:
    """Flush every file under ``folder``, then each folder, to disk."""
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(root)


def publish(staged: str, final: str) -> None:
    """Give the fully written folder ``staged`` the name ``final`` in one rename.

    A folder already at ``final`` (the same step saved again) is first moved aside and deleted
    after the rename, so ``final`` names a whole folder at every moment but one rename.
    """
    fsync_tree(staged)
    parent = os.path.dirname(final) or "."
    aside = None
    if os.path.lexists(final):
        aside = os.path.join(parent, f".{os.path.basename(final)}.replaced")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(staged, final)
    _fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def publish_files(staged: str, target: str) -> None:
    """Move each entry of the fully written folder ``staged`` into ``target`` whole.

    Used for the final model save, whose target (``output_dir``) also holds the checkpoints and
    cannot be replaced as one folder: each file is replaced in one rename, so every file there is
    either the previous save's or this one's, never a torn one. Weight files of a previous save
    that this one does not write (shards of another layout) are removed, so the folder loads this
    save's weights only.
    """
    fsync_tree(staged)
    os.makedirs(target, exist_ok=True)
    names = sorted(os.listdir(staged))
    for name in names:
        source, dest = os.path.join(staged, name), os.path.join(target, name)
        if os.path.isdir(source):
            publish(source, dest)
        else:
            os.replace(source, dest)
    written = set(names)
    for name in os.listdir(target):
        path = os.path.join(target, name)
        if name not in written and os.path.isfile(path) and _WEIGHTS.match(name):
            os.remove(path)
    _fsync_dir(target)
    shutil.rmtree(staged, ignore_errors=True)


def remove_leftovers(run_dir: str) -> list[str]:
    """Delete the staging folders a killed run left in ``run_dir``; returns their names."""
    if not os.path.isdir(run_dir):
        return []
    found = sorted(n for n in os.listdir(run_dir) if _STAGING.match(n))
    for name in found:
        shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    return found


def missing_files(folder: str, needs_optimizer: bool = True) -> list[str]:
    """What a checkpoint folder lacks for resuming (empty when it is whole).

    Args:
        folder: the ``checkpoint-N`` folder.
        needs_optimizer: whether the optimizer's state must be there (not with ``save_only_model``).
    """
    if not os.path.isdir(folder):
        return ["the folder itself"]
    names = os.listdir(folder)
    missing = []
    if not any(_WEIGHTS.match(n) for n in names):
        missing.append("the model's weights (model.safetensors or adapter_model.safetensors)")
    if needs_optimizer and not any(_OPTIMIZER.match(n) for n in names):
        missing.append("optimizer.pt")
    if TRAINER_STATE_FILE not in names:
        missing.append(TRAINER_STATE_FILE)
    else:
        try:
            with open(os.path.join(folder, TRAINER_STATE_FILE)) as f:
                json.load(f)
        except (OSError, json.JSONDecodeError):
            missing.append(f"a readable {TRAINER_STATE_FILE} (it is cut short)")
    if STATE_FILE in names and read_state(folder) is None:
        missing.append(f"a readable {STATE_FILE} (it is cut short)")
    return missing


def check_resumable(folder: str, needs_optimizer: bool = True) -> None:
    """Refuse an incomplete ``resume_from_checkpoint`` folder before anything loads.

    Raises:
        ValueError: the folder lacks files a resume needs; names them and the newest whole
            checkpoint beside it.
    """
    missing = missing_files(folder, needs_optimizer)
    if not missing:
        return
    parent = os.path.dirname(os.path.abspath(folder))
    whole = [
        os.path.join(parent, n)
        for n in (os.listdir(parent) if os.path.isdir(parent) else [])
        if _CHECKPOINT.match(n) and is_complete(os.path.join(parent, n))
    ]
    whole.sort(key=lambda p: int(_CHECKPOINT.match(os.path.basename(p)).group(1)))
    beside = (
        f"The newest whole checkpoint beside it is {whole[-1]}: resume from that, or pass "
        "resume_from_checkpoint=True to take it."
        if whole
        else "There is no whole checkpoint beside it: start without resume_from_checkpoint."
    )
    raise ValueError(
        f"resume_from_checkpoint={folder!r} is not a whole checkpoint: it lacks {', '.join(missing)} "
        f"(a run killed while saving, or a folder another tool wrote). {beside}"
    )


def write_state(folder: str, state: dict[str, Any]) -> None:
    """Write ``state`` to ``folder/posttrain_state.json`` atomically (never half-written)."""
    path = os.path.join(folder, STATE_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_state(folder: str) -> dict[str, Any] | None:
    """The state of a complete checkpoint, or ``None`` when it is missing or unreadable."""
    try:
        with open(os.path.join(folder, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) else None


def is_complete(folder: str) -> bool:
    """Whether a checkpoint folder was written to the end."""
    return os.path.isfile(os.path.join(folder, TRAINER_STATE_FILE)) and read_state(folder) is not None


def latest_complete_checkpoint(output_dir: str) -> str | None:
    """The newest complete ``checkpoint-N`` folder in ``output_dir``.

    Incomplete folders (a run killed while saving) are skipped with a warning. When every
    checkpoint there is incomplete, the run was killed while saving its first one: there is no
    finished work to resume, so this warns and returns ``None`` (train from the start).

    Raises:
        ValueError: ``output_dir`` holds no ``checkpoint-N`` folder at all.
    """
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    folders = sorted(
        (os.path.join(output_dir, n) for n in names if _CHECKPOINT.match(n)),
        key=lambda p: int(_CHECKPOINT.match(os.path.basename(p)).group(1)),
        reverse=True,
    )
    if not folders:
        raise ValueError(
            f"resume_from_checkpoint=True found no checkpoint in {output_dir!r}; pass a checkpoint "
            "folder explicitly, check output_dir, or start without resume_from_checkpoint."
        )
    skipped = []
    for folder in folders:
        if os.path.isdir(folder) and is_complete(folder):
            if skipped:
                warnings.warn(
                    f"Skipping incomplete checkpoint(s) {skipped} (the run was interrupted while saving); "
                    f"resuming from {folder}.",
                    stacklevel=2,
                )
            return folder
        skipped.append(folder)
    warnings.warn(
        f"Every checkpoint in {output_dir!r} is incomplete ({skipped}): the run was interrupted while "
        "saving its first one, so there is no finished step to resume; training starts from step 0.",
        stacklevel=2,
    )
    return None


def finished_output(folder: str, max_steps: int) -> Any:
    """The ``TrainerState`` of a checkpoint that already reached ``max_steps``, else ``None``.

    Resuming such a checkpoint has nothing left to train (transformers would run one more step).
    """
    from transformers import TrainerState

    path = os.path.join(folder, TRAINER_STATE_FILE)
    if max_steps <= 0 or not os.path.isfile(path):
        return None
    state = TrainerState.load_from_json(path)
    if state.global_step < max_steps:
        return None
    warnings.warn(
        f"{folder} is already at step {state.global_step} >= max_steps={max_steps}; nothing left to train.",
        stacklevel=3,
    )
    return state
