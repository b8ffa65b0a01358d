"""ext_proc's view of the fleet, kept live over ADS from the control plane.

ext_proc is an xDS client like Envoy: it subscribes to EDS for the ``workers``
ClusterLoadAssignment, and to the API key table (``inferlb-api-keys``, a
``google.protobuf.Struct``: :mod:`ext_proc.tenants`) on the same stream, each
type with its own version and nonce. The control plane serves ext_proc's
node cluster (``inferlb-ext-proc``) a rich variant of it: per endpoint,
``filter_metadata["inferlb"]`` with ``draining``, ``health`` and the scraped
telemetry; on the locality, ``{"pick_policy": {"name", "params"}}`` and
``ext_proc_replicas`` (the connected replicas' node ids, sorted): our index
among them is ``FleetView.partition``. Model routing (issue 15,
``inferlb_runtime/model_routing.py``): per endpoint ``models``,
``model_aliases`` and ``pool``; on the locality ``rollouts``. A malformed
rollout table is not a reason to refuse the endpoints: the view is taken
without rollouts and the reason logged (once per distinct reason), so the
fleet keeps routing by version while the operator fixes it.

What the per-request path reads is one immutable :class:`FleetView`,
replaced as a whole on each accepted update (an attribute swap is atomic on
the event loop): a decision never sees half an update; the same for the
:class:`~ext_proc.tenants.KeyTable` (``key_table``: None until the first
arrives; a control plane that does not serve the type never sends one). While
the control plane is unreachable the last view and table stay in force;
ext_proc keeps routing.

Protocol choices:

* Delta (incremental) by default: on a reconnect ext_proc declares the
  version it holds in ``initial_resource_versions`` and the server resends
  nothing if that is still current. State of the world is there for control
  planes that only speak it.
* A response that cannot be turned into a view (or a key table) is NACKed
  with the reason in ``error_detail``, and the previous one is kept (as Envoy
  does).
* Plaintext by default (the control plane on loopback); with ``tls`` the
  channel is mutual TLS: ext_proc presents its certificate and checks the
  control plane's against the given CA and name.
* Reconnects use full-jitter exponential backoff, bounded (0.25 s -> 5 s by
  default), reset after a stream that delivered a good response.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Generic, Mapping, Protocol, Sequence, TypeVar

import grpc
from envoy.config.core.v3 import base_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf import any_pb2, struct_pb2
from google.protobuf.message import DecodeError
from google.rpc import status_pb2

from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEYS_TYPE_URL, InvalidKeyTable
from inferlb_runtime.backoff import Backoff
from inferlb_runtime.model_routing import (ALIASES_KEY, DEFAULT_POOL, MODEL_NAME_PATTERN, MODELS_KEY, POOL_KEY,
                                           ROLLOUTS_KEY, InvalidRollouts, Rollout, decode_rollouts)
from inferlb_runtime.tls import PemFiles
from inferlb_runtime.xds_node import METRICS_PORT_KEY

from .catalogue import ModelCatalogue
from .model import EndpointView
from .tenants import KeyTable, parse_key_table

log = logging.getLogger("inferlb.ext_proc.xds")

ENDPOINT_TYPE = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
METADATA_NAMESPACE = "inferlb"
USER_AGENT = "inferlb-ext-proc"
# Keys of the endpoint metadata that are state, not telemetry.
_STATE_KEYS = frozenset({"id", "weight", "computed_weight", "pinned_weight", "draining", "health", MODELS_KEY,
                         ALIASES_KEY, POOL_KEY})
_ROUTABLE_STATUSES = frozenset({health_check_pb2.UNKNOWN, health_check_pb2.HEALTHY})
# Parse big ClusterLoadAssignments in a thread: the loop keeps answering Envoy meanwhile.
_PARSE_INLINE_BYTES = 64 * 1024
_REMOVED = "removed@"  # version prefix of the empty view (or key table) that a removal leaves
_SUBSCRIBED = "ext_proc subscribes to EDS and the API key table only"
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),  # 10,000 endpoints with telemetry
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


# --- the view ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PickPolicySpec:
    """The pick policy the control plane asks for (locality metadata ``inferlb.pick_policy``)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class FleetView:
    """Everything ext_proc knows of the fleet at one moment. Never mutated: replaced.

    ``routable`` (healthy and not draining, in EDS order) and ``pick_values``
    (endpoint id -> the ``ip:port`` text override_host matches) are derived
    once here, not per request.
    """

    version: str
    endpoints: tuple[EndpointView, ...]
    pick_policy: PickPolicySpec | None = None
    received_at: float = 0.0  # time.monotonic()
    partition: tuple[int, int] = (0, 1)  # (our index, replicas) in the control plane's ext_proc_replicas
    rollouts: Mapping[str, Rollout] = field(default_factory=dict)  # by alias
    rollouts_error: str | None = None  # why the locality's rollout table was ignored, if it was
    routable: tuple[EndpointView, ...] = field(init=False)
    by_id: Mapping[str, EndpointView] = field(init=False)
    pick_values: Mapping[str, str] = field(init=False)
    catalogue: ModelCatalogue = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "routable", tuple(e for e in self.endpoints if e.routable))
        object.__setattr__(self, "catalogue", ModelCatalogue.of(self.endpoints, self.rollouts))
        object.__setattr__(self, "by_id", MappingProxyType({e.id: e for e in self.endpoints}))
        object.__setattr__(self, "pick_values", MappingProxyType({e.id: pick_value(e) for e in self.endpoints}))


