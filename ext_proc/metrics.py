"""ext_proc's Prometheus metrics (prefix ``inferlb_ext_proc_``).

Per-request events (decisions, the decision-time histogram, fallbacks, parse
failures, responses, releases) are plain integers in dicts bumped on the hot
path (a dict increment, no lock, no label look-up: prometheus_client's
``labels().inc()`` and ``Histogram.observe`` cost microseconds each, several
times per request) and exported as counters and a histogram by a collector at
scrape time; the names, labels and types are what prometheus_client would
have exported. Everything runs on the one event loop, scrapes included.
Figures that are state rather than events (outstanding work per endpoint, the
cost model's error, the xDS connection) are read at scrape time by a
collector from a callable the server supplies, so an endpoint that leaves the
fleet takes its series with it, and the hot path never updates a gauge.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from inferlb_runtime.request_class import Priority

from .admission.rules import size_label
from .pick.outstanding import OutstandingLoad


PREFIX = "inferlb_ext_proc_"
# A decision is tens of microseconds; a slow one (a huge body tokenised in a thread) tens of ms.
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
WAIT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# From the decision to the worker's response headers: the request's whole time at the worker.
RESPONSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STORE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Why a request went without a pick, or with a weaker one (label ``reason``).
FALLBACK_REASONS = (
    "no_view",  # no EDS yet: Envoy's weighted fallback routes it
    "no_endpoint",  # EDS has no routable endpoint: 503
    "no_decision",  # the policy returned nothing
    "policy_error",  # the policy raised
    "estimated_tokens",  # the body was not understood: a byte-based estimate was used
    "body_too_large",  # the body went over max_body_bytes: 413
)


@dataclass(frozen=True)
class LiveState:
    """Everything the collector reads at scrape time."""

    outstanding: Mapping[str, OutstandingLoad] = field(default_factory=dict)
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
    partition: tuple[int, int] = (0, 1)  # (our index, replicas) as the control plane lists them


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
        yield GaugeMetricFamily(f"{PREFIX}outstanding_requests_all_endpoints", "Requests in flight, all endpoints.",
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
        yield GaugeMetricFamily(f"{PREFIX}partition_index", "Our index among the replicas a large fleet is "
                                "partitioned among (0 when not listed).", value=s.partition[0])
        yield GaugeMetricFamily(f"{PREFIX}partition_replicas", "Replicas a large fleet is partitioned among, as "
                                "the control plane lists them (1: not partitioned).", value=s.partition[1])
        policy = GaugeMetricFamily(f"{PREFIX}pick_policy", "The active pick policy (value 1).", labels=["policy"])
        policy.add_metric([s.policy], 1)
        yield policy
        yield GaugeMetricFamily(f"{PREFIX}active_streams", "ext_proc streams (HTTP requests) open now.",
                                value=s.active_streams)


# The hot-path counters: attribute of ExtProcMetrics -> (metric name, help, label, values shown at zero).
_HOT_COUNTERS = {
    "fallbacks": (f"{PREFIX}fallbacks", "Requests without a (full) decision, by reason.", "reason", FALLBACK_REASONS),
    "parse_failures": (f"{PREFIX}parse_failures", "Inputs that could not be parsed, by what.", "what",
                       ("request_body", "request_headers", "server_timing", "orca", "tokens_header")),
    "responses": (f"{PREFIX}responses", "Upstream responses seen, by status class.", "code", ()),
    "served": (f"{PREFIX}served_elsewhere", "Responses served by another endpoint than the primary pick (the "
               "data plane walked down the fallback list, or retried elsewhere), as the data plane reported it.",
               "by", ("fallback",)),
    "released": (f"{PREFIX}released",
                 "Outstanding entries released: at the response, early (the stream was cancelled or closed "
                 "first: client gone, upstream reset) or on an error.", "how", ("response", "early", "error")),
    "admit_replies": (f"{PREFIX}admit_replies", "Requests ext_proc answered itself instead of routing them, by the "
                      "reply's code: overloaded (an admit plugin shed a sheddable request), rate_limit_exceeded "
                      "(over the tenant's quota), quota_unavailable (the quota store unreachable, failing "
                      "closed), or an admit plugin's own code.", "code",
                      ("overloaded", "rate_limit_exceeded", "quota_unavailable")),
    "sheds": (f"{PREFIX}sheds", "Requests answered 429 overloaded, by where they were judged: request_headers "
              "(a sheddable one, before the body: never buffered, no token count), screen (a sheddable one, with "
              "the body, before the fair queue), fair_queue (the turn never came), decision (judged again when "
              "picked) or predicted_wait (refused at once: its predicted wait was past its maximum).", "at",
              ("request_headers", "screen", "fair_queue", "decision", "predicted_wait")),
    "auth_failures": (f"{PREFIX}auth_failures", "Requests refused for their API key (401, or 503 for no_key_table: "
                      "keys required and no key table received yet), by reason.", "reason",
                      ("missing_key", "invalid_key", "no_key_table")),
    "deadlines": (f"{PREFIX}deadline_predictions", "Requests with a deadline, by whether their pick's predicted "
                  "completion meets it (missed: no candidate could).", "predicted", ("met", "missed")),
    "stage_failures": (f"{PREFIX}stage_failures", "Operator request stages skipped for a request because they "
                       "failed (raised, returned something else than a Reply or None, or ran over their time "
                       "budget): the request went on without them.", "stage", ()),
}
MAX_LABELS = 32  # distinct values per hot counter; later ones count as "other" (a plugin names admit codes)
MAX_TENANTS = 1000  # tenants with series of their own; later ones count as "other"
MAX_MODELS = 64  # model versions with series of their own; later ones count as "other"
OTHER_MODEL = "other"  # a request whose version is not one of the catalogue's (or not known)
# What became of a tenant's request (label ``outcome`` of the usage counters).
TENANT_OUTCOMES = ("served", "failed", "rate_limited", "shed", "unauthenticated")
_DECISION_HELP = ("From the message that completes a request (body or headers) to the answer: token counting, "
                  "prediction and picking.")


class _HotCollector(Collector):
    """Exports the hot-path integers of an :class:`ExtProcMetrics` in prometheus_client's shapes."""

    def __init__(self, metrics: "ExtProcMetrics") -> None:
        self._m = metrics

    def collect(self) -> Iterator[Any]:
        m = self._m
        if m.grpc_front:
            front = GaugeMetricFamily(f"{PREFIX}grpc_front", "The gRPC server under ExternalProcessor (value 1): "
                                      "native (gRPC C++) or grpcio (its aio server).", labels=["front"])
            front.add_metric([m.grpc_front], 1)
            yield front
        decisions = CounterMetricFamily(f"{PREFIX}decisions", "Picks made, by policy and primary endpoint.",
                                        labels=["policy", "endpoint"])
        for (policy, endpoint), value in sorted(m.decision_counts.items()):
            decisions.add_metric([policy, endpoint], value)
        yield decisions
        cumulative, buckets = 0, []
        for bound, count in zip(m._bucket_names, m._bucket_counts):
            cumulative += count
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(f"{PREFIX}decision_seconds", _DECISION_HELP, buckets=buckets,
                                    sum_value=m._decision_sum)
        for attr, (name, help_, label, _) in _HOT_COUNTERS.items():
            family = CounterMetricFamily(name, help_, labels=[label])
            for value_label, value in sorted(m.counts[attr].items()):
                family.add_metric([value_label], value)
            yield family
        requests = CounterMetricFamily(f"{PREFIX}tenant_requests", _TENANT_HELP.format("Requests"),
                                       labels=["tenant", "outcome"])
        tokens = CounterMetricFamily(f"{PREFIX}tenant_tokens", _TENANT_HELP.format("Tokens (ext_proc's exact count "
                                     "before routing) of requests"), labels=["tenant", "outcome"])
        for (tenant, outcome), (n, t) in sorted(m.tenant_counts.items()):
            requests.add_metric([tenant, outcome], n)
            tokens.add_metric([tenant, outcome], t)
        yield requests
        yield tokens
        yield from m.model_families()


