"""The discrete-event loop: a simulated clock, a heap of events, and the trace's arrivals merged in.

Why a hand-rolled loop: at 100k req/s over 10,000 workers the per-event cost
is the whole budget, so events are plain tuples on a ``heapq`` and arrivals
are not pushed at all (the trace is already sorted: the loop takes whichever
comes first, the next arrival or the heap's top). A completion at the same
instant as an arrival is processed first (the slot it frees is free).

A balancer's ``pick`` may answer ``SHED`` instead of a worker: the request is
answered at once (ext_proc's 429) and never reaches a worker. It may also
answer ``HELD``: the request waits in the balancer (ext_proc's fair admission
queue) until a completion frees room, when the balancer's ``released(now)``
hands it back with its worker (or ``SHED``); its latency counts from its
arrival all the same. With ``priorities`` the workers' queues are the workers' ``JobQueue``s (``SimFleet``'s
``queue_order``) and each queued request carries its class.

Event tuples: ``(time, seq, kind, a, b)``; ``seq`` makes ties deterministic.
``kind`` 0 is a job completion (``a`` worker, ``b`` request), 1 a call
(``a`` a callable taking ``now`` and returning the time of its next call or
None).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .fleet import SimFleet

_COMPLETE = 0
_CALL = 1
SHED = -1  # what ``Balancer.pick`` answers for a request it refuses (no worker serves it)
HELD = -2  # what it answers for a request it keeps waiting (only a balancer with ``released``)

Tick = Callable[[float], "float | None"]


class Clock:
    """The simulated time, readable by the real ext_proc classes (they take ``clock=``)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Balancer(Protocol):
    """One data-plane configuration: chooses a worker per request and hears of each response."""

    name: str

    def pick(self, request: int, tokens: int, now: float) -> int:
        """The worker to serve ``request``, or ``SHED``."""
        ...

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        """The response of ``request`` left ``worker``; ``inflight`` is the worker's count including it
        (what its ORCA header says), ``service_s`` its compute seconds (its ``server-timing``)."""
        ...

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        """Periodic work (weight updates, scrapes): (first time, callable)."""
        ...


@dataclass(frozen=True)
class Outcome:
    """Per request (in trace order): completion time (NaN: never completed; a shed request's is when it was
    refused) and the serving worker (``SHED`` when refused)."""

    finished_at: np.ndarray
    worker: np.ndarray
    events: int
    end_s: float


