"""The environment switches that turn one of posttrain's CPU speed-ups off (0) or leave it on (1, unset).

Each is read when a trainer is built, so a typo stops there rather than mid-step
(docs/errors.md: C45 ``POSTTRAIN_SELECTIVE_CHECKPOINTING``, C126 ``POSTTRAIN_REUSE_WEIGHT_CASTS``,
C127 ``POSTTRAIN_FLOAT32_SHORT_ATTENTION``).
"""

from __future__ import annotations

import os


def switched_on(name: str, fix: str) -> bool:
    """Whether the environment variable ``name`` leaves its speed-up on: unset or 1 (0 turns it off).

    Args:
        name: the variable.
        fix: the end of the error message, what setting it to 0 does ("set it to 0 to ..., or unset it.").

    Raises:
        ValueError: the variable holds something else than 0 or 1.
    """
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r} is not 0 or 1; {fix}")
    return value != "0"