def pick_value(endpoint: EndpointView) -> str:
    """``ip:port`` as Envoy's override_host parses it (IPv6 in brackets)."""
    if ":" in endpoint.address:
        return f"[{endpoint.address}]:{endpoint.port}"
    return f"{endpoint.address}:{endpoint.port}"


def _shape(view: FleetView) -> tuple[object, ...]:
    """What makes an update worth an INFO line: who is there, who is routable, which policy."""
    return (tuple(e.id for e in view.endpoints), tuple(e.id for e in view.routable), view.pick_policy,
            view.catalogue.names(), tuple(view.rollouts.items()))


ViewListener = Callable[[FleetView], None]
KeyTableListener = Callable[[KeyTable], None]
T = TypeVar("T")


class ViewSource(Protocol):
    """Where the server gets its view: the xDS client in production, a static one in tests."""

    @property
    def view(self) -> FleetView | None: ...

    def add_listener(self, listener: ViewListener) -> None: ...

    @property
    def connected(self) -> bool: ...

    @property
    def key_table(self) -> KeyTable | None:
        """The API keys, or None until a table has arrived (or if the control plane serves none)."""
        ...

    def add_key_listener(self, listener: KeyTableListener) -> None: ...


class _Listeners(Generic[T]):
    """Listeners called on the loop after each swap; one that raises is logged, never fatal."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._listeners: list[Callable[[T], None]] = []
        self._first = asyncio.Event()

    def add(self, listener: Callable[[T], None]) -> None:
        self._listeners.append(listener)

    def fire(self, value: T) -> None:
        self._first.set()
        for listener in self._listeners:
            try:
                listener(value)
            except Exception:
                log.exception("%s listener failed", self._what)

    async def wait_first(self) -> None:
        await self._first.wait()


class StaticViewSource:
    """A view (and a key table) set by hand: for tests, and for running without a control plane."""

    def __init__(self, view: FleetView | None = None, key_table: KeyTable | None = None) -> None:
        self._view: FleetView | None = None
        self._listeners: _Listeners[FleetView] = _Listeners("view")
        self._key_table = key_table
        self._key_listeners: _Listeners[KeyTable] = _Listeners("key table")
        if view is not None:
            self.set(view)

    @property
    def key_table(self) -> KeyTable | None:
        return self._key_table

    def add_key_listener(self, listener: KeyTableListener) -> None:
        self._key_listeners.add(listener)

    def set_key_table(self, table: KeyTable) -> None:
        self._key_table = table
        self._key_listeners.fire(table)

    @property
    def view(self) -> FleetView | None:
        return self._view

    @property
    def connected(self) -> bool:
        return self._view is not None

    def add_listener(self, listener: ViewListener) -> None:
        self._listeners.add(listener)

    def set(self, view: FleetView) -> None:
        self._view = view
        self._listeners.fire(view)

    async def wait_ready(self, timeout: float | None = None) -> FleetView:
        await asyncio.wait_for(self._listeners.wait_first(), timeout)
        assert self._view is not None
        return self._view


def static_view(endpoints: Sequence[EndpointView], pick_policy: PickPolicySpec | None = None,
                version: str = "static", rollouts: Sequence[Rollout] = ()) -> FleetView:
    return FleetView(version, tuple(endpoints), pick_policy, time.monotonic(),
                     rollouts=MappingProxyType({r.alias: r for r in rollouts}))


# --- parsing -------------------------------------------------------------------------------------


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


async def _parse(parse: Callable[..., T], data: bytes, *args: str) -> T:
    """``parse(data, *args)``, in a thread when ``data`` is big (the loop keeps answering Envoy meanwhile)."""
    if len(data) <= _PARSE_INLINE_BYTES:
        return parse(data, *args)
    return await asyncio.to_thread(parse, data, *args)


# --- the client ----------------------------------------------------------------------------------


class XdsObserver(Protocol):
    """What the client reports (ext_proc's metrics implement it)."""

    def xds_connected(self, connected: bool) -> None: ...
    def xds_update(self, accepted: bool) -> None: ...


class _NoObserver:
    def xds_connected(self, connected: bool) -> None:
        pass

    def xds_update(self, accepted: bool) -> None:
        pass


@dataclass(frozen=True)
class XdsClientSettings:
    target: str = "127.0.0.1:18000"
    node_id: str = "inferlb-ext-proc"
    node_cluster: str = "inferlb-ext-proc"
    cluster: str = "workers"
    delta: bool = True
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 5.0
    tls: PemFiles | None = None  # mTLS: our chain and key, and the CA of the control plane's certificate
    tls_server_name: str | None = None  # the name to check in its certificate (default: the target's host)
    # Our /metrics port, told to the control plane in the node metadata (0: none): it reads our decision
    # count there, at the address our stream comes from, to partition among the replicas carrying traffic.
    metrics_port: int = 0

    def channel(self) -> grpc.aio.Channel:
        options = list(_CHANNEL_OPTIONS)
        if self.tls is None:
            return grpc.aio.insecure_channel(self.target, options=options)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.tls.trusted_ca,
                                                   private_key=self.tls.private_key,
                                                   certificate_chain=self.tls.certificate_chain)
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return grpc.aio.secure_channel(self.target, credentials, options=options)


