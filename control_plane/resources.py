"""Pure builders: one ``FleetState`` in, the Envoy v3 resources of that state out.

No I/O and no clocks: the xDS server versions each resource by a hash of its
deterministic bytes, so the same state must always give the same bytes, and a
change that only touches weights or telemetry must only change the
ClusterLoadAssignment (Envoy then re-sends nothing else and keeps its
connections and listeners as they are).

Two variants of the ClusterLoadAssignment, for two node groups:

* Envoys (the default snapshot) get the lean one: address, ``health_status``
  and ``load_balancing_weight`` per endpoint, no metadata. Envoy reads
  nothing else, so telemetry changes never re-push EDS to Envoys.
* ext_proc (node cluster ``DataPlaneSettings.ext_proc_node_cluster``) gets
  the rich one; what it reads from EDS (it subscribes to EDS only):

  * ``LbEndpoint.metadata.filter_metadata["inferlb"]``: ``id``, ``weight``
    (effective), ``computed_weight``, ``pinned_weight`` (or null),
    ``draining``, ``health`` (the ``Health`` value string) and, when the
    endpoint has been scraped, every ``Telemetry`` field except
    ``observed_at`` under its own name (flat, next to the keys above),
    rounded to ``TELEMETRY_SIGNIFICANT_DIGITS`` significant digits.
  * ``LocalityLbEndpoints.metadata.filter_metadata["inferlb"]["pick_policy"]``:
    ``{"name": ..., "params": {...}}``; and ``["ext_proc_replicas"]``: the
    sorted node ids of the connected ext_proc replicas (absent when none), so
    each can find its index and partition a large fleet with the others.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import ipaddress
import operator
import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from google.protobuf import any_pb2, duration_pb2, struct_pb2, wrappers_pb2
from google.protobuf.message import Message

from envoy.config.accesslog.v3 import accesslog_pb2
from envoy.config.cluster.v3 import circuit_breaker_pb2, cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    base_pb2,
    config_source_pb2,
    extension_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
    substitution_format_string_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.extensions.access_loggers.filters.cel.v3 import cel_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.load_balancing_policies.common.v3 import common_pb2
from envoy.extensions.load_balancing_policies.least_request.v3 import least_request_pb2
from envoy.extensions.load_balancing_policies.override_host.v3 import override_host_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from envoy.type.metadata.v3 import metadata_pb2
from envoy.type.v3 import percent_pb2

from . import type_urls
from .model import MAX_WEIGHT, DataPlaneSettings, Endpoint, FleetState, Health, Telemetry

METADATA_NAMESPACE = "inferlb"
HTTP_PROTOCOL_OPTIONS_KEY = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
STRIP_PICK_FILTER = "envoy.filters.http.header_mutation"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
OVERRIDE_HOST_POLICY = "envoy.load_balancing_policies.override_host"
LEAST_REQUEST_POLICY = "envoy.load_balancing_policies.least_request"
PREVIOUS_HOSTS_PREDICATE = "envoy.retry_host_predicates.previous_hosts"
CEL_FILTER = "envoy.access_loggers.extension_filters.cel"
TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
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
# Telemetry in ext_proc's EDS metadata is rounded to this many significant digits,
# so that scrape noise does not make a new EDS version on every scrape.
TELEMETRY_SIGNIFICANT_DIGITS = 3

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
        # Not set: send_body_without_waiting_for_header_response. Envoy 1.40 honours it only with
        # request_body_mode STREAMED (or FULL_DUPLEX_STREAMED); with BUFFERED it holds the body until
        # the request-headers answer anyway, so it would change nothing. STREAMED would save that round
        # trip but loses the buffer limit's 413 and sends large bodies as many messages.
        # Without this Envoy silently drops the dynamic metadata ext_proc returns,
        # and override_host would never see the pick under envoy.lb.
        metadata_options=ext_proc_pb2.MetadataOptions(
            receiving_namespaces=ext_proc_pb2.MetadataOptions.MetadataNamespaces(
                untyped=[settings.pick_metadata_namespace],
            ),
        ),
        # The pick changes the host, never the route: skip re-matching routes.
        route_cache_action=ext_proc_pb2.ExternalProcessor.RETAIN,
        # The host that really answered (after retries): the cost model learns for the right one.
        response_attributes=["upstream.address"],
    )


def build_strip_pick_filter(settings: DataPlaneSettings) -> header_mutation_pb2.HeaderMutation:
    """Drop a client-sent pick header at the edge: only ext_proc chooses hosts.

    override_host honours the header, so without this a client could pin any
    host, and would keep doing so whenever ext_proc fails open.
    """
    return header_mutation_pb2.HeaderMutation(
        mutations=header_mutation_pb2.Mutations(
            request_mutations=[mutation_rules_pb2.HeaderMutation(remove=settings.pick_header)],
        ),
    )


# --- Envoy's own local replies, in OpenAI's error shape -----------------------------------------

# Envoy's local replies by status: OpenAI's error ``type`` and a ``code`` (the workers' names where they
# have one: request_too_large, internal_error), and the message when Envoy's own text is empty or vague
# (None: Envoy's text, e.g. "no healthy upstream", "upstream request timeout"; %RESPONSE_CODE_DETAILS%
# is Envoy's reason, e.g. missing_host_header).
LOCAL_REPLIES: Mapping[int, tuple[str, str, str | None]] = MappingProxyType({
    400: ("invalid_request_error", "invalid_request", "malformed request (%RESPONSE_CODE_DETAILS%)"),
    404: ("invalid_request_error", "not_found", "no route for this request"),
    408: ("invalid_request_error", "request_timeout", None),
    413: ("invalid_request_error", "request_too_large", "request body is too large"),  # with the limit: below
    431: ("invalid_request_error", "headers_too_large", None),
    500: ("server_error", "internal_error", None),
    502: ("server_error", "bad_gateway", None),
    503: ("server_error", "upstream_unavailable", None),
    504: ("server_error", "upstream_timeout", None),
})
# Any other status: by class.
OTHER_CLIENT_ERROR = ("invalid_request_error", "invalid_request")
OTHER_SERVER_ERROR = ("server_error", "internal_error")
OTHER_MESSAGE = "%LOCAL_REPLY_BODY% (%RESPONSE_CODE_DETAILS%)"
# ext_proc's immediate responses (no endpoint ready, a body over its limit) are already in OpenAI's
# shape, with their own codes; their response code details start with this, and no mapper touches them.
EXT_PROC_DETAILS_PREFIX = "inferlb_"
_NOT_FROM_EXT_PROC = f"!response.code_details.startsWith('{EXT_PROC_DETAILS_PREFIX}')"
_RUNTIME_KEY = "inferlb.local_reply.status"  # required by the proto; nothing sets it


def _status(op: int, code: int) -> accesslog_pb2.AccessLogFilter:
    value = base_pb2.RuntimeUInt32(default_value=code, runtime_key=_RUNTIME_KEY)
    return accesslog_pb2.AccessLogFilter(status_code_filter=accesslog_pb2.StatusCodeFilter(
        comparison=accesslog_pb2.ComparisonFilter(op=op, value=value)))  # type: ignore[arg-type]


def _envoys_own(*conditions: accesslog_pb2.AccessLogFilter) -> accesslog_pb2.AccessLogFilter:
    """``conditions`` and: the reply is Envoy's own, not ext_proc's."""
    not_ext_proc = accesslog_pb2.AccessLogFilter(extension_filter=accesslog_pb2.ExtensionFilter(
        name=CEL_FILTER, typed_config=_pack(cel_pb2.ExpressionFilter(expression=_NOT_FROM_EXT_PROC))))
    return accesslog_pb2.AccessLogFilter(and_filter=accesslog_pb2.AndFilter(filters=[*conditions, not_ext_proc]))


def _openai_error(type_: str, code: str,
                  message: str | None) -> substitution_format_string_pb2.SubstitutionFormatString:
    body = struct_pb2.Struct()
    body.update({"error": {"message": message if message is not None else "%LOCAL_REPLY_BODY%", "type": type_,
                           "param": None, "code": code}})
    return substitution_format_string_pb2.SubstitutionFormatString(json_format=body)  # application/json


def build_local_reply_config(max_request_body_bytes: int | None) -> hcm_pb2.LocalReplyConfig:
    """Envoy's own error replies (413 over the body limit, 503 no healthy upstream, 504 upstream timeout,
    400 malformed, ...) as ``{"error": {"message", "type", "param": null, "code"}}``, application/json.

    Only local replies are formatted: a worker's own error answer passes as it is. ext_proc's replies
    (details ``inferlb_*``) too. ``max_request_body_bytes``: the limit the 413 message names (None: none
    is configured). A pure function: the bench's static Envoys use the same (``MessageToDict`` of it).
    """
    op = accesslog_pb2.ComparisonFilter
    mappers = []
    for status, (type_, code, message) in sorted(LOCAL_REPLIES.items()):
        if status == 413 and max_request_body_bytes is not None:
            message = f"request body is over the limit of {max_request_body_bytes} bytes"
        mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.EQ, status)),
                                              body_format_override=_openai_error(type_, code, message)))
    mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.GE, 400), _status(op.LE, 499)),
                                          body_format_override=_openai_error(*OTHER_CLIENT_ERROR, OTHER_MESSAGE)))
    mappers.append(hcm_pb2.ResponseMapper(filter=_envoys_own(_status(op.GE, 500)),
                                          body_format_override=_openai_error(*OTHER_SERVER_ERROR, OTHER_MESSAGE)))
    # No top-level body_format: a reply no mapper matched (ext_proc's) keeps its body and content type.
    return hcm_pb2.LocalReplyConfig(mappers=mappers)


def build_downstream_tls(cert_chain: str, private_key: str) -> base_pb2.TransportSocket:
    """TLS on the listener: Envoy reads both PEM files (paths on Envoy's host) when it gets the listener;
    ALPN offers HTTP/2 and HTTP/1.1 (the codec is AUTO)."""
    context = tls_pb2.DownstreamTlsContext(common_tls_context=tls_pb2.CommonTlsContext(
        tls_certificates=[tls_common_pb2.TlsCertificate(
            certificate_chain=base_pb2.DataSource(filename=cert_chain),
            private_key=base_pb2.DataSource(filename=private_key),
        )],
        alpn_protocols=["h2", "http/1.1"],
    ))
    return base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=_pack(context))


def build_listener(settings: DataPlaneSettings) -> listener_pb2.Listener:
    """HTTP listener (HTTPS when the settings name a certificate and key): ext_proc picks, the router
    forwards; routes arrive by RDS over ADS; Envoy's own error replies in OpenAI's shape."""
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=settings.listener_name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=_ads(), route_config_name=settings.route_name),
        http_filters=[
            hcm_pb2.HttpFilter(name=STRIP_PICK_FILTER, typed_config=_pack(build_strip_pick_filter(settings))),
            *([hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=_pack(build_ext_proc_filter(settings)))]
              if settings.ext_proc.enabled else []),
            hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=_pack(router_pb2.Router())),
        ],
        request_timeout=_duration(settings.request_timeout_s),
        request_headers_timeout=_duration(REQUEST_HEADERS_TIMEOUT_S),
        # An inference can be silent for as long as the route allows; never cut it earlier.
        stream_idle_timeout=_duration(settings.request_timeout_s),
        use_remote_address=wrappers_pb2.BoolValue(value=False),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        merge_slashes=True,
        local_reply_config=build_local_reply_config(settings.ext_proc.max_request_body_bytes),
    )
    chain = listener_components_pb2.FilterChain(filters=[
        listener_components_pb2.Filter(name=HCM_FILTER, typed_config=_pack(manager)),
    ])
    if settings.listener_tls_cert is not None and settings.listener_tls_key is not None:
        chain.transport_socket.CopyFrom(build_downstream_tls(settings.listener_tls_cert, settings.listener_tls_key))
    return listener_pb2.Listener(
        name=settings.listener_name,
        address=_socket_address(settings.listener_address, settings.listener_port),
        filter_chains=[chain],
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
        # The control plane drains before it deregisters: a removed host is gone at once,
        # not kept by Envoy until it fails health checks.
        ignore_health_on_host_removal=True,
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
#
# The ClusterLoadAssignment is assembled from pre-encoded pieces, not built as
# messages: with 10,000 endpoints, building an LbEndpoint and its metadata
# Struct in Python per endpoint per publish took most of a second. Every piece
# is the canonical (deterministic) protobuf encoding of its part, produced by
# protobuf itself where the input space is small (addresses, health, weights:
# cached), or by a small encoder for Struct metadata; tests parse the result
# and check that re-serialising it gives the very same bytes. (One exception:
# Struct keys are sorted in code-point order, as C++ protobuf does, while upb
# puts "ab" before "a"; only pick-policy params could have such keys, and the
# bytes are deterministic either way.) The caches are bounded
# ``functools.lru_cache``s on pure functions: the same input always gives the
# same bytes, a miss only costs time.

# Enough for two or three generations of a 10,000-endpoint fleet.
_ENDPOINT_CACHE_SIZE = 1 << 15


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: ``tag`` (one byte: field number < 16, wire type 2), length, payload."""
    return b"".join((tag, _varint(len(payload)), payload))


# Struct / Value / ListValue (google/protobuf/struct.proto), canonical encoding.
_FIXED64 = struct.Struct("<d").pack
_STRUCT_FIELDS = b"\x0a"  # Struct.fields = 1 (map entries: key = 1, value = 2)
_VALUE_NULL = b"\x08\x00"  # Value.null_value = 1 (NULL_VALUE = 0)
_VALUE_NUMBER = b"\x11"  # Value.number_value = 2 (double)
_VALUE_STRING = b"\x1a"  # Value.string_value = 3
_VALUE_TRUE, _VALUE_FALSE = b"\x20\x01", b"\x20\x00"  # Value.bool_value = 4
_VALUE_STRUCT = b"\x2a"  # Value.struct_value = 5
_VALUE_LIST = b"\x32"  # Value.list_value = 6
_LIST_VALUES = b"\x0a"  # ListValue.values = 1


@functools.lru_cache(maxsize=1024)
def _map_key(key: str) -> bytes:
    return _len_field(b"\x0a", key.encode())


@functools.lru_cache(maxsize=1024)
def _number_entry_prefix(key: str) -> bytes:
    """A Struct map entry holding a number is this prefix plus the 8 bytes of the double."""
    key_field = _map_key(key)
    return b"\x0a" + _varint(len(key_field) + 11) + key_field + b"\x12\x09" + _VALUE_NUMBER


def _value_entry(key: str, value: bytes) -> bytes:
    return _len_field(_STRUCT_FIELDS, _map_key(key) + _len_field(b"\x12", value))


@functools.lru_cache(maxsize=1024, typed=True)
def _constant_entry(key: str, item: bool | None) -> bytes:
    return _value_entry(key, _encode_value(item))


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _string_entry(key: str, item: str) -> bytes:
    return _value_entry(key, _len_field(_VALUE_STRING, item.encode()))


def _struct_entry(key: str, item: object) -> bytes:
    """One ``Struct.fields`` map entry."""
    cls = item.__class__
    if cls is float or cls is int:  # the common case (never a bool)
        return _number_entry_prefix(key) + _FIXED64(item)
    if cls is str:  # ids, health: few distinct values
        return _string_entry(key, item)  # type: ignore[arg-type]
    if item is None or item is True or item is False:
        return _constant_entry(key, item)
    return _len_field(_STRUCT_FIELDS, _map_key(key) + _len_field(b"\x12", _encode_value(item)))


def _encode_value(obj: object) -> bytes:
    """JSON-like Python value -> the bytes of a ``google.protobuf.Value``; anything else is a caller bug."""
    if obj is None:
        return _VALUE_NULL
    if isinstance(obj, bool):
        return _VALUE_TRUE if obj else _VALUE_FALSE
    if isinstance(obj, (int, float)):
        return _VALUE_NUMBER + _FIXED64(float(obj))
    if isinstance(obj, str):
        return _len_field(_VALUE_STRING, obj.encode())
    if isinstance(obj, enum.Enum):
        return _encode_value(obj.value)
    if isinstance(obj, Mapping):
        return _len_field(_VALUE_STRUCT, _encode_struct(obj))
    if isinstance(obj, Sequence):
        return _len_field(_VALUE_LIST, b"".join(_len_field(_LIST_VALUES, _encode_value(item)) for item in obj))
    raise TypeError(f"cannot put {type(obj).__name__} into EDS metadata: {obj!r}")


def _encode_struct(mapping: Mapping[object, object]) -> bytes:
    """The bytes of a ``google.protobuf.Struct``, map entries sorted by key (code points)."""
    fields = {str(key): item for key, item in mapping.items()}
    return b"".join([_struct_entry(key, fields[key]) for key in sorted(fields)])


def _encode_metadata(struct_bytes: bytes) -> bytes:
    """The bytes of a ``core.v3.Metadata`` with a Struct under ``filter_metadata["inferlb"]``."""
    return _len_field(b"\x0a", _map_key(METADATA_NAMESPACE) + _len_field(b"\x12", struct_bytes))


def _serialized(message: Message) -> bytes:
    return message.SerializeToString(deterministic=True)


# LbEndpoint: endpoint = 1, health_status = 2, metadata = 3, load_balancing_weight = 4;
# canonical encoding is in field-number order, so its bytes are the concatenation of
# each field encoded on its own.

@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _lb_address(address: str, port: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=_socket_address(address, port))))


