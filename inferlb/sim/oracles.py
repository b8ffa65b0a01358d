"""Two ideal balancers, the bounds the real ones are measured against (issue 19). Simulator only: no live
balancer can know what they know.

* ``oracle_clairvoyant`` knows each request's exact service time on every worker (the fleet's own cost
  model: tokens, worker speed) and each worker's exact backlog, and sends the request where it *finishes*
  first (the earliest completion; ties to the lowest worker index).
* ``oracle_central_queue`` is one FIFO queue for the whole fleet feeding whichever slot frees first (an idle
  one at once, the fastest idle one when several are; ties to the lowest index): no stale view, never an
  idle slot while a request waits.

Why both: neither bounds the other. The central queue never lets a slot idle but will hand a 256-token
request to a slow worker that happens to free first; the clairvoyant weighs the size but, greedy, commits
each request at arrival and cannot hold a fast slot for a long request still to come.

How they are exact without changing the engine: the engine starts a worker's jobs FIFO on its first free
slot, and a job's service time is fixed when it starts, so a worker's slots free at times that follow from
what was sent to it (list scheduling). Each oracle keeps that per worker (a heap of slot free times) with
the very arithmetic the engine uses, and knows at arrival when every slot frees. A central FIFO queue
hands its head to the first slot to free, whatever comes after, so deciding at arrival where that will be
is the same schedule. The worker's queue then holds exactly the requests the central queue would hand it,
in order.

The slowdown run: a clairvoyant knows the speed schedule too (``expect_slowdown``: which worker, by how
much, from when to when), so a job's time is its work over the speed the worker has when the job starts, as
in the engine; a job starting at the very instant of a speed change may be costed at the other speed (the
engine orders same-time events by insertion). Limits: with a class mix the workers reorder their own queues by class, so the backlog
is exact only for the last request in line (the bound is then approximate). They never shed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import numpy as np

from .engine import Tick
from .fleet import SimFleet

ORACLE_CLAIRVOYANT = "oracle_clairvoyant"
ORACLE_CENTRAL_QUEUE = "oracle_central_queue"
ORACLES = (ORACLE_CLAIRVOYANT, ORACLE_CENTRAL_QUEUE)


def is_oracle(configuration: str) -> bool:
    return configuration in ORACLES


class Oracle:
    """Either oracle: the per-worker slot schedule, and the rule that picks from it."""

    def __init__(self, fleet: SimFleet, name: str) -> None:
        if name not in ORACLES:
            raise ValueError(f"unknown oracle {name!r}; known: {', '.join(ORACLES)}")
        self.name = name
        self._fleet = fleet
        self._slots = [[0.0] * w.slots for w in fleet.workers]  # each worker's slot free times (heaps)
        self._free = np.zeros(len(fleet))  # each worker's earliest free slot
        self._speed = np.array([w.speed for w in fleet.workers], dtype=np.float64)
        self._clairvoyant = name == ORACLE_CLAIRVOYANT
        self._slow: tuple[int, float, float, float] | None = None  # (worker, factor, from_s, until_s)

    def expect_slowdown(self, worker: int, factor: float, from_s: float, until_s: float = math.inf) -> None:
        """Worker ``worker`` runs at ``factor`` times its speed for jobs starting in [from_s, until_s)."""
        self._slow = (worker, factor, from_s, until_s)

    def _speeds(self, start: np.ndarray) -> np.ndarray:
        """Each worker's speed for a job starting at ``start`` (per worker)."""
        if self._slow is None:
            return self._speed
        w, factor, lo, hi = self._slow
        if not lo <= start[w] < hi:
            return self._speed
        speed = self._speed.copy()
        speed[w] = self._speed[w] * factor  # the engine's normal * factor: the same float
        return speed

    def pick(self, request: int, tokens: int, now: float) -> int:
        start = np.maximum(self._free, now)
        speeds = self._speeds(start)
        work = self._fleet.work_s(tokens)
        if self._clairvoyant:
            finish = start + work / speeds  # the engine's service_s, elementwise: the same floats
            best = int(finish.argmin())  # first minimum: the lowest index on a tie
        else:
            first = start.min()
            tied = np.flatnonzero(start == first)
            best = int(tied[speeds[tied].argmax()]) if tied.size > 1 else int(tied[0])
        slots = self._slots[best]
        begin = slots[0] if slots[0] > now else now
        heapq.heapreplace(slots, begin + work / float(speeds[best]))
        self._free[best] = slots[0]
        return best

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()
