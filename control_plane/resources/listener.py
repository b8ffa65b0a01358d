"""The listener: one HTTP connection manager whose filters are strip-pick, ext_proc and router.

Why this shape: a client-sent pick header is dropped first (only ext_proc chooses hosts), ext_proc
then sees the request and names the endpoint, and the router forwards it; routes come by RDS over
the same ADS stream, and Envoy's own error replies are in OpenAI's shape (``local_reply``).
"""

from __future__ import annotations

from google.protobuf import wrappers_pb2

from envoy.config.core.v3 import base_pb2, grpc_service_pb2
from envoy.config.common.mutation_rules.v3 import mutation_rules_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.trace.v3 import http_tracer_pb2, opentelemetry_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.header_mutation.v3 import header_mutation_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.request_id.uuid.v3 import uuid_pb2
from envoy.extensions.transport_sockets.tls.v3 import common_pb2 as tls_common_pb2
from envoy.extensions.transport_sockets.tls.v3 import tls_pb2
from envoy.type.v3 import http_status_pb2, percent_pb2

from inferlb_runtime.model_routing import MODEL_HEADER

from ..model import DataPlaneSettings
from .access_log import build_access_log
from .local_reply import build_local_reply_config
from .messages import ads, duration, pack, socket_address

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
STRIP_PICK_FILTER = "envoy.filters.http.header_mutation"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
TLS_TRANSPORT_SOCKET = "envoy.transport_sockets.tls"
OPENTELEMETRY_TRACER = "envoy.tracers.opentelemetry"
# Envoy's span export to the collector: a bounded call, so a collector gone slow costs Envoy nothing more.
TRACE_EXPORT_TIMEOUT_S = 1.0

# Slow-loris guard for request headers; bodies are bounded by request_timeout.
REQUEST_HEADERS_TIMEOUT_S = 10.0


def cache_fill_mode() -> processing_mode_pb2.ProcessingMode:
    """The one override ext_proc may ask for: the configured modes, plus this response's body, buffered up to
    Envoy's limit (BUFFERED_PARTIAL: a bigger body is sent in part, never failed, and is then not cached)."""
    mode = processing_mode_pb2.ProcessingMode
    return mode(request_header_mode=mode.SEND, request_body_mode=mode.BUFFERED, request_trailer_mode=mode.SKIP,
                response_header_mode=mode.SEND, response_body_mode=mode.BUFFERED_PARTIAL,
                response_trailer_mode=mode.SKIP)


def build_ext_proc_filter(settings: DataPlaneSettings) -> ext_proc_pb2.ExternalProcessor:
    """The pick: ext_proc sees headers and the whole body, answers with the endpoint to use."""
    mode = processing_mode_pb2.ProcessingMode
    ext = settings.ext_proc
    return ext_proc_pb2.ExternalProcessor(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=settings.ext_proc_cluster),
            # The stream lives as long as the HTTP request (response headers are sent
            # too), so never cut it before the route timeout; message_timeout bounds each step.
            timeout=duration(settings.request_timeout_s),
        ),
        failure_mode_allow=ext.failure_mode_allow,
        # Failing closed (API keys required): 503, which clients retry, rather than Envoy's default 500.
        status_on_error=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable),
        message_timeout=duration(ext.message_timeout_ms / 1000),
        # ext_proc extends it (override_message_timeout) for a request waiting in its fair admission queue.
        max_message_timeout=duration(ext.max_message_timeout_ms / 1000),
        processing_mode=mode(
            request_header_mode=mode.SEND,
            request_body_mode=mode.BUFFERED,
            request_trailer_mode=mode.SKIP,
            response_header_mode=mode.SEND,
            response_body_mode=mode.NONE,
            response_trailer_mode=mode.SKIP,
        ),
        # ext_proc asks for one response's body (mode_override in its response-headers answer) to fill its
        # gateway cache: only for a cacheable 200 miss, so hits and other answers cost nothing more. That one
        # mode only: any other override (say, every request's body streamed) is ignored by Envoy.
        allow_mode_override=True,
        allowed_override_modes=[cache_fill_mode()],
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
        # The client's address: callers without an API key wait at ext_proc's admission as one flow each.
        request_attributes=["source.address"],
        # The host that really answered (after retries): the cost model learns for the right one.
        response_attributes=["upstream.address"],
    )


