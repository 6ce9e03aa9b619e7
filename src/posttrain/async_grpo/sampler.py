"""The background sampler of asynchronous GRPO: generation in a thread, on its own weights.

The sampler holds its own copy of the policy and generates the batch of optimizer step ``k``
with the weights of step ``max(0, k - max_staleness)``, exactly. The trainer hands each
step's weights over through one staging buffer in memory (``publish``), never through disk;
the sampler loads them when the next batch needs them. So:

- generation of batch ``k`` overlaps training on batches ``k - max_staleness .. k - 1``;
- no batch is ever staler than ``max_staleness`` steps, and which weights made which batch does
  not depend on timing (a resumed run samples exactly as an uninterrupted one would, given the
  same completions);
- ``max_staleness=0`` is synchronous: batch ``k`` waits for step ``k - 1``'s weights.

Each batch is scored in the thread (rewards, then the sampler's log-probs of the tokens and its
top ``num_sampler_logprobs`` tokens per position, from one teacher-forced pass of its own
weights). No collective runs in the thread: the advantages, which may need every process's
rewards, are the trainer's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.batch import Rollout
from posttrain.observe.metrics import MetricStore
from posttrain.ops.logprobs import sampler_topk, sampler_topk_truncated
from posttrain.ops.support import Truncation
from posttrain.sampling.pipeline import OnlineSampler


@dataclass
class SampledBatch:
    """One optimizer step's generation batch (this process's rows), as the sampler made it.

    Attributes:
        index: the optimizer step it is for.
        version: the optimizer steps behind the weights that sampled it.
        rollout, rewards: the completions and their [n, F] rewards.
        sampler_logps: [n, T]; sampler_top_logps, sampler_top_ids: [n, T, K].
        sampler_support: [n, T, M] the ids of each position's truncated support (``-1`` padded),
            or ``None`` when the sampler does not truncate (``ops/support.py``).
        metrics: what the reward functions logged while it was scored (means).
        faults: reward-function faults counted while it was scored.
        texts: prompts, completions and log_extra columns (the completions table).
        seconds: how long sampling and scoring it took.
    """

    index: int
    version: int
    rollout: Rollout
    rewards: torch.Tensor
    sampler_logps: torch.Tensor
    sampler_top_logps: torch.Tensor
    sampler_top_ids: torch.Tensor
    sampler_support: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)
    texts: Any = None
    seconds: float = 0.0


class BackgroundSampler:
    """Generates and scores generation batches in a thread (see the module docstring).

    Args:
        model: the sampler's own copy of the policy (not the trained module).
        sampler: the ``OnlineSampler`` that generates with ``model`` and scores.
        metrics: the store ``sampler`` records into (read after each batch).
        batches: ``batches(start)`` iterates this process's dataset rows of batches ``start``,
            ``start + 1``, ...
        first_index: the first batch to generate.
        version: the optimizer steps behind ``model``'s weights now.
        max_staleness: how many steps the sampling weights may lag (``AsyncGRPOConfig``).
        group: completions per prompt.
        temperature, num_logprobs: the sampler's log-prob pass.
        truncation: the sampler's top-k / top-p / min-p (``ops/support.Truncation``); when active,
            the log-prob pass reports the distribution restricted to each position's support.
        timeout: seconds either side waits for the other before failing.
        ready: batches made before a checkpoint, not yet trained on (a resume).
        last_index: the sampler makes no batch from this index on (the run's ``max_steps``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sampler: OnlineSampler,
        metrics: MetricStore,
        batches: Callable[[int], Iterator[list[dict[str, Any]]]],
        first_index: int,
        version: int,
        max_staleness: int,
        group: int,
        temperature: float,
        num_logprobs: int,
        timeout: float,
        ready: list[SampledBatch] | None = None,
        last_index: int | None = None,
        truncation: Truncation | None = None,
    ) -> None:
        self.model, self.sampler, self.metrics = model, sampler, metrics
        self._batches, self._next, self._version = batches, first_index, version
        self.max_staleness, self.group = max_staleness, group
        self.temperature, self.num_logprobs, self.timeout = temperature, num_logprobs, timeout
        self._ready: dict[int, SampledBatch] = {b.index: b for b in ready or []}
        self._last = last_index
        self.truncation = truncation if truncation is not None and truncation.active else None
        self._staged: tuple[int, dict[str, torch.Tensor]] | None = None
        self._buffers: dict[str, torch.Tensor] | None = None
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="posttrain-async-sampler", daemon=True)

    # ---- the trainer's side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Hand over the weights after ``version`` optimizer steps (copied into the staging buffer).

        Waits while the buffer still holds the previous version, which the sampler takes when a
        batch first needs it. Weights no batch will need (past ``last_index``) are not handed over.
        """
        if self._last is not None and version + self.max_staleness >= self._last:
            return
        with self._cond:
            self._wait(lambda: self._staged is None, f"the sampler to take the weights of step {version - 1}")
            if self._buffers is None:
                self._buffers = {k: v.detach().clone() for k, v in state.items()}
            else:
                for k, v in state.items():
                    self._buffers[k].copy_(v.detach())
            self._staged = (version, self._buffers)
            self._cond.notify_all()

    def get(self, index: int) -> SampledBatch:
        """The batch of optimizer step ``index`` (waits for it)."""
        with self._cond:
            self._wait(lambda: index in self._ready, f"the generation batch of step {index}")
            return self._ready.pop(index)

    def ready_until(self, index: int) -> list[SampledBatch]:
        """Wait until every batch before ``index`` is made; the made, untrained ones, in order."""
        if self._last is not None:
            index = min(index, self._last)
        with self._cond:
            self._wait(lambda: self._next >= index, f"the generation batches before step {index}")
            return [self._ready[i] for i in sorted(self._ready)]

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=self.timeout)

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        """Wait on the condition until ``done()`` (holding the lock); raise the thread's error or a timeout."""
        deadline = time.monotonic() + self.timeout
        while not done():
            if self._error is not None:
                raise RuntimeError(f"the background sampler failed: {self._error!r}") from self._error
            if self._stopping:
                raise RuntimeError("the background sampler was stopped")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"waited {self.timeout:g} s for {what}; raise AsyncGRPOConfig.weight_sync_timeout if sampling a "
                    "batch takes longer."
                )
            self._cond.wait(timeout=min(left, 1.0))

    # ---- the thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            rows = self._batches(self._next)
            while self._last is None or self._next < self._last:
                index = self._next
                if not self._take_weights(max(0, index - self.max_staleness)):
                    return
                batch = self._make(index, next(rows))
                with self._cond:
                    self._ready[index] = batch
                    self._next = index + 1
                    self._cond.notify_all()
        except BaseException as error:  # handed to the trainer, which raises it
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _take_weights(self, needed: int) -> bool:
        """Load staged weights until the copy holds version ``needed``; False when stopping."""
        while self._version < needed:
            with self._cond:
                while self._staged is None and not self._stopping:
                    self._cond.wait(timeout=1.0)
                if self._stopping:
                    return False
                version, state = self._staged
                if version != self._version + 1:
                    raise RuntimeError(
                        f"the sampler holds step {self._version}'s weights and got step {version}'s"
                    )
                self.model.load_state_dict(state)
                weights_changed = getattr(self.sampler.generator, "weights_changed", None)
                if weights_changed is not None:  # a vLLM server gets this version before the next batch
                    weights_changed()
                self._version = version
                self._staged = None
                self._cond.notify_all()
        with self._cond:
            return not self._stopping

    def _make(self, index: int, rows: list[dict[str, Any]]) -> SampledBatch:
        start = time.perf_counter()
        rollout, rewards = self.sampler.sample(rows, "train", self.group)
        logps, top_logps, top_ids, kept = sampler_report(
            self.model, rollout, self.temperature, self.num_logprobs, self.truncation
        )
        return SampledBatch(
            index=index,
            version=self._version,
            rollout=rollout,
            rewards=rewards,
            sampler_logps=logps,
            sampler_top_logps=top_logps,
            sampler_top_ids=top_ids,
            sampler_support=kept,
            metrics=self.metrics.pop_means("train"),
            faults=self.sampler.rewards.pop_faults(),
            texts=self.sampler.sampled_text,
            seconds=time.perf_counter() - start,
        )


def sampler_report(
    model: torch.nn.Module, rollout: Rollout, temperature: float, k: int, truncation: Truncation | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The sampler's log-probs of its tokens, its top ``k`` and (truncating) its supports, from one
    teacher-forced pass of ``model``: ``(logps, top_logps, top_ids, support or None)``."""
    r = rollout
    args = (model, r.prompt_ids, r.prompt_mask, r.completion_ids, r.completion_mask, temperature, k)
    images = {"model_inputs": r.vision_kwargs()}  # a vision-language model's image inputs, or None
    if truncation is None or not truncation.active:
        return (*sampler_topk(*args, **images), None)
    return sampler_topk_truncated(*args, truncation, **images)