@functools.lru_cache(maxsize=16)
def _lb_health(status: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(health_status=status))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=2 * MAX_WEIGHT)
def _lb_weight(weight: int) -> bytes:
    return _serialized(endpoint_components_pb2.LbEndpoint(load_balancing_weight=_u32(weight)))


_LB_METADATA = b"\x1a"  # LbEndpoint.metadata = 3
_LB_ENDPOINTS = b"\x12"  # LocalityLbEndpoints.lb_endpoints = 2
_LOCALITY_METADATA = b"\x4a"  # LocalityLbEndpoints.metadata = 9
_CLA_ENDPOINTS = b"\x12"  # ClusterLoadAssignment.endpoints = 2


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _lean_entry(address: str, port: int, health: int, weight: int) -> bytes:
    """One ``lb_endpoints`` entry of the lean (Envoy) variant: address, health, weight."""
    return _len_field(_LB_ENDPOINTS, _lb_address(address, port) + _lb_health(health) + _lb_weight(weight))


_TELEMETRY_NAMES: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(Telemetry) if f.name not in _TELEMETRY_SKIP)
_TELEMETRY_VALUES = operator.attrgetter(*_TELEMETRY_NAMES)
_QUANTISE_FORMAT = " ".join([f"%.{TELEMETRY_SIGNIFICANT_DIGITS}g"] * len(_TELEMETRY_NAMES))
# The rich metadata Struct is encoded in two independently cached parts, so that a
# weight change does not re-encode telemetry and a scrape does not re-encode the
# rest: the entries of the base keys, and the entries of the telemetry keys in
# runs. Interleaved by _PLAN, they are the Struct's entries sorted by key (the
# canonical order), and every key here is a prefix of no other.
_BASE_KEYS = ("id", "weight", "computed_weight", "pinned_weight", "draining", "health")
_BASE_ORDER = tuple(sorted(range(len(_BASE_KEYS)), key=_BASE_KEYS.__getitem__))


