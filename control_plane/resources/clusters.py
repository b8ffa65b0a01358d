"""The clusters: the workers (EDS, picked by override_host), the ext_proc gRPC service and, when Envoy traces,
the OpenTelemetry collector its tracer exports to.

Why they look as they do: the workers cluster takes its hosts and weights from EDS, lets
ext_proc's pick (override_host) choose the host and falls back to weighted least_request, and
contains failures (health checks, outlier detection, circuit breakers, no panic mode). The
ext_proc cluster is HTTP/2 with keepalive PINGs, as every in-flight request holds one stream on it.
"""

from __future__ import annotations

from google.protobuf import wrappers_pb2
from google.protobuf.message import Message

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import address_pb2, base_pb2, extension_pb2, health_check_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2

from inferlb_runtime.hostport import is_ip

from ..model import DataPlaneSettings
from .messages import ads, duration, pack, socket_address, u32

HTTP_PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
OVERRIDE_HOST_POLICY = "envoy.load_balancing_policies.override_host"
LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"

# HTTP/2 PINGs on the long-lived ext_proc connection find a dead peer quickly.
H2_KEEPALIVE_INTERVAL_S = 15.0
H2_KEEPALIVE_TIMEOUT_S = 5.0


def _policy(name: str, config: Message) -> cluster_pb2.LoadBalancingPolicy:
    return cluster_pb2.LoadBalancingPolicy(policies=[
        cluster_pb2.LoadBalancingPolicy.Policy(
            typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=pack(config)),
        ),
    ])


def _circuit_breakers(settings: DataPlaneSettings) -> circuit_breaker_pb2.CircuitBreakers:
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=base_pb2.DEFAULT,
        max_connections=u32(settings.max_connections),
        max_pending_requests=u32(settings.max_pending_requests),
        max_requests=u32(settings.max_requests),
        max_retries=u32(settings.max_retries),
        track_remaining=True,
    )])


def build_lb_policy(settings: DataPlaneSettings) -> cluster_pb2.LoadBalancingPolicy:
    """override_host (ext_proc's pick) over weighted least_request (the control plane's weights).

    Envoy 1.40's override_host honours any pick that names a host in the cluster,
    whatever its health: draining, failing health checks or ejected (its source
    says "TODO: validate host health"; common_lb_config.override_host_status is
    not consulted). Only the fallback skips such hosts, so ext_proc must never
    pick an endpoint whose EDS metadata says draining or unhealthy. Header and
    metadata values are concatenated in source order: the first is the primary
    pick, the rest are retry fallbacks.
    """
    fallback = least_request_pb2.LeastRequest(
        choice_count=u32(2),
        slow_start_config=common_pb2.SlowStartConfig(slow_start_window=duration(settings.slow_start_window_s)),
    )
    override = override_host_pb2.OverrideHost(
        # Dynamic metadata first: only ext_proc can write it, while a client could send the header.
        override_host_sources=[
            override_host_pb2.OverrideHost.OverrideHostSource(metadata=metadata_pb2.MetadataKey(
                key=settings.pick_metadata_namespace,
                path=[metadata_pb2.MetadataKey.PathSegment(key=settings.pick_header)],
            )),
            override_host_pb2.OverrideHost.OverrideHostSource(header=settings.pick_header),
        ],
        fallback_policy=_policy(LEAST_REQUEST_POLICY, fallback),
    )
    return _policy(OVERRIDE_HOST_POLICY, override)


def build_workers_cluster(settings: DataPlaneSettings) -> cluster_pb2.Cluster:
    """The workers: endpoints and weights by EDS, picks by override_host, failures contained."""
    return cluster_pb2.Cluster(
        name=settings.workers_cluster,
        type=cluster_pb2.Cluster.EDS,
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=ads(), service_name=settings.workers_cluster,
        ),
        connect_timeout=duration(settings.connect_timeout_s),
        # The control plane drains before it deregisters: a removed host is gone at once,
        # not kept by Envoy until it fails health checks.
        ignore_health_on_host_removal=True,
        load_balancing_policy=build_lb_policy(settings),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            # No panic mode: draining must mean no new traffic, even when few hosts are left.
            healthy_panic_threshold=percent_pb2.Percent(value=0.0),
        ),
        health_checks=[health_check_pb2.HealthCheck(
            timeout=duration(settings.health_check_timeout_s),
            interval=duration(settings.health_check_interval_s),
            # Envoy's default is 60 s while a cluster is idle: far too slow to notice a dead worker.
            no_traffic_interval=duration(settings.health_check_interval_s),
            unhealthy_threshold=u32(settings.unhealthy_threshold),
            healthy_threshold=u32(settings.healthy_threshold),
            http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=settings.health_check_path),
        )],
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=u32(settings.outlier_consecutive_5xx),
            enforcing_consecutive_5xx=u32(100),
            # Slow hosts are the weight policy's business; outlier detection only ejects broken ones.
            enforcing_success_rate=u32(0),
            interval=duration(settings.health_check_interval_s),
            base_ejection_time=duration(settings.outlier_base_ejection_s),
            max_ejection_percent=u32(settings.outlier_max_ejection_percent),
            successful_active_health_check_uneject_host=wrappers_pb2.BoolValue(value=True),
        ),
        circuit_breakers=_circuit_breakers(settings),
    )


def build_ext_proc_cluster(settings: DataPlaneSettings) -> cluster_pb2.Cluster:
    """The gRPC (HTTP/2) cluster the ext_proc filter calls; one stream per HTTP request. Over a Unix
    domain socket when ``uds_path`` is set (a co-located ext_proc), else TCP."""
    ext = settings.ext_proc
    if ext.uds_path is not None:
        return _grpc_cluster(settings.ext_proc_cluster, address_pb2.Address(pipe=address_pb2.Pipe(path=ext.uds_path)),
                             settings)
    return _grpc_cluster(settings.ext_proc_cluster, ext.address, settings, ext.port)


def build_collector_cluster(settings: DataPlaneSettings) -> cluster_pb2.Cluster:
    """The OTLP/gRPC collector Envoy's OpenTelemetry tracer sends its spans to (only when it traces)."""
    assert settings.tracing is not None
    return _grpc_cluster(settings.tracing_cluster, settings.tracing.collector_address, settings,
                         settings.tracing.collector_port)


def _grpc_cluster(name: str, address: str | address_pb2.Address, settings: DataPlaneSettings,
                  port: int = 0) -> cluster_pb2.Cluster:
    """One gRPC service at ``address``: HTTP/2 with keepalive PINGs, by IP, by DNS name (with ``port``), or a
    ready-made ``Address`` (a pipe)."""
    static = not isinstance(address, str) or is_ip(address)
    h2 = protocol_pb2.Http2ProtocolOptions(connection_keepalive=protocol_pb2.KeepaliveSettings(
        interval=duration(H2_KEEPALIVE_INTERVAL_S), timeout=duration(H2_KEEPALIVE_TIMEOUT_S),
    ))
    options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=h2,
        ),
    )
    cluster = cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STATIC if static else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=duration(settings.connect_timeout_s),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[
                endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
                    address=address if not isinstance(address, str) else socket_address(address, port),
                )),
            ])],
        ),
        # Every in-flight HTTP request holds one ext_proc stream: the default 1024
        # max_requests would fail picks open under load long before the workers saturate.
        circuit_breakers=_circuit_breakers(settings),
    )
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].CopyFrom(pack(options))
    if not static:
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
    return cluster
