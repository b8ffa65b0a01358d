"""The baseline balancers, as Envoy 1.40 and nginx implement them (one load balancer instance each).

What is modelled and from where (Envoy's docs: load_balancers.rst, least_request.proto,
client_side_weighted_round_robin.proto):

* ``envoy_round_robin``: hosts in turn.
* ``envoy_least_request`` with equal weights: ``choice_count`` (2) hosts drawn
  at random, with replacement; the one with fewer active requests wins, the
  first on a tie.
* weighted least_request (unequal weights, as inferlb's control plane sets
  them): an earliest-deadline-first schedule in which a picked host is put
  back with deadline ``now + 1 / weight`` where ``weight = lb_weight /
  (active + 1) ** active_request_bias`` (bias 1.0) read at pick time; a new
  set of weights rebuilds the schedule.
* ``envoy_cswrr_orca``: client-side weighted round robin. Each response's
  ORCA report (the worker's sampled ``cpu_utilization`` and
  ``rps_fractional``) sets that host's weight to ``qps / (utilization +
  eps / qps * error_utilization_penalty)`` (no errors here: ``qps /
  utilization``). Every ``weight_update_period`` the schedule is rebuilt
  from the weights that are past their ``blackout_period`` (counted from the
  host's first report) and younger than ``weight_expiration_period``; hosts
  without such a weight get the mean of those with one (all equal: plain
  round robin). Picks are smooth weighted round robin (EDF) over the weights.
* ``nginx_least_conn``: fewest active connections (one request each, with
  keepalive) over all peers; among the tied ones, round robin.

Not modelled: several Envoy worker threads (each has its own schedule),
slow start, health checking, retries, connection set-up.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .engine import Tick
from .fleet import SimFleet


class RoundRobin:
    name = "envoy_round_robin"

    def __init__(self, fleet: SimFleet, rng: random.Random) -> None:
        self._n = len(fleet)
        self._next = rng.randrange(self._n)  # Envoy starts each schedule at a random host

    def pick(self, request: int, tokens: int, now: float) -> int:
        i = self._next
        self._next = i + 1 if i + 1 < self._n else 0
        return i

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()


class LeastRequest:
    """Envoy's least_request with equal weights: the better of ``choice_count`` random hosts."""

    name = "envoy_least_request"

    def __init__(self, fleet: SimFleet, rng: random.Random, choice_count: int = 2) -> None:
        self._workers = fleet.workers
        self._n = len(fleet)
        self._random = rng.random
        self._choices = choice_count

    def pick(self, request: int, tokens: int, now: float) -> int:
        workers, n, rnd = self._workers, self._n, self._random
        best = int(rnd() * n)
        active = workers[best].inflight
        for _ in range(self._choices - 1):
            j = int(rnd() * n)
            a = workers[j].inflight
            if a < active:
                best, active = j, a
        return best

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()


class _Edf:
    """Envoy's EDF scheduler: pick the earliest deadline, put it back at ``deadline + 1 / weight``."""

    def __init__(self, weights: Sequence[float]) -> None:
        # Deadlines start at 1/weight; the index breaks ties in host order, as Envoy's insertion order does.
        self._heap = [(1.0 / w, i) for i, w in enumerate(weights)]
        heapq.heapify(self._heap)

    def pick_and_add(self, weight_of) -> int:  # type: ignore[no-untyped-def]
        deadline, i = self._heap[0]
        heapq.heapreplace(self._heap, (deadline + 1.0 / weight_of(i), i))
        return i


class WeightedLeastRequest:
    """Envoy's least_request over EDS weights: P2C when they are all equal, dynamic-weight EDF otherwise.

    ``set_weights`` is what an EDS update does (the schedule is rebuilt).
    """

    name = "envoy_weighted_least_request"

    def __init__(self, fleet: SimFleet, rng: random.Random, active_request_bias: float = 1.0) -> None:
        self._workers = fleet.workers
        self._bias = active_request_bias
        self._p2c = LeastRequest(fleet, rng)
        self._weights: list[float] = [1.0] * len(fleet)
        self._edf: _Edf | None = None

    def set_weights(self, weights: Sequence[int]) -> None:
        self._weights = [float(w) for w in weights]
        if min(self._weights) == max(self._weights):
            self._edf = None
        else:
            self._edf = _Edf([self._dynamic(i) for i in range(len(self._weights))])

    def _dynamic(self, i: int) -> float:
        active = self._workers[i].inflight
        if self._bias == 1.0:
            return self._weights[i] / (active + 1)
        return self._weights[i] / (active + 1) ** self._bias

    def pick(self, request: int, tokens: int, now: float) -> int:
        if self._edf is None:
            return self._p2c.pick(request, tokens, now)
        return self._edf.pick_and_add(self._dynamic)

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()