def _interleave_plan() -> tuple[tuple[tuple[bool, int], ...], tuple[tuple[int, ...], ...]]:
    plan: list[tuple[bool, int]] = []  # (is a base entry, its position among base entries | run index)
    runs: list[list[int]] = []  # telemetry runs: indices into _TELEMETRY_NAMES
    for key in sorted(_BASE_KEYS + _TELEMETRY_NAMES):
        if key in _BASE_KEYS:
            plan.append((True, _BASE_ORDER.index(_BASE_KEYS.index(key))))
        elif plan and not plan[-1][0]:
            runs[-1].append(_TELEMETRY_NAMES.index(key))
        else:
            plan.append((False, len(runs)))
            runs.append([_TELEMETRY_NAMES.index(key)])
    return tuple(plan), tuple(tuple(run) for run in runs)


_PLAN, _TELEMETRY_RUNS = _interleave_plan()
_TELEMETRY_RUN_PREFIXES = tuple(tuple(_number_entry_prefix(_TELEMETRY_NAMES[i]) for i in run)
                                for run in _TELEMETRY_RUNS)


def quantise(value: float, digits: int = TELEMETRY_SIGNIFICANT_DIGITS) -> float:
    """``value`` rounded to ``digits`` significant digits (so that noise makes no new EDS version)."""
    return float(f"%.{digits}g" % value)