def build_tracing(settings: DataPlaneSettings) -> hcm_pb2.HttpConnectionManager.Tracing:
    """Envoy's OpenTelemetry tracer: a span per request (and one per call to ext_proc and to the worker,
    ``spawn_upstream_span``), exported over OTLP/gRPC to the collector's cluster. Envoy writes its span's
    ``traceparent`` into the gRPC metadata of its ext_proc call and into the request it forwards, so ext_proc
    and the worker make their spans children of Envoy's: one trace per request (docs/tracing.md)."""
    tracing = settings.tracing
    assert tracing is not None
    config = opentelemetry_pb2.OpenTelemetryConfig(
        grpc_service=grpc_service_pb2.GrpcService(
            envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=settings.tracing_cluster),
            timeout=duration(TRACE_EXPORT_TIMEOUT_S),
        ),
        service_name=tracing.service_name,
    )
    return hcm_pb2.HttpConnectionManager.Tracing(
        provider=http_tracer_pb2.Tracing.Http(name=OPENTELEMETRY_TRACER, typed_config=pack(config)),
        random_sampling=percent_pb2.Percent(value=tracing.sampling_percent),
        spawn_upstream_span=wrappers_pb2.BoolValue(value=True),
    )


def build_strip_pick_filter(settings: DataPlaneSettings) -> header_mutation_pb2.HeaderMutation:
    """Drop a client-sent pick header and model-version header at the edge: only ext_proc chooses.

    override_host honours the pick header, so without this a client could pin any
    host, and would keep doing so whenever ext_proc fails open; the worker honours
    ``x-inferlb-model``, so a client could likewise step around a rollout.
    """
    return header_mutation_pb2.HeaderMutation(
        mutations=header_mutation_pb2.Mutations(
            request_mutations=[mutation_rules_pb2.HeaderMutation(remove=header)
                               for header in (settings.pick_header, MODEL_HEADER)],
        ),
    )


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
    return base_pb2.TransportSocket(name=TLS_TRANSPORT_SOCKET, typed_config=pack(context))


def build_listener(settings: DataPlaneSettings) -> listener_pb2.Listener:
    """HTTP listener (HTTPS when the settings name a certificate and key): ext_proc picks, the router
    forwards; routes arrive by RDS over ADS; Envoy's own error replies in OpenAI's shape."""
    manager = hcm_pb2.HttpConnectionManager(
        stat_prefix=settings.listener_name,
        codec_type=hcm_pb2.HttpConnectionManager.AUTO,
        rds=hcm_pb2.Rds(config_source=ads(), route_config_name=settings.route_name),
        http_filters=[
            hcm_pb2.HttpFilter(name=STRIP_PICK_FILTER, typed_config=pack(build_strip_pick_filter(settings))),
            *([hcm_pb2.HttpFilter(name=EXT_PROC_FILTER, typed_config=pack(build_ext_proc_filter(settings)))]
              if settings.ext_proc.enabled else []),
            hcm_pb2.HttpFilter(name=ROUTER_FILTER, typed_config=pack(router_pb2.Router())),
        ],
        request_timeout=duration(settings.request_timeout_s),
        request_headers_timeout=duration(REQUEST_HEADERS_TIMEOUT_S),
        # An inference can be silent for as long as the route allows; never cut it earlier.
        stream_idle_timeout=duration(settings.request_timeout_s),
        use_remote_address=wrappers_pb2.BoolValue(value=False),
        normalize_path=wrappers_pb2.BoolValue(value=True),
        merge_slashes=True,
        local_reply_config=build_local_reply_config(settings.ext_proc.max_request_body_bytes),
        access_log=[build_access_log()] if settings.access_log else [],
    )
    if settings.tracing is not None:
        manager.tracing.CopyFrom(build_tracing(settings))
        # Envoy's default samples by bits it writes into its own UUID x-request-id, so a request whose client
        # sent an id of its own (any string) would never be traced: sample at random instead, keep the id as sent.
        manager.request_id_extension.typed_config.CopyFrom(pack(uuid_pb2.UuidRequestIdConfig(
            pack_trace_reason=wrappers_pb2.BoolValue(value=False),
            use_request_id_for_trace_sampling=wrappers_pb2.BoolValue(value=False))))
    chain = listener_components_pb2.FilterChain(filters=[
        listener_components_pb2.Filter(name=HCM_FILTER, typed_config=pack(manager)),
    ])
    if settings.listener_tls_cert is not None and settings.listener_tls_key is not None:
        chain.transport_socket.CopyFrom(build_downstream_tls(settings.listener_tls_cert, settings.listener_tls_key))
    return listener_pb2.Listener(
        name=settings.listener_name,
        address=socket_address(settings.listener_address, settings.listener_port),
        filter_chains=[chain],
    )
