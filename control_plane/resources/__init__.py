"""Pure builders: one ``FleetState`` (or its ``DataPlaneSettings``) in, the Envoy v3 resources out.

No I/O and no clocks: the xDS server versions each resource by a hash of its
deterministic bytes, so the same state must always give the same bytes, and a
change that only touches weights or telemetry must only change the
ClusterLoadAssignment (Envoy then re-sends nothing else and keeps its
connections and listeners as they are).

One module per resource kind, so that each reads on its own:

* ``listener``: the HTTP connection manager and its filters (strip-pick, ext_proc, router), TLS, tracing;
* ``local_reply``: Envoy's own error replies in OpenAI's shape;
* ``routes``: the route configuration (RDS);
* ``clusters``: the workers cluster (override_host over least_request), the ext_proc cluster and the
  OpenTelemetry collector's (when Envoy traces);
* ``endpoints``: the ClusterLoadAssignment (EDS) in its two variants, Envoy's and ext_proc's;
* ``struct_wire``: the hand-written canonical encoding of the EDS metadata Structs;
* ``messages``: the small protobuf constructors they all use;
* ``bundle``: every resource of one node group, by type URL;
* ``api_keys``: ext_proc's API key table (a Struct; ext_proc's node group only).

The names below are the package's public surface: ``from control_plane.resources import X``.
"""

from .api_keys import build_api_keys
from .bundle import build_resources, build_static_resources
from .clusters import (
    H2_KEEPALIVE_INTERVAL_S,
    H2_KEEPALIVE_TIMEOUT_S,
    HTTP_PROTOCOL_OPTIONS_KEY,
    LEAST_REQUEST_POLICY,
    OVERRIDE_HOST_POLICY,
    build_collector_cluster,
    build_ext_proc_cluster,
    build_lb_policy,
    build_workers_cluster,
)
from .endpoints import (
    METADATA_NAMESPACE,
    OVERPROVISIONING_FACTOR,
    TELEMETRY_SIGNIFICANT_DIGITS,
    EndpointMemo,
    build_lb_endpoint,
    build_load_assignment,
    eds_health,
    encode_load_assignment,
    endpoint_metadata,
    quantise,
    weights_of,
)
from .listener import (
    EXT_PROC_FILTER,
    HCM_FILTER,
    OPENTELEMETRY_TRACER,
    REQUEST_HEADERS_TIMEOUT_S,
    ROUTER_FILTER,
    STRIP_PICK_FILTER,
    TLS_TRANSPORT_SOCKET,
    build_downstream_tls,
    build_ext_proc_filter,
    build_listener,
    build_strip_pick_filter,
    build_tracing,
)
from .local_reply import (
    CEL_FILTER,
    EXT_PROC_DETAILS_PREFIX,
    LOCAL_REPLIES,
    OTHER_CLIENT_ERROR,
    OTHER_MESSAGE,
    OTHER_SERVER_ERROR,
    build_local_reply_config,
)
from .routes import PREVIOUS_HOSTS_PREDICATE, RETRY_ON, build_route_configuration

__all__ = [
    "CEL_FILTER",
    "EXT_PROC_DETAILS_PREFIX",
    "EXT_PROC_FILTER",
    "H2_KEEPALIVE_INTERVAL_S",
    "H2_KEEPALIVE_TIMEOUT_S",
    "HCM_FILTER",
    "HTTP_PROTOCOL_OPTIONS_KEY",
    "LEAST_REQUEST_POLICY",
    "LOCAL_REPLIES",
    "METADATA_NAMESPACE",
    "OTHER_CLIENT_ERROR",
    "OTHER_MESSAGE",
    "OPENTELEMETRY_TRACER",
    "OTHER_SERVER_ERROR",
    "OVERPROVISIONING_FACTOR",
    "OVERRIDE_HOST_POLICY",
    "PREVIOUS_HOSTS_PREDICATE",
    "REQUEST_HEADERS_TIMEOUT_S",
    "RETRY_ON",
    "ROUTER_FILTER",
    "STRIP_PICK_FILTER",
    "TELEMETRY_SIGNIFICANT_DIGITS",
    "TLS_TRANSPORT_SOCKET",
    "EndpointMemo",
    "build_api_keys",
    "build_collector_cluster",
    "build_downstream_tls",
    "build_ext_proc_cluster",
    "build_ext_proc_filter",
    "build_lb_endpoint",
    "build_lb_policy",
    "build_listener",
    "build_load_assignment",
    "build_local_reply_config",
    "build_resources",
    "build_route_configuration",
    "build_static_resources",
    "build_strip_pick_filter",
    "build_tracing",
    "build_workers_cluster",
    "eds_health",
    "encode_load_assignment",
    "endpoint_metadata",
    "quantise",
    "weights_of",
]