def _quantised_text(telemetry: Telemetry | None) -> str | None:
    return None if telemetry is None else _QUANTISE_FORMAT % _TELEMETRY_VALUES(telemetry)


def _base_values(endpoint: Endpoint) -> tuple[object, ...]:
    return (endpoint.id, endpoint.effective_weight, endpoint.computed_weight, endpoint.pinned_weight,
            endpoint.draining, endpoint.health.value)


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _base_entries(values: tuple[object, ...]) -> tuple[bytes, ...]:
    """The base keys' Struct entries, sorted by key."""
    return tuple(_struct_entry(_BASE_KEYS[i], values[i]) for i in _BASE_ORDER)


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _telemetry_runs(text: str) -> tuple[bytes, ...]:
    """The telemetry keys' Struct entries (``text``: the quantised figures), run by run."""
    values = [float(v) for v in text.split()]
    return tuple(b"".join(map(operator.add, prefixes, [_FIXED64(values[i]) for i in run]))
                 for run, prefixes in zip(_TELEMETRY_RUNS, _TELEMETRY_RUN_PREFIXES))


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _rich_metadata(base: tuple[bytes, ...], telemetry: tuple[bytes, ...] | None) -> bytes:
    """The encoded ``LbEndpoint.metadata`` field of the rich (ext_proc) variant."""
    if telemetry is None:
        body = b"".join(base)
    else:
        body = b"".join([base[i] if is_base else telemetry[i] for is_base, i in _PLAN])
    return _len_field(_LB_METADATA, _encode_metadata(body))