class Engine:
    """Runs one trace through a fleet under one balancer."""

    def __init__(self, fleet: SimFleet, balancer: Balancer, clock: Clock) -> None:
        self.fleet = fleet
        self.balancer = balancer
        self.clock = clock
        self._heap: list[tuple] = []
        self._seq = itertools.count()

    def at(self, when: float, call: Tick) -> None:
        """Schedule ``call(now)`` at ``when``; it may return the time of its next call."""
        heapq.heappush(self._heap, (when, next(self._seq), _CALL, call, None))

    def run(self, send_at: np.ndarray, tokens: np.ndarray, until_s: float,
            progress: Callable[[int], None] | None = None, priorities: np.ndarray | None = None) -> Outcome:
        """Serve every request of the trace; stop at ``until_s`` (later completions count as never).
        ``priorities``: each request's class, for workers whose queues order by class."""
        replay = _Replay.of(send_at, tokens, priorities)
        for first, call in self.balancer.ticks():
            self.at(first, call)
        events = self._replay(replay, until_s, progress)
        return Outcome(np.array(replay.finished, dtype=np.float64), np.array(replay.served_by, dtype=np.int64),
                       events, self.clock.now)

    def _tick(self, call: Tick, now: float, until_s: float) -> None:
        """Run a periodic call and schedule its next one, if it wants one before the end."""
        again = call(now)
        if again is not None and again <= until_s:
            heapq.heappush(self._heap, (again, next(self._seq), _CALL, call, None))

    def _replay(self, replay: _Replay, until_s: float, progress: Callable[[int], None] | None) -> int:
        """The event loop proper; returns how many events it processed. Everything it touches per event is
        bound to a local first and nothing in it is a call it could do without: its speed is the simulator's."""
        send, toks, prio, finished, served_by = replay.send, replay.toks, replay.prio, replay.finished, replay.served_by
        started_at, reached, service = replay.started_at, replay.reached, replay.service
        n = len(send)
        workers, service_s = self.fleet.workers, self.fleet.service_s
        pick, completed = self.balancer.pick, self.balancer.completed
        clock, heap, seq = self.clock, self._heap, self._seq
        push, pop = heapq.heappush, heapq.heappop
        dispatch = _dispatcher(workers, service_s, replay, heap, seq)
        release = _releaser(self.balancer, replay, dispatch)
        events = i = 0  # events processed; the next arrival's index in the trace
        pending = held = 0  # requests on a worker; requests the balancer keeps waiting
        next_arrival = send[0] if n else math.inf
        report_every = max(1, n // 200)
        while True:
            if heap and heap[0][0] <= next_arrival:
                if i >= n and pending == 0 and held == 0:
                    break
                now, _, kind, a, b = pop(heap)
                if now > until_s:
                    break
                clock.now = now
                events += 1
                if kind == _CALL:  # periodic work: rare next to requests, so a call costs nothing
                    self._tick(a, now, until_s)
                    continue
                w = workers[a]
                s = service[b]
                w.busy_done_s += s
                w.running_started_sum -= started_at[b]
                w.running -= 1
                w.completed += 1
                inflight = w.inflight
                w.inflight = inflight - 1
                finished[b] = now
                pending -= 1
                if w.queue:
                    nxt = w.queue.popleft() if prio is None else w.queue.take(now)
                    s2 = service_s(w, toks[nxt])
                    service[nxt] = s2
                    started_at[nxt] = now
                    w.running += 1
                    w.running_started_sum += now
                    w.queue_wait_sum += now - reached[nxt]
                    w.queue_wait_count += 1
                    push(heap, (now + s2, next(seq), _COMPLETE, a, nxt))
                w.duration_sum += now - reached[b]
                w.tokens_total += toks[b]
                w.inputs_total += 1
                completed(b, a, now, s, inflight)
                if held:  # a call only when the balancer holds requests (its fair admission queue)
                    out, placed = release(now)
                    held -= out
                    pending += placed
                continue
            if i >= n:  # every request sent and none left on a worker: only ticks remain
                break
            now = next_arrival
            if now > until_s:
                break
            clock.now = now
            events += 1
            a = pick(i, toks[i], now)
            served_by[i] = a
            if a == SHED:  # answered at once, by the balancer
                finished[i] = now
            elif a == HELD:
                held += 1
            else:
                dispatch(i, a, now)
                pending += 1
            i += 1
            next_arrival = send[i] if i < n else math.inf
            if progress is not None and i % report_every == 0:
                progress(report_every)
        return events


@dataclass
class _Replay:
    """One run's per-request state, in trace order, as plain lists: indexing a list is the cheapest access
    the event loop has, and it makes several per event."""

    send: list[float]
    toks: list[int]
    prio: list[int] | None  # each request's class (None: the workers' queues are FIFO)
    finished: list[float]  # NaN: not (yet) completed
    served_by: list[int]  # the worker, SHED, or -1 before its pick
    started_at: list[float]  # job start (for the busy-time bookkeeping)
    reached: list[float]  # when it reached its worker: its arrival, or when a hold released it
    service: list[float]  # its service seconds, once started

    @classmethod
    def of(cls, send_at: np.ndarray, tokens: np.ndarray, priorities: np.ndarray | None) -> "_Replay":
        """Fresh state for a trace: nothing picked, started or finished yet."""
        n = int(send_at.size)
        send = send_at.tolist()
        prio = priorities.tolist() if priorities is not None else None
        return cls(send, tokens.tolist(), prio, [math.nan] * n, [-1] * n, [0.0] * n, list(send), [0.0] * n)


def _dispatcher(workers: list, service_s: Callable, replay: _Replay, heap: list[tuple],
                seq: "itertools.count[int]") -> Callable[[int, int, float], None]:
    """``dispatch(r, a, now)``: request ``r`` goes to worker ``a``, where it starts on a free slot or joins the
    queue. A closure over the run's lists (as cheap to call as one defined inside the loop's function)."""
    toks, prio, started_at, reached, service = replay.toks, replay.prio, replay.started_at, replay.reached, replay.service
    push = heapq.heappush

    def dispatch(r: int, a: int, now: float) -> None:
        w = workers[a]
        w.inflight += 1
        reached[r] = now
        t = toks[r]
        if w.running < w.slots:
            s = service_s(w, t)
            service[r] = s
            started_at[r] = now
            w.running += 1
            w.running_started_sum += now
            w.queue_wait_count += 1
            push(heap, (now + s, next(seq), _COMPLETE, a, r))
        elif prio is None:
            w.queue.append(r)
        else:
            w.queue.push(r, prio[r], now)

    return dispatch


def _releaser(balancer: Balancer, replay: _Replay,
              dispatch: Callable[[int, int, float], None]) -> Callable[[float], tuple[int, int]]:
    """``release(now)``: what a completion lets the balancer hand back of the requests it held: each goes to
    its worker (or is refused, ``SHED``). Returns how many left the hold and how many of those reached a
    worker, for the loop's counts."""
    released = getattr(balancer, "released", None)
    served_by, finished = replay.served_by, replay.finished

    def release(now: float) -> tuple[int, int]:
        out = placed = 0
        for r, a in released(now):  # type: ignore[misc]
            out += 1
            served_by[r] = a
            if a == SHED:
                finished[r] = now
            else:
                dispatch(r, a, now)
                placed += 1
        return out, placed

    return release
