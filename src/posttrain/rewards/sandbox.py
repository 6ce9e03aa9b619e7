"""Running model-written Python safely, for code rewards and tools.

posttrain never evaluates model output with ``eval`` or ``exec`` in the training process.
``run_python`` runs it in a separate, isolated interpreter:

* a fresh temporary working folder, deleted afterwards; an empty environment (``PATH`` only);
* ``python -I`` (isolated mode: no user site, no ``PYTHON*`` variables, no script folder on
  ``sys.path``);
* limits set before the code starts: wall time (the process group is killed), CPU seconds,
  address space (memory), file size, number of open files;
* no network: inside a new network namespace when ``unshare`` allows it (Linux), and in any
  case an audit hook installed before the code runs refuses socket connections, binds and name
  lookups, and starting further processes. Audit hooks cannot be removed from Python code.

This is defence in depth for reward code, not a security boundary against a determined
attacker with native-code exploits; run untrusted workloads in a container as well.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

# Runs first in the child: install the audit hook, then run the user's file as __main__.
_PRELUDE = r"""
import sys
_BLOCKED = ("socket.connect", "socket.bind", "socket.getaddrinfo", "socket.gethostbyname",
            "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork")
def _hook(event, args):
    if event.startswith(_BLOCKED):
        raise PermissionError(f"{event} is not allowed in the posttrain sandbox")
sys.addaudithook(_hook)
import runpy
runpy.run_path(sys.argv[1], run_name="__main__")
"""


@dataclass
class SandboxResult:
    """The outcome of one ``run_python`` call.

    Attributes:
        stdout: what the code printed (decoded, at most ``max_output`` characters).
        stderr: its error output (same limit).
        returncode: the exit status (negative: killed by that signal).
        timed_out: the wall-time limit was hit and the process killed.
    """

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool

    @property
    def ok(self) -> bool:
        """Finished in time with exit status 0."""
        return self.returncode == 0 and not self.timed_out


def _limits(cpu_seconds: int, memory_mb: int, file_mb: int) -> None:
    import resource

    os.setsid()  # own process group, so a timeout kills everything it started
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb << 20, file_mb << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def _network_namespace() -> list[str]:
    """``unshare -rn`` when it works here (a new, empty network namespace), else nothing."""
    tool = shutil.which("unshare")
    if tool is None or sys.platform != "linux":
        return []
    try:
        ok = subprocess.run([tool, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return [tool, "-rn"] if ok else []


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout: float = 5.0,
    memory_mb: int = 512,
    file_mb: int = 16,
    max_output: int = 100_000,
) -> SandboxResult:
    """Run ``code`` in an isolated Python process with time, memory and network limits.

    Args:
        code: Python source (model output).
        stdin: text fed to its standard input.
        timeout: wall-clock seconds before the process group is killed.
        memory_mb: address-space limit.
        file_mb: largest file it may write (in its temporary folder).
        max_output: characters kept of stdout and of stderr.

    Returns:
        A ``SandboxResult``.
    """
    if timeout <= 0 or memory_mb <= 0:
        raise ValueError("run_python needs timeout > 0 and memory_mb > 0.")
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as workdir:
        script = os.path.join(workdir, "main.py")
        with open(script, "w") as f:
            f.write(code)
        cmd = [*_network_namespace(), sys.executable, "-I", "-c", _PRELUDE, script]
        proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "HOME": workdir},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=lambda: _limits(int(timeout) + 1, memory_mb, file_mb),
        )
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
        return SandboxResult(
            stdout=out.decode(errors="replace")[:max_output],
            stderr=err.decode(errors="replace")[:max_output],
            returncode=proc.returncode,
            timed_out=timed_out,
        )
