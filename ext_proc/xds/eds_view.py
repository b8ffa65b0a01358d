"""The :class:`~ext_proc.xds.fleet_view.FleetView` a ClusterLoadAssignment from the control plane describes.

The control plane serves ext_proc's node cluster (``inferlb-ext-proc``) a rich
variant of the ``workers`` assignment: per endpoint,
``filter_metadata["inferlb"]`` with ``draining``, ``health`` and the scraped
telemetry; on the locality, ``{"pick_policy": {"name", "params"}}`` and
``ext_proc_replicas`` (the connected replicas' node ids, sorted): our index
among them is ``FleetView.partition``. Model routing (issue 15,
``inferlb_runtime/model_routing.py``): per endpoint ``models``,
``model_aliases`` and ``pool``; on the locality ``rollouts``. A malformed
rollout table is not a reason to refuse the endpoints: the view is taken
without rollouts and the reason kept in ``FleetView.rollouts_error``, so the
fleet keeps routing by version while the operator fixes it. Anything else
unusable raises :class:`InvalidResource`, whose message is the NACK's reason.
"""

from __future__ import annotations

import ipaddress
import time
from types import MappingProxyType
from typing import Any, Mapping

from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from inferlb_runtime.model_routing import (ALIASES_KEY, DEFAULT_POOL, MODEL_NAME_PATTERN, MODELS_KEY, POOL_KEY,
                                           ROLLOUTS_KEY, InvalidRollouts, Rollout, decode_rollouts)

from ..model import EndpointView
from .fleet_view import FleetView, PickPolicySpec

ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
METADATA_NAMESPACE = "inferlb"
# Keys of the endpoint metadata that are state, not telemetry.
_STATE_KEYS = frozenset({"id", "weight", "computed_weight", "pinned_weight", "draining", "health", MODELS_KEY,
                         ALIASES_KEY, POOL_KEY})
_ROUTABLE_STATUSES = frozenset({health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY})


class InvalidResource(ValueError):
    """A response ext_proc cannot use; the message goes back to the control plane in the NACK."""


class ForeignResource(InvalidResource):
    """An assignment for another cluster: ignored, not NACKed."""


