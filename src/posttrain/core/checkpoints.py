"""Crash-safe checkpoints: a checkpoint counts only once it is complete.

``transformers.Trainer`` writes a checkpoint folder piece by piece (weights, optimizer,
scheduler, RNG states, ``trainer_state.json``). A process killed in the middle leaves a folder
that ``resume_from_checkpoint=True`` would pick and fail on. posttrain writes its own state file
last, atomically (temporary file, then rename), and treats it as the completion mark: resuming
takes the newest folder that has it, and warns about the incomplete ones it skips.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from typing import Any

STATE_FILE = "posttrain_state.json"  # written last: its presence marks a complete checkpoint
TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


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
