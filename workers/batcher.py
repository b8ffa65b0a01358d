"""Micro-batching: group queued inputs of similar length into one inference call.

Why this shape:
- One batch runs at a time, on one executor thread, because each worker owns
  its ONNX Runtime threads; a second concurrent batch would only contend.
- While a batch runs, new inputs queue; when it ends, the next batch is built
  at once from what queued. So an idle worker never waits, and a busy worker
  batches exactly as much as the load gives it.
- Padding short inputs to long ones costs up to 27x here, so a batch is built
  around the oldest input (no starvation) from inputs of similar length, while
  real tokens stay >= ``min_fill`` of the padded tokens.
- An optional extra wait (the adaptive window) follows BentoML's model: batch
  time is ``a * tokens + b``. Waiting can pay only when another input is
  expected within the fixed cost ``b``; the window is therefore ``min(b, cap)``
  and is used only when the observed inter-arrival gap is shorter than it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

RunBatch = Callable[[list[Sequence[int]]], np.ndarray]


class BatchObserver(Protocol):
    """What the batcher reports; the worker's metrics implement it."""

    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None: ...

    def queue_wait(self, seconds: float) -> None: ...

    def queue_depth(self, items: int) -> None: ...


class QueueFull(Exception):
    """The worker has more queued inputs than ``max_queue_items``: shed load."""


@dataclass
class _Item:
    tokens: Sequence[int]
    future: asyncio.Future[np.ndarray]
    enqueued: float
    started: float = 0.0
    finished: float = 0.0


@dataclass(frozen=True)
class Embedded:
    """Rows in input order, with the request's time queued and computing."""

    vectors: np.ndarray
    queue_s: float
    compute_s: float


@dataclass
class BatchCostModel:
    """Online least squares of batch seconds on padded tokens: ``t = a * tokens + b``.

    Sufficient statistics decay exponentially so the fit follows a machine
    whose speed changes (noisy neighbours, throttling).
    """

    decay: float = 0.98
    _n: float = 0.0
    _sx: float = 0.0
    _sy: float = 0.0
    _sxx: float = 0.0
    _sxy: float = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._n = self._n * d + 1.0
        self._sx = self._sx * d + tokens
        self._sy = self._sy * d + seconds
        self._sxx = self._sxx * d + tokens * tokens
        self._sxy = self._sxy * d + tokens * seconds

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``; ``b`` is 0 until the data can tell it apart from ``a``."""
        if self._n < 2:
            return (self._sy / self._sx if self._sx else 0.0), 0.0
        var = self._n * self._sxx - self._sx * self._sx
        if var <= 1e-9 * max(1.0, self._n * self._sxx):
            return (self._sy / self._sx if self._sx else 0.0), 0.0
        a = (self._n * self._sxy - self._sx * self._sy) / var
        b = (self._sy - a * self._sx) / self._n
        if a < 0 or b < 0:  # noisy fit: fall back to the proportional model
            return (self._sy / self._sx if self._sx else 0.0), 0.0
        return a, b


@dataclass
class MicroBatcher:
    run_batch: RunBatch
    executor: Executor
    observer: BatchObserver
    max_batch_tokens: int = 512
    max_batch_size: int = 64
    max_wait_s: float = 0.005
    max_queue_items: int = 8192
    min_fill: float = 0.75
    cost: BatchCostModel = field(default_factory=BatchCostModel)
    _queue: deque[_Item] = field(default_factory=deque)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    _arrival_gap: float = 1.0
    _last_arrival: float = 0.0
    _busy: bool = False

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(RuntimeError("worker is shutting down"))

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._busy

    # -- submitting ------------------------------------------------------
    async def embed(self, inputs: Sequence[Sequence[int]]) -> Embedded:
        """Embed ``inputs`` (token-id arrays); rows come back in input order.

        The inputs may land in different batches; each has its own future.
        """
        if len(self._queue) + len(inputs) > self.max_queue_items:
            raise QueueFull(f"{len(self._queue)} inputs already queued (limit {self.max_queue_items})")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        if self._last_arrival:
            self._arrival_gap = 0.8 * self._arrival_gap + 0.2 * (now - self._last_arrival)
        self._last_arrival = now
        items = [_Item(tokens, loop.create_future(), now) for tokens in inputs]
        self._queue.extend(items)
        self.observer.queue_depth(len(self._queue))
        self._wakeup.set()
        try:
            rows = await asyncio.gather(*(item.future for item in items))
        except BaseException:
            for item in items:
                item.future.cancel()
            raise
        first_start = min(item.started for item in items)
        return Embedded(
            vectors=np.stack(rows),
            queue_s=first_start - now,
            compute_s=max(item.finished for item in items) - first_start,
        )

    # -- the loop --------------------------------------------------------
    def window(self) -> float:
        """Extra seconds worth waiting for more inputs, from the fitted ``b``."""
        _, b = self.cost.coefficients()
        return min(b, self.max_wait_s)

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._maybe_wait()
            batch = self._take_batch()
            self.observer.queue_depth(len(self._queue))
            if batch:
                await self._execute(batch)

    async def _maybe_wait(self) -> None:
        window = self.window()
        if window <= 0 or self._arrival_gap >= window:
            return
        deadline = self._queue[0].enqueued + window
        while len(self._queue) < self.max_batch_size and self._queued_tokens() < self.max_batch_tokens:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _queued_tokens(self) -> int:
        return sum(len(item.tokens) for item in self._queue)

    def _take_batch(self) -> list[_Item]:
        """The oldest live input plus the queued inputs nearest its length that fit."""
        while self._queue and self._queue[0].future.done():  # cancelled by its client
            self._queue.popleft()
        if not self._queue:
            return []
        anchor = self._queue[0]
        anchor_len = len(anchor.tokens)
        candidates = sorted(
            (item for item in list(self._queue)[1:512] if not item.future.done()),
            key=lambda item: abs(len(item.tokens) - anchor_len),
        )
        batch = [anchor]
        real = lo = hi = anchor_len
        for item in candidates:
            if len(batch) >= self.max_batch_size:
                break
            n = len(item.tokens)
            new_hi, new_lo = max(hi, n), min(lo, n)
            padded = new_hi * (len(batch) + 1)
            if padded > self.max_batch_tokens or (real + n) < self.min_fill * padded:
                continue
            batch.append(item)
            real, lo, hi = real + n, new_lo, new_hi
        chosen = {id(item) for item in batch}
        self._queue = deque(item for item in self._queue if id(item) not in chosen and not item.future.done())
        return batch

    async def _execute(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        for item in batch:
            item.started = start
            self.observer.queue_wait(start - item.enqueued)
        tokens = [item.tokens for item in batch]
        self._busy = True
        try:
            vectors = await loop.run_in_executor(self.executor, self.run_batch, tokens)
        except Exception as exc:  # a failed batch fails its requests, never the worker
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self._busy = False
        finished = time.perf_counter()
        seconds = finished - start
        padded = max(len(t) for t in tokens) * len(tokens)
        self.cost.observe(padded, seconds)
        self.observer.batch_done(
            size=len(batch), tokens=sum(len(t) for t in tokens), padded_tokens=padded, seconds=seconds
        )
        for item, row in zip(batch, vectors):
            item.finished = finished
            if not item.future.done():
                item.future.set_result(row)
