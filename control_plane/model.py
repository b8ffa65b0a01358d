"""The control plane's domain state: endpoints, their telemetry and weights, and
the data-plane settings that Envoy's resources are built from.

Everything here is a frozen dataclass. State changes by building a new value
(``dataclasses.replace``), so a snapshot handed to the resource builders or a
policy can never change under them.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass, field
from typing import Literal, Mapping

from inferlb_runtime.hostport import endpoint_id
from inferlb_runtime.model_routing import DEFAULT_POOL, Rollout

EndpointSource = Literal["static", "api", "kubernetes", "dns"]

MIN_WEIGHT = 1
MAX_WEIGHT = 1000
DEFAULT_WEIGHT = 100


def normalise_address(value: str) -> str:
    """An IPv4 or IPv6 literal, in canonical form; ``ValueError`` saying why not.

    The one check for every way an endpoint enters the fleet (admin API,
    DNS, EndpointSlices): Envoy's EDS takes IP addresses only, and one
    hostname would get the whole ClusterLoadAssignment NACKed by Envoy and
    refused by ext_proc, holding back every later update.
    """
    try:
        ip = ipaddress.ip_address(value.strip().strip("[]"))
    except ValueError:
        raise ValueError("must be an IPv4 or IPv6 address (EDS does not resolve hostnames)") from None
    if ip.is_unspecified or ip.is_multicast or (ip.version == 4 and ip == ipaddress.IPv4Address("255.255.255.255")):
        raise ValueError("must be a unicast address (not unspecified, multicast or broadcast)")
    return str(ip)


class Health(enum.Enum):
    UNKNOWN = "unknown"  # not scraped yet: routable, Envoy's own health checks decide
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # scrapes failed N times in a row


@dataclass(frozen=True)
class Telemetry:
    """Windowed, EWMA-smoothed figures derived from one worker's /metrics.

    Rates are per second over the scrape window; latencies in seconds.
    ``observed_at`` is the ``time.monotonic()`` of the last successful scrape:
    figures older than a few intervals are stale and must not be used as fresh.
    """

    observed_at: float
    cpu_utilization: float = 0.0  # 0..1 of the worker's allotted cores
    latency_mean_s: float = 0.0
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    latency_per_token_s: float = 0.0  # request seconds per token served
    queue_wait_mean_s: float = 0.0
    queue_depth: float = 0.0
    inflight: float = 0.0
    rps: float = 0.0
    tokens_per_s: float = 0.0
    error_rate: float = 0.0  # fraction of requests answered 5xx (or 429) in the window
    batch_cost_per_token_s: float = 0.0  # the worker's own fit t = a * tokens + b
    batch_cost_fixed_s: float = 0.0
    slots: float = 1.0  # jobs the worker runs at once (its ``inferlb_worker_slots``; 1 if it does not say)


@dataclass(frozen=True)
class Endpoint:
    address: str
    port: int
    source: EndpointSource = "static"
    health: Health = Health.UNKNOWN
    draining: bool = False
    computed_weight: int = DEFAULT_WEIGHT
    pinned_weight: int | None = None
    telemetry: Telemetry | None = None
    consecutive_scrape_failures: int = 0
    # What the worker serves, as its /metrics last said (kept through failed scrapes): model versions,
    # the aliases they answer to, and the pool it belongs to (inferlb_runtime.model_routing).
    models: tuple[str, ...] = ()
    model_aliases: tuple[str, ...] = ()
    pool: str = DEFAULT_POOL

    @property
    def id(self) -> str:
        return endpoint_id(self.address, self.port)

    @property
    def effective_weight(self) -> int:
        """What Envoy gets: a pin beats the policy; always within 1..1000."""
        weight = self.pinned_weight if self.pinned_weight is not None else self.computed_weight
        return max(MIN_WEIGHT, min(MAX_WEIGHT, weight))

    @property
    def routable(self) -> bool:
        return not self.draining and self.health is not Health.UNHEALTHY


@dataclass(frozen=True)
class ExtProcSettings:
    """The ext_proc filter in the listener and the cluster that reaches ext_proc."""

    address: str = "127.0.0.1"
    port: int = 9002
    # A Unix domain socket path: Envoy reaches a co-located ext_proc there instead of address:port
    # (a pipe costs the kernel less per gRPC message than loopback TCP). None: TCP.
    uds_path: str | None = None
    message_timeout_ms: int = 200
    max_message_timeout_ms: int = 10_000  # the most ext_proc may extend one message's timeout to
    max_request_body_bytes: int = 4 * 1024 * 1024
    failure_mode_allow: bool = True
    # False: no ext_proc filter and no ext_proc cluster; Envoy routes on the weights alone
    # (the bench's "inferlb_weights" data plane, or a fleet without ext_proc).
    enabled: bool = True


@dataclass(frozen=True)
class EnvoyTracing:
    """Envoy's OpenTelemetry tracer: where it sends spans (OTLP/gRPC, plaintext) and how many requests it
    samples. From the control plane's standard OTEL_* variables (docs/tracing.md); None: Envoy does not trace."""

    collector_address: str
    collector_port: int
    service_name: str = "inferlb-envoy"
    sampling_percent: float = 100.0


@dataclass(frozen=True)
class DataPlaneSettings:
    """Everything about Envoy's resources that is not an endpoint."""

    listener_address: str = "127.0.0.1"
    listener_port: int = 10000
    # TLS on the listener: PEM files on Envoy's host, both or neither (None: plaintext HTTP).
    listener_tls_cert: str | None = None
    listener_tls_key: str | None = None
    listener_name: str = "inferlb_http"
    route_name: str = "inferlb_routes"
    workers_cluster: str = "workers"
    ext_proc_cluster: str = "ext_proc"
    ext_proc: ExtProcSettings = field(default_factory=ExtProcSettings)
    request_timeout_s: float = 60.0
    # cluster "workers"
    connect_timeout_s: float = 1.0
    health_check_path: str = "/readyz"
    health_check_interval_s: float = 1.0
    health_check_timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    retries: int = 2
    slow_start_window_s: float = 10.0
    max_connections: int = 4096
    max_pending_requests: int = 4096
    max_requests: int = 4096
    max_retries: int = 64
    outlier_consecutive_5xx: int = 5
    outlier_base_ejection_s: float = 10.0
    outlier_max_ejection_percent: int = 50
    # the Endpoint Picker Protocol header / metadata key
    pick_header: str = "x-gateway-destination-endpoint"
    pick_metadata_namespace: str = "envoy.lb"
    # xDS node cluster (= node group) of ext_proc: its snapshot carries the rich EDS
    # (telemetry and pick-policy metadata); every other group gets the lean one.
    ext_proc_node_cluster: str = "inferlb-ext-proc"
    access_log: bool = True  # one JSON line per request on Envoy's stdout (resources/access_log.py)
    tracing: EnvoyTracing | None = None  # and the collector's cluster "opentelemetry_collector"
    tracing_cluster: str = "opentelemetry_collector"


@dataclass(frozen=True)
class PickPolicySpec:
    """The pick policy ext_proc should run; it reaches ext_proc as EDS metadata, never by import."""

    name: str = "least_completion_time"
    params: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetState:
    """The whole input of the resource builders: one value, one set of resources."""

    endpoints: tuple[Endpoint, ...] = ()
    settings: DataPlaneSettings = field(default_factory=DataPlaneSettings)
    pick_policy: PickPolicySpec = field(default_factory=PickPolicySpec)
    rollouts: tuple[Rollout, ...] = ()  # the admin API's canary / blue-green splits, sorted by alias

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        return next((e for e in self.endpoints if e.id == endpoint_id), None)
