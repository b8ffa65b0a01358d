"""Turn one counted request and the current endpoints into a ranked pick.

The picker owns what every policy needs and none should get wrong:

* **Filtering.** Envoy's override_host honours a pick even of a draining or
  unhealthy host, so only ``EndpointInfo.routable`` endpoints may ever be
  candidates. The filtered tuple is cached per input sequence object (the
  xDS view hands the same tuple until EDS changes), so a decision does not
  re-scan a large fleet.
* **Partitioning.** With several ext_proc replicas and a large fleet (at
  least ``MIN_PARTITION`` endpoints each), replica i of R considers only the
  endpoints at positions i, i+R, ... of the id-sorted fleet (deterministic
  subsetting; i and R come from the control plane's list of connected
  replicas in EDS, ``set_partition``). Each replica then sees nearly all the
  work on its endpoints, its own, exactly and at once, where it used to see
  a tenth plus a stale snapshot and herd with the others (simulated, 1,000
  workers x 10 replicas at 80%: p99 432 -> 195 ms). An empty partition (none
  routable) falls back to the whole fleet; one replica never partitions.
* **Candidates.** Only the endpoints the policy samples (``sample``, when
  the policy has it) are costed, so power-of-d stays O(d).
* **Outstanding work** of a candidate, in predicted seconds::

      outstanding_s = ours_s + max(0, foreign) * cost(mean_tokens)
      foreign = reported + replica_factor * (ours_now - ours_then) - ours_now

  ``ours_s`` is the predicted cost of this ext_proc's requests in flight
  there (exact and fresh; a running request counts in full, which errs on
  the safe side when the worker's overheads exceed its compute time).
  ``reported`` is the worker's in-flight count from the fresher snapshot: the
  last ORCA report noted here if it came after the current EDS view, else the
  EDS telemetry key ``inflight`` (the raw gauge); ``ours_then`` is what we had
  in flight there at that snapshot. Everything we began or finished since is
  extrapolated, times ``replica_factor`` (fleet requests/s in telemetry over
  our own decisions/s: about the number of ext_proc replicas): the other
  replicas are assumed to act as we do, so that ten replicas do not all herd
  onto a worker that looked idle half a second ago. With one replica the
  factor is ~1 and this is exact bookkeeping of our own work. Foreign work is
  costed at this ext_proc's mean request size; requests, not queued inputs,
  are the unit because that is what ext_proc counts of its own.
* **Validation.** Ids the policy made up or repeated are dropped; at most a
  primary and two fallbacks are returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from .model import Candidate, EndpointInfo, PickPolicy, RequestView
from .outstanding import Outstanding

ORCA_INFLIGHT_KEY = "named_metrics.inflight"
MAX_RANKED = 3  # a primary and up to two retry fallbacks (Endpoint Picker Protocol)
MAX_REPLICA_FACTOR = 64.0
MIN_PARTITION = 32  # endpoints per replica below which every replica samples the whole fleet


class CostPredictor(Protocol):
    """What the picker needs of the cost model (``ext_proc.cost.CostModel``)."""

    def predict(self, endpoint_id: str, tokens: int, telemetry: Mapping[str, float] | None = None) -> float: ...


@dataclass(frozen=True)
class Decision:
    """A pick: ``ranked[0]`` is the primary, the rest retry fallbacks."""

    ranked: tuple[str, ...]
    predicted_s: float  # this request's predicted service seconds on the primary (pass it to Outstanding.begin)
    policy: str
    completion_s: float = 0.0  # predicted completion on the primary: its outstanding work + predicted_s
    evaluated: int = 0  # candidates costed for this decision

    @property
    def primary(self) -> str:
        return self.ranked[0]


class Picker:
    """Filters, costs and ranks; one per ext_proc process, called on its event loop."""

    def __init__(
        self,
        policy: PickPolicy,
        cost: CostPredictor,
        outstanding: Outstanding,
        *,
        reported_load_key: str = "inflight",
        load_ttl_s: float = 1.0,
        mean_tokens_prior: float = 32.0,
        clock: Callable[[], float] = time.monotonic,
        failure_observer: Callable[[str, str], None] | None = None,
    ) -> None:
        self.cost = cost
        self.failure_observer = failure_observer  # told of contained user-policy failures
        self.outstanding = outstanding
        self.reported_load_key = reported_load_key
        self.load_ttl_s = load_ttl_s
        self._clock = clock
        self._mean_tokens = mean_tokens_prior
        self._seen: Sequence[EndpointInfo] | None = None
        self._routable: Sequence[EndpointInfo] = ()
        # endpoint -> (in-flight after the answered request, ours then, noted at): the last ORCA report
        self._loads: dict[str, tuple[float, int, float]] = {}
        self._eds_at = -1.0  # when the current EDS view (and its telemetry) arrived
        self._ours_at_eds: dict[str, int] = {}  # our requests in flight per endpoint then
        self._decisions = 0  # since the last EDS view
        self._own_rps = 0.0  # this ext_proc's decisions per second (EWMA over EDS intervals)
        self.replica_factor = 1.0  # fleet requests/s over ours: how many of us there are, in effect
        self.partition: tuple[int, int] = (0, 1)  # (our index, replicas): see set_partition
        self.partitioned = False  # whether the current view is narrowed to our partition
        self.set_policy(policy)

    # -- policy ------------------------------------------------------------------------------
    @property
    def policy(self) -> PickPolicy:
        return self._policy

    def set_policy(self, policy: PickPolicy) -> None:
        """Switch policy at run time; the next decision uses it.

        A contained user policy (``ContainedPickPolicy``) without a failure observer gets the picker's.
        """
        if self.failure_observer is not None and getattr(policy, "observer", False) is None:
            policy.observer = self.failure_observer  # type: ignore[attr-defined]
        self._policy = policy
        self._sample = getattr(policy, "sample", None)

    def set_partition(self, index: int, count: int) -> None:
        """Our place among the ext_proc replicas (the control plane's list of them, in EDS).

        With at least ``MIN_PARTITION`` endpoints per replica, replica ``index``
        of ``count`` picks only among the endpoints whose position in the
        id-sorted fleet is ``index`` mod ``count`` (deterministic subsetting):
        then its own in-flight bookkeeping is nearly the whole truth there, instead
        of a tenth of it plus a stale snapshot of the rest. Envoy spreads
        requests evenly over the replicas, so each partition gets its share.
        """
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"partition index {index} of {count}: need 0 <= index < count")
        if (index, count) != self.partition:
            self.partition = (index, count)
            self._seen = None  # re-derive the routable subset on the next decision

    # -- load reports ------------------------------------------------------------------------
    def note_load(self, endpoint_id: str, orca: Mapping[str, float]) -> None:
        """Remember an endpoint's ORCA report (``cost.parse_orca`` of ``endpoint-load-metrics``).

        Called before the answered request is released (as ``server.py`` does):
        the worker took the report while that request still counted, and it is
        finished by the time the next pick reads it, so one is taken off both
        the report and our own count then.
        """
        inflight = orca.get(ORCA_INFLIGHT_KEY)
        if inflight is not None:
            ours = self.outstanding.requests_of(endpoint_id)
            self._loads[endpoint_id] = (max(0.0, inflight - 1.0), max(0, ours - 1), self._clock())

    # -- decisions ---------------------------------------------------------------------------
    def routable(self, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        """The endpoints that may be picked (cached per sequence object)."""
        if endpoints is not self._seen:
            self._seen = endpoints
            self._routable = self._subset(endpoints)
            if self._loads:
                ids = {e.id for e in endpoints}
                for gone in [e for e in self._loads if e not in ids]:
                    del self._loads[gone]
            self._new_view(endpoints)
        return self._routable

    def _subset(self, endpoints: Sequence[EndpointInfo]) -> tuple[EndpointInfo, ...]:
        """The routable endpoints we may pick: our partition of them, or all (small fleet, empty partition)."""
        routable = tuple(e for e in endpoints if e.routable)
        index, count = self.partition
        self.partitioned = False
        if count > 1 and len(endpoints) >= MIN_PARTITION * count:
            ours = set(sorted(e.id for e in endpoints)[index::count])
            mine = tuple(e for e in routable if e.id in ours)
            if mine:
                self.partitioned = True
                return mine
        return routable

    def _new_view(self, endpoints: Sequence[EndpointInfo]) -> None:
        """A new EDS view: its telemetry is a fresh snapshot of every worker's load. Remember what we had
        in flight at that moment (to extrapolate from it) and how large our share of the traffic is."""
        now = self._clock()
        elapsed = now - self._eds_at if self._eds_at >= 0 else 0.0
        if elapsed > 0:
            rate = self._decisions / elapsed
            self._own_rps = rate if self._own_rps <= 0 else self._own_rps + 0.3 * (rate - self._own_rps)
        self._decisions = 0
        self._eds_at = now
        self._ours_at_eds = {e: t.requests for e, t in self.outstanding.snapshot().items()}
        fleet_rps = 0.0
        for e in (self._routable if self.partitioned else endpoints):
            fleet_rps += e.telemetry.get("rps", 0.0)
        own = self._own_rps
        self.replica_factor = min(MAX_REPLICA_FACTOR, fleet_rps / own) if own > 0 and fleet_rps > own else 1.0

    def decide(self, request: RequestView, endpoints: Sequence[EndpointInfo]) -> Decision | None:
        """Rank routable endpoints for ``request``; None when none is routable or the policy ranked none.

        Exceptions from the policy propagate: the caller counts them and lets
        Envoy's weighted fallback route the request.
        """
        routable = self.routable(endpoints)
        if not routable:
            return None
        tokens = request.tokens
        self._mean_tokens += 0.02 * (tokens - self._mean_tokens)
        pool = self._sample(request, routable) if self._sample is not None else routable
        predict = self.cost.predict
        load_of = self.outstanding.load_of
        loads = self._loads
        key = self.reported_load_key
        mean_tokens = int(self._mean_tokens)
        eds_at = self._eds_at
        ours_at_eds = self._ours_at_eds
        factor = self.replica_factor
        self._decisions += 1
        now = -1.0
        candidates: list[Candidate] = []
        for e in pool:
            if not e.routable:  # a policy's sample() must not smuggle one in
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
                    if noted[2] >= eds_at or now - noted[2] <= self.load_ttl_s and key not in telemetry:
                        reported, ours_then = noted[0], noted[1]
            if reported is None:
                reported = telemetry.get(key)
                ours_then = ours_at_eds.get(endpoint_id, 0)
            if reported is not None:
                # everyone's work now ~ the snapshot + what we began since (net), times our replica factor
                foreign = reported + factor * (requests - ours_then) - requests
                if foreign > 0:
                    outstanding_s += foreign * predict(endpoint_id, mean_tokens, telemetry)
            candidates.append(Candidate(e, predict(endpoint_id, tokens, telemetry), outstanding_s, requests,
                                        load.tokens))
        if not candidates:
            return None
        by_id = {c.endpoint.id: c for c in candidates}
        ranked: list[str] = []
        for endpoint_id in self._policy.rank(request, candidates):
            if endpoint_id in by_id and endpoint_id not in ranked:
                ranked.append(endpoint_id)
                if len(ranked) == MAX_RANKED:
                    break
        if not ranked:
            return None
        primary = by_id[ranked[0]]
        return Decision(tuple(ranked), primary.predicted_cost_s, self._policy.name,
                        primary.predicted_completion_s, len(candidates))
