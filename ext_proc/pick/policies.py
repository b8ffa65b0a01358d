"""The built-in plugins of the pick chain; the named policies are configurations of them
(``inferlb_runtime/pick_chain.py``: ``least_completion_time`` is ``sample(d=4)`` then the
``completion_time`` scorer then the ``max_score`` picker).

``completion_time`` (the default's scorer) judges a candidate by::

    completion = (outstanding_s + predicted_cost_s) / weight ** weight_exponent

i.e. predicted completion time (the work already queued there plus this
request's own cost), and scores it ``best / completion`` (1 for the best).
By default (``weight_exponent: 0``) the weight is not in the score: the cost
model already learns each endpoint's speed from its own timings, and the
capacity weights grow roughly with speed squared, so dividing by them (and
sampling by them) counted speed two or three times and starved slow workers
of work they could do (simulated, 8 workers at 80%: p99 342 -> 217 ms,
goodput 151 -> 162/s). ``weight_exponent: 1`` reads an endpoint of weight
200 as draining work twice as fast as one of weight 100, which lets operator
pins and the control plane's CPU view steer ext_proc's picks too.

Power-of-d (``sample``): with more than ``d`` candidates left by the
filters, ``d`` distinct ones are sampled (uniformly by default; ``weighted``
samples proportionally to weight) and only they are costed and scored. d
defaults to 4, not 2: the outstanding work ext_proc knows of its own requests
is exact and fresh, so more choices keep improving the pick while each costs
~2 µs; with several ext_procs and stale reports of each other's work, random
sampling still keeps them from herding onto one endpoint that only looks
idle (simulated, 1,000 workers, 10 replicas, before large fleets were
partitioned among replicas: d = 2 p99 761 ms, d = 3 483, d = 4 417, d = 8
353). The sample keeps the favourites of scorers that have them (a sticky
session's worker).

``routable`` and ``Partition`` head every chain; see their docstrings.
"""

from __future__ import annotations

import bisect
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence

from inferlb_runtime.pick_chain import (CompletionTimeParams, InOrderParams, MaxScoreParams, RotateParams,
                                        SampleParams, ShedParams)
from inferlb_runtime.request_class import Priority

from ..model import Candidate, Decision, EndpointView, Reply, RequestView
from .catalogue import ModelCatalogue
from .failing_filter import FailingFilter
from .model_filter import ModelFilter
from .offered_work import OfferedWork
from .slow_start import SlowStart

MIN_PARTITION = 32  # endpoints per replica below which every replica samples the whole fleet


# --- the head of every chain ---------------------------------------------------------------------------
# The router runs these once per EDS view (their answer is the same until EDS changes), before any
# configured filter.


def routable(fleet: Sequence[EndpointView]) -> tuple[EndpointView, ...]:
    """Only endpoints that are healthy and not draining: Envoy's override_host honours a pick even of a
    draining or unhealthy host, so nothing else may ever be a candidate."""
    return tuple(e for e in fleet if e.routable)


