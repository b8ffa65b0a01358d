"""The one static Envoy config of the bench, derived from the control plane's own builders.

Every static Envoy the bench starts (the baselines (a)-(c) of ``inferlb bench
run``, and the no-filter / trivial-servicer / ext_proc Envoys of ``inferlb bench
ext-proc``) is ``static_bootstrap``: the very Listener, RouteConfiguration and
Cluster protos that ``control_plane.resources`` sends over xDS, with the route
inline instead of RDS and the endpoints inline instead of EDS. So the listener,
timeouts, circuit breakers, health checks and local replies (Envoy's own errors
in OpenAI's shape) are inferlb's own, and what a benchmark varies is named:

- the baselines keep everything but the load-balancing policy (``render_static_bootstrap``):
  Envoy's own balancer instead of override_host, no ext_proc filter, no retries
  (the bench sets inferlb's to 0 too);
- the ext_proc bench keeps or removes the ext_proc filter, trims its messages, or
  has Envoy answer by itself (``direct_response``).

CSWRR (``envoy_cswrr_orca``) reads the ORCA report that every worker puts on
every response (``endpoint-load-metrics: TEXT cpu_utilization=..,
rps_fractional=..``); Envoy's router hands per-request reports to the policy
without further configuration, and out-of-band reporting stays off. Weight =
rps / utilization. Its documented defaults suit long-lived fleets (10 s
blackout, 1 s update); a 20 s run on a fresh fleet needs shorter ones, see
``CSWRR_SETTINGS``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from google.protobuf import json_format

from control_plane import resources
from control_plane.config import DataPlaneConfig
from control_plane.model import DataPlaneSettings, Endpoint, FleetState

WORKERS_CLUSTER = DataPlaneSettings().workers_cluster
NODE_CLUSTER = "inferlb-bench"

ROUND_ROBIN = "envoy.load_balancing_policies.round_robin"
LEAST_REQUEST = "envoy.load_balancing_policies.least_request"
CSWRR = "envoy.load_balancing_policies.client_side_weighted_round_robin"

_TYPES = {
    ROUND_ROBIN: "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
    LEAST_REQUEST: "type.googleapis.com/envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
    CSWRR: "type.googleapis.com/envoy.extensions.load_balancing_policies.client_side_weighted_round_robin.v3."
           "ClientSideWeightedRoundRobin",
}

# Envoy 1.40 docs (client_side_weighted_round_robin.proto): blackout_period default 10 s (a host's
# weight is not used until it has reported for that long), weight_update_period default 1 s (minimum
# 100 ms), weight_expiration_period default 3 min, error_utilization_penalty default 1.0.
# - blackout 1 s: the fleet is fresh for every configuration and the warm-up is ~3 s; with 10 s the
#   first half of a 20 s run would be plain round robin. 1 s still averages several reports.
# - update 0.5 s: the workers resample cpu_utilization and rps every 0.5 s; faster updates would only
#   re-read the same report.
# - expiration and penalty: the documented defaults (no errors are expected; reports never stop).
CSWRR_SETTINGS: Mapping[str, Any] = {
    "blackout_period": "1s",
    "weight_update_period": "0.5s",
    "weight_expiration_period": "180s",
    "error_utilization_penalty": 1.0,
}

# The baselines' policies, by configuration name.
POLICIES: Mapping[str, tuple[str, Mapping[str, Any]]] = {
    "envoy_round_robin": (ROUND_ROBIN, {}),
    "envoy_least_request": (LEAST_REQUEST, {"choice_count": 2}),  # Envoy's default P2C, written out
    "envoy_cswrr_orca": (CSWRR, CSWRR_SETTINGS),
}

def lb_policy(configuration: str) -> dict[str, Any]:
    """The cluster's ``load_balancing_policy`` for one baseline configuration."""
    try:
        name, settings = POLICIES[configuration]
    except KeyError:
        raise ValueError(f"not an Envoy baseline: {configuration!r}; known: {', '.join(POLICIES)}") from None
    return {"policies": [{"typed_extension_config": {
        "name": name, "typed_config": {"@type": _TYPES[name], **settings}}}]}


def _manager(listener: Any) -> tuple[Any, hcm_pb2.HttpConnectionManager]:
    """The listener's HTTP connection manager, unpacked (and the Any to pack it back into)."""
    packed = listener.filter_chains[0].filters[0].typed_config
    manager = hcm_pb2.HttpConnectionManager()
    if not packed.Unpack(manager):
        raise RuntimeError("the listener's first network filter is not the HTTP connection manager")
    return packed, manager


