"""Pure builders: one ``FleetState`` in, the Envoy v3 resources of that state out.

No I/O and no clocks: the xDS server versions each resource by a hash of its
deterministic bytes, so the same state must always give the same bytes, and a
change that only touches weights or telemetry must only change the
ClusterLoadAssignment (Envoy then re-sends nothing else and keeps its
connections and listeners as they are).

What ext_proc reads from EDS (it subscribes to EDS only):

* ``LbEndpoint.metadata.filter_metadata["inferlb"]``: ``id``, ``weight``
  (effective), ``computed_weight``, ``pinned_weight`` (or null), ``draining``,
  ``health`` (the ``Health`` value string) and, when the endpoint has been
  scraped, every ``Telemetry`` field except ``observed_at`` under its own name
  (flat, next to the keys above).
* ``LocalityLbEndpoints.metadata.filter_metadata["inferlb"]["pick_policy"]``:
  ``{"name": ..., "params": {...}}``.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2

from . import type_urls
from .model import DataPlaneSettings, Endpoint, FleetState, Health, Telemetry

METADATA_NAMESPACE = "inferlb"
HTTP_PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
OVERRIDE_HOST_POLICY = "envoy.load_balancing_policies.override_host"
LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"
PREVIOUS_HOSTS_PREDICATE = "envoy.retry_host_predicates.previous_hosts"
RETRY_ON = "connect-failure,reset,5xx"

# One locality, one priority: nothing to spill over to. 100 makes Envoy's
# availability arithmetic the plain healthy fraction (the default 140 would
# count 1 healthy host of 2 as 70% available and mask the loss).
OVERPROVISIONING_FACTOR = 100
# Slow-loris guard for request headers; bodies are bounded by request_timeout.
REQUEST_HEADERS_TIMEOUT_S = 10.0
# HTTP/2 PINGs on the long-lived ext_proc connection find a dead peer quickly.
H2_KEEPALIVE_INTERVAL_S = 15.0
H2_KEEPALIVE_TIMEOUT_S = 5.0
# Figures that are metadata for ext_proc, not telemetry: never sent.
_TELEMETRY_SKIP = frozenset({"observed_at"})

_EDS_HEALTH: Mapping[Health, int] = MappingProxyType({
    Health.HEALTHY: health_check_pb2.HEALTHY,
    Health.UNHEALTHY: health_check_pb2.UNHEALTHY,
    Health.UNKNOWN: health_check_pb2.UNKNOWN,
})


# --- small helpers -------------------------------------------------------------------------------

def _duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message, deterministic=True)
    return packed


def _u32(value: int) -> wrappers_pb2.UInt32Value:
    return wrappers_pb2.UInt32Value(value=value)


def _ads() -> config_source_pb2.ConfigSource:
    return config_source_pb2.ConfigSource(
        ads=config_source_pb2.AggregatedConfigSource(), resource_api_version=config_source_pb2.V3,
    )


def _socket_address(address: str, port: int) -> address_pb2.Address:
    return address_pb2.Address(socket_address=address_pb2.SocketAddress(address=address, port_value=port))


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def _value(obj: object) -> struct_pb2.Value:
    """JSON-like Python value -> protobuf Value; anything else is a bug in the caller."""
    if obj is None:
        return struct_pb2.Value(null_value=struct_pb2.NULL_VALUE)
    if isinstance(obj, bool):
        return struct_pb2.Value(bool_value=obj)
    if isinstance(obj, (int, float)):
        return struct_pb2.Value(number_value=float(obj))
    if isinstance(obj, str):
        return struct_pb2.Value(string_value=obj)
    if isinstance(obj, enum.Enum):
        return _value(obj.value)
    if isinstance(obj, Mapping):
        return struct_pb2.Value(struct_value=_struct(obj))
    if isinstance(obj, Sequence):
        return struct_pb2.Value(list_value=struct_pb2.ListValue(values=[_value(item) for item in obj]))
    raise TypeError(f"cannot put {type(obj).__name__} into EDS metadata: {obj!r}")


def _struct(mapping: Mapping[str, object]) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    for key, item in mapping.items():
        struct.fields[str(key)].CopyFrom(_value(item))
    return struct


def _policy(name: str, config: Message) -> cluster_pb2.LoadBalancingPolicy:
    return cluster_pb2.LoadBalancingPolicy(policies=[
        cluster_pb2.LoadBalancingPolicy.Policy(
            typed_extension_config=extension_pb2.TypedExtensionConfig(name=name, typed_config=_pack(config)),
        ),
    ])


# --- listener and routes -------------------------------------------------------------------------

def build_ext_proc_filter(settings: DataPlaneSettings) -> ext_proc_pb2.ExternalProcessor:
    """The pick: ext_proc sees headers and the whole body, answers with the endpoint to use."""
    mode = processing_mode_pb2.ProcessingMode
    ext = settings.ext_proc
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=settings.ext_proc_cluster),
            # The stream lives as long as the HTTP request (response headers are sent
            # too), so never cut it before the route timeout; message_timeout bounds each step.
            timeout=_duration(settings.request_timeout_s),
        ),
        failure_mode_allow=ext.failure_mode_allow,
        message_timeout=_duration(ext.message_timeout_ms / 1000),
        processing_mode=mode(
            request_header_mode=mode.SEND,
            request_body_mode=mode.BUFFERED,
            request_trailer_mode=mode.SKIP,
            response_header_mode=mode.SEND,
            response_body_mode=mode.NONE,
            response_trailer_mode=mode.SKIP,
        ),
        allow_mode_override=False,
        # Without this Envoy silently drops the dynamic metadata ext_proc returns,
        # and override_host would never see the pick under envoy.lb.
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[settings.pick_metadata_namespace],
            ),
        ),
        # The pick changes the host, never the route: skip re-matching routes.
        route_cache_action=ext_proc_pb2.ExternalProcessor.RETAIN,
    )


def build_listener(settings: DataPlaneSettings) -> listener_pb2.Listener:
    """HTTP listener: ext_proc picks, the router forwards; routes arrive by RDS over ADS."""
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=settings.listener_name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=_ads(), route_config_name=settings.route_name),
        http_filters=[
            hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=_pack(build_ext_proc_filter(settings))),
            hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=_pack(router_pb2.Router())),
        ],
        request_timeout=_duration(settings.request_timeout_s),
        request_headers_timeout=_duration(REQUEST_HEADERS_TIMEOUT_S),
        # An inference can be silent for as long as the route allows; never cut it earlier.
        stream_idle_timeout=_duration(settings.request_timeout_s),
        use_remote_address=wrappers_pb2.BoolValue(value=False),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        merge_slashes=True,
    )
    return listener_pb2.Listener(
        name=settings.listener_name,
        address=_socket_address(settings.listener_address, settings.listener_port),
        filter_chains=[listener_components_pb2.FilterChain(filters=[
            listener_components_pb2.Filter(name=HCM_FILTER, typed_config=_pack(manager)),
        ])],
    )


def build_route_configuration(settings: DataPlaneSettings) -> route_pb2.RouteConfiguration:
    """Everything goes to the workers cluster; retries avoid the host that just failed."""
    retry = route_components_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        num_retries=_u32(settings.retries),
        retry_host_predicate=[route_components_pb2.RetryPolicy.RetryHostPredicate(
            name=PREVIOUS_HOSTS_PREDICATE, typed_config=_pack(previous_hosts_pb2.PreviousHostsPredicate()),
        )],
        host_selection_retry_max_attempts=3,
    )
    route = route_components_pb2.Route(
        name="workers",
        match=route_components_pb2.RouteMatch(prefix="/"),
        route=route_components_pb2.RouteAction(
            cluster=settings.workers_cluster,
            timeout=_duration(settings.request_timeout_s),
            retry_policy=retry,
        ),
        # Envoy >= 1.36: the stream's request-body buffer limit, applied as soon as the
        # route matches (before ext_proc buffers). ext_proc BUFFERED and retry buffering
        # both obey it: bodies up to it pass (without it, 1 MiB per_connection_buffer_limit
        # applies and a 2 MiB body gets 413), larger ones get 413.
        request_body_buffer_limit=wrappers_pb2.UInt64Value(value=settings.ext_proc.max_request_body_bytes),
    )
    return route_pb2.RouteConfiguration(
        name=settings.route_name,
        virtual_hosts=[route_components_pb2.VirtualHost(name="inferlb", domains=["*"], routes=[route])],
    )


# --- clusters ------------------------------------------------------------------------------------

def _circuit_breakers(settings: DataPlaneSettings) -> circuit_breaker_pb2.CircuitBreakers:
    return circuit_breaker_pb2.CircuitBreakers(thresholds=[circuit_breaker_pb2.CircuitBreakers.Thresholds(
        priority=base_pb2.DEFAULT,
        max_connections=_u32(settings.max_connections),
        max_pending_requests=_u32(settings.max_pending_requests),
        max_requests=_u32(settings.max_requests),
        max_retries=_u32(settings.max_retries),
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
        choice_count=_u32(2),
        slow_start_config=common_pb2.SlowStartConfig(slow_start_window=_duration(settings.slow_start_window_s)),
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
            eds_config=_ads(), service_name=settings.workers_cluster,
        ),
        connect_timeout=_duration(settings.connect_timeout_s),
        load_balancing_policy=build_lb_policy(settings),
        common_lb_config=cluster_pb2.Cluster.CommonLbConfig(
            # No panic mode: draining must mean no new traffic, even when few hosts are left.
            healthy_panic_threshold=percent_pb2.Percent(value=0.0),
        ),
        health_checks=[health_check_pb2.HealthCheck(
            timeout=_duration(settings.health_check_timeout_s),
            interval=_duration(settings.health_check_interval_s),
            # Envoy's default is 60 s while a cluster is idle: far too slow to notice a dead worker.
            no_traffic_interval=_duration(settings.health_check_interval_s),
            unhealthy_threshold=_u32(settings.unhealthy_threshold),
            healthy_threshold=_u32(settings.healthy_threshold),
            http_health_check=health_check_pb2.HealthCheck.HttpHealthCheck(path=settings.health_check_path),
        )],
        outlier_detection=outlier_detection_pb2.OutlierDetection(
            consecutive_5xx=_u32(settings.outlier_consecutive_5xx),
            enforcing_consecutive_5xx=_u32(100),
            # Slow hosts are the weight policy's business; outlier detection only ejects broken ones.
            enforcing_success_rate=_u32(0),
            interval=_duration(settings.health_check_interval_s),
            base_ejection_time=_duration(settings.outlier_base_ejection_s),
            max_ejection_percent=_u32(settings.outlier_max_ejection_percent),
            successful_active_health_check_uneject_host=wrappers_pb2.BoolValue(value=True),
        ),
        circuit_breakers=_circuit_breakers(settings),
    )


def build_ext_proc_cluster(settings: DataPlaneSettings) -> cluster_pb2.Cluster:
    """The gRPC (HTTP/2) cluster the ext_proc filter calls; one stream per HTTP request."""
    ext = settings.ext_proc
    static = _is_ip(ext.address)
    h2 = protocol_pb2.Http2ProtocolOptions(connection_keepalive=protocol_pb2.KeepaliveSettings(
        interval=_duration(H2_KEEPALIVE_INTERVAL_S), timeout=_duration(H2_KEEPALIVE_TIMEOUT_S),
    ))
    options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=h2,
        ),
    )
    cluster = cluster_pb2.Cluster(
        name=settings.ext_proc_cluster,
        type=cluster_pb2.Cluster.STATIC if static else cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_duration(settings.connect_timeout_s),
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=settings.ext_proc_cluster,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[
                endpoint_components_pb2.LbEndpoint(endpoint=endpoint_components_pb2.Endpoint(
                    address=_socket_address(ext.address, ext.port),
                )),
            ])],
        ),
        # Every in-flight HTTP request holds one ext_proc stream: the default 1024
        # max_requests would fail picks open under load long before the workers saturate.
        circuit_breakers=_circuit_breakers(settings),
    )
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS_KEY].CopyFrom(_pack(options))
    if not static:
        cluster.dns_lookup_family = cluster_pb2.Cluster.V4_PREFERRED
    return cluster


# --- endpoints -----------------------------------------------------------------------------------

def _telemetry_fields(telemetry: Telemetry) -> dict[str, float]:
    return {
        f.name: getattr(telemetry, f.name)
        for f in dataclasses.fields(telemetry) if f.name not in _TELEMETRY_SKIP
    }


def endpoint_metadata(endpoint: Endpoint) -> dict[str, object]:
    """What ext_proc knows about one endpoint (see the module docstring)."""
    meta: dict[str, object] = {
        "id": endpoint.id,
        "weight": endpoint.effective_weight,
        "computed_weight": endpoint.computed_weight,
        "pinned_weight": endpoint.pinned_weight,
        "draining": endpoint.draining,
        "health": endpoint.health.value,
    }
    if endpoint.telemetry is not None:
        meta.update(_telemetry_fields(endpoint.telemetry))
    return meta


def eds_health(endpoint: Endpoint) -> int:
    """DRAINING beats everything: Envoy then excludes the host from new picks and lets it finish."""
    if endpoint.draining:
        return health_check_pb2.DRAINING
    return _EDS_HEALTH[endpoint.health]


def build_lb_endpoint(endpoint: Endpoint) -> endpoint_components_pb2.LbEndpoint:
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[METADATA_NAMESPACE].CopyFrom(_struct(endpoint_metadata(endpoint)))
    return endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=_socket_address(endpoint.address, endpoint.port)),
        health_status=eds_health(endpoint),
        metadata=metadata,
        load_balancing_weight=_u32(max(1, endpoint.effective_weight)),
    )


def build_load_assignment(state: FleetState) -> endpoint_pb2.ClusterLoadAssignment:
    """Every endpoint with its weight, health and telemetry; the pick policy rides on the locality."""
    settings = state.settings
    policy = {"pick_policy": {"name": state.pick_policy.name, "params": dict(state.pick_policy.params)}}
    locality_metadata = base_pb2.Metadata()
    locality_metadata.filter_metadata[METADATA_NAMESPACE].CopyFrom(_struct(policy))
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=settings.workers_cluster,
        endpoints=[endpoint_components_pb2.LocalityLbEndpoints(
            metadata=locality_metadata,
            lb_endpoints=[build_lb_endpoint(e) for e in sorted(state.endpoints, key=lambda e: e.id)],
        )],
        policy=endpoint_pb2.ClusterLoadAssignment.Policy(overprovisioning_factor=_u32(OVERPROVISIONING_FACTOR)),
    )


def weights_of(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, int]:
    """``host:port`` -> load_balancing_weight, over every locality of a ClusterLoadAssignment."""
    weights: dict[str, int] = {}
    for locality in cla.endpoints:
        for lb_endpoint in locality.lb_endpoints:
            socket = lb_endpoint.endpoint.address.socket_address
            weights[f"{socket.address}:{socket.port_value}"] = lb_endpoint.load_balancing_weight.value
    return weights


# --- everything ----------------------------------------------------------------------------------

def build_resources(state: FleetState) -> dict[str, dict[str, Message]]:
    """Type URL -> resource name -> message: the whole snapshot for one state."""
    settings = state.settings
    return {
        type_urls.CLUSTER: {
            settings.workers_cluster: build_workers_cluster(settings),
            settings.ext_proc_cluster: build_ext_proc_cluster(settings),
        },
        type_urls.ENDPOINT: {settings.workers_cluster: build_load_assignment(state)},
        type_urls.LISTENER: {settings.listener_name: build_listener(settings)},
        type_urls.ROUTE: {settings.route_name: build_route_configuration(settings)},
    }
