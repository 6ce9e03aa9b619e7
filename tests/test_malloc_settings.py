"""ops/memory.py: large blocks are mapped on their own and go back to the system when freed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from posttrain.ops import memory

needs_glibc = pytest.mark.skipif(memory._libc() is None, reason="glibc's mallopt is not available")

# In a fresh process: raise glibc's dynamic threshold by freeing one 24 MB mapped block, then
# allocate 6 MB blocks with a 200 KB long-lived block after each, free the large ones and report
# how much of them stayed resident.
PATTERN = textwrap.dedent(
    """
    import sys
    import torch
    from posttrain.ops import memory

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon"))

    if sys.argv[1] == "on":
        assert memory.map_large_blocks() == memory.MMAP_THRESHOLD
    x = torch.ones(6 * 2**20)  # 24 MB, mapped
    del x
    start = rss_mb()
    large, small = [], []
    for _ in range(60):
        large.append(torch.ones(6 * 2**18))  # 6 MB
        small.append(torch.ones(50_000))  # 200 KB, kept: a heap block after each large one
    del large
    print(rss_mb() - start)
    """
)


def _resident_after_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_freed_large_blocks_leave_the_resident_set():
    assert _resident_after_free("off") > 200  # glibc's default: 360 MB of freed blocks stay resident
    assert _resident_after_free("on") < 40


def test_environment_choices_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert memory.map_large_blocks() == 0  # glibc's own variable already applied at start-up
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("POSTTRAIN_MALLOC_MMAP_THRESHOLD", "0")
    assert memory.map_large_blocks() == 0
    monkeypatch.setenv("POSTTRAIN_MALLOC_MMAP_THRESHOLD", "4MB")
    with pytest.raises(ValueError, match="POSTTRAIN_MALLOC_MMAP_THRESHOLD='4MB' is not a number of bytes"):
        memory.map_large_blocks()
    monkeypatch.setenv("POSTTRAIN_MALLOC_MMAP_THRESHOLD", "-1")
    with pytest.raises(ValueError, match="set it to an integer such as 4194304"):
        memory.map_large_blocks()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_trainer_applies_it_on_the_cpu(tmp_path, monkeypatch):
    from conftest import build_tiny_tokenizer
    from helpers import length_reward, make_config, make_trainer

    tok = build_tiny_tokenizer()
    calls = []
    monkeypatch.setattr(memory, "map_large_blocks", lambda: calls.append(1) or memory.MMAP_THRESHOLD)
    make_trainer(tok, length_reward, make_config(tmp_path, max_steps=1))
    assert calls == [1]
