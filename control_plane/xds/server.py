"""The ADS server: StreamAggregatedResources (state of the world) and
DeltaAggregatedResources (incremental) for CDS, EDS, LDS and RDS.

Protocol decisions (Envoy's "xDS REST and gRPC protocol" document is the spec):

* One unacknowledged response per type per stream. While one is out, changes
  for that type wait; on the ACK the stream sends the *latest* state, never
  the intermediate ones.
* A SotW request whose non-empty ``response_nonce`` is not the latest nonce
  sent for its type is stale and ignored entirely (no ACK/NACK, no response).
  In Delta, the spec says subscription changes must be honoured even on a
  stale nonce, so only the ACK/NACK part is ignored there.
* A NACK is recorded (status, counters, a warning log) and the rejected
  response is never sent again as is: the stream sends that type again only
  when the snapshot's version of it changes, or the client subscribes to
  something the rejected response did not carry. This is the go-control-plane
  failure ("resend the NACKed config forever") designed out.
* Order CDS -> EDS -> LDS -> RDS. LDS and RDS are held until CDS and EDS are
  settled (acknowledged, or rejected, at the snapshot's current versions), as
  Consul does. EDS is deliberately NOT held behind the CDS ACK: Envoy finishes
  warming a new or changed cluster only when it receives a
  ClusterLoadAssignment, and it may not ACK CDS before then (see the spec's
  "Resource warming" section and Consul's hashicorp/consul#15083), so holding
  EDS could stall warming until ``initial_fetch_timeout``. EDS still goes out
  after CDS on the same stream, so Envoy always sees the cluster first. For
  the same reason, after a cluster changes, its ClusterLoadAssignment is resent
  even if the endpoints did not change ("warming completes only when a new
  ClusterLoadAssignment is supplied").
* Removals last (make before break): additions and updates for every type go
  out, in order, and are settled first; only then the responses that drop
  resources, in reverse order (RDS, LDS, EDS, CDS: stop referring before
  deleting). SotW CDS/LDS carry the whole set, so a removal there is first a
  response with the union of what the client has and the new set (a
  transitional version ``<version>+<hash>``), then the final set.
* A fresh request for a type (the first on a stream, or a SotW request with
  no nonce) always gets a response, even an empty one, so Envoy's
  initialisation never waits for ``initial_fetch_timeout``. A new stream
  starts from nothing, except what a Delta client declares in
  ``initial_resource_versions`` (resources it already has are not resent).
* Wildcard: CDS/LDS requests that never named a resource (or name "*").
  SotW EDS/RDS responses carry only the requested names that are new or
  changed for this client (the spec allows it for these types).

Who may connect, and how much one client may take (``XdsServerSettings``):

* Only nodes whose ``node.cluster`` is in ``allowed_node_clusters`` are served;
  any other stream ends at its first request with PERMISSION_DENIED naming the
  cluster and the allowed ones (logged, counted as refused{reason=node_cluster}).
  The node is self-declared: with mTLS, only holders of a certificate from the
  client CA get that far.
* mTLS (``tls``: the server's chain and key, the CA that signs the clients;
  client certificates required), else plaintext (the local default, loopback).
* Bounds: connections (``grpc.max_allowed_incoming_connections``), streams per
  connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: an excess stream is reset
  with REFUSED_STREAM), streams in all (RESOURCE_EXHAUSTED), streams per node id
  (RESOURCE_EXHAUSTED, refused{reason=node_streams}), request size, and requests
  buffered per stream (``_Inbox``: backpressure, never an unbounded queue).
* Keepalive: the server pings every connection (streams idle for long between
  pushes included) and drops one that does not answer, so a vanished client
  frees its stream; clients may ping every ``min_client_ping_interval_s``
  (Envoy's bootstrap and ext_proc ping every 30 s).

Responses go out pre-serialised: each resource's ``resources`` entry is
encoded once per snapshot (``VersionedResource.sotw_entry``/``delta_entry``)
and a response is those entries framed by the per-stream fields, in field
order (the bytes protobuf itself would produce). The ADS methods are
registered with a serializer that passes ``bytes`` through.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import AsyncIterator, Generic, Iterable, Mapping, NoReturn, TypeVar

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message

from inferlb_runtime.hostport import peer_address
from inferlb_runtime.tls import PemFiles
from inferlb_runtime.xds_node import METRICS_PORT_KEY

from control_plane.type_urls import CLUSTER, ENDPOINT, LISTENER, PUSH_ORDER, ROUTE, SHORT_NAMES
from control_plane.xds.cache import SnapshotCache, Watch
from control_plane.xds.clients import Mode, NoopMetrics, StreamRecord, XdsMetrics
from control_plane.xds.snapshot import Snapshot, VersionedResource, digest_names

LOG = logging.getLogger(__name__)

FULL_STATE_TYPES = frozenset({CLUSTER, LISTENER})  # SotW responses carry the whole set; wildcard allowed
HELD_TYPES = frozenset({LISTENER, ROUTE})  # held until every GATING_TYPES type is settled
GATING_TYPES = (CLUSTER, ENDPOINT)
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class XdsServerSettings:
    """Who the ADS server serves and how much it lets one client take. The defaults suit a local
    stack; the control plane sets every field from its config (``control_plane.serving.xds_server_settings``)."""

    # None: every node (a library default; the control plane always passes its allowlist).
    allowed_node_clusters: frozenset[str] | None = None
    tls: PemFiles | None = None  # mutual TLS: chain, key and the CA of the clients; None: plaintext
    keepalive_time_s: float = 30.0  # the server pings each connection this often ...
    keepalive_timeout_s: float = 10.0  # ... and closes it when the ping is not answered within this
    min_client_ping_interval_s: float = 10.0  # clients pinging more often than this are told to calm down
    max_connections: int = 1024
    max_concurrent_streams: int = 16  # per HTTP/2 connection (Envoy and ext_proc use one)
    max_streams: int = 4096  # in all
    max_streams_per_node: int = 4  # one node id (a reconnect may overlap its dying predecessor)
    max_request_bytes: int = 1 * MIB
    inbound_buffer: int = 8  # requests read and not yet handled, per stream

    def grpc_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", self.max_request_bytes),
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # gRPC 1.85 times out an unanswered keepalive PING by this one (default 60 s), not by the above.
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            # Keep pinging a stream that has had no push for a while: that is how a dead client is found.
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(self.min_client_ping_interval_s * 1000)),
        ]

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.private_key, self.tls.certificate_chain)],
                                           root_certificates=self.tls.trusted_ca, require_client_auth=True)


@dataclass(frozen=True, slots=True)
class _Sent:
    """One response as sent: what the client has once it ACKs it."""

    nonce: str
    version: str
    resources: Mapping[str, VersionedResource]
    removed: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class _Plan:
    version: str
    resources: Mapping[str, VersionedResource]
    removed: frozenset[str] = frozenset()


@dataclass(slots=True)
class _TypeState:
    """Per stream, per type: the subscription and where the ACK/NACK exchange stands."""

    wildcard: bool = False
    names: set[str] = field(default_factory=set)
    nonce: str = ""  # the latest nonce sent for this type
    inflight: _Sent | None = None  # the one unacknowledged response
    nacked: _Sent | None = None  # the last rejected response: never resent as is
    must_respond: bool = True  # a fresh request: answer even if nothing is new

    def rejected(self, version: str, names: Iterable[str], removed: Iterable[str] = ()) -> bool:
        """Would this response repeat (part of) one the client already NACKed?"""
        nacked = self.nacked
        return (nacked is not None and nacked.version == version
                and set(names) <= nacked.resources.keys() and set(removed) <= nacked.removed)


@dataclass(slots=True)
class _SotwState(_TypeState):
    explicit: bool = False  # names were given once: an empty list no longer means wildcard
    acked: dict[str, VersionedResource] = field(default_factory=dict)
    force: set[str] = field(default_factory=set)  # names to send even if the client has them


@dataclass(slots=True)
class _DeltaState(_TypeState):
    acked: dict[str, str] = field(default_factory=dict)  # name -> version the client has
    told_absent: set[str] = field(default_factory=set)  # explicit names we said do not exist
    notify_removed: set[str] = field(default_factory=set)  # wildcard-unsubscribe answers owed


S = TypeVar("S", bound=_TypeState)


def _metrics_target(node: base_pb2.Node, peer: str) -> tuple[str, int] | None:
    """Where a client's /metrics is: the IP its stream comes from (never an address it names, so a client
    cannot point the control plane elsewhere) and the port in its node metadata, if valid."""
    value = node.metadata.fields.get(METRICS_PORT_KEY)
    address = peer_address(peer)
    if value is None or address is None:
        return None
    port = value.number_value
    return (address, int(port)) if port.is_integer() and 0 < port < 65536 else None


def _log_extra(record: StreamRecord, event: str, **fields: object) -> dict[str, object]:
    return {"xds_event": event, "stream_id": record.stream_id, "node_id": record.node_id,
            "group": record.group, "mode": record.mode, **fields}


class _Protocol(ABC, Generic[S]):
    """The per-stream protocol state machine; pure bookkeeping, no I/O, no awaits.

    ``handle`` digests one request; ``plan`` returns the responses to send now
    and records them as sent (status updates happen here, synchronously, so a
    reader of ``SnapshotCache.clients()`` sees decisions as soon as they are made).
    """

    mode: Mode

    def __init__(self, record: StreamRecord, cache: SnapshotCache, metrics: XdsMetrics) -> None:
        self.record = record
        self._cache = cache
        self._metrics = metrics
        self._serial = itertools.count(1)
        self._types: dict[str, S] = {}

    # -- requests ------------------------------------------------------------------

    def _state(self, type_url: str) -> tuple[S, bool]:
        state = self._types.get(type_url)
        if state is None:
            state = self._types[type_url] = self._new_state()
            return state, True
        return state, False

    def _known_type(self, type_url: str) -> bool:
        if type_url in PUSH_ORDER:
            return True
        LOG.debug("ignoring request for unserved type %s", type_url,
                  extra=_log_extra(self.record, "unknown_type", type_url=type_url))
        return False

    def _stale(self, state: S, type_url: str, nonce: str) -> bool:
        if not nonce or nonce == state.nonce:
            return False
        LOG.debug("stale nonce %s for %s (latest %s)", nonce, SHORT_NAMES[type_url], state.nonce,
                  extra=_log_extra(self.record, "stale", type_url=type_url, nonce=nonce))
        return True

    def _answer(self, type_url: str, state: S, request: Message) -> None:
        """The client ACKed or NACKed the in-flight response."""
        sent = state.inflight
        assert sent is not None
        state.inflight = None
        if request.HasField("error_detail"):  # type: ignore[attr-defined]
            error = request.error_detail.message  # type: ignore[attr-defined]
            state.nacked = sent
            self.record.nacked(type_url, sent.version, sent.nonce, error)
            self._cache.count_nack(type_url)
            self._metrics.on_nack(type_url)
            LOG.warning("%s NACKed %s version %s: %s", self.record.node_id, SHORT_NAMES[type_url],
                        sent.version, error, extra=_log_extra(self.record, "nack", type_url=type_url,
                                                              version=sent.version, nonce=sent.nonce,
                                                              error=error))
            return
        self._apply_ack(type_url, state, sent)
        if state.nacked is not None and state.nacked.version != sent.version:
            state.nacked = None
        self.record.acked(type_url, sent.version)
        self._cache.count_ack(type_url)
        self._metrics.on_ack(type_url)
        LOG.debug("%s ACKed %s version %s", self.record.node_id, SHORT_NAMES[type_url], sent.version,
                  extra=_log_extra(self.record, "ack", type_url=type_url, version=sent.version,
                                   nonce=sent.nonce))

    # -- responses -----------------------------------------------------------------

    def plan(self, snapshot: Snapshot) -> list[tuple[str, bytes]]:
        """The responses due now, as (type URL, serialised response): updates in push order,
        else removals in reverse order."""
        out: list[tuple[str, bytes]] = []
        for type_url in PUSH_ORDER:
            state = self._types.get(type_url)
            if state is None or state.inflight is not None:
                continue
            if type_url in HELD_TYPES and not all(self._settled(t, snapshot) for t in GATING_TYPES):
                continue
            plan = self._update_plan(type_url, state, snapshot)
            if plan is not None:
                out.append(self._emit(type_url, state, plan, snapshot))
        if out or not all(self._settled(t, snapshot) for t in self._types):
            return out
        for type_url in reversed(PUSH_ORDER):
            state = self._types.get(type_url)
            if state is None:
                continue
            plan = self._removal_plan(type_url, state, snapshot)
            if plan is not None:
                out.append(self._emit(type_url, state, plan, snapshot))
        return out

    def _settled(self, type_url: str, snapshot: Snapshot) -> bool:
        """Nothing in flight and nothing new to send (a NACK at this version counts as settled)."""
        state = self._types.get(type_url)
        return state is None or (state.inflight is None and self._update_plan(type_url, state, snapshot) is None)

    def _emit(self, type_url: str, state: S, plan: _Plan, snapshot: Snapshot) -> tuple[str, bytes]:
        nonce = f"{self.record.stream_id}-{next(self._serial)}"
        if type_url == CLUSTER:
            changed = [n for n, r in plan.resources.items() if self._acked_version(state, n) != r.version]
            self._rewarm([snapshot.eds_names[n] for n in changed if n in snapshot.eds_names])
        response = self._response(type_url, nonce, plan)
        state.inflight = _Sent(nonce, plan.version, plan.resources, plan.removed)
        state.nonce = nonce
        state.must_respond = False
        self._emitted(state)
        self.record.sent(type_url, plan.version, nonce)
        self._cache.count_push(type_url)
        LOG.debug("push %s version %s: %d resources, %d removed", SHORT_NAMES[type_url], plan.version,
                  len(plan.resources), len(plan.removed),
                  extra=_log_extra(self.record, "push", type_url=type_url, version=plan.version, nonce=nonce))
        return type_url, response

    # -- mode specific ---------------------------------------------------------------

    def _emitted(self, state: S) -> None:
        """Hook: a response for this type was just planned."""

    @abstractmethod
    def _new_state(self) -> S: ...

    @abstractmethod
    def handle(self, request: Message) -> None: ...

    @abstractmethod
    def _apply_ack(self, type_url: str, state: S, sent: _Sent) -> None: ...

    @abstractmethod
    def _acked_version(self, state: S, name: str) -> str | None: ...

    @abstractmethod
    def _rewarm(self, eds_names: list[str]) -> None:
        """Make the stream resend these ClusterLoadAssignments (their cluster changed)."""

    @abstractmethod
    def _update_plan(self, type_url: str, state: S, snapshot: Snapshot) -> _Plan | None:
        """Additions and changes due for one type (pure: no state changes)."""

    @abstractmethod
    def _removal_plan(self, type_url: str, state: S, snapshot: Snapshot) -> _Plan | None:
        """The response that drops removed resources of one type, if any (pure)."""

    @abstractmethod
    def _response(self, type_url: str, nonce: str, plan: _Plan) -> bytes:
        """The serialised response (DiscoveryResponse or DeltaDiscoveryResponse)."""


class _SotwProtocol(_Protocol[_SotwState]):
    mode: Mode = "sotw"

    def _new_state(self) -> _SotwState:
        return _SotwState()

    def handle(self, request: Message) -> None:
        assert isinstance(request, discovery_pb2.DiscoveryRequest)
        type_url = request.type_url
        if not self._known_type(type_url):
            return
        state, _ = self._state(type_url)
        nonce = request.response_nonce
        if self._stale(state, type_url, nonce):
            return  # the spec: never answer a stale request
        if not nonce:
            # A fresh subscription: the client holds nothing of this type from this stream.
            state.acked.clear()
            state.inflight = None
            state.must_respond = True
        elif state.inflight is not None:
            self._answer(type_url, state, request)
        self._subscribe(type_url, state, list(request.resource_names))
        self.record.subscribed(type_url, state.wildcard, state.names)

    def _subscribe(self, type_url: str, state: _SotwState, names: list[str]) -> None:
        if type_url in FULL_STATE_TYPES:
            if not names and not state.explicit:
                wildcard, wanted = True, set()
            else:
                state.explicit = True
                wildcard, wanted = "*" in names, set(names) - {"*"}
        else:
            wildcard, wanted = False, set(names)
        if wildcard and not state.wildcard:
            state.must_respond = True
        # Newly requested names must be sent even if the client saw them before.
        state.force |= wanted - state.names
        state.wildcard, state.names = wildcard, wanted
        if not wildcard:  # the client forgets what it no longer asks for
            state.acked = {n: r for n, r in state.acked.items() if n in wanted}

    def _apply_ack(self, type_url: str, state: _SotwState, sent: _Sent) -> None:
        acked = {n: r for n, r in sent.resources.items() if state.wildcard or n in state.names}
        if type_url in FULL_STATE_TYPES:
            state.acked = acked  # the response was the whole set
        else:
            state.acked.update(acked)

    def _acked_version(self, state: _SotwState, name: str) -> str | None:
        acked = state.acked.get(name)
        return acked.version if acked is not None else None

    def _rewarm(self, eds_names: list[str]) -> None:
        eds = self._types.get(ENDPOINT)
        if eds is not None:
            eds.force.update(eds_names)

    def _emitted(self, state: _SotwState) -> None:
        state.force.clear()  # forced names that exist were just sent; absent ones are not acked anyway

    @staticmethod
    def _desired(state: _SotwState, current: Mapping[str, VersionedResource]) -> dict[str, VersionedResource]:
        if state.wildcard:
            return dict(current)
        return {n: current[n] for n in sorted(state.names) if n in current}

    def _update_plan(self, type_url: str, state: _SotwState, snapshot: Snapshot) -> _Plan | None:
        current = snapshot.resources(type_url)
        desired = self._desired(state, current)
        acked = state.acked
        changed = {n for n, r in desired.items() if (a := acked.get(n)) is None or a.version != r.version}
        forced = state.force & desired.keys()
        version = snapshot.version(type_url)
        if type_url in FULL_STATE_TYPES:
            if not changed and not forced and not state.must_respond:
                return None
            # Make before break: keep what the client has until every update is settled.
            retained = {n: r for n, r in acked.items() if n not in current}
            if retained:
                version = f"{version}+{digest_names(retained)}"
            resources = {**desired, **retained}
            if not state.must_respond and state.rejected(version, resources):
                return None
            return _Plan(version, resources)
        names = changed | forced
        if state.nacked is not None and state.nacked.version == version:
            names -= state.nacked.resources.keys()
        if not names and not state.must_respond:
            return None
        return _Plan(version, {n: r for n, r in desired.items() if n in names})

    def _removal_plan(self, type_url: str, state: _SotwState, snapshot: Snapshot) -> _Plan | None:
        if type_url not in FULL_STATE_TYPES:
            return None  # EDS/RDS: SotW has no removal; parents stop referring to them
        current = snapshot.resources(type_url)
        removed = frozenset(n for n in state.acked if n not in current)
        if not removed:
            return None
        desired = self._desired(state, current)
        version = snapshot.version(type_url)
        if state.rejected(version, desired):
            return None
        return _Plan(version, desired, removed)

    def _response(self, type_url: str, nonce: str, plan: _Plan) -> bytes:
        return encode_sotw_response(type_url, plan.version, nonce, plan.resources.values())


class _DeltaProtocol(_Protocol[_DeltaState]):
    mode: Mode = "delta"

    def _new_state(self) -> _DeltaState:
        return _DeltaState()

    def handle(self, request: Message) -> None:
        assert isinstance(request, discovery_pb2.DeltaDiscoveryRequest)
        type_url = request.type_url
        if not self._known_type(type_url):
            return
        state, first = self._state(type_url)
        nonce = request.response_nonce
        if nonce and not self._stale(state, type_url, nonce) and state.inflight is not None:
            self._answer(type_url, state, request)
        subscribe = list(request.resource_names_subscribe)
        unsubscribe = list(request.resource_names_unsubscribe)
        if first:
            state.wildcard = type_url in FULL_STATE_TYPES and not subscribe and not unsubscribe
            self._subscribe(type_url, state, subscribe, fresh=True)
            self._unsubscribe(type_url, state, unsubscribe)
            # What the client already has (a reconnect): do not resend it.
            state.acked = dict(request.initial_resource_versions)
        else:
            self._subscribe(type_url, state, subscribe, fresh=False)
            self._unsubscribe(type_url, state, unsubscribe)
        self.record.subscribed(type_url, state.wildcard, state.names)

    @staticmethod
    def _subscribe(type_url: str, state: _DeltaState, names: list[str], fresh: bool) -> None:
        for name in names:
            if name == "*" and type_url in FULL_STATE_TYPES:
                state.wildcard = True
                continue
            state.names.add(name)
            if not fresh:  # the spec: a (re)subscribed resource must be sent even if the client has it
                state.acked.pop(name, None)
                state.told_absent.discard(name)

    @staticmethod
    def _unsubscribe(type_url: str, state: _DeltaState, names: list[str]) -> None:
        for name in names:
            if name == "*" and type_url in FULL_STATE_TYPES:
                state.wildcard = False
                state.acked = {n: v for n, v in state.acked.items() if n in state.names}
                continue
            state.names.discard(name)
            state.told_absent.discard(name)
            state.acked.pop(name, None)
            if state.wildcard:
                # The spec's exception: the client cannot tell whether the wildcard still
                # covers it, so resend it (it is dropped from acked) or say it is removed.
                state.notify_removed.add(name)

    def _apply_ack(self, type_url: str, state: _DeltaState, sent: _Sent) -> None:
        for name, resource in sent.resources.items():
            if state.wildcard or name in state.names:
                state.acked[name] = resource.version
        for name in sent.removed:
            state.acked.pop(name, None)
            state.told_absent.add(name)
        state.told_absent.difference_update(sent.resources)
        state.notify_removed.difference_update(sent.removed)
        state.notify_removed.difference_update(sent.resources)

    def _acked_version(self, state: _DeltaState, name: str) -> str | None:
        return state.acked.get(name)

    def _rewarm(self, eds_names: list[str]) -> None:
        eds = self._types.get(ENDPOINT)
        if eds is not None:
            for name in eds_names:
                eds.acked.pop(name, None)

    def _update_plan(self, type_url: str, state: _DeltaState, snapshot: Snapshot) -> _Plan | None:
        current = snapshot.resources(type_url)
        acked = state.acked
        candidates: Iterable[str] = current if state.wildcard else sorted(state.names)
        updates = {n: r for n in candidates if (r := current.get(n)) is not None and acked.get(n) != r.version}
        version = snapshot.version(type_url)
        if state.nacked is not None and state.nacked.version == version:
            updates = {n: r for n, r in updates.items() if n not in state.nacked.resources}
        if not updates and not state.must_respond:
            return None
        return _Plan(version, updates)

    def _removal_plan(self, type_url: str, state: _DeltaState, snapshot: Snapshot) -> _Plan | None:
        current = snapshot.resources(type_url)
        removed = {n for n in state.acked if n not in current}
        removed.update(n for n in state.names if n not in current and n not in state.told_absent)
        removed.update(n for n in state.notify_removed if n not in current)
        version = snapshot.version(type_url)
        if state.nacked is not None and state.nacked.version == version:
            removed -= state.nacked.removed
        if not removed:
            return None
        return _Plan(version, {}, frozenset(removed))

    def _response(self, type_url: str, nonce: str, plan: _Plan) -> bytes:
        return encode_delta_response(type_url, plan.version, nonce, plan.resources.values(), plan.removed)


def encode_sotw_response(type_url: str, version: str, nonce: str, resources: Iterable[VersionedResource]) -> bytes:
    """The bytes of ``DiscoveryResponse(version_info, resources, type_url, nonce)`` from the
    resources' pre-encoded entries (fields in number order: what deterministic protobuf gives)."""
    return b"".join((
        discovery_pb2.DiscoveryResponse(version_info=version).SerializeToString(),  # 1
        *(_sotw_entry(r) for r in resources),  # 2
        discovery_pb2.DiscoveryResponse(type_url=type_url, nonce=nonce).SerializeToString(),  # 4, 5
    ))


