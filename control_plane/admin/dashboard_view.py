"""The dashboard's data: pure functions from what the control plane holds to the JSON the page renders.

Two sources, both already in the control plane:

- the admin API's own views (``EndpointList``, ``XdsClients``, ``PolicyState``,
  ``ModelCatalogueOut``): each endpoint's state, weights and the smoothed
  telemetry the scraper derives from the workers' ``/metrics``;
- the ext_proc replicas' ``/metrics`` (the gateway's view), read at the
  address their xDS stream names: picks per endpoint
  (``inferlb_ext_proc_decisions_total``), what became of each tenant's
  requests (``inferlb_ext_proc_tenant_requests_total{outcome}``: served,
  failed, rate_limited, shed, unauthenticated), the time from a pick to the
  response headers (``inferlb_ext_proc_model_response_seconds``) and the
  gateway cache (``inferlb_ext_proc_cache_requests_total``).

Counters become rates between two reads of the same replica, as Prometheus'
``rate()`` would; a replica that restarted in between (a new start time, or a
counter that went down) sits that interval out rather than count negative.
Every mapping read from a replica is capped: its ``/metrics`` is untrusted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric

from ..api_models import EndpointList, EndpointOut, ModelCatalogueOut, PolicyState, XdsClients
from ..telemetry.parse import histogram_quantile

DECISIONS = "inferlb_ext_proc_decisions"
TENANT_REQUESTS = "inferlb_ext_proc_tenant_requests"
RESPONSE_SECONDS = "inferlb_ext_proc_model_response_seconds"
CACHE_REQUESTS = "inferlb_ext_proc_cache_requests"
START_TIME = "process_start_time_seconds"
OUTCOMES = ("served", "failed", "rate_limited", "shed", "unauthenticated")

MAX_POINTS = 300  # the history the page gets: five minutes at one point a second
MAX_KEYS = 4096  # labelled series kept per family and replica; more means the body is not a sane ext_proc's
MAX_TENANTS_SHOWN = 50  # the busiest ones; the rest are summed as "(others)"


# --- one replica's counters ------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayCounters:
    """One ext_proc replica's cumulative counters, as far as the dashboard needs them."""

    started_at: float | None
    picks: Mapping[str, float] = field(default_factory=dict)  # endpoint id -> decisions, all policies
    tenants: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (tenant, outcome) -> requests
    response_buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count), all models summed
    cache: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (level, result) -> requests

    def counters(self) -> Iterable[float]:
        yield from self.picks.values()
        yield from self.tenants.values()
        yield from (c for _, c in self.response_buckets)
        yield from self.cache.values()


def _add(into: dict[Any, float], key: Any, value: float) -> None:
    if math.isfinite(value) and value >= 0 and (key in into or len(into) < MAX_KEYS):
        into[key] = into.get(key, 0.0) + value


def gateway_counters(families: Mapping[str, Metric]) -> GatewayCounters | None:
    """The counters in one replica's parsed ``/metrics``; None when it has no decisions (not an ext_proc)."""
    if DECISIONS not in families:
        return None
    picks: dict[str, float] = {}
    for s in families[DECISIONS].samples:
        if s.name == DECISIONS + "_total" and "endpoint" in s.labels:
            _add(picks, s.labels["endpoint"], float(s.value))
    tenants: dict[tuple[str, str], float] = {}
    for s in families[TENANT_REQUESTS].samples if TENANT_REQUESTS in families else ():
        if s.name == TENANT_REQUESTS + "_total" and s.labels.get("outcome") in OUTCOMES:
            _add(tenants, (s.labels.get("tenant", ""), s.labels["outcome"]), float(s.value))
    buckets: dict[float, float] = {}
    for s in families[RESPONSE_SECONDS].samples if RESPONSE_SECONDS in families else ():
        if s.name == RESPONSE_SECONDS + "_bucket":
            try:
                bound = float(s.labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(bound):
                _add(buckets, bound, float(s.value))
    cache: dict[tuple[str, str], float] = {}
    for s in families[CACHE_REQUESTS].samples if CACHE_REQUESTS in families else ():
        if s.name == CACHE_REQUESTS + "_total":
            _add(cache, (s.labels.get("level", ""), s.labels.get("result", "")), float(s.value))
    start = families.get(START_TIME)
    started = float(start.samples[0].value) if start is not None and start.samples else math.nan
    return GatewayCounters(started_at=started if math.isfinite(started) else None, picks=picks, tenants=tenants,
                           response_buckets=tuple(sorted(buckets.items())), cache=cache)


# --- rates between two reads -------------------------------------------------------------------------


@dataclass(frozen=True)
class GatewayRates:
    """What every readable replica did between two reads, per second (summed over replicas)."""

    replicas: int  # replicas that counted in this interval
    picks: Mapping[str, float] = field(default_factory=dict)
    tenants: Mapping[tuple[str, str], float] = field(default_factory=dict)
    response_buckets: tuple[tuple[float, float], ...] = ()  # increases, not rates: for the quantiles
    cache: Mapping[tuple[str, str], float] = field(default_factory=dict)

    def outcome(self, outcome: str) -> float:
        return sum(v for (_, o), v in self.tenants.items() if o == outcome)

    @property
    def requests_per_s(self) -> float:
        return sum(self.tenants.values())

    def response_quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.response_buckets)


