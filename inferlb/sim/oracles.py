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

Limits: the cost model must hold still, so the oracles do not run in the slowdown run (a speed change would
make their backlog wrong); with a class mix the workers reorder their own queues by class, so the backlog
is exact only for the last request in line (the bound is then approximate). They never shed.
"""

from __future__ import annotations

import heapq
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

    def pick(self, request: int, tokens: int, now: float) -> int:
        start = np.maximum(self._free, now)
        work = self._fleet.work_s(tokens)
        if self._clairvoyant:
            finish = start + work / self._speed  # the engine's service_s, elementwise: the same floats
            best = int(finish.argmin())  # first minimum: the lowest index on a tie
        else:
            first = start.min()
            tied = np.flatnonzero(start == first)
            best = int(tied[self._speed[tied].argmax()]) if tied.size > 1 else int(tied[0])
        slots = self._slots[best]
        begin = slots[0] if slots[0] > now else now
        heapq.heapreplace(slots, begin + self._fleet.service_s(self._fleet.workers[best], tokens))
        self._free[best] = slots[0]
        return best

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()