def encode_delta_response(type_url: str, version: str, nonce: str, resources: Iterable[VersionedResource],
                          removed: Iterable[str] = ()) -> bytes:
    """The bytes of ``DeltaDiscoveryResponse(system_version_info, resources, type_url, nonce,
    removed_resources)``, removed names sorted, from the resources' pre-encoded entries."""
    return b"".join((
        discovery_pb2.DeltaDiscoveryResponse(system_version_info=version).SerializeToString(),  # 1
        *(_delta_entry(r) for r in resources),  # 2
        discovery_pb2.DeltaDiscoveryResponse(type_url=type_url, nonce=nonce,  # 4, 5, 6
                                             removed_resources=sorted(removed)).SerializeToString(),
    ))


def _sotw_entry(resource: VersionedResource) -> bytes:
    if resource.sotw_entry:
        return resource.sotw_entry
    return discovery_pb2.DiscoveryResponse(resources=[resource.any]).SerializeToString()


def _delta_entry(resource: VersionedResource) -> bytes:
    if resource.delta_entry:
        return resource.delta_entry
    return discovery_pb2.DeltaDiscoveryResponse(resources=[discovery_pb2.Resource(
        name=resource.name, version=resource.version, resource=resource.any)]).SerializeToString()


@dataclass(slots=True)
class _Session:
    protocol: _Protocol
    watch: Watch
    closed: bool = False