def _endpoint_rich_metadata(endpoint: Endpoint) -> bytes:
    text = _quantised_text(endpoint.telemetry)
    return _rich_metadata(_base_entries(_base_values(endpoint)), None if text is None else _telemetry_runs(text))


@functools.lru_cache(maxsize=_ENDPOINT_CACHE_SIZE)
def _rich_entry(address: str, port: int, health: int, weight: int, metadata: bytes) -> bytes:
    """One ``lb_endpoints`` entry of the rich (ext_proc) variant."""
    return _len_field(_LB_ENDPOINTS, b"".join((_lb_address(address, port), _lb_health(health), metadata,
                                                _lb_weight(weight))))


def endpoint_metadata(endpoint: Endpoint) -> dict[str, object]:
    """What ext_proc knows about one endpoint (see the module docstring); telemetry is quantised."""
    meta = dict(zip(_BASE_KEYS, _base_values(endpoint)))
    text = _quantised_text(endpoint.telemetry)
    if text is not None:
        meta.update(zip(_TELEMETRY_NAMES, map(float, text.split())))
    return meta


def eds_health(endpoint: Endpoint) -> int:
    """DRAINING beats everything: Envoy then excludes the host from new picks and lets it finish."""
    if endpoint.draining:
        return health_check_pb2.DRAINING
    return _EDS_HEALTH[endpoint.health]