class Partition:
    """This replica's share of a large fleet (deterministic subsetting).

    With several ext_proc replicas and at least ``MIN_PARTITION`` endpoints
    each, replica i of R considers only the endpoints at positions i, i+R, ...
    of the id-sorted fleet (i and R come from the control plane's list of
    connected replicas in EDS: ``set_partition``). Each replica then sees
    nearly all the work on its endpoints, its own, exactly and at once, where
    it used to see a tenth plus a stale snapshot and herd with the others
    (simulated, 1,000 workers x 10 replicas at 80%: p99 432 -> 195 ms). An
    empty partition (none routable) falls back to all; one replica never
    partitions.
    """

    def __init__(self) -> None:
        self.partition: tuple[int, int] = (0, 1)  # (our index, replicas)
        self.partitioned = False  # whether the current candidates are narrowed to our partition

    def set_partition(self, index: int, count: int) -> None:
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"partition index {index} of {count}: need 0 <= index < count")
        self.partition = (index, count)

    def narrow(self, fleet: Sequence[EndpointView], candidates: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """Our partition of ``candidates`` (the routable part of ``fleet``, whose id order defines it)."""
        index, count = self.partition
        self.partitioned = False
        if count > 1 and len(fleet) >= MIN_PARTITION * count:
            ours = set(sorted(e.id for e in fleet)[index::count])
            mine = tuple(e for e in candidates if e.id in ours)
            if mine:
                self.partitioned = True
                return mine
        return candidates


# --- filters ------------------------------------------------------------------------------------------


class Rotate:
    """Round robin: the next ``width`` endpoints in EDS order, starting one further each time."""

    name = "rotate"
    kind = "filter"
    Params = RotateParams

    def __init__(self, params: RotateParams = RotateParams()) -> None:
        self.params = params
        self._cursor = 0

    def filter(self, request: RequestView, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        n = len(endpoints)
        if not n:
            return endpoints
        start = self._cursor % n
        self._cursor = start + 1
        return [endpoints[(start + i) % n] for i in range(min(n, self.params.width))]


# --- sampling -----------------------------------------------------------------------------------------


class Sampler:
    """d distinct endpoints, uniformly or proportionally to weight, in O(d log n), plus the favourites.

    The cumulative weights are rebuilt only when a different sequence object
    comes in (the filters pass the same tuple until EDS changes).
    """

    def __init__(self, params: SampleParams, rng: random.Random) -> None:
        self.params = params
        self._rng = rng
        self._seq: Sequence[EndpointView] | None = None
        self._cum: list[float] = []
        self._total = 0.0

    def sample(self, endpoints: Sequence[EndpointView], keep: Iterable[EndpointView] = ()) -> Sequence[EndpointView]:
        d = self.params.d
        n = len(endpoints)
        if d == 0 or n <= d:
            return endpoints
        weighted = self.params.weighted
        if weighted and endpoints is not self._seq:
            self._seq = endpoints
            acc = 0.0
            cum = []
            for e in endpoints:
                acc += e.weight if e.weight > 0 else 0.0
                cum.append(acc)
            self._cum, self._total = cum, acc
        rng = self._rng
        use_weights = weighted and self._total > 0.0
        chosen: list[int] = []
        for _ in range(8 * d):  # collisions are rare; the cap bounds pathological weight skews
            if use_weights:
                i = bisect.bisect_right(self._cum, rng.random() * self._total)
                if i >= n:
                    i = n - 1
            else:
                i = rng.randrange(n)
            if i not in chosen:
                chosen.append(i)
                if len(chosen) == d:
                    break
        pool = [endpoints[i] for i in chosen]
        if keep:
            ids = {e.id for e in pool}
            for e in keep:
                if e.id not in ids:
                    ids.add(e.id)
                    pool.append(e)
        return pool


# --- admit ------------------------------------------------------------------------------------------


class Shed:
    """Sheds a ``sheddable`` request when even its best candidate is predicted to finish after the SLO.

    Judged per request, by the request's own predicted completion, so a short sheddable request still goes
    through where a long one would not, and the fleet's queues stop growing at about the SLO rather than
    without bound. Critical and standard requests are never shed here: when the fleet is short, they keep
    its capacity (the workers serve them first by class). The 429 is answered by ext_proc at once: the
    request never costs a worker anything.

    The prediction (``queue_model``): with ``fifo``, the work queued there plus its cost. With
    ``priority`` (the default), the workers' class order is counted: the critical and standard requests
    that arrive while it waits are served first, so its time there ``B + c`` (queued work and its own
    cost) is stretched to ``(B + c) / (1 - rho)``, ``rho`` the utilisation those classes offer that
    endpoint (``pick/offered_work.py``: the predicted seconds this ext_proc routed there per second, observed
    through :meth:`decided`, over the endpoint's slots); at ``rho >= 1`` it would not be served within any SLO. That is the
    preemptive-resume priority queue's response time; the workers do not preempt, so it overstates a
    long request's by ``c * rho / (1 - rho)``, on purpose: a long sheddable request holds a worker
    against every higher-class arrival, and goodput (answers within the SLO) gains one answer for it as
    for a short one. Without it (``fifo``), an admitted sheddable request waited behind every
    higher-class arrival and was served outside the SLO, its capacity spent for nothing: simulated at
    130% of capacity (``scenarios/overload.toml``, six seeds), goodput 81% of capacity with ``fifo`` at
    ``slo_ms`` 250 and 49% at 500 (the SLO), 94% with ``priority`` at 500 (see docs/benchmarks.md).
    """

    name = "shed"
    kind = "admit"
    Params = ShedParams
    clocked = True  # the registry gives it the router's clock (the simulator's, in ``inferlb sim``)

    def __init__(self, params: ShedParams = ShedParams(), clock: Callable[[], float] = time.monotonic) -> None:
        self.params = params
        self._slo_s = params.slo_ms / 1000
        self._offered = OfferedWork(params.rate_window_s, clock) if params.queue_model == "priority" else None

    def admit(self, request: RequestView, candidates: Sequence[Candidate]) -> Reply | None:
        if request.priority is not Priority.SHEDDABLE or not candidates:
            return None
        offered = self._offered
        if offered is None:
            best = min(c.outstanding_s + c.predicted_cost_s for c in candidates)
        else:
            best = math.inf
            for c in candidates:
                free = 1.0 - offered.rate(c.endpoint.id) / c.endpoint.slots  # its slots share the work
                if free > 0.0:
                    best = min(best, (c.outstanding_s + c.predicted_cost_s) / free)
        if best <= self._slo_s:
            return None
        if best == math.inf:
            predicted = "predicted to wait while the critical and standard requests keep every candidate busy"
            retry_after = math.ceil(self.params.rate_window_s)
        else:
            predicted = f"predicted to complete in {best * 1000:.0f} ms"
            retry_after = math.ceil(best - self._slo_s)
        return Reply(429, "overloaded",
                     f"the fleet is overloaded: this sheddable request is {predicted}, over the "
                     f"{self.params.slo_ms:g} ms SLO; retry later, or send it as standard or critical "
                     "(header x-gateway-inference-objective)",
                     retry_after_s=max(self.params.retry_after_s, retry_after))

    def decided(self, request: RequestView, decision: Decision) -> None:
        """A request was routed: a higher class's predicted work counts towards its primary's offered load."""
        if self._offered is not None and request.priority is not Priority.SHEDDABLE:
            self._offered.add(decision.ranked[0], decision.predicted_s)

    def new_view(self, routable: Sequence[EndpointView], catalogue: ModelCatalogue) -> None:
        if self._offered is not None:
            self._offered.keep(e.id for e in routable)


# --- scorers ------------------------------------------------------------------------------------------


class CompletionTime:
    """Least predicted completion time (outstanding work + this request's cost) scores 1, the others
    ``best / theirs``; over ``weight ** weight_exponent`` when the exponent is set."""

    name = "completion_time"
    kind = "scorer"
    Params = CompletionTimeParams

    def __init__(self, params: CompletionTimeParams = CompletionTimeParams()) -> None:
        self.params = params

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> list[float]:
        exponent = self.params.weight_exponent
        if exponent:
            times = [(c.outstanding_s + c.predicted_cost_s) / c.endpoint.weight ** exponent if c.endpoint.weight > 0
                     else math.inf for c in candidates]
        else:
            times = [c.outstanding_s + c.predicted_cost_s for c in candidates]
            best = min(times)
            if best > 0.0:  # the common case, inline (this is the default chain's scorer)
                return [best / t for t in times]
        return relative(times)


class OutstandingRequests:
    """Fewest requests this ext_proc has in flight there scores 1."""

    name = "outstanding_requests"
    kind = "scorer"

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> list[float]:
        return relative([c.outstanding_requests + 1.0 for c in candidates])


class OutstandingTokens:
    """Fewest tokens this ext_proc has in flight there scores 1."""

    name = "outstanding_tokens"
    kind = "scorer"

    def score(self, request: RequestView, candidates: Sequence[Candidate]) -> list[float]:
        return relative([c.outstanding_tokens + 1.0 for c in candidates])


def relative(costs: Sequence[float]) -> list[float]:
    """Costs (lower is better, >= 0) as scores in [0, 1]: the least scores 1, the others least / theirs."""
    best = min(costs)
    if best == math.inf:
        return [0.0] * len(costs)
    if best <= 0.0:
        return [1.0 if c <= 0.0 else 0.0 for c in costs]
    return [best / c for c in costs]


# --- pickers ------------------------------------------------------------------------------------------


class MaxScore:
    """The highest total score first, exact ties at random; then up to ``fallbacks`` more."""

    name = "max_score"
    Params = MaxScoreParams

    def __init__(self, params: MaxScoreParams = MaxScoreParams()) -> None:
        self.params = params
        self._rng = random.Random(params.seed)

    def pick(self, request: RequestView, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        rnd = self._rng.random
        ranked = sorted([(-s, rnd(), c.endpoint.id) for c, s in zip(candidates, scores)])
        return [r[2] for r in ranked[: 1 + self.params.fallbacks]]


class InOrder:
    """The candidates as the filters left them (round robin's rotation), then up to ``fallbacks`` more."""

    name = "in_order"
    Params = InOrderParams

    def __init__(self, params: InOrderParams = InOrderParams()) -> None:
        self.params = params

    def pick(self, request: RequestView, candidates: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        return [c.endpoint.id for c in candidates[: 1 + self.params.fallbacks]]


BUILTIN_CLASSES: dict[str, type] = {cls.name: cls for cls in (  # type: ignore[attr-defined]
    Shed, ModelFilter, FailingFilter, SlowStart, Rotate, CompletionTime, OutstandingRequests, OutstandingTokens, MaxScore, InOrder)}
