"""ops/memory.py: large blocks are mapped on their own, and backward returns freed heap pages."""

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
    trainer = make_trainer(tok, length_reward, make_config(tmp_path, max_steps=1))
    assert calls == [1]
    if memory._libc() is not None:
        assert len(trainer._trim_hooks) >= 1  # at least the last decoder layer's


# ---- freed heap pages returned in backward ------------------------------------------------------

# In a fresh process: 1 MB blocks (below the 4 MB threshold: heap) each followed by a small block
# that stays, as activations sit between longer-lived tensors; free the large ones, then trim.
HEAP_PATTERN = textwrap.dedent(
    """
    import torch
    from posttrain.ops import memory

    def rss_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon"))

    memory.map_large_blocks()
    large, small = [], []
    for _ in range(300):
        large.append(torch.ones(2**18))  # 1 MB
        small.append(torch.ones(256))  # 1 KB, kept
    del large
    before = rss_mb()
    memory.trim_heap()
    print(before - rss_mb())
    """
)


@needs_glibc
def test_trim_heap_returns_freed_heap_pages():
    out = subprocess.run([sys.executable, "-c", HEAP_PATTERN], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) > 200  # of the 300 MB freed inside the heap


def _stack(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


@needs_glibc
@pytest.mark.parametrize("checkpointing", [False, True])
def test_backward_trims_at_every_nth_decoder_layer_from_the_last(monkeypatch, checkpointing):
    import torch

    model = _stack(8)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    fired: list[int] = []
    memory.trim_heap_in_backward(model, every=2)
    hooked = [
        i
        for i, layer in enumerate(model.model.layers)
        if any(hook is memory._trim_at_backward for hook in layer._forward_hooks.values())
    ]
    assert hooked == [1, 3]  # every second from the last layer (7, 5, 3, 1), in backward's second half
    monkeypatch.setattr(memory, "trim_heap", lambda: fired.append(len(fired)) or True)
    ids = torch.randint(0, 64, (2, 5))
    with torch.no_grad():
        model(input_ids=ids)  # generation and reference forwards: nothing
    assert fired == []
    loss = model(input_ids=ids, labels=ids).loss
    assert fired == []  # only once backward reaches those layers
    loss.backward()
    assert len(fired) == 2


@needs_glibc
def test_trim_layers_from_the_environment(monkeypatch):
    model = _stack(8)
    monkeypatch.setenv("POSTTRAIN_MALLOC_TRIM_LAYERS", "0")
    assert memory.trim_heap_in_backward(model) == []
    monkeypatch.setenv("POSTTRAIN_MALLOC_TRIM_LAYERS", "2")
    assert len(memory.trim_heap_in_backward(model)) == 2  # layers 3 and 1 (7 and 5: backward's first half)
    monkeypatch.setenv("POSTTRAIN_MALLOC_TRIM_LAYERS", "every five")
    with pytest.raises(
        ValueError, match="POSTTRAIN_MALLOC_TRIM_LAYERS='every five' is not a non-negative integer"
    ):
        memory.trim_heap_in_backward(model)
    monkeypatch.delenv("POSTTRAIN_MALLOC_TRIM_LAYERS")
    assert len(memory.trim_heap_in_backward(model)) == 1  # default 5: layer 2 (7 is in the upper half)


@pytest.mark.parametrize(
    ("count", "every", "expected"),
    [(30, 5, [4, 9, 14]), (8, 3, [1]), (2, 5, [1]), (1, 5, [0]), (0, 5, [])],
)
def test_trims_come_every_nth_layer_from_the_last_in_the_lower_half(count, every, expected):
    """SmolLM2's 30 layers trim at 14, 9 and 4 (not 29, 24, 19, whose freed pages the next layers'
    gradients take again at once); a stack too short for its lower half keeps its lowest trim."""
    assert memory.trimmed_layers(count, every) == expected