class NginxLeastConn:
    """nginx ``least_conn``: the fewest active connections; ties round robin from a moving cursor."""

    name = "nginx_least_conn"

    def __init__(self, fleet: SimFleet, rng: random.Random) -> None:
        self._workers = fleet.workers
        self._n = len(fleet)
        self._active = np.zeros(self._n, dtype=np.int64)  # mirrors inflight, for a vectorised argmin
        self._cursor = 0

    def pick(self, request: int, tokens: int, now: float) -> int:
        active = self._active
        n = self._n
        if n <= 16:  # small fleets: a plain scan beats numpy's call overhead
            workers = self._workers
            best, low = -1, 1 << 62
            for k in range(n):
                j = (self._cursor + k) % n
                a = workers[j].inflight
                if a < low:
                    best, low = j, a
        else:
            low = active.min()
            tied = np.flatnonzero(active == low)
            k = int(np.searchsorted(tied, self._cursor))
            best = int(tied[k]) if k < tied.size else int(tied[0])
        self._cursor = best + 1 if best + 1 < n else 0
        active[best] += 1
        return best

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        self._active[worker] -= 1

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ()


@dataclass(frozen=True)
class CswrrParams:
    """Envoy's ClientSideWeightedRoundRobin knobs, as the live bench configures it
    (inferlb/bench/stack/dataplanes/envoy_static.py). Envoy's defaults are a 10 s blackout and a 1 s update
    period; the bench shortens both because every run starts on a fresh fleet."""

    blackout_period_s: float = 1.0
    weight_expiration_period_s: float = 180.0
    weight_update_period_s: float = 0.5
    error_utilization_penalty: float = 1.0  # no errors are simulated, so it never applies


class CswrrOrca:
    """Envoy's client_side_weighted_round_robin fed by the workers' per-response ORCA reports."""

    name = "envoy_cswrr_orca"

    def __init__(self, fleet: SimFleet, rng: random.Random, params: CswrrParams | None = None) -> None:
        self.params = params or CswrrParams()
        self._workers = fleet.workers
        n = len(fleet)
        self._weight = [0.0] * n  # from the last report
        self._non_empty_since = [-1.0] * n  # first report of the current streak (blackout start); -1: none
        self._last_update = [-1.0] * n
        self._rr = RoundRobin(fleet, rng)
        self._edf: _Edf | None = None
        self.updates = 0

    def pick(self, request: int, tokens: int, now: float) -> int:
        if self._edf is None:
            return self._rr.pick(request, tokens, now)
        return self._edf.pick_and_add(self._static_weight)

    def _static_weight(self, i: int) -> float:
        return self._effective[i]

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        w = self._workers[worker]
        qps, utilization = w.rps, w.cpu_utilization  # the worker's ORCA header (no errors: eps = 0)
        if qps <= 0.0 or utilization <= 0.0:
            return  # Envoy ignores a report it cannot make a weight of
        self._weight[worker] = qps / utilization
        if self._non_empty_since[worker] < 0:
            self._non_empty_since[worker] = now
        self._last_update[worker] = now

    def update_weights(self, now: float) -> float:
        """The periodic weight update; returns the time of the next one."""
        p = self.params
        valid: list[float] = []
        effective = [0.0] * len(self._weight)
        for i, weight in enumerate(self._weight):
            if self._last_update[i] < 0:
                continue
            if now - self._last_update[i] > p.weight_expiration_period_s:
                self._non_empty_since[i] = -1.0  # expired: a new blackout when reports return
                continue
            if now - self._non_empty_since[i] < p.blackout_period_s:
                continue
            effective[i] = weight
            valid.append(weight)
        if valid:
            mean = sum(valid) / len(valid)
            self._effective = [e if e > 0 else mean for e in effective]
            self._edf = _Edf(self._effective) if min(self._effective) != max(self._effective) else None
        else:
            self._edf = None
        self.updates += 1
        return now + p.weight_update_period_s

    def ticks(self) -> Sequence[tuple[float, Tick]]:
        return ((self.params.weight_update_period_s, self.update_weights),)
