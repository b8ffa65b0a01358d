"""The route configuration: every request goes to the workers cluster.

Why it is here and not inline in the listener: Envoy gets it by RDS, so a route change never
rebuilds the listener (and never drains its connections). Retries avoid the host that just
failed, and the route sets the request-body buffer limit that ext_proc's buffering obeys.
"""

from __future__ import annotations

from google.protobuf import wrappers_pb2

from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2

from ..model import DataPlaneSettings
from .messages import duration, pack, u32

PREVIOUS_HOSTS_PREDICATE = "envoy.retry_host_predicates.previous_hosts"
# Not "5xx": a worker's 504 deadline_exceeded means the request's budget is spent, and a retry would
# arrive at another worker with a fresh budget (the header is relative), stretching the client's deadline.
RETRY_ON = "connect-failure,refused-stream,reset,retriable-status-codes"
RETRIABLE_STATUS_CODES = (500, 502, 503)


def build_route_configuration(settings: DataPlaneSettings) -> route_pb2.RouteConfiguration:
    """Everything goes to the workers cluster; retries avoid the host that just failed."""
    retry = route_components_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        retriable_status_codes=RETRIABLE_STATUS_CODES,
        num_retries=u32(settings.retries),
        retry_host_predicate=[route_components_pb2.RetryPolicy.RetryHostPredicate(
            name=PREVIOUS_HOSTS_PREDICATE, typed_config=pack(previous_hosts_pb2.PreviousHostsPredicate()),
        )],
        host_selection_retry_max_attempts=3,
    )
    route = route_components_pb2.Route(
        name="workers",
        match=route_components_pb2.RouteMatch(prefix="/"),
        route=route_components_pb2.RouteAction(
            cluster=settings.workers_cluster,
            timeout=duration(settings.request_timeout_s),
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