def _lb_endpoint_entry(endpoint: Endpoint, rich: bool) -> bytes:
    health, weight = eds_health(endpoint), endpoint.effective_weight
    if not rich:
        return _lean_entry(endpoint.address, endpoint.port, health, weight)
    return _rich_entry(endpoint.address, endpoint.port, health, weight, _endpoint_rich_metadata(endpoint))


def _pick_policy_metadata(state: FleetState, replicas: Sequence[str] = ()) -> bytes:
    policy: dict[str, object] = {"pick_policy": {"name": state.pick_policy.name,
                                                 "params": dict(state.pick_policy.params)}}
    if replicas:
        policy["ext_proc_replicas"] = list(replicas)
    return _len_field(_LOCALITY_METADATA, _encode_metadata(_encode_struct(policy)))


@functools.lru_cache(maxsize=16)
def _cla_head(cluster_name: str) -> bytes:
    return _serialized(endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster_name))


_CLA_POLICY = _serialized(endpoint_pb2.ClusterLoadAssignment(
    policy=endpoint_pb2.ClusterLoadAssignment.Policy(overprovisioning_factor=_u32(OVERPROVISIONING_FACTOR))))


class EndpointMemo:
    """The last build's per-endpoint encodings, by endpoint *object*: an optional speed-up
    that the caller owns (the controller keeps one per EDS variant) and passes in.

    ``Endpoint`` values are immutable, so an object seen in the previous build
    encodes to the same bytes: a state that shares most endpoint objects with the
    previous one (``dataclasses.replace`` of a few) costs a dict lookup per
    unchanged endpoint. The memo holds the objects, so their ids are not reused.
    It never changes the bytes; one memo must serve one variant only, and one
    build at a time.
    """

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Endpoint, str, bytes]] = {}