class _Inbox:
    """The requests one stream has read and not yet handled: at most ``limit`` (backpressure).

    Why a bound with backpressure rather than coalescing: SotW requests of one type supersede each
    other's subscription, but each may also ACK or NACK a nonce, and Delta requests are increments
    (subscribe, unsubscribe), so dropping or merging any would change what the client is owed. When
    the buffer is full the reader stops reading; gRPC then stops granting HTTP/2 flow-control window
    and the client's writes wait. A client that floods requests without reading its responses stalls
    only its own stream, holding at most ``limit`` requests (each at most ``max_request_bytes``) plus
    the transport's window; every request it sent is still handled, in order.
    """

    __slots__ = ("_items", "_limit", "_wake", "_space")

    def __init__(self, limit: int, wake: asyncio.Event) -> None:
        self._items: collections.deque[Message | None] = collections.deque()
        self._limit = limit
        self._wake = wake
        self._space = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self._limit

    async def put(self, request: Message) -> None:
        """Queue ``request``, first waiting for room."""
        while self.full:
            self._space.clear()
            await self._space.wait()
        self._items.append(request)
        self._wake.set()

    def close(self) -> None:
        """The client's side ended (``None`` marks it; never waits: the reader is finishing)."""
        self._items.append(None)
        self._wake.set()

    def take(self) -> Message | None:
        item = self._items.popleft()
        self._space.set()
        return item


