"""The control plane's own Prometheus metrics.

Counters come from the xDS server and the scraper through their observer
protocols. Per-endpoint figures (weights, health) are read from the current
state at scrape time by a collector, so a removed endpoint's series vanish
with it instead of lingering at their last value.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .autoscale import (
    DESIRED_REPLICAS_METRIC,
    ONGOING_REQUESTS_METRIC,
    RAW_DESIRED_REPLICAS_METRIC,
    ROUTABLE_REPLICAS_METRIC,
    AutoscaleSignal,
)
from .model import FleetState, Health
from .type_urls import SHORT_NAMES

# The supervised background tasks (label ``task`` of inferlb_cp_task_failures_total).
SUPERVISED_TASKS = ("publisher", "deregister", "store-follower")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _type(type_url: str) -> str:
    return SHORT_NAMES.get(type_url, type_url.rsplit(".", 1)[-1])


class _EndpointCollector(Collector):
    def __init__(self, state: Callable[[], FleetState]) -> None:
        self._state = state

    def collect(self) -> Iterator[GaugeMetricFamily]:
        weight = GaugeMetricFamily("inferlb_cp_endpoint_weight", "Endpoint weight.", labels=["endpoint", "kind"])
        healthy = GaugeMetricFamily(
            "inferlb_cp_endpoint_healthy", "1 healthy, 0 unhealthy, -1 not scraped yet.", labels=["endpoint"]
        )
        draining = GaugeMetricFamily("inferlb_cp_endpoint_draining", "1 while draining.", labels=["endpoint"])
        for e in self._state().endpoints:
            weight.add_metric([e.id, "effective"], e.effective_weight)
            weight.add_metric([e.id, "computed"], e.computed_weight)
            if e.pinned_weight is not None:
                weight.add_metric([e.id, "pinned"], e.pinned_weight)
            healthy.add_metric([e.id], {Health.HEALTHY: 1, Health.UNHEALTHY: 0}.get(e.health, -1))
            draining.add_metric([e.id], int(e.draining))
        yield from (weight, healthy, draining)


class _AutoscaleCollector(Collector):
    """The autoscaling signal per pool (``autoscale.py``); nothing until the first round computed one."""

    def __init__(self, signals: Callable[[], Mapping[str, AutoscaleSignal]]) -> None:
        self._signals = signals

    def collect(self) -> Iterator[GaugeMetricFamily]:
        signals = self._signals()
        if not signals:
            return
        families = (
            (GaugeMetricFamily(DESIRED_REPLICAS_METRIC, "Workers the pool should have (for an HPA: an External "
                               "metric selected by pool, target AverageValue 1).", labels=["pool"]),
             lambda s: s.desired_replicas),
            (GaugeMetricFamily(RAW_DESIRED_REPLICAS_METRIC, "This round's recommendation before scale-down "
                               "smoothing, per pool.", labels=["pool"]), lambda s: s.raw_desired_replicas),
            (GaugeMetricFamily(ONGOING_REQUESTS_METRIC, "Requests in flight plus queued, all workers of the pool.",
                               labels=["pool"]), lambda s: s.load.ongoing_requests),
            (GaugeMetricFamily(ROUTABLE_REPLICAS_METRIC, "Routable workers of the pool.", labels=["pool"]),
             lambda s: s.load.replicas),
        )
        for family, value in families:
            for pool, signal in sorted(signals.items()):
                family.add_metric([pool], value(signal))
            yield family


class ControlPlaneMetrics:
    """Implements ``XdsMetrics`` (xDS server) and ``ScrapeObserver`` (scraper)."""

    def __init__(self, state: Callable[[], FleetState]) -> None:
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        r.register(_EndpointCollector(state))
        # By area, in this order in the exposition.
        self._register_xds(r)
        self._register_scrapes_and_snapshots(r)
        self._register_policy_and_discovery(r)
        self._register_nginx(r)
        self._register_store_and_tasks(r)

    def _register_xds(self, r: CollectorRegistry) -> None:
        """The xDS server (``XdsMetrics``): pushes, ACKs and NACKs per type, streams, refusals."""
        self.pushes = Counter("inferlb_cp_xds_pushes", "xDS responses sent.", ["type"], registry=r)
        self.push_latency = Histogram(
            "inferlb_cp_xds_push_latency_seconds",
            "From the change (or request) that made a response due until it was sent.",
            ["type"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.acks = Counter("inferlb_cp_xds_acks", "xDS ACKs received.", ["type"], registry=r)
        self.nacks = Counter("inferlb_cp_xds_nacks", "xDS NACKs received.", ["type"], registry=r)
        self.clients = Gauge("inferlb_cp_xds_clients", "Connected xDS streams.", ["mode"], registry=r)
        self.xds_laggards = Gauge(
            "inferlb_cp_xds_laggard_streams",
            "xDS clients (distinct node ids) with a stream that missed the settle deadline and has not answered "
            "its last push since: EDS publishes do not wait for them.", registry=r)
        self.xds_refused = Counter(
            "inferlb_cp_xds_refused",
            "xDS streams refused at their first request, by reason (node_cluster: not in "
            "xds_allowed_node_clusters, PERMISSION_DENIED; node_streams: over xds_limits.max_streams_per_node).",
            ["reason"], registry=r)
        for reason in ("node_cluster", "node_streams"):  # exported at 0 from the start
            self.xds_refused.labels(reason=reason)
        self.xds_backpressure = Counter(
            "inferlb_cp_xds_backpressure",
            "Times an xDS stream's reader paused because its inbound buffer (xds_limits.inbound_buffer) was full.",
            registry=r)

    def _register_scrapes_and_snapshots(self, r: CollectorRegistry) -> None:
        """The scraper (``ScrapeObserver``) and the snapshots it leads to."""
        self.scrapes = Counter("inferlb_cp_scrapes", "Worker scrapes.", ["endpoint", "result"], registry=r)
        self.scrape_refused_samples = Counter(
            "inferlb_cp_scrape_refused_samples",
            "Worker /metrics sample lines refused for a NaN or infinite value (that scrape's telemetry is not "
            "averaged in).", registry=r)
        self.scrape_duration = Histogram(
            "inferlb_cp_scrape_duration_seconds", "Duration of one worker scrape.", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.snapshot_build = Histogram(
            "inferlb_cp_snapshot_build_seconds", "Building and serialising one snapshot.", buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.snapshots = Counter("inferlb_cp_snapshots", "Snapshots published, by the types they changed.",
                                 ["type"], registry=r)

    def _register_policy_and_discovery(self, r: CollectorRegistry) -> None:
        """Contained weight-policy rounds, and the discovery sources' syncs."""
        self.policy_failures = Counter(
            "inferlb_cp_policy_failures",
            "Weight-policy rounds contained (the default policy's weights used instead), by policy and reason.",
            ["policy", "reason"], registry=r,
        )
        self.discovery_errors = Counter("inferlb_cp_discovery_errors", "Failed discovery rounds, by source.",
                                        ["source"], registry=r)
        self.discovery_last_success = Gauge("inferlb_cp_discovery_last_success_timestamp_seconds",
                                            "Unix time of the last successful discovery sync, by source.",
                                            ["source"], registry=r)
        self.discovery_endpoints = Gauge("inferlb_cp_discovery_endpoints",
                                         "Endpoints the source listed at its last successful sync.",
                                         ["source"], registry=r)

    def _register_nginx(self, r: CollectorRegistry) -> None:
        """The NGINX data plane's reloads."""
        self.nginx_reloads = Counter(
            "inferlb_cp_nginx_reloads",
            "NGINX data plane: configs applied by reload (ok), refused by nginx -t (invalid), or failed.",
            ["result"], registry=r,
        )
        self.nginx_last_reload = Gauge("inferlb_cp_nginx_last_reload_timestamp_seconds",
                                       "Unix time of the last NGINX reload that took effect.", registry=r)

    def _register_store_and_tasks(self, r: CollectorRegistry) -> None:
        """The shared store's change feed and reloads, and the supervised background tasks."""
        self.store_changes = Counter(
            "inferlb_cp_store_changes",
            "Shared-store change feed events, by reason (connected, notified, periodic, own: this replica's).",
            ["reason"], registry=r,
        )
        self.store_reloads = Counter("inferlb_cp_store_reloads", "Operator-state reloads from the shared store.",
                                     ["result"], registry=r)
        self.task_failures = Counter(
            "inferlb_cp_task_failures",
            "Background-task failures, each logged and retried with backoff (publisher: snapshot publishing; "
            "deregister: a drain-then-remove; store-follower: following the shared store), by task.",
            ["task"], registry=r,
        )
        for task in SUPERVISED_TASKS:  # exported at 0 from the start
            self.task_failures.labels(task=task)

    # XdsMetrics
    def on_connect(self, mode: str) -> None:
        self.clients.labels(mode=mode).inc()

    def on_disconnect(self, mode: str) -> None:
        self.clients.labels(mode=mode).dec()

    def on_push(self, type_url: str, seconds: float) -> None:
        self.pushes.labels(type=_type(type_url)).inc()
        self.push_latency.labels(type=_type(type_url)).observe(seconds)

    def on_ack(self, type_url: str) -> None:
        self.acks.labels(type=_type(type_url)).inc()

    def on_nack(self, type_url: str) -> None:
        self.nacks.labels(type=_type(type_url)).inc()

    def on_refused(self, reason: str) -> None:
        self.xds_refused.labels(reason=reason).inc()

    def on_backpressure(self) -> None:
        self.xds_backpressure.inc()

    # ScrapeObserver
    def scrape_done(self, endpoint_id: str, ok: bool, duration_s: float) -> None:
        self.scrapes.labels(endpoint=endpoint_id, result="ok" if ok else "error").inc()
        self.scrape_duration.observe(duration_s)

    def samples_refused(self, endpoint_id: str, count: int) -> None:
        self.scrape_refused_samples.inc(count)

    def endpoint_gone(self, endpoint_id: str) -> None:
        """Remove the endpoint's labelled series: label sets must not grow with churn."""
        for result in ("ok", "error"):
            with contextlib.suppress(KeyError):
                self.scrapes.remove(endpoint_id, result)

    def count_laggards(self, laggards: Callable[[], int]) -> None:
        """Read ``inferlb_cp_xds_laggard_streams`` from ``laggards`` at each collection (live, not per publish)."""
        self.xds_laggards.set_function(laggards)

    def snapshot_published(self, changed_types: frozenset[str], seconds: float) -> None:
        self.snapshot_build.observe(seconds)
        for type_url in changed_types:
            self.snapshots.labels(type=_type(type_url)).inc()

    # policy_guard.FailureObserver
    def policy_failure(self, policy: str, reason: str) -> None:
        self.policy_failures.labels(policy=policy, reason=reason).inc()

    # store.follow.FollowObserver
    def store_change(self, reason: str) -> None:
        self.store_changes.labels(reason=reason).inc()

    def store_reload(self, ok: bool) -> None:
        self.store_reloads.labels(result="ok" if ok else "error").inc()

    # nginx.applier.ReloadObserver
    def nginx_applied(self, result: str, at: float) -> None:
        self.nginx_reloads.labels(result=result).inc()
        if result == "ok":
            self.nginx_last_reload.set(at)

    # discovery.runner.DiscoveryObserver
    def discovery_synced(self, source: str, endpoints: int, at: float) -> None:
        self.discovery_last_success.labels(source=source).set(at)
        self.discovery_endpoints.labels(source=source).set(endpoints)

    def discovery_failed(self, source: str) -> None:
        self.discovery_errors.labels(source=source).inc()

    # inferlb_runtime.supervision.FailureObserver
    def task_failed(self, task: str) -> None:
        self.task_failures.labels(task=task).inc()

    def register_autoscale(self, signals: Callable[[], Mapping[str, AutoscaleSignal]]) -> None:
        """Export ``signals()`` (pool -> signal), called at each collection."""
        self.registry.register(_AutoscaleCollector(signals))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
