"""Simulated inference (``python -m workers --simulate``): a stand-in for machines
this host does not have.

Everything but the model is real: the HTTP API, tokenisation, metrics, the
ORCA header and readiness. The vectors are dummies (deterministic unit
vectors). So one machine can hold a heterogeneous fleet of 8-16 workers, and a
test or a benchmark can slow one down at run time (a noisy neighbour,
throttling).

Requests are served by ``SlotScheduler`` on ``K`` slots (``--sim-slots``), in
the workers' queue order (``workers.queue_order``: class with aging, then
arrival), one request is one job, no batching across requests, and a job of ``n
tokens (all its inputs together, unpadded) takes exactly
``(fixed + per_token * n) / speed`` seconds, with the speed read when the job
starts. That is the queueing model the fleet simulator (``inferlb sim``)
implements, so the two can be checked against each other.

A simulated worker serves model versions like a real one; its versions share
the slots (one machine), and each may cost a multiple of the base
(``--model-cost VERSION=X``), so a benchmark can make a canary slower than the
version it replaces. Each version's dummy vectors differ.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .batcher import BatchCostModel, BatchObserver, DeadlineExceeded, Embedded, Priority, QueueFull
from .queue_order import JobQueue, QueueOrder

log = logging.getLogger("inferlb.worker")

# Fitted to the int8 all-MiniLM-L6-v2 on one core of the development machine
# (a least-squares fit over length-batched and single inputs of the benchmark mix):
# seconds = FIXED + PER_TOKEN * tokens.
DEFAULT_FIXED_S = 0.001
DEFAULT_PER_TOKEN_S = 0.000114


def parse_model_costs(specs: Sequence[str], served: Sequence[str]) -> dict[str, float]:
    """``["v1=2", "v2=0.5,v3=1"]`` -> {"v1": 2.0, ...}; each version must be served here, each scale > 0."""
    costs: dict[str, float] = {}
    for part in (p.strip() for spec in specs for p in spec.split(",")):
        if not part:
            continue
        model, sep, scale = part.rpartition("=")
        try:
            value = float(scale)
        except ValueError:
            value = float("nan")
        if not sep or not model or not value > 0 or value == float("inf"):
            raise ValueError(f"--model-cost {part!r} is not VERSION=SCALE with SCALE > 0")
        if model not in served:
            raise ValueError(f"--model-cost names {model!r}, which this worker does not serve "
                             f"(it serves {', '.join(served)})")
        costs[model] = value
    return costs


def check_fail_rate(fail_rate: float) -> float:
    """A share of requests in [0, 1] (ValueError otherwise)."""
    if not 0.0 <= fail_rate <= 1.0:
        raise ValueError(f"fail rate must be in [0, 1], got {fail_rate}")
    return fail_rate


def parse_speed_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """``"30:0.25,60:1"`` → ((30.0, 0.25), (60.0, 1.0)): at t seconds after start, set speed."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        at, sep, speed = part.partition(":")
        try:
            step = (float(at), float(speed))
        except ValueError:
            raise ValueError(f"speed schedule step {part!r} is not SECONDS:SPEED") from None
        if not sep or step[0] < 0 or step[1] <= 0:
            raise ValueError(f"speed schedule step {part!r} needs SECONDS >= 0 and SPEED > 0")
        steps.append(step)
    return tuple(sorted(steps))


class Simulation:
    """The simulated machine: its speed (settable at run time) and the busy time it has spent."""

    def __init__(
        self,
        *,
        speed: float = 1.0,
        fixed_s: float = DEFAULT_FIXED_S,
        per_token_s: float = DEFAULT_PER_TOKEN_S,
        schedule: Sequence[tuple[float, float]] = (),
        fail_rate: float = 0.0,
    ) -> None:
        if speed <= 0 or fixed_s < 0 or per_token_s < 0:
            raise ValueError("speed must be > 0 and costs >= 0")
        self._speed = speed
        self._fail_rate = check_fail_rate(fail_rate)
        self._random = random.Random()
        self.fixed_s = fixed_s
        self.per_token_s = per_token_s
        self._schedule = list(schedule)
        self._started = time.monotonic()
        self._busy = 0.0
        self._lock = threading.Lock()

    @property
    def speed(self) -> float:
        with self._lock:
            elapsed = time.monotonic() - self._started
            while self._schedule and self._schedule[0][0] <= elapsed:
                self._speed = self._schedule.pop(0)[1]
            return self._speed

    def set_speed(self, speed: float) -> None:
        if not speed > 0:
            raise ValueError(f"speed must be > 0, got {speed}")
        with self._lock:
            self._speed = speed

    @property
    def fail_rate(self) -> float:
        with self._lock:
            return self._fail_rate

    def set_fail_rate(self, fail_rate: float) -> None:
        fail_rate = check_fail_rate(fail_rate)
        with self._lock:
            self._fail_rate = fail_rate

    def fails_now(self) -> bool:
        """A simulated fault (``--sim-fail-rate``): this request is answered 500 at once, before any queue, so
        the worker looks fast while it fails (what a balancer must not reward)."""
        with self._lock:
            return self._fail_rate > 0 and self._random.random() < self._fail_rate

    def batch_seconds(self, padded_tokens: int) -> float:
        return (self.fixed_s + self.per_token_s * padded_tokens) / self.speed

    def add_busy(self, seconds: float) -> None:
        with self._lock:
            self._busy += seconds

    def busy_seconds(self) -> float:
        """Cumulative simulated compute: reported as the worker's CPU time."""
        with self._lock:
            return self._busy


