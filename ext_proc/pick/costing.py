"""Cost the sampled endpoints for one request: its predicted service time there, and the work already there.

**Outstanding work** of a candidate, in predicted seconds::

    outstanding_s = ours_s + max(0, foreign) * cost(mean_tokens)
    foreign = reported + replica_factor * (ours_now - ours_then) - ours_now

``ours_s`` is the predicted cost of this ext_proc's requests in flight there
(exact and fresh; a running request counts in full, which errs on the safe
side when the worker's overheads exceed its compute time). ``reported`` is
the worker's in-flight count: the last ORCA report noted here if it is at
most ``load_ttl_s`` old, else the EDS telemetry key ``inflight`` (the raw
gauge); ``ours_then`` is what we had in flight there at that snapshot.

Why a report wins even over a newer EDS view: the worker takes its report
as it answers, so it and our count at that moment describe the same
instant. The view's gauge was scraped before the view arrived (a scrape,
then the control plane's debounce: 0.1-0.6 s), yet it can only be set
against our count at its arrival. The mismatch reads as foreign work, and
it does not cancel out: a negative estimate is clipped to none, a positive
one is costed at the endpoint's own rate, so it weighs most against the
slow endpoints. Simulated at 80% with one ext_proc, preferring the view
when it was the newer gave p99 94-118 ms on the real-worker fleet (4 seeds)
and 210-217 ms on the default one (2 seeds). Preferring the report gave
86-101 and 197-211 ms, and 2-6% lower p99 with 3 or 4 replicas
(docs/benchmarks.md, "Closing the gap: the worker's own load report").

Everything we began or finished since is extrapolated, times
``replica_factor`` (fleet requests/s in telemetry over our own decisions/s:
about the number of ext_proc replicas): the other replicas are assumed to act
as we do, so that ten replicas do not all herd onto a worker that looked idle
half a second ago. With one replica the factor is ~1 and this is exact
bookkeeping of our own work. Foreign work is costed at this ext_proc's mean
request size; requests, not queued inputs, are the unit because that is what
ext_proc counts of its own.

**Slots.** A worker that runs ``k`` jobs at once (telemetry ``slots``: its
``inferlb_worker_slots`` gauge, 1 when it does not say) serves its outstanding
work ``k`` times as fast, and a request there waits only for the first slot to
free. So the candidate's ``outstanding_s`` is the predicted wait, by
:func:`slot_wait_s`: with ``n`` requests there (ours and foreign) holding
``W`` seconds of work, ``W * max(0, n - k + 1) / (n * k)``, i.e. the
``n - k + 1`` requests' worth of work that must finish before a slot is free,
done ``k`` at a time. ``k = 1`` gives ``W``: the single-slot arithmetic,
unchanged. Without it, 3 requests on a 4-slot worker looked like a queue of
3, and the pick chain sent work to idle single-slot slow workers instead
(simulated multi-slot fleet: p99 2.15x the clairvoyant oracle's; see
docs/benchmarks.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from ..model import Candidate, EndpointView, RequestView
from .outstanding import Outstanding

ORCA_INFLIGHT_KEY = "named_metrics.inflight"
MAX_REPLICA_FACTOR = 64.0


def slot_wait_s(work_s: float, requests: float, slots: float) -> float:
    """Predicted wait for a free slot on a worker with ``slots`` slots and ``requests`` requests holding
    ``work_s`` seconds of work (see the module docstring). Each request is taken as the mean of the work,
    since only the total is known of the foreign ones. ``slots`` <= 1: all of ``work_s``."""
    if slots <= 1.0:
        return work_s
    ahead = requests - slots + 1.0  # requests that must finish before one of the slots is free
    if ahead <= 0.0 or requests <= 0.0:
        return 0.0
    return work_s * ahead / (requests * slots)


class CostPredictor(Protocol):
    """What costing needs of the cost model (``ext_proc.pick.cost.CostModel``)."""

    def predict(self, endpoint_id: str, tokens: int, telemetry: Mapping[str, float] | None = None,
                model: str | None = None) -> float: ...


class Costing:
    """Turns endpoints into :class:`Candidate` s; keeps the load reports and the replica factor."""

    def __init__(self, cost: CostPredictor, outstanding: Outstanding, *, reported_load_key: str = "inflight",
                 load_ttl_s: float = 1.0, mean_tokens_prior: float = 32.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cost = cost
        self.outstanding = outstanding
        self.reported_load_key = reported_load_key
        self.load_ttl_s = load_ttl_s
        self._clock = clock
        self._mean_tokens = mean_tokens_prior
        # endpoint -> (in-flight after the answered request, ours then, noted at): the last ORCA report
        self._loads: dict[str, tuple[float, int, float]] = {}
        self._eds_at = -1.0  # when the current EDS view (and its telemetry) arrived
        self._ours_at_eds: dict[str, int] = {}  # our requests in flight per endpoint then
        self._decisions = 0  # since the last EDS view
        self._own_rps = 0.0  # this ext_proc's decisions per second (EWMA over EDS intervals)
        self.replica_factor = 1.0  # fleet requests/s over ours: how many of us there are, in effect

    def note_load(self, endpoint_id: str, orca: Mapping[str, float]) -> None:
        """Remember an endpoint's ORCA report (``cost.parse_orca`` of ``endpoint-load-metrics``).

        Called before the answered request is released: the worker took the
        report while that request still counted, and it is finished by the
        time the next pick reads it, so one is taken off both the report and
        our own count then.
        """
        inflight = orca.get(ORCA_INFLIGHT_KEY)
        if inflight is not None:
            ours = self.outstanding.requests_of(endpoint_id)
            self._loads[endpoint_id] = (max(0.0, inflight - 1.0), max(0, ours - 1), self._clock())

    def new_view(self, endpoints: Sequence[EndpointView], traffic_from: Sequence[EndpointView]) -> None:
        """A new EDS view: its telemetry is a fresh snapshot of every worker's load. Remember what we had in
        flight at that moment (to extrapolate from it) and how large our share of the traffic is
        (``traffic_from``: the endpoints whose requests/s we share, our partition or the whole fleet)."""
        if self._loads:
            ids = {e.id for e in endpoints}
            for gone in [e for e in self._loads if e not in ids]:
                del self._loads[gone]
        now = self._clock()
        elapsed = now - self._eds_at if self._eds_at >= 0 else 0.0
        if elapsed > 0:
            rate = self._decisions / elapsed
            self._own_rps = rate if self._own_rps <= 0 else self._own_rps + 0.3 * (rate - self._own_rps)
        self._decisions = 0
        self._eds_at = now
        self._ours_at_eds = {e: t.requests for e, t in self.outstanding.snapshot().items()}
        fleet_rps = 0.0
        for e in traffic_from:
            fleet_rps += e.telemetry.get("rps", 0.0)
        own = self._own_rps
        self.replica_factor = min(MAX_REPLICA_FACTOR, fleet_rps / own) if own > 0 and fleet_rps > own else 1.0

    def candidates(self, request: RequestView, pool: Sequence[EndpointView], observe: bool = True) -> list[Candidate]:
        """Every routable endpoint of ``pool``, costed for ``request`` (a plugin cannot smuggle in another).
        ``observe`` False: a look that decides nothing (the shed's screens), so neither the mean request size
        nor our decision rate moves."""
        tokens = request.tokens
        version = request.version  # the model version it runs on, when the model filter chose one
        if observe:
            self._mean_tokens += 0.02 * (tokens - self._mean_tokens)
            self._decisions += 1
        predict = self.cost.predict
        load_of = self.outstanding.load_of
        loads = self._loads
        key = self.reported_load_key
        mean_tokens = int(self._mean_tokens)
        ours_at_eds = self._ours_at_eds
        factor = self.replica_factor
        now = -1.0
        candidates: list[Candidate] = []
        for e in pool:
            if not e.routable:
                continue
            endpoint_id = e.id
            telemetry = e.telemetry
            load = load_of(endpoint_id)
            requests = load.requests
            outstanding_s = load.seconds
            reported = None
            if loads:
                noted = loads.get(endpoint_id)
                if noted is not None:
                    if now < 0:
                        now = self._clock()
                    if now - noted[2] <= self.load_ttl_s:
                        reported, ours_then = noted[0], noted[1]
            if reported is None:
                reported = telemetry.get(key)
                ours_then = ours_at_eds.get(endpoint_id, 0)
            there = float(requests)
            if reported is not None:
                # everyone's work now ~ the snapshot + what we began since (net), times our replica factor
                foreign = reported + factor * (requests - ours_then) - requests
                if foreign > 0:
                    outstanding_s += foreign * predict(endpoint_id, mean_tokens, telemetry)
                    there += foreign
            slots = e.slots
            if slots > 1.0:
                outstanding_s = slot_wait_s(outstanding_s, there, slots)
            candidates.append(Candidate(e, predict(endpoint_id, tokens, telemetry, version), outstanding_s, requests,
                                        load.tokens))
        return candidates