def _value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        return value.number_value
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return {k: _value(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_value(v) for v in value.list_value.values]
    return None


def _inferlb_metadata(metadata: base_pb2.Metadata) -> Mapping[str, struct_pb2.Value]:
    struct = metadata.filter_metadata.get(METADATA_NAMESPACE)
    return struct.fields if struct is not None else {}


def _pick_policy(fields: Mapping[str, struct_pb2.Value]) -> PickPolicySpec | None:
    raw = fields.get("pick_policy")
    if raw is None:
        return None
    spec = _value(raw)
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidResource(f"locality metadata inferlb.pick_policy must be {{name, params}}, got {spec!r}")
    params = spec.get("params") or {}
    if not isinstance(params, dict):
        raise InvalidResource(f"pick_policy.params must be an object, got {params!r}")
    return PickPolicySpec(spec["name"], MappingProxyType(params))


def _rollouts(fields: Mapping[str, struct_pb2.Value]) -> tuple[Mapping[str, Rollout], str | None]:
    """The locality's rollout table (none when absent: a control plane from before rollouts), or none and
    the reason it is unusable."""
    raw = fields.get(ROLLOUTS_KEY)
    if raw is None:
        return {}, None
    try:
        return decode_rollouts(_value(raw)), None
    except InvalidRollouts as exc:
        return {}, f"locality metadata inferlb.{ROLLOUTS_KEY} ignored: {exc}"


def _names(fields: Mapping[str, struct_pb2.Value], key: str, where: str) -> tuple[str, ...]:
    """A list of model names; a name that is not one (it could not be a header or a label) is left out."""
    raw = fields.get(key)
    if raw is None:
        return ()
    names = _value(raw)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidResource(f"endpoint {where}: metadata inferlb.{key} must be a list of strings, got {names!r}")
    return tuple(dict.fromkeys(n for n in names if MODEL_NAME_PATTERN.match(n)))


def _partition(fields: Mapping[str, struct_pb2.Value], node_id: str) -> tuple[int, int] | None:
    """(our index, count) in the locality's ``ext_proc_replicas``; None when absent or we are not listed
    (just connected: the next update lists us)."""
    raw = fields.get("ext_proc_replicas")
    if raw is None:
        return None
    replicas = _value(raw)
    if not isinstance(replicas, list) or not all(isinstance(r, str) for r in replicas):
        raise InvalidResource(f"locality metadata inferlb.ext_proc_replicas must be a list of node ids, "
                              f"got {replicas!r}")
    if node_id not in replicas:
        return None
    return replicas.index(node_id), len(replicas)


def _endpoint(lb: Any) -> EndpointView:
    socket = lb.endpoint.address.socket_address
    if not socket.address or socket.WhichOneof("port_specifier") != "port_value":
        raise InvalidResource("an lb_endpoint has no socket address with a port_value")
    if not 0 < socket.port_value < 65536:
        raise InvalidResource(f"endpoint {socket.address}: port {socket.port_value} out of range")
    try:
        ipaddress.ip_address(socket.address)
    except ValueError:
        # override_host matches ip:port: a host name could never be picked.
        raise InvalidResource(f"endpoint address {socket.address!r} is not an IP address") from None
    fields = _inferlb_metadata(lb.metadata)
    status = lb.health_status
    draining = status == health_check_pb2.DRAINING
    healthy = status in _ROUTABLE_STATUSES
    if "draining" in fields:
        draining = draining or fields["draining"].bool_value
    if "health" in fields and fields["health"].string_value == "unhealthy":
        healthy = False
    telemetry = {k: v.number_value for k, v in fields.items()
                 if k not in _STATE_KEYS and v.WhichOneof("kind") == "number_value"}
    weight = lb.load_balancing_weight.value if lb.HasField("load_balancing_weight") else 1
    endpoint_id = f"{socket.address}:{socket.port_value}"
    pool = fields[POOL_KEY].string_value if POOL_KEY in fields else DEFAULT_POOL
    if POOL_KEY in fields and fields[POOL_KEY].WhichOneof("kind") != "string_value":
        raise InvalidResource(f"endpoint {endpoint_id}: metadata inferlb.{POOL_KEY} must be a string")
    return EndpointView(id=endpoint_id, address=socket.address, port=socket.port_value, weight=weight,
                        healthy=healthy, draining=draining, telemetry=MappingProxyType(telemetry),
                        models=_names(fields, MODELS_KEY, endpoint_id),
                        model_aliases=_names(fields, ALIASES_KEY, endpoint_id), pool=pool or DEFAULT_POOL)


def parse_load_assignment(data: bytes, cluster: str, version: str, node_id: str = "") -> FleetView:
    """The view a serialised ClusterLoadAssignment describes; :class:`InvalidResource` if unusable.

    ``node_id``: ours, to find our index in the locality's ``ext_proc_replicas``.
    """
    cla = endpoint_pb2.ClusterLoadAssignment()
    try:
        cla.ParseFromString(data)
    except DecodeError as exc:
        raise InvalidResource(f"ClusterLoadAssignment does not parse: {exc}") from None
    if cla.cluster_name != cluster:
        raise ForeignResource(f"ClusterLoadAssignment for {cla.cluster_name!r}, subscribed to {cluster!r}")
    endpoints: list[EndpointView] = []
    seen: set[str] = set()
    spec: PickPolicySpec | None = None
    partition: tuple[int, int] | None = None
    rollouts: Mapping[str, Rollout] = {}
    rollouts_error: str | None = None
    for locality in cla.endpoints:
        fields = _inferlb_metadata(locality.metadata)
        spec = _pick_policy(fields) or spec
        partition = _partition(fields, node_id) or partition
        if ROLLOUTS_KEY in fields:
            rollouts, rollouts_error = _rollouts(fields)
        for lb in locality.lb_endpoints:
            info = _endpoint(lb)
            if info.id in seen:
                raise InvalidResource(f"endpoint {info.id} is listed twice")
            seen.add(info.id)
            endpoints.append(info)
    return FleetView(version, tuple(endpoints), spec, time.monotonic(), partition or (0, 1),
                     MappingProxyType(dict(rollouts)), rollouts_error)
