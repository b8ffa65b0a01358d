"""Micro-batching: group queued inputs of similar length into one inference call.

Why this shape:
- One batch runs at a time, on one executor thread, because each worker owns
  its ONNX Runtime threads; a second concurrent batch would only contend.
- While a batch runs, new inputs queue; when it ends, the next batch is built
  at once from what queued. So an idle worker never waits, and a busy worker
  batches exactly as much as the load gives it.
- Padding short inputs to long ones costs up to 27x here, so a batch is built
  around one input (the anchor) from inputs of similar length, while real
  tokens stay >= ``min_fill`` of the padded tokens.
- The anchor comes from the first request in ``workers.queue_order``'s
  order (shared with the simulated worker and the fleet simulator): the best
  priority class, a class climbing one per ``aging_s`` its longest-waiting
  request waited so no class starves, then by default the request that has had
  the least service so far
  (padded tokens computed for it): a request of 2,048 inputs gets one batch,
  then a one-sentence request that arrived meanwhile gets the next, instead
  of waiting for all 2,048 (least attained service: short requests finish
  first without anyone knowing sizes ahead). ``round_robin`` and ``fifo``
  (the old oldest-input-first) are the alternatives it was measured against.
- A request whose client has gone is dropped from the queue at once; one
  whose deadline has passed never starts another input.
- An optional extra wait (the adaptive window) follows BentoML's model: batch
  time is ``a * tokens + b``. Waiting can pay only when another input is
  expected within the fixed cost ``b``; the window is therefore ``min(b, cap)``
  and is used only when the observed inter-arrival gap is shorter than it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from inferlb_runtime.request_class import Priority

from .queue_order import AGING_S, QueueOrder, Scheduling

RunBatch = Callable[[list[Sequence[int]]], np.ndarray]


class BatchObserver(Protocol):
    """What the batcher reports; the worker's metrics implement it."""

    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None: ...

    def queue_wait(self, seconds: float, priority: Priority) -> None: ...

    def queue_depth(self, items: int) -> None: ...


    def inputs_cancelled(self, items: int) -> None: ...

    def deadline_missed(self) -> None: ...


class QueueFull(Exception):
    """The worker has more queued inputs than ``max_queue_items``: shed load."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before all its inputs had started; the rest never will."""


@dataclass(eq=False)
class _Item:
    tokens: Sequence[int]
    future: asyncio.Future[np.ndarray]
    enqueued: float
    priority: Priority
    started: float = 0.0
    finished: float = 0.0
    batch: int = 0  # the batch it ran in (the batcher's sequence number) and that batch's size: for traces
    batch_size: int = 0


@dataclass(eq=False)
class _Request:
    """One ``embed`` call's queued inputs and what orders it against the other requests."""

    items: deque[_Item]
    priority: Priority
    deadline: float | None  # perf_counter seconds; None: no deadline
    seq: int  # arrival order, the last tie-break
    waiting_since: float  # arrival, then the end of its last batch: aging counts from here
    attained: int = 0  # padded tokens computed for it so far

    def key(self, order: QueueOrder) -> tuple[float, ...]:
        """Where it stands in ``order`` (smallest first): its class, then the order within the class."""
        return (int(self.priority), *order.within_key(waiting_since=self.waiting_since, attained=self.attained,
                                                       seq=self.seq))