def _sorted_entries(endpoints: Sequence[Endpoint], rich: bool, memo: EndpointMemo | None) -> list[bytes]:
    previous = memo._entries if memo is not None else {}
    current: dict[int, tuple[Endpoint, str, bytes]] = {}
    items = []
    for endpoint in endpoints:
        key = id(endpoint)
        known = previous.get(key)
        if known is None or known[0] is not endpoint:
            known = (endpoint, endpoint.id, _lb_endpoint_entry(endpoint, rich))
        current[key] = known
        items.append(known)
    if memo is not None:
        memo._entries = current
    items.sort(key=_BY_ID)  # stable: by id, then as given
    return [entry for _, _, entry in items]


_BY_ID = operator.itemgetter(1)


def encode_load_assignment(state: FleetState, *, ext_proc: bool = False, memo: EndpointMemo | None = None,
                           replicas: Sequence[str] = ()) -> bytes:
    """The deterministic bytes of :func:`build_load_assignment` (fast: no message is built).

    ``ext_proc=False``: the lean variant Envoy gets (address, health, weight);
    ``ext_proc=True``: the rich variant ext_proc gets (plus the metadata of the module docstring).
    ``memo``: see :class:`EndpointMemo` (the bytes are the same with or without it).
    ``replicas``: the connected ext_proc node ids (rich variant only; see the module docstring).
    """
    entries = _sorted_entries(state.endpoints, ext_proc, memo)
    if ext_proc:
        entries.append(_pick_policy_metadata(state, sorted(replicas)))
    locality = b"".join(entries)
    return b"".join((_cla_head(state.settings.workers_cluster), _CLA_ENDPOINTS, _varint(len(locality)), locality,
                     _CLA_POLICY))


def build_lb_endpoint(endpoint: Endpoint, *, ext_proc: bool = False) -> endpoint_components_pb2.LbEndpoint:
    """One endpoint as it appears in :func:`build_load_assignment`."""
    entry = _lb_endpoint_entry(endpoint, ext_proc)  # an lb_endpoints entry of a LocalityLbEndpoints
    (lb_endpoint,) = endpoint_components_pb2.LocalityLbEndpoints.FromString(entry).lb_endpoints
    return lb_endpoint


def build_load_assignment(state: FleetState, *, ext_proc: bool = False,
                          replicas: Sequence[str] = ()) -> endpoint_pb2.ClusterLoadAssignment:
    """Every endpoint with its weight and health, in one locality, sorted by id.

    The ext_proc variant adds each endpoint's metadata and the pick policy on the locality.
    """
    return endpoint_pb2.ClusterLoadAssignment.FromString(encode_load_assignment(state, ext_proc=ext_proc,
                                                                                replicas=replicas))


def weights_of(cla: endpoint_pb2.ClusterLoadAssignment) -> dict[str, int]:
    """``host:port`` -> load_balancing_weight, over every locality of a ClusterLoadAssignment."""
    weights: dict[str, int] = {}
    for locality in cla.endpoints:
        for lb_endpoint in locality.lb_endpoints:
            socket = lb_endpoint.endpoint.address.socket_address
            weights[f"{socket.address}:{socket.port_value}"] = lb_endpoint.load_balancing_weight.value
    return weights


# --- everything ----------------------------------------------------------------------------------

def build_static_resources(settings: DataPlaneSettings) -> dict[str, dict[str, Message]]:
    """CDS, LDS and RDS: what depends on the settings alone (the same for every node group)."""
    clusters: dict[str, Message] = {settings.workers_cluster: build_workers_cluster(settings)}
    if settings.ext_proc.enabled:  # disabled: no filter calls it, so no cluster either
        clusters[settings.ext_proc_cluster] = build_ext_proc_cluster(settings)
    return {
        type_urls.CLUSTER: clusters,
        type_urls.LISTENER: {settings.listener_name: build_listener(settings)},
        type_urls.ROUTE: {settings.route_name: build_route_configuration(settings)},
    }


def build_resources(state: FleetState, *, ext_proc: bool = False) -> dict[str, dict[str, Message]]:
    """Type URL -> resource name -> message: the whole snapshot of one node group for one state.

    ``ext_proc=False``: the Envoys' snapshot; ``ext_proc=True``: ext_proc's (the rich EDS).
    """
    resources = build_static_resources(state.settings)
    resources[type_urls.ENDPOINT] = {state.settings.workers_cluster: build_load_assignment(state, ext_proc=ext_proc)}
    return resources
