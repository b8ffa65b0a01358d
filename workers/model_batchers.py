"""One micro-batcher per served model version, all on the worker's one inference thread.

Why one batcher per model: a batch runs one model's graph, so inputs of two
versions can never share a batch. Why one thread for all of them: each
engine's intra-op threads are the worker's whole CPU budget; a thread per
model would double it and the two would only contend. Each batcher submits
one batch at a time to the shared executor, whose queue is first come first
served, so two busy models take turns batch by batch. (Priority classes rank
requests within a model's queue, not across models.)

The fleet-level metrics stay one series: batches of every model feed the same
observer and one cost model (the worker's cost is that of the mix it serves),
and the queue-depth gauge reports every model's queue together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

from inferlb_runtime.request_class import Priority

from .batcher import BatchCostModel, BatchObserver, Embedded, MicroBatcher

RunModelBatch = Callable[[str, list[Sequence[int]]], np.ndarray]


class ModelBatchers:
    """The service's input scheduler when it serves real models: ``embed`` takes the version to run."""

    # Batches run one at a time, on the service's single inference thread, whichever version they are for:
    # one slot (a batch holds many requests, but they start and end together).
    slots = 1

    def __init__(self, models: Sequence[str], run_batch: RunModelBatch, *, executor: Executor,
                 observer: BatchObserver, **options: Any) -> None:
        self.cost = BatchCostModel()
        depth = _TotalDepth(observer, self)
        self._batchers: Mapping[str, MicroBatcher] = {
            model: MicroBatcher(run_batch=functools.partial(run_batch, model), executor=executor, observer=depth,
                                cost=self.cost, **options)
            for model in models
        }

    @property
    def queued(self) -> int:
        return sum(batcher.queued for batcher in self._batchers.values())

    def start(self) -> None:
        for batcher in self._batchers.values():
            batcher.start()

    async def stop(self) -> None:
        for batcher in self._batchers.values():
            await batcher.stop()

    async def embed(self, inputs: Sequence[Sequence[int]], *, model: str, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded:
        """Embed ``inputs`` with ``model`` (a version this worker serves; the service resolved it)."""
        return await self._batchers[model].embed(inputs, priority=priority, deadline=deadline)


class _TotalDepth:
    """A batcher's observer that reports the depth of every model's queue together, not its own alone."""

    def __init__(self, observer: BatchObserver, batchers: ModelBatchers) -> None:
        self._observer = observer
        self._batchers = batchers

    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None:
        self._observer.batch_done(size=size, tokens=tokens, padded_tokens=padded_tokens, seconds=seconds)

    def queue_wait(self, seconds: float, priority: Priority) -> None:
        self._observer.queue_wait(seconds, priority)

    def queue_depth(self, items: int) -> None:
        self._observer.queue_depth(self._batchers.queued)

    def inputs_cancelled(self, items: int) -> None:
        self._observer.inputs_cancelled(items)

    def deadline_missed(self) -> None:
        self._observer.deadline_missed()