def _trim_ext_proc(manager: hcm_pb2.HttpConnectionManager, messages: int) -> None:
    """``messages`` < 3: skip the response headers (2), then the request headers too (1: body only)."""
    for http_filter in manager.http_filters:
        if http_filter.name == resources.EXT_PROC_FILTER:
            config = ext_proc_pb2.ExternalProcessor()
            http_filter.typed_config.Unpack(config)
            config.processing_mode.response_header_mode = processing_mode_pb2.ProcessingMode.SKIP
            if messages < 2:
                config.processing_mode.request_header_mode = processing_mode_pb2.ProcessingMode.SKIP
            http_filter.typed_config.Pack(config)


def static_bootstrap(settings: DataPlaneSettings, endpoints: Sequence[tuple[str, int]], *, admin_port: int,
                     node_id: str = "inferlb-bench", ext_proc_messages: int = 3,
                     direct_response: bytes | None = None) -> bootstrap_pb2.Bootstrap:
    """A static Envoy of ``settings`` in front of ``endpoints``: the control plane's listener, route and
    workers cluster (and its ext_proc cluster when ``settings.ext_proc.enabled``), made static.

    ``ext_proc_messages``: 3 as the control plane builds it (request headers, buffered body, response
    headers); 2 skips the response headers; 1 the request headers too (body only: Envoy's router then
    picks the host at the request headers, before ext_proc answers, so override_host never sees the
    pick: a floor, not an option). ``direct_response``: Envoy answers 200 with this body itself instead
    of routing to the workers, so that the upstream costs nothing. Without retries
    (``settings.retries == 0``) the route carries no retry policy at all.
    """
    if not endpoints:
        raise ValueError("a static Envoy needs at least one endpoint")
    if ext_proc_messages not in (1, 2, 3):
        raise ValueError(f"ext_proc_messages is 1, 2 or 3, got {ext_proc_messages}")
    listener = resources.build_listener(settings)
    packed, manager = _manager(listener)
    if settings.ext_proc.enabled and ext_proc_messages < 3:
        _trim_ext_proc(manager, ext_proc_messages)
    routes = resources.build_route_configuration(settings)
    for route in routes.virtual_hosts[0].routes:
        if settings.retries == 0:
            route.route.ClearField("retry_policy")
        if direct_response is not None:
            route.direct_response.CopyFrom(route_components_pb2.DirectResponseAction(status=200))
            route.direct_response.body.inline_bytes = direct_response
    manager.route_config.CopyFrom(routes)  # replaces rds (a oneof)
    packed.Pack(manager)
    cluster = resources.build_workers_cluster(settings)
    cluster.type = cluster_pb2.Cluster.STATIC
    cluster.ClearField("eds_cluster_config")
    fleet = FleetState(endpoints=tuple(Endpoint(host, port) for host, port in endpoints), settings=settings)
    cluster.load_assignment.CopyFrom(resources.build_load_assignment(fleet))
    # build_load_assignment sorts by id; keep the fleet's own order (worker i is the i-th host)
    by_id = {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}": e
             for e in cluster.load_assignment.endpoints[0].lb_endpoints}
    ordered = [by_id[f"{host}:{port}"] for host, port in endpoints]
    del cluster.load_assignment.endpoints[0].lb_endpoints[:]
    cluster.load_assignment.endpoints[0].lb_endpoints.extend(ordered)
    bootstrap = bootstrap_pb2.Bootstrap()
    bootstrap.node.id = node_id
    bootstrap.node.cluster = NODE_CLUSTER
    bootstrap.admin.address.socket_address.address = "127.0.0.1"
    bootstrap.admin.address.socket_address.port_value = admin_port
    bootstrap.static_resources.listeners.append(listener)
    bootstrap.static_resources.clusters.append(cluster)
    if settings.ext_proc.enabled:
        bootstrap.static_resources.clusters.append(resources.build_ext_proc_cluster(settings))
    return bootstrap


def bootstrap_dict(bootstrap: bootstrap_pb2.Bootstrap) -> dict[str, Any]:
    """The bootstrap as Envoy reads it from JSON (proto field names)."""
    return json_format.MessageToDict(bootstrap, preserving_proto_field_name=True)


def render_static_bootstrap(
    configuration: str,
    *,
    endpoints: Sequence[tuple[str, int]],
    listener_port: int,
    admin_port: int,
    request_timeout_s: float,
    node_id: str = "inferlb-bench",
) -> dict[str, Any]:
    """The whole bootstrap (a dict: write it as JSON, which is YAML) of one Envoy baseline: inferlb's
    static Envoy without ext_proc and retries, with Envoy's own balancer for ``configuration``."""
    policy = lb_policy(configuration)
    if not endpoints:
        raise ValueError("a baseline needs at least one endpoint")
    settings = DataPlaneConfig(listener_port=listener_port, request_timeout_s=request_timeout_s, retries=0,
                               ext_proc_enabled=False).settings()
    doc = bootstrap_dict(static_bootstrap(settings, endpoints, admin_port=admin_port, node_id=node_id))
    doc["static_resources"]["clusters"][0]["load_balancing_policy"] = policy
    return doc