def restarted(prev: GatewayCounters, cur: GatewayCounters) -> bool:
    """A new process between the reads: another start time, or any counter went down."""
    if prev.started_at is not None and cur.started_at is not None and prev.started_at != cur.started_at:
        return True
    if tuple(b for b, _ in prev.response_buckets) != tuple(b for b, _ in cur.response_buckets) \
            and prev.response_buckets and cur.response_buckets:
        return True
    return any(_delta(prev_map, cur_map) is None for prev_map, cur_map in
               ((prev.picks, cur.picks), (prev.tenants, cur.tenants), (prev.cache, cur.cache),
                (dict(prev.response_buckets), dict(cur.response_buckets))))


def _delta(prev: Mapping[Any, float], cur: Mapping[Any, float]) -> dict[Any, float] | None:
    """Per key, how much it grew (a new key counts from zero); None if one went down (a reset)."""
    out = {}
    for key, value in cur.items():
        grown = value - prev.get(key, 0.0)
        if grown < 0:
            return None
        out[key] = grown
    return out


def gateway_rates(prev: Mapping[str, GatewayCounters], cur: Mapping[str, GatewayCounters],
                  interval_s: float) -> GatewayRates | None:
    """The rates between two reads of the replicas (node id -> counters); None when no replica was read
    both times (first read, no ext_proc, or an interval that is not positive)."""
    if interval_s <= 0:
        return None
    picks: dict[str, float] = {}
    tenants: dict[tuple[str, str], float] = {}
    cache: dict[tuple[str, str], float] = {}
    buckets: dict[float, float] = {}
    counted = 0
    for node, now in cur.items():
        before = prev.get(node)
        if before is None or restarted(before, now):
            continue
        counted += 1
        for into, grown in ((picks, _delta(before.picks, now.picks)), (tenants, _delta(before.tenants, now.tenants)),
                            (cache, _delta(before.cache, now.cache))):
            for key, value in (grown or {}).items():
                into[key] = into.get(key, 0.0) + value / interval_s
        for bound, value in (_delta(dict(before.response_buckets), dict(now.response_buckets)) or {}).items():
            buckets[bound] = buckets.get(bound, 0.0) + value
    if not counted:
        return None
    return GatewayRates(replicas=counted, picks=picks, tenants=tenants,
                        response_buckets=tuple(sorted(buckets.items())), cache=cache)