_TENANT_HELP = ("{} by the API key's tenant (anonymous: no key) and outcome: served (a 2xx answer), failed (an "
                "error answer, or the stream ended first), rate_limited, shed, unauthenticated.")


class ExtProcMetrics:
    """Hot-path counters (plain integers, exported at scrape time), the rarer prometheus_client counters,
    and the live collector; one registry per instance."""

    def __init__(self, live: Callable[[], LiveState] | None = None) -> None:
        # Collectors without names (ours, the process collector) still answer a restricted scrape (``render``).
        self.registry = r = CollectorRegistry(support_collectors_without_names=True)
        ProcessCollector(registry=r)
        if live is not None:
            r.register(_LiveCollector(live))
        self.grpc_front: str | None = None  # set once the gRPC server is up
        # Hot path: decisions by (policy, endpoint), the decision-time histogram, and the one-label counters.
        self.decision_counts: dict[tuple[str, str], int] = {}
        self._bounds = DECISION_BUCKETS
        self._bucket_names = [_le(b) for b in DECISION_BUCKETS] + ["+Inf"]
        self._bucket_counts = [0] * (len(DECISION_BUCKETS) + 1)
        self._decision_sum = 0.0
        self.counts: dict[str, dict[str, int]] = {
            attr: dict.fromkeys(zero, 0) for attr, (_, _, _, zero) in _HOT_COUNTERS.items()}
        # Usage by (tenant, outcome): [requests, tokens].
        self.tenant_counts: dict[tuple[str, str], list[int]] = {}
        self._tenants: set[str] = set()
        # Per model version (a canary against its baseline): decisions, answers by status class, and the time
        # from the decision to the response headers (bucket counts, sum).
        self.model_decision_counts: dict[str, int] = {}
        self.model_request_counts: dict[tuple[str, str], int] = {}
        self.model_response_times: dict[str, tuple[list[int], list[float]]] = {}
        self._models: set[str] = set()  # the model labels in use
        self._response_bucket_names = [_le(b) for b in RESPONSE_BUCKETS] + ["+Inf"]
        r.register(_HotCollector(self))
        # Rare events: prometheus_client metrics, by area (in this order in the exposition).
        self._register_xds_and_policy(r)
        self._register_quota(r)
        self._register_fair_queue(r)
        self._register_failures(r)
        self._register_cache(r)

    def _register_xds_and_policy(self, r: CollectorRegistry) -> None:
        self.xds_updates = Counter(f"{PREFIX}xds_updates", "EDS responses, by result.", ["result"], registry=r)
        self.xds_connects = Counter(f"{PREFIX}xds_connects", "ADS streams established.", registry=r)
        self.policy_switches = Counter(f"{PREFIX}policy_switches", "Pick-policy changes, by result.",
                                       ["result"], registry=r)

    def _register_quota(self, r: CollectorRegistry) -> None:
        self.quota_decisions = Counter(f"{PREFIX}quota_decisions", "Quota checks, by result: admitted, limited "
                                       "(429), failed_open / failed_closed (the quota store unreachable or too "
                                       "slow; the configured failure mode decided).", ["result"], registry=r)
        self.quota_store_errors = Counter(f"{PREFIX}quota_store_errors", "Calls to the shared quota store (Redis) "
                                          "not answered, by operation and why: timeout (slower than the store "
                                          "timeout), error (refused, reset, a Redis error) or backoff (not tried: "
                                          "the store failed moments ago).", ["operation", "reason"], registry=r)
        self.quota_store_seconds = Histogram(f"{PREFIX}quota_store_seconds", "Round trips to the shared quota "
                                             "store (Redis).", buckets=STORE_BUCKETS, registry=r)
        for result in ("admitted", "limited", "failed_open", "failed_closed"):
            self.quota_decisions.labels(result=result)

    def _register_fair_queue(self, r: CollectorRegistry) -> None:
        """Fair admission (ext_proc/admission/gate.py); requests that passed at once are not reported."""
        self.fair_queue_depth = Gauge(f"{PREFIX}fair_queue_depth", "Requests waiting in the fair admission queue, "
                                      "by tenant.", ["tenant"], registry=r)
        self.fair_queue_waits = Histogram(f"{PREFIX}fair_queue_wait_seconds", "Time requests waited in the fair "
                                          "admission queue, by how they left: admitted, timed_out, displaced "
                                          "(evicted from a full queue), cancelled (the client left).", ["how"],
                                          buckets=WAIT_BUCKETS, registry=r)
        self.fair_queue_refusals = Counter(f"{PREFIX}fair_queue_refusals", "Requests refused at the fair queue's "
                                           "door, by reason (queue_full, tenant_full, predicted_wait: its "
                                           "predicted wait was past its maximum, refused at once).", ["reason"],
                                           registry=r)
        self.admission_waits = Histogram(f"{PREFIX}admission_wait_seconds", "Time admitted requests waited at "
                                         "the fair queue, by class and size (tokens: le_64, le_512, le_4096, "
                                         "gt_4096).", ["priority", "size"], buckets=WAIT_BUCKETS, registry=r)
        self.admission_predicted = Counter(f"{PREFIX}admission_predicted_wait_seconds", "The waits predicted "
                                           "for the admitted requests that waited, summed: against "
                                           "admission_wait_seconds_sum, how well the wait is predicted.",
                                           registry=r)

    def _register_failures(self, r: CollectorRegistry) -> None:
        """Contained failures: supervised background tasks, and user plugins of the pick chain (reported
        through the plugin registry's observer)."""
        self.task_failures = Counter(f"{PREFIX}task_failures", "Failures of supervised background tasks, by task "
                                     "(each is logged and retried).", ["task"], registry=r)
        self.policy_failures = Counter(f"{PREFIX}policy_failures",
                                       "User pick-chain plugin calls contained (the chain went on without it, or "
                                       "it was over its time budget), by plugin and reason.", ["policy", "reason"],
                                       registry=r)

    def _register_cache(self, r: CollectorRegistry) -> None:
        """The gateway cache (ext_proc/cache/memory_store.py), by level ("memory"; "redis": the shared level)."""
        self.cache_requests = Counter(f"{PREFIX}cache_requests", "Cacheable requests by cache level and result: "
                                      "hit, miss, bypass (Cache-Control: no-cache: no lookup).", ["level", "result"],
                                      registry=r)
        self.cache_bytes = Gauge(f"{PREFIX}cache_bytes", "Bytes the gateway cache holds, by level.", ["level"],
                                 registry=r)
        self.cache_evictions = Counter(f"{PREFIX}cache_evictions", "Gateway cache entries evicted for room (not "
                                       "expiries), by level.", ["level"], registry=r)

    def cache_levels(self, *levels: str) -> None:
        """Export the cache's series from the start (zero), for the levels configured."""
        for level in levels:
            for result in ("hit", "miss", "bypass"):
                self.cache_requests.labels(level=level, result=result)
            self.cache_bytes.labels(level=level)
            self.cache_evictions.labels(level=level)

    def cache_request(self, level: str, result: str) -> None:
        self.cache_requests.labels(level=level, result=result).inc()

    def cache_state(self, level: str, held_bytes: int, evicted: int) -> None:
        """After a store: what the level holds, and how many entries it evicted for room."""
        self.cache_bytes.labels(level=level).set(held_bytes)
        if evicted:
            self.cache_evictions.labels(level=level).inc(evicted)

    def decision(self, policy: str, endpoint: str, seconds: float) -> None:
        key = (policy, endpoint)
        counts = self.decision_counts
        counts[key] = counts.get(key, 0) + 1
        self._bucket_counts[bisect.bisect_left(self._bounds, seconds)] += 1
        self._decision_sum += seconds

    def _model_label(self, model: str) -> str:
        """``model`` (the servicer passes a catalogue version or "other") unless MAX_MODELS are known already."""
        models = self._models
        if model not in models:
            if len(models) >= MAX_MODELS:
                return OTHER_MODEL
            models.add(model)
        return model

    def model_decision(self, model: str) -> None:
        """A pick for a request that runs on ``model``."""
        model = self._model_label(model)
        self.model_decision_counts[model] = self.model_decision_counts.get(model, 0) + 1

    def model_answer(self, model: str, status: str, seconds: float | None = None) -> None:
        """A request of ``model`` answered with ``status`` (its worker's, or ext_proc's own reply); ``seconds``
        from the decision to the worker's response headers (None: ext_proc answered)."""
        model = self._model_label(model)
        key = (model, f"{status[:1]}xx" if status[:1].isdigit() else "unknown")
        self.model_request_counts[key] = self.model_request_counts.get(key, 0) + 1
        if seconds is not None:
            times = self.model_response_times.get(model)
            if times is None:
                times = self.model_response_times[model] = ([0] * (len(RESPONSE_BUCKETS) + 1), [0.0])
            times[0][bisect.bisect_left(RESPONSE_BUCKETS, seconds)] += 1
            times[1][0] += seconds

    def model_families(self) -> Iterator[Any]:
        """The per-version families (for the hot collector)."""
        decisions = CounterMetricFamily(f"{PREFIX}model_decisions", "Picks made, by the model version the request "
                                        "runs on (other: not one the fleet lists, or none chosen: a bare alias "
                                        "or no model).", labels=["model"])
        for model, value in sorted(self.model_decision_counts.items()):
            decisions.add_metric([model], value)
        yield decisions
        requests = CounterMetricFamily(f"{PREFIX}model_requests", "Requests by model version (the one that "
                                       "served, else the one chosen) and status class (ext_proc's own 404 "
                                       "model_not_found and 503 model_unavailable included).",
                                       labels=["model", "code_class"])
        for (model, code_class), value in sorted(self.model_request_counts.items()):
            requests.add_metric([model, code_class], value)
        yield requests
        seconds = HistogramMetricFamily(f"{PREFIX}model_response_seconds", "From ext_proc's decision to the "
                                        "worker's response headers, by model version.", labels=["model"])
        for model, (counts, total) in sorted(self.model_response_times.items()):
            cumulative, buckets = 0, []
            for bound, count in zip(self._response_bucket_names, counts):
                cumulative += count
                buckets.append((bound, cumulative))
            seconds.add_metric([model], buckets, total[0])
        yield seconds

    def retain_endpoints(self, endpoint_ids: Iterable[str]) -> None:
        """Drop the series of endpoints that left the fleet (on each EDS view), so churn never grows them."""
        keep = set(endpoint_ids)
        for key in [k for k in self.decision_counts if k[1] not in keep]:
            del self.decision_counts[key]

    def count(self, counter: str, label: str) -> None:
        """``counter``: a key of ``_HOT_COUNTERS`` ("fallbacks", "admit_replies", "deadlines", ...); ``label``: its
        one label's value."""
        counts = self.counts[counter]
        if label not in counts and len(counts) >= MAX_LABELS:
            label = "other"
        counts[label] = counts.get(label, 0) + 1

    def tenant_usage(self, tenant: str, outcome: str, tokens: int) -> None:
        """One finished request of ``tenant`` (billing and fairness figures)."""
        if tenant not in self._tenants:
            if len(self._tenants) >= MAX_TENANTS:
                tenant = "other"
            self._tenants.add(tenant)
        counts = self.tenant_counts.get((tenant, outcome))
        if counts is None:
            self.tenant_counts[(tenant, outcome)] = [1, tokens]
        else:
            counts[0] += 1
            counts[1] += tokens

    # XdsObserver
    def xds_connected(self, connected: bool) -> None:
        if connected:
            self.xds_connects.inc()

    def xds_update(self, accepted: bool) -> None:
        self.xds_updates.labels(result="accepted" if accepted else "rejected").inc()

    def policy_failure(self, policy: str, reason: str) -> None:
        self.policy_failures.labels(policy=policy, reason=reason).inc()

    # GateObserver (only requests that wait are reported) and FailureObserver
    def depth(self, tenant: str, queued: int) -> None:
        if queued:
            self.fair_queue_depth.labels(tenant=tenant).set(queued)
        else:
            try:
                self.fair_queue_depth.remove(tenant)
            except KeyError:
                pass

    def left(self, tenant: str, priority: int, how: str, waited_s: float) -> None:
        self.fair_queue_waits.labels(how=how).observe(waited_s)

    def rejected(self, tenant: str, priority: int, reason: str) -> None:
        self.fair_queue_refusals.labels(reason=reason).inc()

    def admission_waited(self, priority: Priority, tokens: int, waited_s: float, predicted_s: float) -> None:
        """An admitted request that waited (a few per second at most: prometheus_client's cost is fine)."""
        self.admission_waits.labels(priority=priority.name.lower(), size=size_label(tokens)).observe(waited_s)
        self.admission_predicted.inc(predicted_s)

    def task_failed(self, task: str) -> None:
        self.task_failures.labels(task=task).inc()

    # QuotaObserver (a quota check is one per request with a quota: prometheus_client's cost is fine there)
    def quota_decision(self, result: str) -> None:
        self.quota_decisions.labels(result=result).inc()

    def quota_store_error(self, operation: str, reason: str) -> None:
        self.quota_store_errors.labels(operation=operation, reason=reason).inc()

    def quota_store_latency(self, seconds: float) -> None:
        self.quota_store_seconds.observe(seconds)

    def render(self, names: Collection[str] = ()) -> bytes:
        """The exposition; only the samples named in ``names`` when there are any. The control plane reads
        four samples of every replica each half second (``replica_activity``): the whole exposition took
        about 2.7 ms on the event loop, in the way of the requests."""
        return generate_latest(self.registry.restricted_registry(names) if names else self.registry)


def _le(bound: float) -> str:
    """A bucket bound as prometheus_client's Histogram writes it (``5e-05``, ``0.001``)."""
    return floatToGoString(bound)


def create_http_app(metrics: ExtProcMetrics, ready: Callable[[], str | None]) -> Starlette:
    """``/metrics``, ``/healthz`` (the process is up) and ``/readyz`` (200 once the first EDS view arrived;
    ``ready`` returns None when ready, else the reason)."""

    async def metrics_route(request: Request) -> Response:
        # name[]=<sample name>, repeated: prometheus_client's own handlers' convention for a partial scrape
        return Response(metrics.render(request.query_params.getlist("name[]")), media_type=CONTENT_TYPE)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        reason = ready()
        if reason is None:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "not ready", "reason": reason}, status_code=503)

    return Starlette(routes=[Route("/metrics", metrics_route), Route("/healthz", healthz), Route("/readyz", readyz)])
