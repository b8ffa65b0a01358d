"""The ADS server: one gRPC servicer for StreamAggregatedResources (State of the World, ``sotw``)
and DeltaAggregatedResources (incremental, ``delta``) for CDS, EDS, LDS and RDS.

Envoy's "xDS REST and gRPC protocol" document is the spec. What a request means and what a response
carries is each variant's module; the ACK/NACK bookkeeping and ordering they share is ``protocol``.
This module is what is the same for every stream whatever its variant: admission, the bounded
request buffer, the loop that turns snapshot changes into responses, and the gRPC registration.

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
order (the bytes protobuf itself would produce; ``sotw.encode_sotw_response``,
``delta.encode_delta_response``). The ADS methods are registered with a
serializer that passes ``bytes`` through.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, NoReturn

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message

from inferlb_runtime.hostport import peer_address
from inferlb_runtime.tls import PemFiles
from inferlb_runtime.xds_node import METRICS_PORT_KEY

from .cache import SnapshotCache, Watch
from .clients import Mode, NoopMetrics, StreamRecord, XdsMetrics
from .delta import DeltaProtocol
from .protocol import StreamProtocol, log_extra
from .sotw import SotwProtocol

LOG = logging.getLogger(__name__)

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
            # gRPC's default is SO_REUSEPORT: a second control plane (or anything else reusing ports) started
            # on the same port would silently take half the Envoys. Fail loudly instead.
            ("grpc.so_reuseport", 0),
        ]

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials([(self.tls.private_key, self.tls.certificate_chain)],
                                           root_certificates=self.tls.trusted_ca, require_client_auth=True)


def _metrics_target(node: base_pb2.Node, peer: str) -> tuple[str, int] | None:
    """Where a client's /metrics is: the IP its stream comes from (never an address it names, so a client
    cannot point the control plane elsewhere) and the port in its node metadata, if valid."""
    value = node.metadata.fields.get(METRICS_PORT_KEY)
    address = peer_address(peer)
    if value is None or address is None:
        return None
    port = value.number_value
    return (address, int(port)) if port.is_integer() and 0 < port < 65536 else None


@dataclass(slots=True)
class _Session:
    protocol: StreamProtocol
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
        async for response in self._serve(SotwProtocol, request_iterator, context):
            yield response

    async def DeltaAggregatedResources(self, request_iterator, context):  # type: ignore[override]
        async for response in self._serve(DeltaProtocol, request_iterator, context):
            yield response

    async def _serve(self, protocol_type: type[StreamProtocol], requests: AsyncIterator[Message],
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

    def _open(self, protocol_type: type[StreamProtocol], request: Message, context: grpc.aio.ServicerContext,
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
                 extra=log_extra(record, "connect", peer=context.peer()))
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
                 extra=log_extra(record, "disconnect"))


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
