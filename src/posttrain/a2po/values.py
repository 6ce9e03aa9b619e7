"""A*-PO's stage 1 store: the reference samples' rewards of each prompt, kept on disk.

Stage 1 samples ``num_value_samples`` completions of every prompt from the reference and keeps
their binary rewards, one JSON line per prompt, in ``output_dir/a2po_values.jsonl``. A run that
stops during stage 1 starts again where it stopped; a resumed or repeated run with the same
sampling settings reuses every prompt already there. The rewards are kept rather than ``V*``
itself, so ``beta1`` may change without sampling again.

The first line records the settings the samples depend on (model, sampling options, reward
functions); a file written under other settings is refused, since its values would not be
those of this run's reference.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

VALUES_FILE = "a2po_values.jsonl"


def row_key(row: dict[str, Any]) -> str:
    """A stable key of a dataset row: every column counts (the reward may read any of them).

    An image counts by its pixels (a digest of its mode, size and bytes): a row decoded again is
    the same row, and two rows with the same text and other images are two prompts.
    """
    text = json.dumps(row, sort_keys=True, default=_stable, ensure_ascii=False)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def _stable(value: Any) -> Any:
    """A JSON stand-in for a value JSON cannot hold, the same for equal values (not ``str``, which
    writes an image's memory address)."""
    if all(hasattr(value, name) for name in ("tobytes", "mode", "size")):  # a PIL image
        return {
            "image": hashlib.sha1(value.tobytes()).hexdigest(),
            "mode": value.mode,
            "size": list(value.size),
        }
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": hashlib.sha1(bytes(value)).hexdigest()}
    return str(value)


@dataclass
class ValueStore:
    """The rewards of each prompt's reference samples, read from and appended to ``path``.

    Attributes:
        path: the JSON-lines file.
        settings: what the samples depend on; the file's must match.
        rewards: row key -> the ``num_value_samples`` rewards of its reference samples.
    """

    path: str
    settings: dict[str, Any]
    rewards: dict[str, list[float]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, settings: dict[str, Any]) -> ValueStore:
        """The store at ``path`` (empty when there is no file).

        Raises:
            ValueError: the file was written under other settings.
        """
        store = cls(path, settings)
        if not os.path.isfile(path):
            return store
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        if not lines:
            return store
        saved = json.loads(lines[0]).get("settings", {})
        changed = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
        if changed:
            detail = ", ".join(f"{k}: {saved.get(k)!r} there, {settings.get(k)!r} now" for k in changed)
            raise ValueError(
                f"{path} holds A*-PO value samples taken under other settings ({detail}); delete the file to "
                "sample again, or give this run another output_dir."
            )
        for line in lines[1:]:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:  # the last line of a run stopped mid-write
                continue
            store.rewards[entry["key"]] = [float(r) for r in entry["rewards"]]
        return store

    def add(self, entries: dict[str, list[float]], write: bool) -> None:
        """Record prompts' rewards; ``write`` appends them to the file (the main process does)."""
        self.rewards.update(entries)
        if not write:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        new = not os.path.isfile(self.path) or os.path.getsize(self.path) == 0
        with open(self.path, "a", encoding="utf-8") as f:
            if new:
                f.write(json.dumps({"settings": self.settings}) + "\n")
            for key, rewards in entries.items():
                f.write(json.dumps({"key": key, "rewards": rewards}) + "\n")
            f.flush()
            os.fsync(f.fileno())
