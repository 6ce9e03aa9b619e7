"""The Python sandbox for code rewards and tools."""

from __future__ import annotations

import time

from posttrain.rewards.sandbox import run_python


def test_runs_code_and_captures_output():
    result = run_python("import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))", stdin="1 2 3")
    assert result.ok and result.stdout.strip() == "6"


def test_errors_are_reported_not_raised():
    result = run_python("raise ValueError('boom')")
    assert not result.ok and result.returncode == 1 and "ValueError: boom" in result.stderr


def test_wall_time_limit_kills_the_process():
    start = time.perf_counter()
    result = run_python("while True:\n    pass", timeout=1.0)
    assert result.timed_out and not result.ok
    assert time.perf_counter() - start < 5.0


def test_memory_limit():
    result = run_python("x = bytearray(400 * 1024 * 1024)\nprint('allocated')", memory_mb=256)
    assert not result.ok and "MemoryError" in result.stderr


def test_no_network():
    code = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)"
    result = run_python(code)
    assert not result.ok
    assert "PermissionError" in result.stderr or "Network is unreachable" in result.stderr


def test_no_subprocesses():
    result = run_python("import subprocess\nsubprocess.run(['true'])")
    assert not result.ok and "PermissionError" in result.stderr


def test_runs_in_a_temporary_folder_that_is_removed():
    result = run_python("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())")
    assert result.ok
    folder = result.stdout.strip()
    assert "posttrain-sandbox-" in folder
    import os

    assert not os.path.exists(folder)


def test_environment_is_empty():
    result = run_python("import os\nprint(sorted(os.environ))")
    assert result.ok and "HF_HUB_OFFLINE" not in result.stdout


def test_posttrain_never_calls_eval_or_exec():
    """No module of posttrain calls the eval or exec builtins (model output goes to the sandbox)."""
    import ast
    import pathlib

    import posttrain

    root = pathlib.Path(posttrain.__file__).parent
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("eval", "exec")
            ):
                offenders.append(f"{path.relative_to(root)}:{node.lineno}")
    assert offenders == []


def test_trust_remote_code_is_off_by_default(tmp_path):
    from posttrain import GRPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).trust_remote_code is False