async def _pump(requests: AsyncIterator[Message], inbox: _Inbox, metrics: XdsMetrics) -> None:
    """Move requests into the inbox, pausing while it is full; then mark the end of the client's side."""
    try:
        async for request in requests:
            if inbox.full:
                metrics.on_backpressure()  # counted as the pause begins: it may last as long as the client likes
            await inbox.put(request)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the client went away mid-read
        LOG.debug("request stream ended: %r", exc)
    finally:
        inbox.close()


@dataclass(frozen=True, slots=True)
class _Refusal:
    """Why the server will not serve a stream: the status it ends with, the metric's reason, the message."""

    code: grpc.StatusCode
    reason: str
    message: str


class AggregatedDiscoveryServer(ads_pb2_grpc.AggregatedDiscoveryServiceServicer):
    """grpc.aio servicer for both ADS variants over one :class:`SnapshotCache`.

    Its methods yield serialised responses (``bytes``): register it with
    :func:`add_to_server`, not the generated ``add_..._to_server``.
    """

    def __init__(self, cache: SnapshotCache, metrics: XdsMetrics | None = None,
                 settings: XdsServerSettings | None = None) -> None:
        self._cache = cache
        self._metrics: XdsMetrics = metrics if metrics is not None else NoopMetrics()
        self._settings = settings if settings is not None else XdsServerSettings()
        self._stream_ids = itertools.count(1)
        self._streams_per_node: collections.Counter[str] = collections.Counter()

    async def StreamAggregatedResources(self, request_iterator, context):  # type: ignore[override]
        async for response in self._serve(_SotwProtocol, request_iterator, context):
            yield response

    async def DeltaAggregatedResources(self, request_iterator, context):  # type: ignore[override]
        async for response in self._serve(_DeltaProtocol, request_iterator, context):
            yield response

    async def _serve(self, protocol_type: type[_Protocol], requests: AsyncIterator[Message],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        wake = asyncio.Event()
        inbox = _Inbox(self._settings.inbound_buffer, wake)
        reader = asyncio.create_task(_pump(requests, inbox, self._metrics))
        session: _Session | None = None
        try:
            while True:
                await wake.wait()
                wake.clear()
                woke_at = time.monotonic()
                while inbox:
                    request = inbox.take()
                    if request is None:
                        return  # the client half-closed: nothing more to say
                    if session is None:
                        refusal = self._refusal(request.node)  # type: ignore[attr-defined]
                        if refusal is not None:
                            await self._refuse(refusal, request, protocol_type.mode, context)
                        session = self._open(protocol_type, request, context, wake)
                    session.protocol.handle(request)
                if session is None:
                    continue
                if session.watch.closed:
                    return
                changed_at = session.watch.take_changed_at()
                snapshot = self._cache.get(session.watch.group)
                if snapshot is None:
                    continue  # nothing to serve this group yet; wait for set_snapshot
                since = changed_at if changed_at is not None else woke_at
                for type_url, response in session.protocol.plan(snapshot):
                    yield response
                    self._metrics.on_push(type_url, time.monotonic() - since)
        finally:
            reader.cancel()
            if session is not None:
                self._close(session)

    def _refusal(self, node: base_pb2.Node) -> _Refusal | None:
        """Why this node may not open one more stream, or None."""
        allowed = self._settings.allowed_node_clusters
        if allowed is not None and node.cluster not in allowed:
            return _Refusal(grpc.StatusCode.PERMISSION_DENIED, "node_cluster",
                            f"xDS node cluster {node.cluster!r} is not allowed (node id {node.id!r}); "
                            f"allowed: {', '.join(sorted(allowed))}")
        limit = self._settings.max_streams_per_node
        if self._streams_per_node[node.id] >= limit:
            return _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "node_streams",
                            f"xDS node {node.id!r} already has {limit} streams open (max_streams_per_node)")
        return None

    async def _refuse(self, refusal: _Refusal, request: Message, mode: Mode,
                      context: grpc.aio.ServicerContext) -> NoReturn:
        """Log and count the refusal, then end the stream with its status (``abort`` raises)."""
        node: base_pb2.Node = request.node  # type: ignore[attr-defined]
        self._metrics.on_refused(refusal.reason)
        LOG.warning("xDS client refused: %s", refusal.message, extra={
            "xds_event": "refused", "reason": refusal.reason, "node_id": node.id, "node_cluster": node.cluster,
            "mode": mode, "peer": context.peer()})
        await context.abort(refusal.code, refusal.message)

    def _open(self, protocol_type: type[_Protocol], request: Message, context: grpc.aio.ServicerContext,
              wake: asyncio.Event) -> _Session:
        node: base_pb2.Node = request.node  # type: ignore[attr-defined]
        group = self._cache.group_of(node)
        record = StreamRecord(next(self._stream_ids), node.id, node.cluster, group, protocol_type.mode,
                              metrics_target=_metrics_target(node, context.peer()))
        session = _Session(protocol_type(record, self._cache, self._metrics), self._cache.watch(record, wake))
        self._streams_per_node[node.id] += 1
        # The generator's finally may run late if gRPC drops it mid-yield; this runs when the RPC ends.
        context.add_done_callback(lambda _context: self._close(session))
        self._metrics.on_connect(record.mode)
        LOG.info("xDS client %s connected (%s, group %s, peer %s)", node.id, record.mode, group, context.peer(),
                 extra=_log_extra(record, "connect", peer=context.peer()))
        return session

    def _close(self, session: _Session) -> None:
        if session.closed:
            return
        session.closed = True
        self._cache.unwatch(session.watch)
        record = session.protocol.record
        self._streams_per_node[record.node_id] -= 1
        if self._streams_per_node[record.node_id] <= 0:
            del self._streams_per_node[record.node_id]
        self._metrics.on_disconnect(record.mode)
        LOG.info("xDS client %s disconnected (%s)", record.node_id, record.mode,
                 extra=_log_extra(record, "disconnect"))