# --- the history of the time series ------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One second of the fleet: the time series and the heat map's column. None: not known this interval."""

    seq: int
    t: float  # unix seconds
    served_rps: float  # the workers' own figure (smoothed telemetry), summed
    requests_per_s: float | None  # the gateway's: every outcome
    p50_s: float | None  # the gateway's: pick to response headers, all models
    p99_s: float | None
    worker_p99_s: float | None  # the slowest worker's smoothed p99
    errors_per_s: float | None  # gateway "failed"; without a gateway: the workers' 5xx and 429
    sheds_per_s: float | None  # gateway "shed" (an admit plugin refused a sheddable request)
    rate_limited_per_s: float | None
    picks: Mapping[str, float]  # endpoint id -> picks/s (gateway), or served rps (workers) without one
    picks_source: str  # "gateway" or "workers"

    def json(self) -> dict[str, Any]:
        return {"seq": self.seq, "t": round(self.t, 3), "served_rps": _round(self.served_rps),
                "requests_per_s": _round(self.requests_per_s), "p50_s": _round(self.p50_s, 6),
                "p99_s": _round(self.p99_s, 6), "worker_p99_s": _round(self.worker_p99_s, 6),
                "errors_per_s": _round(self.errors_per_s), "sheds_per_s": _round(self.sheds_per_s),
                "rate_limited_per_s": _round(self.rate_limited_per_s),
                "picks": {k: _round(v) for k, v in sorted(self.picks.items())}, "picks_source": self.picks_source}


@dataclass(frozen=True)
class History:
    """The last ``MAX_POINTS`` points, oldest first."""

    points: tuple[Point, ...] = ()

    @property
    def next_seq(self) -> int:
        return self.points[-1].seq + 1 if self.points else 1

    def add(self, point: Point, keep: int = MAX_POINTS) -> History:
        return History((*self.points, point)[-keep:])

    def since(self, seq: int) -> tuple[Point, ...]:
        """The points after ``seq`` (what a page that has seen up to ``seq`` lacks)."""
        return tuple(p for p in self.points if p.seq > seq)


def _round(x: float | None, digits: int = 3) -> float | None:
    return round(x, digits) if x is not None and math.isfinite(x) else None


def _telemetry(e: EndpointOut, name: str) -> float | None:
    t = e.telemetry
    return None if t is None or t.stale else getattr(t, name)


def point(seq: int, t: float, endpoints: EndpointList, rates: GatewayRates | None) -> Point:
    """The fleet at ``t``: the gateway's rates where a replica was read twice, the workers' figures always."""
    served = {e.id: _telemetry(e, "rps") or 0.0 for e in endpoints.endpoints}
    p99s = [p for e in endpoints.endpoints if (p := _telemetry(e, "latency_p99_s"))]
    worker_errors = sum((_telemetry(e, "error_rate") or 0.0) * served[e.id] for e in endpoints.endpoints)
    common = {"seq": seq, "t": t, "served_rps": sum(served.values()), "worker_p99_s": max(p99s, default=None)}
    if rates is None:
        return Point(**common, requests_per_s=None, p50_s=None, p99_s=None, errors_per_s=worker_errors,
                     sheds_per_s=None, rate_limited_per_s=None, picks=served, picks_source="workers")
    picks = {e.id: rates.picks.get(e.id, 0.0) for e in endpoints.endpoints}
    return Point(**common, requests_per_s=rates.requests_per_s, p50_s=rates.response_quantile(0.5),
                 p99_s=rates.response_quantile(0.99), errors_per_s=rates.outcome("failed"),
                 sheds_per_s=rates.outcome("shed"), rate_limited_per_s=rates.outcome("rate_limited"),
                 picks=picks, picks_source="gateway")


# --- the snapshot the page renders -------------------------------------------------------------------


def endpoint_state(e: EndpointOut) -> str:
    """One word for the table: removing, draining, unhealthy, stale, healthy or unknown."""
    if e.removing:
        return "removing"
    if e.draining:
        return "draining"
    if e.health == "unhealthy":
        return "unhealthy"
    if e.telemetry is not None and e.telemetry.stale:
        return "stale"
    return e.health


def endpoint_rows(endpoints: EndpointList, pools: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{**e.model_dump(mode="json"), "state": endpoint_state(e), "pool": pools.get(e.id)}
            for e in endpoints.endpoints]


