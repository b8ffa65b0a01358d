"""Envoy with its own balancer: a static bootstrap, the fleet as a STATIC cluster.

The baselines (a)-(c) of the comparison. Everything but the load-balancing
policy is the same as in inferlb's own Envoy (``control_plane/resources.py``),
so that the policy is the only difference: one HTTP listener, one route to the
``workers`` cluster, the same request/idle/route timeout, no retries (the bench
sets inferlb's to 0 too), the same circuit-breaker thresholds (Envoy's default
1024 pending would fail requests that inferlb's Envoy queues), and the same
local replies (Envoy's own errors in OpenAI's shape: ``build_local_reply_config``).

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

from google.protobuf import json_format

from control_plane.resources import build_local_reply_config

WORKERS_CLUSTER = "workers"

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

# The same thresholds as inferlb's workers cluster (control_plane/model.py DataPlaneSettings).
CIRCUIT_BREAKER_LIMIT = 4096


def _seconds(value: float) -> str:
    return f"{value:g}s"


def lb_policy(configuration: str) -> dict[str, Any]:
    """The cluster's ``load_balancing_policy`` for one baseline configuration."""
    try:
        name, settings = POLICIES[configuration]
    except KeyError:
        raise ValueError(f"not an Envoy baseline: {configuration!r}; known: {', '.join(POLICIES)}") from None
    return {"policies": [{"typed_extension_config": {
        "name": name, "typed_config": {"@type": _TYPES[name], **settings}}}]}


def render_static_bootstrap(
    configuration: str,
    *,
    endpoints: Sequence[tuple[str, int]],
    listener_port: int,
    admin_port: int,
    request_timeout_s: float,
    node_id: str = "inferlb-bench",
) -> dict[str, Any]:
    """The whole bootstrap (a dict: write it as JSON, which is YAML) of one Envoy baseline."""
    if not endpoints:
        raise ValueError("a baseline needs at least one endpoint")
    timeout = _seconds(request_timeout_s)
    limit = CIRCUIT_BREAKER_LIMIT
    route = {"match": {"prefix": "/"}, "route": {"cluster": WORKERS_CLUSTER, "timeout": timeout}}
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "bench_http",
        "codec_type": "AUTO",
        "route_config": {"name": "bench_routes",
                         "virtual_hosts": [{"name": "workers", "domains": ["*"], "routes": [route]}]},
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "request_timeout": timeout,
        "stream_idle_timeout": timeout,
        "use_remote_address": False,
        # No body buffer limit here (nothing buffers the body): the 413 message names none.
        "local_reply_config": json_format.MessageToDict(build_local_reply_config(None),
                                                        preserving_proto_field_name=True),
    }
    cluster = {
        "name": WORKERS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_balancing_policy": lb_policy(configuration),
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_connections": limit,
                                             "max_pending_requests": limit, "max_requests": limit,
                                             "max_retries": 64}]},
        "load_assignment": {"cluster_name": WORKERS_CLUSTER, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in endpoints]}]},
    }
    return {
        "node": {"id": node_id, "cluster": "inferlb-bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "bench_http",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                "typed_config": manager}]}],
            }],
            "clusters": [cluster],
        },
    }
