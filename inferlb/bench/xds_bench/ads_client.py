"""A small ADS client that speaks both xDS variants the way Envoy does.

``inferlb bench xds`` uses it to emulate many Envoys (its client fleet); tests
use it (``tests/xds_client.py`` re-exports it) to drive the real server over
gRPC. Many clients may share one ``grpc.aio.Channel``; ``decode=False`` skips
parsing resources. Every response is recorded, in
order, in ``received``; by default each is ACKed at once (``auto_ack``), or a
``decide`` callback returns an error text to NACK it instead.

For long runs (the benchmark), ``history=False`` keeps ``received`` and
``sent`` empty (no memory growth; ``next`` and ``of_type`` then see nothing,
``wait_for`` still works on other state), and ``observe`` is called with
every response as it arrives, before it is ACKed.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, TypeVar

import grpc
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import base_pb2
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.protobuf.message import Message
from google.rpc import status_pb2

from control_plane.type_urls import CLUSTER, ENDPOINT, LISTENER, ROUTE

RESOURCE_TYPES: Mapping[str, type[Message]] = {
    CLUSTER: cluster_pb2.Cluster,
    ENDPOINT: endpoint_pb2.ClusterLoadAssignment,
    LISTENER: listener_pb2.Listener,
    ROUTE: route_pb2.RouteConfiguration,
}
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 * 1024 * 1024)]
T = TypeVar("T")


def decode(type_url: str, data: bytes) -> Message:
    message = RESOURCE_TYPES[type_url]()
    message.ParseFromString(data)
    return message


def resource_name(type_url: str, message: Message) -> str:
    return message.cluster_name if type_url == ENDPOINT else message.name  # type: ignore[attr-defined]


def eds_names(clusters: Iterable[cluster_pb2.Cluster]) -> list[str]:
    """The ClusterLoadAssignments Envoy would request for these clusters."""
    return sorted({c.eds_cluster_config.service_name or c.name for c in clusters
                   if c.WhichOneof("cluster_discovery_type") == "type" and c.type == cluster_pb2.Cluster.EDS})


@dataclass(frozen=True, slots=True)
class Received:
    """One response as the client saw it. ``seq`` orders it among everything sent and received."""

    seq: int
    type_url: str
    version: str
    nonce: str
    names: tuple[str, ...]  # resource names carried (empty for SotW when decode=False)
    removed: tuple[str, ...]
    message: Message

    def resources(self) -> dict[str, Message]:
        """The decoded resources by name."""
        if isinstance(self.message, discovery_pb2.DeltaDiscoveryResponse):
            return {r.name: decode(self.type_url, r.resource.value) for r in self.message.resources}
        decoded = (decode(self.type_url, a.value) for a in self.message.resources)  # type: ignore[attr-defined]
        return {resource_name(self.type_url, m): m for m in decoded}

    def versions(self) -> dict[str, str]:
        """Delta only: name -> per-resource version."""
        assert isinstance(self.message, discovery_pb2.DeltaDiscoveryResponse)
        return {r.name: r.version for r in self.message.resources}


Decision = Callable[[Received], "str | None"]


class _AdsClient:
    """The stream plumbing shared by both variants: one bidirectional call, a reader task."""

    def __init__(self, target: str | grpc.aio.Channel, node_id: str, node_cluster: str = "", *,
                 auto_ack: bool = True, decide: Decision | None = None, follow_clusters: bool = False,
                 decode: bool = True, history: bool = True,
                 observe: Callable[[Received], None] | None = None) -> None:
        self._owns_channel = isinstance(target, str)
        self._channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) if isinstance(target, str) \
            else target
        self.node = base_pb2.Node(id=node_id, cluster=node_cluster)
        self.auto_ack = auto_ack
        self.decide = decide
        self.follow_clusters = follow_clusters
        self.decode = decode
        self.history = history
        self.observe = observe
        self.received: list[Received] = []
        self.sent: list[tuple[int, Message]] = []
        self.ended = False
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None  # the status message the stream ended with
        self._seq = itertools.count()
        self._changed = asyncio.Condition()
        self._write_lock = asyncio.Lock()
        self._cursors: dict[str | None, int] = {}
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._node_sent = False

    async def __aenter__(self: T) -> T:
        await self.start()  # type: ignore[attr-defined]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        self._call = self._open(ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel))
        self._reader = asyncio.create_task(self._read())

    def _open(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> grpc.aio.StreamStreamCall:
        raise NotImplementedError

    async def disconnect(self) -> None:
        """Drop the stream abruptly (like an Envoy that dies)."""
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def close(self) -> None:
        await self.disconnect()
        if self._owns_channel:
            await self._channel.close()

    async def _send(self, request: Message) -> None:
        if not self._node_sent:
            request.node.CopyFrom(self.node)  # type: ignore[attr-defined]
            self._node_sent = True
        assert self._call is not None
        async with self._write_lock:
            seq = next(self._seq)
            if self.history:
                self.sent.append((seq, request))
            await self._call.write(request)

    async def _read(self) -> None:
        assert self._call is not None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                received = self._record(response)
                if self.observe is not None:
                    self.observe(received)
                if self.history:
                    self.received.append(received)
                async with self._changed:
                    self._changed.notify_all()
                await self._on_response(received)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            self.ended = True
            try:
                self.code = await self._call.code()
                self.details = await self._call.details()
            except (grpc.aio.AioRpcError, asyncio.CancelledError):
                self.code = grpc.StatusCode.CANCELLED
            async with self._changed:
                self._changed.notify_all()

    def _record(self, response: Message) -> Received:
        raise NotImplementedError

    async def _on_response(self, received: Received) -> None:
        if self.follow_clusters and received.type_url == CLUSTER:
            await self._follow(received)
        if not self.auto_ack:
            return
        error = self.decide(received) if self.decide is not None else None
        if error is None:
            await self.ack(received)
        else:
            await self.nack(received, error)

    async def _follow(self, received: Received) -> None:
        raise NotImplementedError

    async def ack(self, received: Received) -> None:
        raise NotImplementedError

    async def nack(self, received: Received, message: str) -> None:
        raise NotImplementedError

    # -- waiting -----------------------------------------------------------------

    async def wait_for(self, predicate: Callable[[], T], timeout: float = 10.0) -> T:
        """Wait until ``predicate()`` is truthy (checked on every response); return its value."""
        async def until() -> T:
            async with self._changed:
                while True:
                    value = predicate()
                    if value:
                        return value
                    if self.ended:
                        raise ConnectionError(f"stream ended ({self.code}) before the condition held")
                    await self._changed.wait()
        return await asyncio.wait_for(until(), timeout)

    async def next(self, type_url: str | None = None, timeout: float = 10.0) -> Received:
        """The next response (of ``type_url``, if given) not yet returned by ``next``."""
        def find() -> Received | None:
            start = self._cursors.get(type_url, 0)
            for index in range(start, len(self.received)):
                if type_url is None or self.received[index].type_url == type_url:
                    self._cursors[type_url] = index + 1
                    return self.received[index]
            self._cursors[type_url] = len(self.received)
            return None
        return await self.wait_for(find, timeout)

    def of_type(self, type_url: str) -> list[Received]:
        return [r for r in self.received if r.type_url == type_url]


class SotwClient(_AdsClient):
    """State-of-the-world ADS (StreamAggregatedResources)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.names: dict[str, list[str]] = {}
        self.accepted: dict[str, str] = {}  # type -> last ACKed version
        self._nonces: dict[str, str] = {}  # type -> latest nonce received

    def _open(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> grpc.aio.StreamStreamCall:
        return stub.StreamAggregatedResources()

    def _record(self, response: Message) -> Received:
        assert isinstance(response, discovery_pb2.DiscoveryResponse)
        self._nonces[response.type_url] = response.nonce
        names: tuple[str, ...] = ()
        if self.decode:
            names = tuple(resource_name(response.type_url, decode(response.type_url, a.value))
                          for a in response.resources)
        return Received(next(self._seq), response.type_url, response.version_info, response.nonce, names, (),
                        response)

    async def subscribe(self, type_url: str, names: Iterable[str] = ()) -> None:
        """Send a request for ``type_url`` with these names, carrying the latest nonce (like Envoy)."""
        self.names[type_url] = list(names)
        await self.request(type_url)

    async def request(self, type_url: str, *, nonce: str | None = None, version: str | None = None,
                      error: str | None = None) -> None:
        """A raw request; ``nonce``/``version`` default to the latest received / accepted."""
        request = discovery_pb2.DiscoveryRequest(
            type_url=type_url, resource_names=self.names.get(type_url, []),
            version_info=self.accepted.get(type_url, "") if version is None else version,
            response_nonce=self._nonces.get(type_url, "") if nonce is None else nonce)
        if error is not None:
            request.error_detail.CopyFrom(status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                            message=error))
        await self._send(request)

    async def ack(self, received: Received) -> None:
        self.accepted[received.type_url] = received.version
        await self.request(received.type_url, nonce=received.nonce, version=received.version)

    async def nack(self, received: Received, message: str) -> None:
        await self.request(received.type_url, nonce=received.nonce, error=message)

    async def _follow(self, received: Received) -> None:
        wanted = eds_names(received.resources().values())  # type: ignore[arg-type]
        if wanted != self.names.get(ENDPOINT):
            await self.subscribe(ENDPOINT, wanted)


