"""The GRPO regression fixture (``regression_cases.py``): the recorded runs reproduce.

On the host that recorded the fixture the final parameters must be bit-identical; elsewhere
(other float kernels) parameters and metrics must agree to a relative 1e-5.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from regression_cases import CASES, FIXTURE, host

RECORDED = json.loads(FIXTURE.read_text())


def _close(actual, expected, where: str, problems: list[str]) -> None:
    if isinstance(expected, dict):
        if set(actual) != set(expected):
            problems.append(f"{where}: keys {sorted(set(actual) ^ set(expected))} differ")
        for k in expected:
            if k in actual:
                _close(actual[k], expected[k], f"{where}.{k}", problems)
    elif isinstance(expected, list):
        if len(actual) != len(expected):
            problems.append(f"{where}: {len(actual)} entries, recorded {len(expected)}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=False)):
            _close(a, e, f"{where}[{i}]", problems)
    elif isinstance(expected, float) and not isinstance(expected, bool):
        if not (
            math.isclose(actual, expected, rel_tol=1e-5, abs_tol=1e-7)
            or (actual != actual and expected != expected)
        ):
            problems.append(f"{where}: {actual!r}, recorded {expected!r}")
    elif actual != expected and where.split(".")[-1] != "sha256":
        problems.append(f"{where}: {actual!r}, recorded {expected!r}")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "two_processes" else n for n in CASES]
)
def test_the_recorded_run_reproduces(name, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as recorded: the kernels' reduction order depends on the threads
    try:
        actual = json.loads(json.dumps(CASES[name](str(tmp_path))))
    finally:
        torch.set_num_threads(threads)
    expected = RECORDED["cases"][name]
    problems: list[str] = []
    _close(actual, expected, name, problems)
    assert not problems, "\n".join(problems[:20])
    if RECORDED["host"] == host():
        assert actual["params"]["sha256"] == expected["params"]["sha256"], (
            "parameters differ in their last bits"
        )
