"""Grouped sampling: every prompt's G completions land in the same global batch."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest

from posttrain.data.sampling import GroupedBatchSampler, GroupedStream, grouped_dataloader

try:  # imported once at collection, so no single test pays for it
    import datasets
except ImportError:  # pragma: no cover
    datasets = None

needs_datasets = pytest.mark.skipif(datasets is None, reason="datasets is not installed")


def batches_of_all_processes(num_processes: int, **kwargs) -> list[list[list[int]]]:
    """[process][step] -> indices, each process computing its own plan independently."""
    return [
        list(GroupedBatchSampler(num_processes=num_processes, process_index=r, **kwargs))
        for r in range(num_processes)
    ]


def test_two_processes_share_whole_groups():
    """G=4, 4 rows per process, 2 processes: global batch 8 = P=2 prompts x 4."""
    per_proc = batches_of_all_processes(2, num_rows=10, group_size=4, per_process=4, seed=3)
    assert len(per_proc[0]) == len(per_proc[1]) == 5  # 10 prompts // 2 per batch
    seen = []
    for b0, b1 in zip(*per_proc, strict=True):
        assert len(b0) == len(b1) == 4
        counts = Counter(b0 + b1)
        assert len(counts) == 2
        assert set(counts.values()) == {4}
        # Prompts are repeated consecutively: process 0 holds the first prompt's 4 rows.
        assert len(set(b0)) == 1 and len(set(b1)) == 1
        seen.extend(counts)
    # One epoch draws every prompt once (a permutation).
    assert sorted(seen) == list(range(10))


def test_process_zero_gets_first_rows_unshuffled():
    """shuffle=False: global batch rows [0,0,0,0,1,1,1,1]; process 0 the first 4, process 1 the rest."""
    p0, p1 = batches_of_all_processes(2, num_rows=4, group_size=4, per_process=4, shuffle=False)
    assert p0 == [[0, 0, 0, 0], [2, 2, 2, 2]]
    assert p1 == [[1, 1, 1, 1], [3, 3, 3, 3]]


def test_group_straddling_processes():
    """G=3, 2 rows per process, 3 processes: rows [a,a,a,b,b,b] -> [a,a], [a,b], [b,b]."""
    p0, p1, p2 = batches_of_all_processes(3, num_rows=4, group_size=3, per_process=2, shuffle=False)
    assert (p0[0], p1[0], p2[0]) == ([0, 0], [0, 1], [1, 1])
    assert (p0[1], p1[1], p2[1]) == ([2, 2], [2, 3], [3, 3])


def test_repeat_yields_each_batch_in_a_row():
    sampler = GroupedBatchSampler(6, group_size=2, per_process=4, repeat=3, shuffle=False)
    out = list(sampler)
    assert out == [[0, 0, 1, 1]] * 3 + [[2, 2, 3, 3]] * 3 + [[4, 4, 5, 5]] * 3
    assert len(sampler) == 9


@pytest.mark.parametrize(
    ("num_rows", "g", "per_process", "procs", "repeat", "expected"),
    [
        (10, 4, 4, 2, 1, 5),  # 2 prompts per batch
        (11, 4, 4, 2, 1, 5),  # last incomplete batch dropped
        (10, 4, 4, 2, 3, 15),
        (7, 2, 2, 1, 2, 14),  # 1 prompt per batch
        (9, 3, 9, 1, 1, 3),
    ],
)
def test_len(num_rows, g, per_process, procs, repeat, expected):
    sampler = GroupedBatchSampler(num_rows, g, per_process, procs, 0, repeat=repeat)
    assert len(sampler) == expected
    assert len(list(sampler)) == expected


def test_set_epoch_reshuffles_and_is_deterministic():
    kwargs = dict(num_rows=40, group_size=2, per_process=4, seed=7)
    a, b = GroupedBatchSampler(**kwargs), GroupedBatchSampler(**kwargs)
    epoch0 = list(a)
    assert list(b) == epoch0  # same seed and epoch: identical
    assert list(a) == epoch0  # iterating again without set_epoch: same order
    a.set_epoch(1)
    epoch1 = list(a)
    assert epoch1 != epoch0
    b.set_epoch(1)
    assert list(b) == epoch1
    # A different seed gives a different order.
    assert list(GroupedBatchSampler(**{**kwargs, "seed": 8})) != epoch0


def test_every_process_agrees_after_set_epoch():
    """Each process reshuffles independently, yet their slices still form whole groups."""
    samplers = [
        GroupedBatchSampler(12, group_size=4, per_process=2, num_processes=4, process_index=r, seed=1)
        for r in range(4)
    ]
    for epoch in (0, 1, 2):
        for s in samplers:
            s.set_epoch(epoch)
        steps = list(zip(*(list(s) for s in samplers), strict=True))
        assert len(steps) == 6
        seen = []
        for step in steps:
            rows = [i for batch in step for i in batch]
            counts = Counter(rows)
            assert len(counts) == 2 and set(counts.values()) == {4}
            assert rows == sorted(rows, key=rows.index)  # consecutive groups
            seen.extend(counts)
        assert sorted(seen) == list(range(12))


def test_shuffle_false_keeps_dataset_order_across_epochs():
    sampler = GroupedBatchSampler(4, group_size=2, per_process=2, shuffle=False)
    assert list(sampler) == [[0, 0], [1, 1], [2, 2], [3, 3]]
    sampler.set_epoch(5)
    assert list(sampler) == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_global_batch_not_multiple_of_group_size():
    with pytest.raises(ValueError, match="not a multiple of num_generations=4"):
        GroupedBatchSampler(10, group_size=4, per_process=3, num_processes=2)


def test_dataset_smaller_than_one_batch():
    with pytest.raises(ValueError, match="3 prompts"):
        GroupedBatchSampler(3, group_size=2, per_process=4, num_processes=2)  # needs 4 prompts


# ---- streams ---------------------------------------------------------------------------------


ROWS = [{"prompt": f"p{i}", "answer": i} for i in range(5)]


def test_grouped_stream_over_list_of_rows():
    """G=2, 2 rows per process, 2 processes: P=2 prompts per batch; the 5th prompt is dropped."""
    p0 = list(GroupedStream(ROWS, group_size=2, per_process=2, num_processes=2, process_index=0))
    p1 = list(GroupedStream(ROWS, group_size=2, per_process=2, num_processes=2, process_index=1))
    assert p0 == [[ROWS[0], ROWS[0]], [ROWS[2], ROWS[2]]]
    assert p1 == [[ROWS[1], ROWS[1]], [ROWS[3], ROWS[3]]]


def test_grouped_stream_repeat_and_straddling():
    """G=3, 2 per process, 3 processes, repeat 2: rows [p0 p0 p0 p1 p1 p1]; process 1 gets [p0, p1]."""
    s = GroupedStream(ROWS[:2], group_size=3, per_process=2, num_processes=3, process_index=1, repeat=2)
    assert list(s) == [[ROWS[0], ROWS[1]]] * 2


def test_grouped_stream_rejects_bad_global_batch():
    with pytest.raises(ValueError, match="num_generations=4"):
        GroupedStream(ROWS, group_size=4, per_process=3, num_processes=1)


@needs_datasets
def test_grouped_stream_over_hf_iterable_dataset():
    stream = datasets.Dataset.from_dict({"prompt": ["a", "b", "c", "d"], "k": [0, 1, 2, 3]})
    stream = stream.to_iterable_dataset()
    out = list(GroupedStream(stream, group_size=2, per_process=2, num_processes=2, process_index=1))
    assert out == [[{"prompt": "b", "k": 1}] * 2, [{"prompt": "d", "k": 3}] * 2]


class RecordingStream:
    """An iterable without __len__ that records set_epoch."""

    def __init__(self, rows):
        self.rows = rows
        self.epochs = []

    def __iter__(self):
        return iter(self.rows)

    def set_epoch(self, epoch):
        self.epochs.append(epoch)


# ---- grouped_dataloader ----------------------------------------------------------------------


def test_grouped_dataloader_map_style_yields_lists_of_rows():
    loader = grouped_dataloader(
        ROWS, group_size=2, per_process=2, num_processes=2, process_index=1, repeat=2, shuffle=False, seed=0
    )
    out = list(loader)
    assert out == [[ROWS[1], ROWS[1]]] * 2 + [[ROWS[3], ROWS[3]]] * 2
    assert len(loader) == 4


@needs_datasets
def test_grouped_dataloader_hf_dataset():
    ds = datasets.Dataset.from_dict({"prompt": ["a", "b", "c"]})
    loader = grouped_dataloader(ds, 3, 3, 1, 0, 1, False, 0)
    assert list(loader) == [[{"prompt": p}] * 3 for p in "abc"]


def test_grouped_dataloader_set_epoch_reaches_sampler():
    rows = [{"prompt": str(i)} for i in range(30)]
    loader = grouped_dataloader(rows, 2, 2, 1, 0, 1, True, 0)
    assert isinstance(loader.batch_sampler, GroupedBatchSampler)
    first = list(loader)
    loader.set_epoch(4)
    assert loader.batch_sampler.epoch == 4
    second = list(loader)
    assert first != second
    ref = GroupedBatchSampler(30, 2, 2, seed=0)
    ref.set_epoch(4)
    assert second == [[rows[i] for i in batch] for batch in ref]


def test_grouped_dataloader_stream_yields_lists_and_forwards_set_epoch():
    stream = RecordingStream(ROWS)
    loader = grouped_dataloader(stream, 2, 4, 1, 0, 1, True, 0)
    assert isinstance(loader.dataset, GroupedStream)
    assert list(loader) == [[ROWS[0]] * 2 + [ROWS[1]] * 2, [ROWS[2]] * 2 + [ROWS[3]] * 2]
    loader.set_epoch(2)
    assert stream.epochs == [2]
    assert loader.dataset.epoch == 2


@needs_datasets
def test_grouped_dataloader_hf_iterable_dataset():
    stream = datasets.Dataset.from_dict({"prompt": ["a", "b", "c", "d"]}).to_iterable_dataset()
    loader = grouped_dataloader(stream, 2, 2, 2, 0, 1, False, 0)
    assert isinstance(loader.dataset, GroupedStream)
    assert list(islice(loader, 5)) == [[{"prompt": "a"}] * 2, [{"prompt": "c"}] * 2]
    loader.set_epoch(1)  # datasets.IterableDataset.set_epoch exists: forwarded without error
    assert loader.dataset.epoch == 1