class DeltaClient(_AdsClient):
    """Incremental ADS (DeltaAggregatedResources). ``state`` is what the client has accepted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.state: dict[str, dict[str, str]] = {}  # type -> name -> version accepted
        self.subscribed: dict[str, set[str]] = {}

    def _open(self, stub: ads_pb2_grpc.AggregatedDiscoveryServiceStub) -> grpc.aio.StreamStreamCall:
        return stub.DeltaAggregatedResources()

    def _record(self, response: Message) -> Received:
        assert isinstance(response, discovery_pb2.DeltaDiscoveryResponse)
        return Received(next(self._seq), response.type_url, response.system_version_info, response.nonce,
                        tuple(r.name for r in response.resources), tuple(response.removed_resources), response)

    async def subscribe(self, type_url: str, names: Iterable[str] = (),
                        initial_resource_versions: Mapping[str, str] | None = None) -> None:
        names = list(names)
        self.subscribed.setdefault(type_url, set()).update(names)
        await self._send(discovery_pb2.DeltaDiscoveryRequest(
            type_url=type_url, resource_names_subscribe=names,
            initial_resource_versions=dict(initial_resource_versions or {})))

    async def unsubscribe(self, type_url: str, names: Iterable[str]) -> None:
        names = list(names)
        self.subscribed.setdefault(type_url, set()).difference_update(names)
        for name in names:
            self.state.get(type_url, {}).pop(name, None)
        await self._send(discovery_pb2.DeltaDiscoveryRequest(type_url=type_url,
                                                             resource_names_unsubscribe=names))

    async def ack(self, received: Received) -> None:
        state = self.state.setdefault(received.type_url, {})
        state.update(received.versions())
        for name in received.removed:
            state.pop(name, None)
        await self._send(discovery_pb2.DeltaDiscoveryRequest(type_url=received.type_url,
                                                             response_nonce=received.nonce))

    async def nack(self, received: Received, message: str) -> None:
        request = discovery_pb2.DeltaDiscoveryRequest(type_url=received.type_url, response_nonce=received.nonce)
        request.error_detail.CopyFrom(status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                        message=message))
        await self._send(request)

    async def _follow(self, received: Received) -> None:
        wanted = set(eds_names(received.resources().values()))  # type: ignore[arg-type]
        new = wanted - self.subscribed.get(ENDPOINT, set())
        if new:
            await self.subscribe(ENDPOINT, sorted(new))
