"""ext_proc's ADS stream to the control plane: subscribe, resume, ACK or NACK, and reconnect for ever.

It subscribes to EDS for the ``workers`` ClusterLoadAssignment and to the API
key table (``inferlb-api-keys``) on the same stream, each type with its own
version and nonce, and hands every response to a :class:`Subscriber` (the
:class:`~ext_proc.xds.client.XdsClient`), whose answer is the ACK (None) or
the NACK's reason. What to make of a response is not this module's business:
it frames the wire protocol.

* Delta (incremental) by default: on a reconnect ext_proc declares the
  version it holds in ``initial_resource_versions`` and the server resends
  nothing if that is still current. State of the world is there for control
  planes that only speak it.
* Plaintext by default (the control plane on loopback); with ``tls`` the
  channel is mutual TLS: ext_proc presents its certificate and checks the
  control plane's against the given CA and name.
* Reconnects use full-jitter exponential backoff, bounded (0.25 s -> 5 s by
  default), reset after a stream that delivered a good response.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from google.rpc import status_pb2

from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEYS_TYPE_URL
from inferlb_runtime.backoff import Backoff
from inferlb_runtime.tls import PemFiles
from inferlb_runtime.xds_node import METRICS_PORT_KEY

from .eds_view import ENDPOINT_TYPE

log = logging.getLogger("inferlb.ext_proc.xds")

USER_AGENT = "inferlb-ext-proc"
REMOVED = "removed@"  # version prefix of the empty view (or key table) that a removal leaves
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),  # 10,000 endpoints with telemetry
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


class XdsObserver(Protocol):
    """What the client reports (ext_proc's metrics implement it)."""

    def xds_connected(self, connected: bool) -> None: ...
    def xds_update(self, accepted: bool) -> None: ...


class NoObserver:
    def xds_connected(self, connected: bool) -> None:
        pass

    def xds_update(self, accepted: bool) -> None:
        pass


class Subscriber(Protocol):
    """What the stream feeds: it holds the resources and judges each response."""

    def held_version(self, type_url: str) -> str | None:
        """The version of what is held of ``type_url`` (None: nothing yet)."""
        ...

    async def apply_delta(self, response: discovery_pb2.DeltaDiscoveryResponse) -> str | None:
        """Apply a Delta response; the NACK reason, or None to ACK."""
        ...

    async def apply_sotw(self, response: discovery_pb2.DiscoveryResponse) -> str | None:
        """Apply a state-of-the-world response; the NACK reason, or None to ACK."""
        ...


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


def _nack(message: str) -> status_pb2.Status:
    return status_pb2.Status(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=message)


class AdsStream:
    """The subscription's stream, reopened for ever (with backoff) until :meth:`stop`."""

    def __init__(self, settings: XdsClientSettings, subscriber: Subscriber, observer: XdsObserver,
                 rng: random.Random | None = None) -> None:
        self.settings = settings
        self._subscriber = subscriber
        self._observer = observer
        backoff, rng = Backoff(settings.backoff_initial_s, settings.backoff_max_s), rng or random.Random()
        # Attempt 0 (the first reconnect) waits about backoff_initial_s; jittered so replicas do not align.
        self._delay: Callable[[int], float] = lambda attempt: backoff.delay(attempt + 1, rng)
        self.connected = False
        self._task: asyncio.Task[None] | None = None
        self._channel: grpc.aio.Channel | None = None
        self._got_response = False  # the current stream delivered a response: reset the backoff
        self._connected_at = 0.0  # time.monotonic() the current stream connected
        self._node = base_pb2.Node(id=settings.node_id, cluster=settings.node_cluster,
                                   user_agent_name=USER_AGENT)
        if settings.metrics_port:
            self._node.metadata.fields[METRICS_PORT_KEY].number_value = settings.metrics_port

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
                if self.connected:
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
        if connected != self.connected:
            self.connected = connected
            self._observer.xds_connected(connected)

    def _on_connected(self, mode: str) -> None:
        self._connected_at = time.monotonic()
        self._set_connected(True)
        log.info("xds connected", extra={"target": self.settings.target, "mode": mode,
                                         "node_id": self.settings.node_id, "node_cluster": self.settings.node_cluster,
                                         "have_version": self._subscriber.held_version(ENDPOINT_TYPE)})

    def _resume_from(self, type_url: str) -> str:
        """The version to declare on (re)subscribing: what is held, unless nothing or a removal's empty one."""
        version = self._subscriber.held_version(type_url)
        return version if version and not version.startswith(REMOVED) else ""

    async def _responses(self, call: Any, mode: str) -> AsyncIterator[Any]:
        """The responses of a stream once it is up, until the server ends it."""
        await call.wait_for_connection()
        self._on_connected(mode)
        while (response := await call.read()) is not grpc.aio.EOF:
            self._got_response = True
            yield response

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
            for request, name in ((first, cluster), (keys, API_KEYS_RESOURCE)):
                if held := self._resume_from(request.type_url):
                    request.initial_resource_versions[name] = held
            await call.write(first)
            await call.write(keys)
            async for response in self._responses(call, "delta"):
                ack = discovery_pb2.DeltaDiscoveryRequest(type_url=response.type_url, response_nonce=response.nonce)
                error = await self._subscriber.apply_delta(response)
                if error is not None:
                    ack.error_detail.CopyFrom(_nack(error))
                await call.write(ack)
        finally:
            call.cancel()

    async def _sotw_stream(self) -> None:
        """One state-of-the-world stream, until it ends."""
        assert self._channel is not None
        call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(self._channel).StreamAggregatedResources()
        names = {ENDPOINT_TYPE: [self.settings.cluster], KEYS_TYPE_URL: [API_KEYS_RESOURCE]}
        accepted = {t: self._resume_from(t) for t in names}  # per type: what we ACK with
        try:
            await call.write(discovery_pb2.DiscoveryRequest(node=self._node, type_url=ENDPOINT_TYPE,
                                                            resource_names=names[ENDPOINT_TYPE],
                                                            version_info=accepted[ENDPOINT_TYPE]))
            await call.write(discovery_pb2.DiscoveryRequest(type_url=KEYS_TYPE_URL,
                                                            resource_names=names[KEYS_TYPE_URL],
                                                            version_info=accepted[KEYS_TYPE_URL]))
            async for response in self._responses(call, "sotw"):
                error = await self._subscriber.apply_sotw(response)
                type_url = response.type_url
                request = discovery_pb2.DiscoveryRequest(type_url=type_url, resource_names=names.get(type_url, []),
                                                         response_nonce=response.nonce)
                if error is None and type_url in accepted:
                    accepted[type_url] = response.version_info
                elif error is not None:
                    request.error_detail.CopyFrom(_nack(error))
                request.version_info = accepted.get(type_url, "")
                await call.write(request)
        finally:
            call.cancel()