_ADS_SERVICE = "envoy.service.discovery.v3.AggregatedDiscoveryService"


def _serialize_response(response: bytes | Message) -> bytes:
    """Pre-serialised responses pass through; messages (if any) are serialised as usual."""
    return response if isinstance(response, bytes) else response.SerializeToString()


def add_to_server(servicer: AggregatedDiscoveryServer, server: grpc.aio.Server) -> None:
    """Register both ADS methods (the generated registration, with a bytes-passing serializer)."""
    handlers = {
        "StreamAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.StreamAggregatedResources,
            request_deserializer=discovery_pb2.DiscoveryRequest.FromString,
            response_serializer=_serialize_response),
        "DeltaAggregatedResources": grpc.stream_stream_rpc_method_handler(
            servicer.DeltaAggregatedResources,
            request_deserializer=discovery_pb2.DeltaDiscoveryRequest.FromString,
            response_serializer=_serialize_response),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_ADS_SERVICE, handlers),))
    server.add_registered_method_handlers(_ADS_SERVICE, handlers)


async def serve_xds(cache: SnapshotCache, address: str = "127.0.0.1:18000",
                    metrics: XdsMetrics | None = None, settings: XdsServerSettings | None = None) -> grpc.aio.Server:
    """Start the ADS server on ``address`` and return it (already serving).

    With ``settings.tls``: mutual TLS only (a client without a certificate from the CA fails the
    handshake). Stop it with :func:`stop_xds`, which ends the streams first so that clients
    reconnect at once instead of after the grace period.
    """
    settings = settings if settings is not None else XdsServerSettings()
    server = grpc.aio.server(options=settings.grpc_options(), maximum_concurrent_rpcs=settings.max_streams)
    add_to_server(AggregatedDiscoveryServer(cache, metrics, settings), server)
    credentials = settings.credentials()
    if credentials is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, credentials)
    await server.start()
    LOG.info("xDS server listening on %s (%s)", address, "mTLS" if credentials is not None else "plaintext",
             extra={"xds_event": "listen", "address": address, "port": port, "mtls": credentials is not None,
                    "allowed_node_clusters": sorted(settings.allowed_node_clusters)
                    if settings.allowed_node_clusters is not None else None})
    return server


async def stop_xds(server: grpc.aio.Server, cache: SnapshotCache, grace: float = 5.0) -> None:
    """Graceful stop: end every stream of ``cache`` (OK status), then stop the server."""
    cache.close_streams()
    await server.stop(grace)
