"""Sampling prompts so that every group of completions stays whole.

GRPO compares the ``G = num_generations`` completions of one prompt with each other, so all of
them must be generated and scored in the same global batch. The plan, shared by every process:

1. Draw ``P = global_batch / G`` distinct prompts (a shuffled permutation per epoch, from a
   seed every process shares).
2. Repeat each prompt ``G`` times, consecutively: the global batch of ``P * G`` rows.
3. Give process ``r`` the rows ``[r * B, (r + 1) * B)`` where ``B`` is the per-process batch.
   A group may straddle two processes; rewards are gathered before advantages are computed,
   so the group is still whole where it matters.
4. Yield the same per-process batch ``repeat`` times (``steps_per_generation *
   num_iterations``): the trainer generates on the first and replays the buffered rollouts on
   the others, so the trainer's step counting (and resumption) is one batch per micro-step.

Processes never exchange indices: each computes its own slice from the shared seed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset


class GroupedBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields this process's row indices of each global batch, each prompt repeated ``G`` times.

    Args:
        num_rows: rows of the (map-style) dataset.
        group_size: completions per prompt (``G``).
        per_process: rows per process per batch (``B``).
        num_processes: number of processes.
        process_index: this process.
        repeat: times each batch is yielded in a row.
        shuffle: draw prompts in a shuffled order (reshuffled each epoch).
        seed: seed shared by all processes.
    """

    def __init__(
        self,
        num_rows: int,
        group_size: int,
        per_process: int,
        num_processes: int = 1,
        process_index: int = 0,
        repeat: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.num_rows = num_rows
        self.group_size = group_size
        self.per_process = per_process
        self.num_processes = num_processes
        self.process_index = process_index
        self.repeat = repeat
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        global_batch = per_process * num_processes
        if global_batch % group_size != 0:
            raise ValueError(
                f"The global batch ({per_process} per process x {num_processes} processes = {global_batch}) "
                f"is not a multiple of num_generations={group_size}."
            )
        self.prompts_per_batch = global_batch // group_size
        if num_rows < self.prompts_per_batch:
            raise ValueError(
                f"The dataset has {num_rows} prompts but one batch needs {self.prompts_per_batch} distinct "
                "prompts. Add prompts or lower the batch size."
            )

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (called by the trainer at each epoch start)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return (self.num_rows // self.prompts_per_batch) * self.repeat

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_rows, generator=gen).tolist()
        else:
            order = list(range(self.num_rows))
        start = self.process_index * self.per_process
        for b in range(self.num_rows // self.prompts_per_batch):
            prompts = order[b * self.prompts_per_batch : (b + 1) * self.prompts_per_batch]
            rows = [i for i in prompts for _ in range(self.group_size)]
            mine = rows[start : start + self.per_process]
            for _ in range(self.repeat):
                yield list(mine)


class GroupedStream(IterableDataset):
    """The same plan for a stream (``datasets.IterableDataset``): yields lists of rows.

    Every process reads the whole stream in the same order and keeps its own slice, so no
    coordination is needed. The stream is shuffled (with a buffer) upstream when asked.
    """

    def __init__(
        self,
        stream: Any,
        group_size: int,
        per_process: int,
        num_processes: int = 1,
        process_index: int = 0,
        repeat: int = 1,
    ) -> None:
        self.stream = stream
        self.group_size = group_size
        self.per_process = per_process
        self.process_index = process_index
        self.repeat = repeat
        global_batch = per_process * num_processes
        if global_batch % group_size != 0:
            raise ValueError(
                f"The global batch ({global_batch}) is not a multiple of num_generations={group_size}."
            )
        self.prompts_per_batch = global_batch // group_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the stream so its shuffle changes each epoch."""
        self.epoch = epoch
        if hasattr(self.stream, "set_epoch"):
            self.stream.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        start = self.process_index * self.per_process
        prompts: list[dict[str, Any]] = []
        for row in self.stream:
            prompts.append(row)
            if len(prompts) < self.prompts_per_batch:
                continue
            rows = [r for r in prompts for _ in range(self.group_size)]
            mine = rows[start : start + self.per_process]
            for _ in range(self.repeat):
                yield list(mine)
            prompts = []


def _identity(batch: list[Any]) -> list[Any]:
    return batch


class GroupedDataLoader(DataLoader):
    """A DataLoader that forwards ``set_epoch`` to its sampler or stream."""

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``."""
        target = self.batch_sampler if isinstance(self.batch_sampler, GroupedBatchSampler) else self.dataset
        if hasattr(target, "set_epoch"):
            target.set_epoch(epoch)


def grouped_dataloader(
    dataset: Dataset | Any,
    group_size: int,
    per_process: int,
    num_processes: int,
    process_index: int,
    repeat: int,
    shuffle: bool,
    seed: int,
) -> DataLoader:
    """A DataLoader of lists of rows that follows the plan above, for either kind of dataset."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        stream = GroupedStream(dataset, group_size, per_process, num_processes, process_index, repeat)
        return GroupedDataLoader(stream, batch_size=None, collate_fn=_identity)
    sampler = GroupedBatchSampler(
        len(dataset), group_size, per_process, num_processes, process_index, repeat, shuffle, seed
    )
    return GroupedDataLoader(dataset, batch_sampler=sampler, collate_fn=_identity)


def online_dataloader(
    dataset: Dataset | Any,
    args: Any,
    per_process: int,
    group_size: int,
    repeat: int,
    shuffle: bool,
    seed: int | None = None,
) -> DataLoader:
    """The grouped dataloader of an online trainer, from its config.

    Args:
        dataset: the prompts (map-style or a stream).
        args: the config (``remove_unused_columns`` keeps only the prompt column; ``seed`` or
            ``data_seed``; the world size and process index).
        per_process: rows per process per yielded batch.
        group_size: completions per prompt.
        repeat: how many times each batch is yielded in a row.
        shuffle: shuffle (a stream through a buffer of 1000 rows).
        seed: the shuffling seed; ``None``: ``data_seed`` or ``seed``.
    """
    seed = (args.data_seed or args.seed) if seed is None else seed
    if args.remove_unused_columns and hasattr(dataset, "select_columns"):
        dataset = dataset.select_columns(["prompt"])
    if shuffle and not hasattr(dataset, "__len__") and hasattr(dataset, "shuffle"):
        dataset = dataset.shuffle(seed=seed, buffer_size=1000)
    return grouped_dataloader(
        dataset, group_size, per_process, args.world_size, args.process_index, repeat, shuffle, seed
    )