class XdsClient:
    """EDS and the API key table over ADS, reconnecting for ever; :attr:`view` and :attr:`key_table` are the
    latest accepted ones."""

    def __init__(self, settings: XdsClientSettings, observer: XdsObserver | None = None,
                 rng: random.Random | None = None) -> None:
        self.settings = settings
        self._observer = observer or _NoObserver()
        backoff, rng = Backoff(settings.backoff_initial_s, settings.backoff_max_s), rng or random.Random()
        # Attempt 0 (the first reconnect) waits about backoff_initial_s; jittered so replicas do not align.
        self._delay: Callable[[int], float] = lambda attempt: backoff.delay(attempt + 1, rng)
        self._view: FleetView | None = None
        self._key_table: KeyTable | None = None
        self._connected = False
        self._listeners: _Listeners[FleetView] = _Listeners("view")
        self._key_listeners: _Listeners[KeyTable] = _Listeners("key table")
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._got_response = False  # the current stream delivered a response: reset the backoff
        self._connected_at = 0.0  # time.monotonic() the current stream connected
        self._node = base_pb2.Node(id=settings.node_id, cluster=settings.node_cluster,
                                   user_agent_name=USER_AGENT)
        if settings.metrics_port:
            self._node.metadata.fields[METRICS_PORT_KEY].number_value = settings.metrics_port
        self.accepted = 0  # responses ACKed
        self.rejected = 0  # responses NACKed
        self.last_error: str | None = None  # the last NACK's reason

    # -- the view ------------------------------------------------------------
    @property
    def view(self) -> FleetView | None:
        return self._view

    @property
    def connected(self) -> bool:
        return self._connected

    def add_listener(self, listener: ViewListener) -> None:
        self._listeners.add(listener)

    @property
    def key_table(self) -> KeyTable | None:
        """The latest accepted API key table; None until the first (never, from a control plane without one)."""
        return self._key_table

    def add_key_listener(self, listener: KeyTableListener) -> None:
        """Call ``listener(table)`` on the loop after each accepted table."""
        self._key_listeners.add(listener)

    async def wait_ready(self, timeout: float | None = None) -> FleetView:
        """The first view (raises TimeoutError after ``timeout``)."""
        await asyncio.wait_for(self._listeners.wait_first(), timeout)
        assert self._view is not None
        return self._view

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._channel = self.settings.channel()
            self._task = asyncio.create_task(self._run(), name="xds-client")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._set_connected(False)

    async def __aenter__(self) -> "XdsClient":
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- the loop ------------------------------------------------------------
    async def _run(self) -> None:
        attempt = 0
        mode = "delta" if self.settings.delta else "sotw"
        reported = None  # the last failure said at WARNING: a refusal or a TLS error is seen, not repeated
        while True:
            self._got_response = False
            self._connected_at = 0.0
            reason = "stream ended"
            try:
                await (self._delta_stream() if self.settings.delta else self._sotw_stream())
            except asyncio.CancelledError:
                reason = "stopping"
                raise
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            except Exception as exc:  # a bug here must not end the subscription
                log.exception("xds stream failed")
                reason = repr(exc)
            finally:
                if self._connected:
                    (log.info if reason == "stopping" else log.warning)(
                        "xds disconnected", extra={"target": self.settings.target, "mode": mode, "reason": reason})
                self._set_connected(False)
            # A stream that delivered something, or stayed up a while, was a success: start over.
            lived = time.monotonic() - self._connected_at if self._connected_at else 0.0
            attempt = 0 if self._got_response or lived >= self.settings.backoff_max_s else attempt + 1
            delay = self._delay(attempt)
            if self._got_response:
                reported = None
            elif reason not in (reported, "stream ended"):  # e.g. PERMISSION_DENIED, a TLS handshake failure
                log.warning("xds stream failed", extra={"target": self.settings.target, "reason": reason})
                reported = reason
            log.debug("xds reconnecting", extra={"in_s": round(delay, 3), "attempt": attempt, "reason": reason})
            await asyncio.sleep(delay)

    def _set_connected(self, connected: bool) -> None:
        if connected != self._connected:
            self._connected = connected
            self._observer.xds_connected(connected)

    def _on_connected(self, mode: str) -> None:
        self._connected_at = time.monotonic()
        self._set_connected(True)
        log.info("xds connected", extra={"target": self.settings.target, "mode": mode,
                                         "node_id": self.settings.node_id, "node_cluster": self.settings.node_cluster,
                                         "have_version": self._view.version if self._view else None})

    def _accept(self, view: FleetView) -> None:
        previous = self._view
        self._view = view
        self.accepted += 1
        self._observer.xds_update(True)
        if view.rollouts_error is not None and (previous is None or previous.rollouts_error != view.rollouts_error):
            log.error("rollout table ignored; routing by version and alias only",
                      extra={"version": view.version, "error": view.rollouts_error})
        # Telemetry changes every scrape: INFO only when membership, routability or the policy change.
        changed = previous is None or _shape(previous) != _shape(view)
        (log.info if changed else log.debug)("eds update", extra={
            "version": view.version, "endpoints": len(view.endpoints), "routable": len(view.routable),
            "pick_policy": view.pick_policy.name if view.pick_policy else None,
            "previous_version": previous.version if previous else None,
        })
        self._listeners.fire(view)

    def _accept_keys(self, table: KeyTable) -> None:
        previous = self._key_table
        self._key_table = table
        self.accepted += 1
        self._observer.xds_update(True)
        log.info("api key table update", extra={"version": table.version, "keys": len(table),
                                                "previous_version": previous.version if previous else None})
        self._key_listeners.fire(table)

    def _reject(self, version: str, error: str, type_url: str = ENDPOINT_TYPE) -> None:
        self.rejected += 1
        self.last_error = error
        self._observer.xds_update(False)
        kept = self._view if type_url == ENDPOINT_TYPE else self._key_table
        log.warning("eds update rejected" if type_url == ENDPOINT_TYPE else "api key table update rejected",
                    extra={"version": version, "error": error, "kept_version": kept.version if kept else None})

    @staticmethod
    def _error(message: str) -> status_pb2.Status:
        return status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=message)

    async def _delta_stream(self) -> None:
        """One Delta stream, until it ends."""
        assert self._channel is not None
        cluster = self.settings.cluster
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel).DeltaAggregatedResources()
        try:
            first = discovery_pb2.DeltaDiscoveryRequest(node=self._node, type_url=ENDPOINT_TYPE,
                                                        resource_names_subscribe=[cluster])
            keys = discovery_pb2.DeltaDiscoveryRequest(type_url=KEYS_TYPE_URL,
                                                       resource_names_subscribe=[API_KEYS_RESOURCE])
            # Resume: the server resends nothing that is still current.
            for request, name, held in ((first, cluster, self._view), (keys, API_KEYS_RESOURCE, self._key_table)):
                if held is not None and held.version and not held.version.startswith(_REMOVED):
                    request.initial_resource_versions[name] = held.version
            await call.write(first)
            await call.write(keys)
            await call.wait_for_connection()
            self._on_connected("delta")
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                self._got_response = True
                ack = discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url, response_nonce=response.nonce)
                error = await self._apply_delta(response)
                if error is not None:
                    ack.error_detail.CopyFrom(self._error(error))
                await call.write(ack)
        finally:
            call.cancel()

    async def _apply_delta(self, response: discovery_pb2.DeltaDiscoveryResponse) -> str | None:
        """Apply a Delta response; the NACK reason, or None to ACK."""
        if response.type_url == KEYS_TYPE_URL:
            return await self._apply_delta_keys(response)
        cluster = self.settings.cluster
        if response.type_url != ENDPOINT_TYPE:
            return f"unexpected type {response.type_url}: {_SUBSCRIBED}"
        for resource in response.resources:
            if resource.name != cluster:
                continue  # not ours (nothing to apply; the spec lets us ignore it)
            try:
                view = await _parse(parse_load_assignment, resource.resource.value, cluster, resource.version,
                                    self.settings.node_id)
            except InvalidResource as exc:
                self._reject(resource.version, str(exc))
                return str(exc)
            self._accept(view)
        if cluster in response.removed_resources:
            # The control plane has no such assignment: no endpoints (503s) rather than stale ones.
            self._accept(FleetView(f"{_REMOVED}{response.system_version_info}", (),
                                      self._view.pick_policy if self._view else None, time.monotonic()))
        return None

    async def _apply_delta_keys(self, response: discovery_pb2.DeltaDiscoveryResponse) -> str | None:
        for resource in response.resources:
            if resource.name != API_KEYS_RESOURCE:
                continue
            error = await self._apply_keys(resource.resource, resource.version)
            if error is not None:
                return error
        if API_KEYS_RESOURCE in response.removed_resources:
            # The control plane has no table: no key is valid (rather than keys it may have revoked).
            self._accept_keys(KeyTable.empty(f"{_REMOVED}{response.system_version_info}"))
        return None

    async def _apply_keys(self, resource: any_pb2.Any, version: str) -> str | None:
        """Accept one key table; the NACK reason if it is unusable (the previous table stays)."""
        try:
            if resource.type_url != KEYS_TYPE_URL:
                raise InvalidKeyTable(f"the api key table is a {resource.type_url}, not a {KEYS_TYPE_URL}")
            table = await _parse(parse_key_table, resource.value, version)
        except InvalidKeyTable as exc:
            self._reject(version, str(exc), KEYS_TYPE_URL)
            return str(exc)
        self._accept_keys(table)
        return None

    async def _sotw_stream(self) -> None:
        """One state-of-the-world stream, until it ends."""
        assert self._channel is not None
        cluster = self.settings.cluster
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel).StreamAggregatedResources()
        names = {ENDPOINT_TYPE: [cluster], KEYS_TYPE_URL: [API_KEYS_RESOURCE]}
        held = {ENDPOINT_TYPE: self._view, KEYS_TYPE_URL: self._key_table}
        accepted = {t: h.version if h is not None and not h.version.startswith(_REMOVED) else ""
                    for t, h in held.items()}  # per type: what we ACK with
        try:
            await call.write(discovery_pb2.DiscoveryRequest(node=self._node, type_url=ENDPOINT_TYPE,
                                                            resource_names=names[ENDPOINT_TYPE],
                                                            version_info=accepted[ENDPOINT_TYPE]))
            await call.write(discovery_pb2.DiscoveryRequest(type_url=KEYS_TYPE_URL,
                                                            resource_names=names[KEYS_TYPE_URL],
                                                            version_info=accepted[KEYS_TYPE_URL]))
            await call.wait_for_connection()
            self._on_connected("sotw")
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    return
                self._got_response = True
                error = await self._apply_sotw(response)
                type_url = response.type_url
                request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names.get(type_url, []),
                                                         response_nonce=response.nonce)
                if error is None and type_url in accepted:
                    accepted[type_url] = response.version_info
                elif error is not None:
                    request.error_detail.CopyFrom(self._error(error))
                request.version_info = accepted.get(type_url, "")
                await call.write(request)
        finally:
            call.cancel()

    async def _apply_sotw(self, response: discovery_pb2.DiscoveryResponse) -> str | None:
        if response.type_url == KEYS_TYPE_URL:
            if len(response.resources) > 1:  # a Struct has no name: one subscribed name, at most one resource
                return f"an api key table response carries {len(response.resources)} resources, expected one"
            for table in response.resources:
                return await self._apply_keys(table, response.version_info)
            return None
        cluster = self.settings.cluster
        if response.type_url != ENDPOINT_TYPE:
            return f"unexpected type {response.type_url}: {_SUBSCRIBED}"
        mine = [r for r in response.resources if r.type_url == ENDPOINT_TYPE]
        if len(mine) != len(response.resources):
            return "a resource in an EDS response is not a ClusterLoadAssignment"
        for resource in mine:
            try:
                view = await _parse(parse_load_assignment, resource.value, cluster, response.version_info,
                                    self.settings.node_id)
            except ForeignResource:
                continue  # someone else's assignment: not an error for us
            except InvalidResource as exc:
                self._reject(response.version_info, str(exc))
                return str(exc)
            self._accept(view)
        return None
