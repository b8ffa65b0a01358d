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
        n = int(send_at.size)
        send = send_at.tolist()
        toks = tokens.tolist()
        prio = priorities.tolist() if priorities is not None else None
        finished = [math.nan] * n
        served_by = [-1] * n
        workers = self.fleet.workers
        service_s = self.fleet.service_s
        balancer = self.balancer
        pick, completed = balancer.pick, balancer.completed
        released = getattr(balancer, "released", None)
        clock = self.clock
        heap = self._heap
        push, pop = heapq.heappush, heapq.heappop
        seq = self._seq
        for first, call in balancer.ticks():
            self.at(first, call)
        started_at = [0.0] * n  # job start (for the busy-time bookkeeping)
        reached = list(send)  # when it reached its worker: its arrival, or when a hold released it
        service = [0.0] * n
        events = 0
        pending = 0  # requests on a worker
        i = 0
        next_arrival = send[0] if n else math.inf
        report_every = max(1, n // 200)
        held = 0

        def dispatch(r: int, a: int, now: float) -> None:
            """Request ``r`` goes to worker ``a``: it starts on a free slot or joins the worker's queue."""
            nonlocal pending
            w = workers[a]
            w.inflight += 1
            pending += 1
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

        while True:
            if heap and heap[0][0] <= next_arrival:
                if i >= n and pending == 0 and held == 0:
                    break
                now, _, kind, a, b = pop(heap)
                if now > until_s:
                    break
                clock.now = now
                events += 1
                if kind == _CALL:
                    again = a(now)
                    if again is not None and again <= until_s:
                        push(heap, (again, next(seq), _CALL, a, None))
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
                if held:
                    for r, a2 in released(now):  # type: ignore[misc]
                        held -= 1
                        served_by[r] = a2
                        if a2 == SHED:
                            finished[r] = now
                        else:
                            dispatch(r, a2, now)
                continue
            if i >= n:  # every request sent and none left on a worker: only ticks remain
                break
            now = next_arrival
            if now > until_s:
                break
            clock.now = now
            events += 1
            t = toks[i]
            a = pick(i, t, now)
            served_by[i] = a
            if a == SHED:  # answered at once, by the balancer
                finished[i] = now
            elif a == HELD:
                held += 1
            else:
                dispatch(i, a, now)
            i += 1
            next_arrival = send[i] if i < n else math.inf
            if progress is not None and i % report_every == 0:
                progress(report_every)
        return Outcome(np.array(finished, dtype=np.float64), np.array(served_by, dtype=np.int64), events,
                       clock.now)
