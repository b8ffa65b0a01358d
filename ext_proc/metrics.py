"""ext_proc's Prometheus metrics (prefix ``inferlb_ext_proc_``).

Per-request events (decisions, fallbacks, parse failures, observations) are
counters bumped on the hot path. Figures that are state rather than events
(outstanding work per endpoint, the cost model's error, the xDS connection)
are read at scrape time by a collector from a callable the server supplies,
so an endpoint that leaves the fleet takes its series with it, and the hot
path never updates a gauge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

PREFIX = "inferlb_ext_proc_"
# A decision is tens of microseconds; a slow one (a huge body tokenised in a thread) tens of ms.
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Why a request went without a pick, or with a weaker one (label ``reason``).
FALLBACK_REASONS = (
    "no_view",  # no EDS yet: Envoy's weighted fallback routes it
    "no_endpoint",  # EDS has no routable endpoint: 503
    "no_decision",  # the policy returned nothing
    "policy_error",  # the policy raised
    "estimated_tokens",  # the body was not understood: a byte-based estimate was used
)


@dataclass(frozen=True)
class EndpointLoad:
    """What this ext_proc has in flight on one endpoint."""

    requests: int = 0
    tokens: int = 0
    seconds: float = 0.0  # predicted work


@dataclass(frozen=True)
class LiveState:
    """Everything the collector reads at scrape time."""

    outstanding: Mapping[str, EndpointLoad] = field(default_factory=dict)
    mape: float | None = None  # the cost model's mean absolute percentage error (a fraction)
    mape_by_endpoint: Mapping[str, float] = field(default_factory=dict)
    observations: int = 0
    leaked: int = 0
    xds_connected: bool = False
    view_version: str | None = None
    endpoints: int = 0
    routable: int = 0
    policy: str = ""
    active_streams: int = 0


class _LiveCollector(Collector):
    def __init__(self, state: Callable[[], LiveState]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        s = self._state()
        requests = GaugeMetricFamily(f"{PREFIX}outstanding_requests", "Requests this ext_proc has in flight.",
                                     labels=["endpoint"])
        tokens = GaugeMetricFamily(f"{PREFIX}outstanding_tokens", "Tokens this ext_proc has in flight.",
                                   labels=["endpoint"])
        seconds = GaugeMetricFamily(f"{PREFIX}outstanding_seconds",
                                    "Predicted service seconds this ext_proc has in flight.", labels=["endpoint"])
        for endpoint, load in sorted(s.outstanding.items()):
            requests.add_metric([endpoint], load.requests)
            tokens.add_metric([endpoint], load.tokens)
            seconds.add_metric([endpoint], load.seconds)
        yield from (requests, tokens, seconds)
        yield GaugeMetricFamily(f"{PREFIX}outstanding_requests_total", "Requests in flight, all endpoints.",
                                value=sum(load.requests for load in s.outstanding.values()))
        if s.mape is not None:
            yield GaugeMetricFamily(f"{PREFIX}prediction_mape",
                                    "Mean absolute percentage error of predicted service time over recent "
                                    "responses (a fraction).", value=s.mape)
        per_endpoint = GaugeMetricFamily(f"{PREFIX}endpoint_prediction_mape",
                                         "The same error, per endpoint (a fraction).", labels=["endpoint"])
        for endpoint, value in sorted(s.mape_by_endpoint.items()):
            per_endpoint.add_metric([endpoint], value)
        yield per_endpoint
        yield GaugeMetricFamily(f"{PREFIX}cost_observations", "Responses the cost model has learnt from.",
                                value=s.observations)
        yield GaugeMetricFamily(f"{PREFIX}outstanding_leaked",
                                "Outstanding entries dropped by the age safety net (should stay 0).",
                                value=s.leaked)
        yield GaugeMetricFamily(f"{PREFIX}xds_connected", "1 while the ADS stream to the control plane is up.",
                                value=int(s.xds_connected))
        yield GaugeMetricFamily(f"{PREFIX}ready", "1 once the first EDS view arrived.",
                                value=int(s.view_version is not None))
        yield GaugeMetricFamily(f"{PREFIX}endpoints", "Endpoints in the current view.", value=s.endpoints)
        yield GaugeMetricFamily(f"{PREFIX}routable_endpoints", "Healthy, not draining endpoints in the view.",
                                value=s.routable)
        policy = GaugeMetricFamily(f"{PREFIX}pick_policy", "The active pick policy (value 1).", labels=["policy"])
        policy.add_metric([s.policy], 1)
        yield policy
        yield GaugeMetricFamily(f"{PREFIX}active_streams", "ext_proc streams (HTTP requests) open now.",
                                value=s.active_streams)


class ExtProcMetrics:
    """Counters and histograms on the hot path, plus the live collector; one registry per instance."""

    def __init__(self, live: Callable[[], LiveState] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self._children: dict[tuple[str, ...], Any] = {}
        ProcessCollector(registry=r)
        if live is not None:
            r.register(_LiveCollector(live))
        self.decisions = Counter(f"{PREFIX}decisions", "Picks made, by policy and primary endpoint.",
                                 ["policy", "endpoint"], registry=r)
        self.decision_seconds = Histogram(f"{PREFIX}decision_seconds",
                                          "From the message that completes a request (body or headers) to the "
                                          "answer: token counting, prediction and picking.",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.fallbacks = Counter(f"{PREFIX}fallbacks", "Requests without a (full) decision, by reason.",
                                 ["reason"], registry=r)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        self.parse_failures = Counter(f"{PREFIX}parse_failures", "Inputs that could not be parsed, by what.",
                                      ["what"], registry=r)
        for what in ("request_body", "server_timing", "orca", "tokens_header"):
            self.parse_failures.labels(what=what)
        self.responses = Counter(f"{PREFIX}responses", "Upstream responses seen, by status class.",
                                    ["code"], registry=r)
        self.released = Counter(f"{PREFIX}released",
                                "Outstanding entries released: at the response, early (the stream was cancelled "
                                "or closed first: client gone, upstream reset) or on an error.",
                                ["how"], registry=r)
        for how in ("response", "early", "error"):
            self.released.labels(how=how)
        self.xds_updates = Counter(f"{PREFIX}xds_updates", "EDS responses, by result.", ["result"], registry=r)
        self.xds_connects = Counter(f"{PREFIX}xds_connects", "ADS streams established.", registry=r)
        self.policy_switches = Counter(f"{PREFIX}policy_switches", "Pick-policy changes, by result.",
                                       ["result"], registry=r)

    # Hot-path shortcuts: a labelled child is looked up once, then cached (``labels()`` costs microseconds).
    def decision(self, policy: str, endpoint: str, seconds: float) -> None:
        child = self._children.get(("d", policy, endpoint))
        if child is None:
            child = self._children[("d", policy, endpoint)] = self.decisions.labels(policy=policy, endpoint=endpoint)
        child.inc()
        self.decision_seconds.observe(seconds)

    def count(self, counter: str, label: str) -> None:
        """``counter``: "fallbacks", "parse_failures", "responses" or "released"; ``label``: its one label's value."""
        key = (counter, label)
        child = self._children.get(key)
        if child is None:
            metric = {"fallbacks": self.fallbacks, "parse_failures": self.parse_failures,
                      "responses": self.responses, "released": self.released}[counter]
            child = self._children[key] = metric.labels(label)
        child.inc()

    def forget_endpoints(self, keep: set[str]) -> None:
        """Drop the cached children of endpoints that left (their series stay until restart: counters)."""
        for key in [k for k in self._children if k[0] == "d" and k[2] not in keep]:
            del self._children[key]

    # XdsObserver
    def xds_connected(self, connected: bool) -> None:
        if connected:
            self.xds_connects.inc()

    def xds_update(self, accepted: bool) -> None:
        self.xds_updates.labels(result="accepted" if accepted else "rejected").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def create_http_app(metrics: ExtProcMetrics, ready: Callable[[], str | None]) -> Starlette:
    """``/metrics``, ``/healthz`` (the process is up) and ``/readyz`` (200 once the first EDS view arrived;
    ``ready`` returns None when ready, else the reason)."""

    async def metrics_route(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        reason = ready()
        if reason is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    return Starlette(routes=[Route("/metrics", metrics_route), Route("/healthz", healthz), Route("/readyz", readyz)])
