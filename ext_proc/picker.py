"""Turn one counted request and the current endpoints into a ranked pick.

The picker owns what every policy needs and none should get wrong:

* **Filtering.** Envoy's override_host honours a pick even of a draining or
  unhealthy host, so only ``EndpointInfo.routable`` endpoints may ever be
  candidates. The filtered tuple is cached per input sequence object (the
  xDS view hands the same tuple until EDS changes), so a decision does not
  re-scan a large fleet.
* **Candidates.** Only the endpoints the policy samples (``sample``, when
  the policy has it) are costed, so power-of-d stays O(d).
* **Outstanding work** of a candidate, in predicted seconds::

      outstanding_s = ours_s + max(0, reported_inflight - ours_requests) * cost(mean_tokens)

  ``ours_s`` is the predicted cost of this ext_proc's requests in flight
  there (exact and fresh; a running request counts in full, which errs on
  the safe side when the worker's overheads exceed its compute time). The
  worker's reported in-flight requests (the fresher of the last ORCA report
  noted here and the telemetry key ``inflight``) include ours, so only the
  excess is foreign work (other ext_procs, Envoy's fail-open traffic); it is
  costed at this ext_proc's mean request size. Requests, not queued inputs,
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
        self._loads: dict[str, tuple[float, float]] = {}  # endpoint -> (foreign-inclusive in-flight, noted at)
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

    # -- load reports ------------------------------------------------------------------------
    def note_load(self, endpoint_id: str, orca: Mapping[str, float]) -> None:
        """Remember an endpoint's ORCA report (``cost.parse_orca`` of ``endpoint-load-metrics``).

        The worker takes it while the answered request still counts, and that
        request is finished by the time the next pick reads it: one is taken off.
        """
        inflight = orca.get(ORCA_INFLIGHT_KEY)
        if inflight is not None:
            self._loads[endpoint_id] = (max(0.0, inflight - 1.0), self._clock())

    # -- decisions ---------------------------------------------------------------------------
    def routable(self, endpoints: Sequence[EndpointInfo]) -> Sequence[EndpointInfo]:
        """The endpoints that may be picked (cached per sequence object)."""
        if endpoints is not self._seen:
            self._seen = endpoints
            self._routable = tuple(e for e in endpoints if e.routable)
            if self._loads:
                ids = {e.id for e in endpoints}
                for gone in [e for e in self._loads if e not in ids]:
                    del self._loads[gone]
        return self._routable

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
                    if now - noted[1] <= self.load_ttl_s:
                        reported = noted[0]
            if reported is None:
                reported = telemetry.get(key)
            if reported is not None and reported > requests:
                outstanding_s += (reported - requests) * predict(endpoint_id, mean_tokens, telemetry)
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