@dataclass(frozen=True)
class Embedded:
    """Rows in input order, with the request's time queued and computing, and the batches its inputs ran in
    ((sequence number, inputs in the batch), for its trace span)."""

    vectors: np.ndarray
    queue_s: float
    compute_s: float
    batches: tuple[tuple[int, int], ...] = ()


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
    max_batch_tokens: int = 256
    max_batch_size: int = 64
    max_wait_s: float = 0.005
    max_queue_items: int = 8192
    min_fill: float = 0.75
    aging_s: float = AGING_S
    scheduling: Scheduling = Scheduling.LAS
    cost: BatchCostModel = field(default_factory=BatchCostModel)
    _pending: list[_Request] = field(default_factory=list)  # in arrival order
    _queued: int = 0  # inputs in _pending
    _seq: int = 0
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None
    _arrival_gap: float = 1.0
    _last_arrival: float = 0.0
    _busy: bool = False
    _running: asyncio.Future[None] | None = None  # done when the batch on the inference thread ends
    _running_items: frozenset[int] = frozenset()  # id() of that batch's items
    _batches: int = 0  # batches run so far: the next one's sequence number, less one
    _order: QueueOrder = field(init=False)

    def __post_init__(self) -> None:
        self._order = QueueOrder(Scheduling(self.scheduling), self.aging_s)

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
        pending, self._pending, self._queued = self._pending, [], 0
        for request in pending:
            for item in request.items:
                if not item.future.done():
                    item.future.set_exception(RuntimeError("worker is shutting down"))

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def busy(self) -> bool:
        return self._busy

    # -- submitting ------------------------------------------------------
    async def embed(self, inputs: Sequence[Sequence[int]], *, priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded:
        """Embed ``inputs`` (token-id arrays); rows come back in input order.

        The inputs may land in different batches; each has its own future.
        ``deadline`` (``time.perf_counter()`` seconds): no input starts after
        it, the call raises ``DeadlineExceeded`` instead. Cancelling the call
        (the client went away) takes its inputs out of the queue at once.
        """
        if self._queued + len(inputs) > self.max_queue_items:
            raise QueueFull(f"{self._queued} inputs already queued (limit {self.max_queue_items})")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        if deadline is not None and deadline <= now:
            self.observer.deadline_missed()
            raise DeadlineExceeded("the request's deadline had passed when it arrived")
        if self._last_arrival:
            self._arrival_gap = 0.8 * self._arrival_gap + 0.2 * (now - self._last_arrival)
        self._last_arrival = now
        priority = Priority(priority)
        items = [_Item(tokens, loop.create_future(), now, priority) for tokens in inputs]
        self._seq += 1
        request = _Request(deque(items), priority, deadline, self._seq, now)
        self._pending.append(request)
        self._queued += len(items)
        self.observer.queue_depth(self._queued)
        self._wakeup.set()
        try:
            rows = await asyncio.gather(*(item.future for item in items))
        except BaseException:
            for item in items:
                item.future.cancel()
            self._withdraw(request)
            running = self._running
            if running is not None and any(id(item) in self._running_items for item in items):
                # Its inputs are computing now: the request ends with that batch, so a worker that
                # reports itself idle (no request in flight) is idle, and its load reports stay true.
                await asyncio.shield(running)
            raise
        first_start = min(item.started for item in items)
        return Embedded(
            vectors=np.stack(rows),
            queue_s=first_start - now,
            compute_s=max(item.finished for item in items) - first_start,
            batches=tuple(sorted({(item.batch, item.batch_size) for item in items})),
        )

    def _withdraw(self, request: _Request) -> None:
        """Take a request's still-queued inputs out (its client left, or one of its inputs failed)."""
        if request not in self._pending:
            return
        self._pending.remove(request)
        left = len(request.items)
        self._queued -= left
        request.items.clear()
        if left:
            self.observer.inputs_cancelled(left)
            self.observer.queue_depth(self._queued)

    # -- the loop --------------------------------------------------------
    def window(self) -> float:
        """Extra seconds worth waiting for more inputs, from the fitted ``b``."""
        _, b = self.cost.coefficients()
        return min(b, self.max_wait_s)

    async def _run(self) -> None:
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            await self._maybe_wait()
            batch = self._take_batch()
            self.observer.queue_depth(self._queued)
            if batch:
                await self._execute(batch)

    async def _maybe_wait(self) -> None:
        window = self.window()
        if window <= 0 or self._arrival_gap >= window or not self._pending:
            return
        deadline = self._pending[0].items[0].enqueued + window if self._pending[0].items else 0.0
        while self._queued < self.max_batch_size and self._queued_tokens() < self.max_batch_tokens:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except TimeoutError:
                return

    def _queued_tokens(self) -> int:
        return sum(len(item.tokens) for request in self._pending for item in request.items)

    def _expire(self, now: float) -> None:
        """Fail the requests whose deadline has passed; forget the empty ones."""
        for request in list(self._pending):
            if request.deadline is not None and request.deadline <= now and request.items:
                error = DeadlineExceeded("the request's deadline passed while its inputs waited in the queue")
                for item in request.items:
                    if not item.future.done():
                        item.future.set_exception(error)
                self.observer.deadline_missed()
            if request.deadline is not None and request.deadline <= now or not request.items:
                self._queued -= len(request.items)
                request.items.clear()
                self._pending.remove(request)

    def _take_batch(self) -> list[_Item]:
        """An anchor input from the first request in the queue order, plus the queued inputs nearest its
        length that fit (from any request: the spare room of a batch costs no one a turn)."""
        now = time.perf_counter()
        self._expire(now)
        if not self._pending:
            return []
        owner = self._order.first(self._pending, now)
        keys = {request: request.key(self._order) for request in self._pending}
        anchor = owner.items[0]
        anchor_len = len(anchor.tokens)
        # At most a batch's worth from each request: a request of 2,048 inputs is not scanned whole.
        candidates = sorted(
            ((item, request) for request in self._pending
             for item in itertools.islice(request.items, 1 if request is owner else 0, self.max_batch_size)),
            key=lambda pair: (abs(len(pair[0].tokens) - anchor_len), keys[pair[1]]),
        )
        batch, taken = [anchor], {owner: 1}
        real = lo = hi = anchor_len
        for item, request in candidates:
            if len(batch) >= self.max_batch_size:
                break
            n = len(item.tokens)
            new_hi, new_lo = max(hi, n), min(lo, n)
            padded = new_hi * (len(batch) + 1)
            if padded > self.max_batch_tokens or (real + n) < self.min_fill * padded:
                continue
            batch.append(item)
            taken[request] = taken.get(request, 0) + 1
            real, lo, hi = real + n, new_lo, new_hi
        chosen = {id(item) for item in batch}
        for request, count in taken.items():
            request.items = deque(item for item in request.items if id(item) not in chosen)
            self._queued -= count
            request.attained += hi * count  # its share of the padded batch
            request.waiting_since = now
            if not request.items:
                self._pending.remove(request)
        return batch

    async def _execute(self, batch: list[_Item]) -> None:
        loop = asyncio.get_running_loop()
        tokens = [item.tokens for item in batch]
        self._busy = True
        self._running, self._running_items = loop.create_future(), frozenset(id(item) for item in batch)
        submitted = time.perf_counter()
        try:
            vectors, start, finished = await loop.run_in_executor(self.executor, self._timed_run, tokens)
        except Exception as exc:  # a failed batch fails its requests, never the worker
            self._waited(batch, submitted)
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self._busy = False
            self._running.set_result(None)
            self._running, self._running_items = None, frozenset()
        self._waited(batch, start)
        seconds = finished - start
        padded = max(len(t) for t in tokens) * len(tokens)
        self.cost.observe(padded, seconds)
        self.observer.batch_done(
            size=len(batch), tokens=sum(len(t) for t in tokens), padded_tokens=padded, seconds=seconds
        )
        self._batches += 1
        for item, row in zip(batch, vectors):
            item.finished, item.batch, item.batch_size = finished, self._batches, len(batch)
            if not item.future.done():
                item.future.set_result(row)

    def _timed_run(self, tokens: list[Sequence[int]]) -> tuple[np.ndarray, float, float]:
        """``run_batch`` with its start and end, timed on the inference thread: when that thread is shared
        (one batcher per model), a batch's wait for it is queueing, not compute, and must not reach the
        cost model."""
        start = time.perf_counter()
        vectors = self.run_batch(tokens)
        return vectors, start, time.perf_counter()

    def _waited(self, batch: list[_Item], start: float) -> None:
        for item in batch:
            item.started = start
            self.observer.queue_wait(start - item.enqueued, item.priority)