def dummy_vectors(batch: Sequence[Sequence[int]], dimensions: int, model: str = "") -> np.ndarray:
    """Deterministic unit vectors, one per input, seeded by its token ids and the model version."""
    vectors = np.empty((len(batch), dimensions), dtype=np.float32)
    for row, item in enumerate(batch):
        seed = zlib.crc32(np.asarray(item, dtype=np.int64).tobytes(), zlib.crc32(model.encode()))
        v = np.random.default_rng(seed).standard_normal(dimensions)
        vectors[row] = v / np.linalg.norm(v)
    return vectors


class SimulatedEngine:
    """Implements the service's ``EmbeddingEngine`` with a timed wait instead of a model.

    The slot scheduler does not call ``embed``; the service's warm-up still
    builds the engine to check the dimensions, as it does for the real one.
    """

    def __init__(self, simulation: Simulation, dimensions: int = 384) -> None:
        self.simulation = simulation
        self._dimensions = dimensions

    @property
    def dimensions(self) -> int:
        return self._dimensions

    def embed(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        seconds = self.simulation.batch_seconds(max(len(item) for item in batch) * len(batch))
        time.sleep(seconds)  # the simulated compute, on the inference thread
        self.simulation.add_busy(seconds)
        return dummy_vectors(batch, self._dimensions)


@dataclass(eq=False)
class _Job:
    inputs: Sequence[Sequence[int]]
    tokens: int
    future: asyncio.Future[Embedded]
    loop: asyncio.AbstractEventLoop
    enqueued: float
    priority: Priority = Priority.STANDARD
    deadline: float | None = None  # perf_counter seconds
    model: str = ""
    cost_scale: float = 1.0  # the model's cost relative to the simulation's
    taken: bool = False  # a slot is serving it (set under the scheduler's lock)
    finished: asyncio.Future[None] | None = None  # done when its slot is through with it


class SlotScheduler:
    """A queue in the workers' order served on ``slots`` slots; one request is one job of
    ``(fixed + per_token * tokens) / speed``.

    Stands in for the service's ``MicroBatcher`` (same ``start``/``stop``/
    ``embed``/``queued``/``cost``). Each slot is a thread that takes the next
    job (``JobQueue``, under a condition variable) and sleeps until the job's
    end, so the next job starts the moment a slot frees, without a hop through
    the event loop, and service times keep ``time.sleep``'s precision rather
    than the event loop's millisecond timers. ``queued`` counts requests
    waiting for a slot (the ORCA ``queue``); metrics keep their shape (one
    "batch" per job).
    """

    def __init__(self, simulation: Simulation, *, slots: int, observer: BatchObserver,
                 max_queue_items: int = 8192, dimensions: int = 384, order: QueueOrder | None = None,
                 model_costs: Mapping[str, float] | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.simulation = simulation
        self.model_costs = dict(model_costs or {})  # version -> cost scale; 1 when not named
        self.slots = slots
        self.observer = observer
        self.max_queue_items = max_queue_items
        self.dimensions = dimensions
        self.cost = BatchCostModel()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a job was queued, or the slots must stop
        self._jobs: JobQueue[_Job] = JobQueue(order)  # under _lock
        self._stopping = False  # under _lock
        self._threads: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._threads = [threading.Thread(target=self._slot, name=f"sim-slot-{i}", daemon=True)
                         for i in range(self.slots)]
        for thread in self._threads:
            thread.start()

    async def stop(self) -> None:
        """Fail the jobs still waiting, let running ones end (each is one service time), stop the slots."""
        with self._changed:
            waiting = self._jobs.drain()
            self._stopping = True
            self._changed.notify_all()
        for job in waiting:
            self._resolve(job, RuntimeError("worker is shutting down"))
        threads, self._threads = self._threads, []
        await asyncio.to_thread(lambda: [t.join(30) for t in threads])

    @property
    def queued(self) -> int:
        """Jobs submitted and not yet taken by a slot."""
        return len(self._jobs)

    # -- submitting ------------------------------------------------------
    async def embed(self, inputs: Sequence[Sequence[int]], *, model: str = "", priority: Priority = Priority.STANDARD,
                    deadline: float | None = None) -> Embedded:
        """Queue one job for all of ``inputs`` of ``model``; rows come back in input order.

        Jobs start in the workers' queue order (``priority`` with aging, then
        arrival); a job whose ``deadline`` has passed when a slot takes it is
        refused with ``DeadlineExceeded`` and costs no slot time.
        """
        if deadline is not None and deadline <= time.perf_counter():
            self.observer.deadline_missed()
            raise DeadlineExceeded("the request's deadline had passed when it arrived")
        loop = asyncio.get_running_loop()
        job = _Job(inputs, sum(len(i) for i in inputs), loop.create_future(), loop, time.perf_counter(),
                   Priority(priority), deadline, model, self.model_costs.get(model, 1.0),
                   finished=loop.create_future())
        with self._changed:
            if len(self._jobs) >= self.max_queue_items:
                raise QueueFull(f"{len(self._jobs)} requests already queued (limit {self.max_queue_items})")
            self._jobs.push(job, int(job.priority), job.enqueued)
            depth = len(self._jobs)
            self._changed.notify()
        self.observer.queue_depth(depth)
        try:
            return await job.future
        except asyncio.CancelledError:
            # The client left. A queued job is skipped by its slot; a running one ends the request when it
            # ends, so the worker never reports itself idle while a slot is still busy with it.
            job.future.cancel()
            with self._lock:
                taken = job.taken
            if taken and job.finished is not None:
                await asyncio.shield(job.finished)
            raise

    # -- the slots (threads) -----------------------------------------------
    def _slot(self) -> None:
        while True:
            with self._changed:
                while not self._jobs and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                job = self._jobs.take(time.perf_counter())
                job.taken = not job.future.cancelled()
            if not job.taken:
                self._settle(functools.partial(self.observer.inputs_cancelled, len(job.inputs)), job)
                self._settle(self._report_depth, job)  # it left the queue: the gauge must say so
                continue
            if job.deadline is not None and job.deadline <= time.perf_counter():
                self._settle(self.observer.deadline_missed, job)
                self._settle(self._report_depth, job)
                self._resolve(job, DeadlineExceeded("the request's deadline passed while it waited for a slot"))
                continue
            try:
                result = self._serve(job)
            except Exception as exc:  # a failed job fails its request, never the slot
                log.exception("simulated job failed")
                self._resolve(job, exc)
                continue
            self._resolve(job, result)

    def _serve(self, job: _Job) -> tuple[Embedded, float]:
        started = time.perf_counter()
        seconds = self.simulation.batch_seconds(job.tokens) * job.cost_scale  # the speed at the start of the job
        vectors = dummy_vectors(job.inputs, self.dimensions, job.model)
        remaining = started + seconds - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        finished = time.perf_counter()
        self.simulation.add_busy(seconds)
        return Embedded(vectors, queue_s=started - job.enqueued, compute_s=finished - started), seconds

    def _report_depth(self) -> None:
        """The queue depth now (on the event loop): every job that leaves the queue, served or skipped,
        reports it, so the gauge never keeps a depth from before a skipped job left."""
        self.observer.queue_depth(self.queued)

    @staticmethod
    def _settle(call: Callable[[], None], job: _Job) -> None:
        """Run ``call`` on the job's event loop (the observer is not thread-safe)."""
        try:
            job.loop.call_soon_threadsafe(call)
        except RuntimeError:  # the loop is closed
            pass

    def _resolve(self, job: _Job, outcome: tuple[Embedded, float] | BaseException) -> None:
        def settle() -> None:
            if job.finished is not None and not job.finished.done():
                job.finished.set_result(None)
            if isinstance(outcome, BaseException):
                if not job.future.done():
                    job.future.set_exception(outcome)
                return
            embedded, seconds = outcome
            self.cost.observe(job.tokens, seconds)
            self._report_depth()
            self.observer.queue_wait(embedded.queue_s, job.priority)
            self.observer.batch_done(size=len(job.inputs), tokens=job.tokens, padded_tokens=job.tokens,
                                     seconds=embedded.compute_s)
            if not job.future.done():
                job.future.set_result(embedded)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