def tenant_rows(rates: GatewayRates | None) -> list[dict[str, Any]]:
    """Requests/s per tenant and outcome, busiest first; past ``MAX_TENANTS_SHOWN`` summed as "(others)"."""
    if rates is None:
        return []
    by_tenant: dict[str, dict[str, float]] = {}
    for (tenant, outcome), value in rates.tenants.items():
        by_tenant.setdefault(tenant, dict.fromkeys(OUTCOMES, 0.0))[outcome] += value
    ordered = sorted(by_tenant.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))
    shown, rest = ordered[:MAX_TENANTS_SHOWN], ordered[MAX_TENANTS_SHOWN:]
    if rest:
        shown.append(("(others)", {o: sum(r[o] for _, r in rest) for o in OUTCOMES}))
    return [{"tenant": tenant, **{o: _round(v) for o, v in row.items()}} for tenant, row in shown]


def cache_rows(rates: GatewayRates | None) -> list[dict[str, Any]]:
    """Per gateway cache level: hits, misses and bypasses per second, and the hit ratio of lookups."""
    if rates is None:
        return []
    levels: dict[str, dict[str, float]] = {}
    for (level, result), value in rates.cache.items():
        levels.setdefault(level, {})[result] = value
    rows = []
    for level, results in sorted(levels.items()):
        hits, misses = results.get("hit", 0.0), results.get("miss", 0.0)
        rows.append({"level": level, **{r: _round(v) for r, v in sorted(results.items())},
                     "hit_ratio": _round(hits / (hits + misses)) if hits + misses > 0 else None})
    return rows


def xds_rows(clients: XdsClients) -> list[dict[str, Any]]:
    """Per connected stream: node, mode and, per type, acked and current versions and NACKs."""
    return [{"node_id": c.node_id, "node_cluster": c.node_cluster, "group": c.group, "mode": c.mode,
             "connected_at": c.connected_at,
             "types": {name: {"acked": t.acked_version, "current": t.current_version, "in_sync": t.in_sync,
                              "nacks": t.nack_count,
                              "last_nack": None if t.last_nack is None else t.last_nack.model_dump(mode="json")}
                       for name, t in sorted(c.types.items())}}
            for c in sorted(clients.clients, key=lambda c: (c.node_cluster, c.node_id, c.stream_id))]


def pools_by_endpoint(models: ModelCatalogueOut | None) -> dict[str, str]:
    return {} if models is None else {e.id: e.pool for m in models.models for e in m.endpoints}


@dataclass(frozen=True)
class GatewayStatus:
    """How the last read of the ext_proc replicas went."""

    replicas: int = 0  # connected ext_proc replicas (xDS streams of ext_proc's node group)
    read: int = 0  # those whose /metrics could be read
    errors: Mapping[str, str] = field(default_factory=dict)  # node id -> why not


@dataclass(frozen=True)
class Sources:
    """Everything one snapshot is built from (the admin API's views and the gateway's rates)."""

    endpoints: EndpointList
    xds: XdsClients
    policy: PolicyState
    models: ModelCatalogueOut | None
    models_error: str | None  # why the models could not be read (the store), or None
    rates: GatewayRates | None
    gateway: GatewayStatus


def snapshot(src: Sources, *, at: float, interval_s: float, viewers: int) -> dict[str, Any]:
    """The page's whole state except the history (sent as points): JSON-ready."""
    return {
        "at": round(at, 3), "interval_s": interval_s, "viewers": viewers,
        "endpoints": endpoint_rows(src.endpoints, pools_by_endpoint(src.models)),
        "xds_clients": xds_rows(src.xds),
        "policy": {"weight": src.policy.weight.model_dump(mode="json"),
                   "pick": src.policy.pick.model_dump(mode="json"),
                   "available": {"weight": [p.name for p in src.policy.available.weight],
                                 "pick": [p.name for p in src.policy.available.pick]}},
        "models": None if src.models is None else src.models.model_dump(mode="json"),
        "models_error": src.models_error,
        "tenants": tenant_rows(src.rates),
        "cache": cache_rows(src.rates),
        "gateway": {"replicas": src.gateway.replicas, "read": src.gateway.read,
                    "errors": dict(sorted(src.gateway.errors.items())),
                    "counted": 0 if src.rates is None else src.rates.replicas},
    }
