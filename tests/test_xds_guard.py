"""Who the ADS server serves and how much one client may take, over real gRPC on loopback.

The server runs in the test's loop (``serve_xds`` with :class:`XdsServerSettings`); clients are the
test ADS client, a raw grpc.aio call, or raw HTTP/2 frames (hyperframe + hpack) where the point is
what goes over the wire: SETTINGS_MAX_CONCURRENT_STREAMS, a refused stream, the server's keepalive
PINGs. Nothing waits a fixed time: every wait is a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from pathlib import Path
from typing import Iterator

import grpc
import hpack
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.discovery.v3 import ads_pb2_grpc, discovery_pb2
from hyperframe.frame import (
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)
from pydantic import ValidationError

from control_plane.config import ENVOY_NODE_CLUSTER, ControlPlaneConfig
from control_plane.type_urls import CLUSTER, ROUTE
from control_plane.xds import SnapshotCache
from control_plane.xds.server import XdsServerSettings
from ext_proc.config import ExtProcConfig
from inferlb.bootstrap import render_bootstrap
from tests.certs import Pki
from tests.test_xds_server import (
    TIMEOUT,
    RecordingMetrics,
    cluster,
    run,
    snapshot,
    type_status,
    until,
    xds_server,
)
from tests.xds_client import CHANNEL_OPTIONS, DeltaClient, SotwClient

pytestmark = pytest.mark.servers

ALLOWED = frozenset({"inferlb", "inferlb-ext-proc"})
MODES = pytest.mark.parametrize("client_type", [SotwClient, DeltaClient], ids=["sotw", "delta"])
REFUSED_STREAM = 0x7
ADS_PATH = "/envoy.service.discovery.v3.AggregatedDiscoveryService/StreamAggregatedResources"


def node_ids(cache: SnapshotCache) -> list[str]:
    return sorted(c.node_id for c in cache.clients())


# -- the node allowlist ----------------------------------------------------------------------


@MODES
def test_an_unknown_node_cluster_is_refused_with_permission_denied(client_type: type[SotwClient]) -> None:
    async def scenario() -> None:
        cache, metrics = SnapshotCache(), RecordingMetrics()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, metrics, XdsServerSettings(allowed_node_clusters=ALLOWED)) as address, \
                client_type(address, "stray-1", "intruders") as stray, \
                client_type(address, "envoy-1", "inferlb") as envoy:
            await stray.subscribe(CLUSTER)
            await envoy.subscribe(CLUSTER)
            assert (await envoy.next(CLUSTER)).names == ("workers",)  # an allowed node is served
            await stray.wait_for(lambda: stray.ended)
            assert stray.code == grpc.StatusCode.PERMISSION_DENIED
            assert stray.details == ("xDS node cluster 'intruders' is not allowed (node id 'stray-1'); "
                                     "allowed: inferlb, inferlb-ext-proc")
            assert stray.received == []
            assert node_ids(cache) == ["envoy-1"]
        assert metrics.events.count(("refused", "node_cluster")) == 1
        assert len([e for e in metrics.events if e[0] == "connect"]) == 1  # the refused stream never connected
    run(scenario)


def test_a_node_without_a_cluster_is_refused_when_an_allowlist_is_set() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, None, XdsServerSettings(allowed_node_clusters=ALLOWED)) as address, \
                SotwClient(address, "anonymous") as client:
            await client.subscribe(CLUSTER)
            await client.wait_for(lambda: client.ended)
            assert client.code == grpc.StatusCode.PERMISSION_DENIED
            assert "node cluster ''" in (client.details or "")
    run(scenario)


def test_the_default_allowlist_is_the_node_clusters_the_stack_uses() -> None:
    """Envoy's bootstrap (``inferlb up``, Compose, Kubernetes, the tests) and ext_proc's default, and it follows
    a moved ext_proc node cluster; a list set by the operator replaces it."""
    envoy_default = inspect.signature(render_bootstrap).parameters["node_cluster"].default
    assert ControlPlaneConfig().allowed_node_clusters == {ENVOY_NODE_CLUSTER, ExtProcConfig().node_cluster}
    assert envoy_default == ENVOY_NODE_CLUSTER
    moved = ControlPlaneConfig(data_plane={"ext_proc_node_cluster": "pickers"})
    assert moved.allowed_node_clusters == {"inferlb", "pickers"}
    assert ControlPlaneConfig(xds_allowed_node_clusters="edge-a, edge-b").allowed_node_clusters == {"edge-a", "edge-b"}
    with pytest.raises(ValidationError, match="at least one non-empty node cluster"):
        ControlPlaneConfig(xds_allowed_node_clusters=[])


# -- stream caps -----------------------------------------------------------------------------


def test_streams_per_node_are_capped_and_freed_on_disconnect() -> None:
    async def scenario() -> None:
        cache, metrics = SnapshotCache(), RecordingMetrics()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, metrics, XdsServerSettings(max_streams_per_node=2)) as address:
            first, second = SotwClient(address, "twin", "inferlb"), DeltaClient(address, "twin", "inferlb")
            async with first, second, SotwClient(address, "twin", "inferlb") as third:
                for client in (first, second):
                    await client.subscribe(CLUSTER)
                    await client.next(CLUSTER)
                await third.subscribe(CLUSTER)
                await third.wait_for(lambda: third.ended)
                assert third.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert third.details == "xDS node 'twin' already has 2 streams open (max_streams_per_node)"
                assert metrics.events.count(("refused", "node_streams")) == 1
                await first.disconnect()
                await until(lambda: node_ids(cache) == ["twin"], "the first stream to be gone")
                async with SotwClient(address, "twin", "inferlb") as again:  # its place is free again
                    await again.subscribe(CLUSTER)
                    assert (await again.next(CLUSTER)).names == ("workers",)
    run(scenario)


def test_streams_in_all_are_capped_with_resource_exhausted() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, None, XdsServerSettings(max_streams=2)) as address, \
                SotwClient(address, "a", "inferlb") as a, SotwClient(address, "b", "inferlb") as b:
            for client in (a, b):
                await client.subscribe(CLUSTER)
                await client.next(CLUSTER)
            async with SotwClient(address, "c", "inferlb") as c:
                await c.subscribe(CLUSTER)
                await c.wait_for(lambda: c.ended)
                assert c.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert node_ids(cache) == ["a", "b"]
    run(scenario)


# -- raw HTTP/2: what the server says on the wire ----------------------------------------------


class RawH2:
    """A bare HTTP/2 client connection (prior knowledge, no TLS): frames in, frames out, nothing hidden."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
        self.encoder = hpack.Encoder()
        self._buffer = b""
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize())

    def close(self) -> None:
        self.sock.close()

    def _exactly(self, size: int) -> bytes | None:
        while len(self._buffer) < size:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buffer += chunk
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def frames(self) -> Iterator[Frame]:
        """Frames from the server until it closes the connection (socket timeout: TIMEOUT)."""
        while (header := self._exactly(9)) is not None:
            frame, length = Frame.parse_frame_header(memoryview(header))
            body = self._exactly(length)
            if body is None:
                return
            frame.parse_body(memoryview(body))
            yield frame

    def server_settings(self) -> SettingsFrame:
        """The server's SETTINGS, acknowledged (from then on the server enforces them)."""
        frame = next(f for f in self.frames() if isinstance(f, SettingsFrame) and "ACK" not in f.flags)
        self.sock.sendall(SettingsFrame(0, flags=["ACK"]).serialize())
        return frame

    def open_ads_stream(self, stream_id: int, authority: str) -> None:
        headers = [(":method", "POST"), (":scheme", "http"), (":path", ADS_PATH), (":authority", authority),
                   ("content-type", "application/grpc"), ("te", "trailers")]
        self.sock.sendall(HeadersFrame(stream_id, self.encoder.encode(headers), flags=["END_HEADERS"]).serialize())


def test_http2_max_concurrent_streams_is_advertised_and_the_excess_stream_refused() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, None, XdsServerSettings(max_concurrent_streams=2)) as address:
            def exchange() -> tuple[int, list[int]]:
                h2 = RawH2(address)
                try:
                    limit = h2.server_settings().settings[SettingsFrame.MAX_CONCURRENT_STREAMS]
                    for stream_id in (1, 3, 5):  # one more than allowed
                        h2.open_ads_stream(stream_id, address)
                    refused = next(f for f in h2.frames() if isinstance(f, RstStreamFrame))
                    return limit, [refused.stream_id, refused.error_code]
                finally:
                    h2.close()
            limit, refused = await asyncio.to_thread(exchange)
            assert limit == 2
            assert refused == [5, REFUSED_STREAM]
    run(scenario)


def test_keepalive_pings_a_connection_and_drops_it_when_the_ping_goes_unanswered() -> None:
    async def scenario() -> None:
        settings = XdsServerSettings(keepalive_time_s=0.2, keepalive_timeout_s=0.5)
        async with xds_server(SnapshotCache(), None, settings) as address:
            def silent_peer() -> list[str]:
                h2 = RawH2(address)
                try:
                    h2.server_settings()
                    h2.open_ads_stream(1, address)  # a stream open, then never another byte from us
                    seen = []
                    for frame in h2.frames():  # until the server closes the connection
                        if isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                            seen.append("ping")
                        elif isinstance(frame, GoAwayFrame):
                            seen.append("goaway")
                    return seen
                finally:
                    h2.close()
            seen = await asyncio.to_thread(silent_peer)
            assert seen[0] == "ping" and "goaway" in seen, seen
    run(scenario)


# -- the inbound buffer ----------------------------------------------------------------------


def padded_clusters(count: int, pad_bytes: int) -> dict:
    """Clusters large enough in all (count x pad_bytes) that a client not reading them stalls the server's send."""
    clusters = {}
    for i in range(count):
        resource = cluster(f"padded-{i}")
        resource.metadata.filter_metadata["pad"].update({"bytes": "x" * pad_bytes})
        clusters[resource.name] = resource
    return clusters


def test_a_flooding_client_is_held_to_its_inbound_buffer_and_others_are_served() -> None:
    """A client writes requests as fast as it can and never reads: the server's send to it stalls (flow
    control), its reader pauses once ``inbound_buffer`` requests wait (backpressure, counted), another
    client is served meanwhile, and when the flooder reads again every request it sent is handled."""
    async def scenario() -> None:
        cache, metrics = SnapshotCache(), RecordingMetrics()
        snap = snapshot().replace_type(CLUSTER, padded_clusters(64, 128 * 1024))  # 8 MiB of CDS
        cache.set_snapshot("inferlb", snap)
        async with xds_server(cache, metrics, XdsServerSettings(inbound_buffer=4)) as address, \
                grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            call = ads_pb2_grpc.AggregatedDiscoveryServiceStub(channel).StreamAggregatedResources()
            node = base_pb2.Node(id="flood", cluster="inferlb")
            await call.write(discovery_pb2.DiscoveryRequest(node=node, type_url=CLUSTER))
            floods = [[f"route-{i}-{j:03d}-{'y' * 64}" for j in range(64)] for i in range(300)]  # ~1.5 MiB

            async def flood() -> None:
                for names in floods:
                    await call.write(discovery_pb2.DiscoveryRequest(type_url=ROUTE, resource_names=names))

            writer = asyncio.create_task(flood())
            try:
                await until(lambda: metrics.backpressure >= 1, "the flooder's reader to pause")
                async with SotwClient(channel, "bystander", "inferlb") as bystander:
                    await bystander.subscribe(CLUSTER)
                    assert set((await bystander.next(CLUSTER)).names) == set(snap.resources(CLUSTER))

                async def drain() -> None:
                    while await call.read() is not grpc.aio.EOF:
                        pass
                reader = asyncio.create_task(drain())
                try:
                    await asyncio.wait_for(writer, TIMEOUT * 3)
                    last = tuple(sorted(floods[-1]))
                    await until(lambda: (s := type_status(cache, "flood", ROUTE)) is not None and s.names == last,
                                "the flooder's last request to be handled", timeout=TIMEOUT * 3)
                finally:
                    reader.cancel()
                    await asyncio.gather(reader, return_exceptions=True)
            finally:
                writer.cancel()
                call.cancel()
                await asyncio.gather(writer, return_exceptions=True)
    run(scenario)


# -- mutual TLS --------------------------------------------------------------------------------


def test_mtls_serves_a_client_with_a_certificate_and_refuses_one_without(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    server, client = pki.issue("control-plane", "127.0.0.1"), pki.issue("envoy-1")
    settings = XdsServerSettings(allowed_node_clusters=ALLOWED, tls=server.pem())

    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache, None, settings) as address:
            ca = pki.ca.read_bytes()
            with_cert = grpc.ssl_channel_credentials(ca, client.key.read_bytes(), client.cert.read_bytes())
            async with grpc.aio.secure_channel(address, with_cert, options=CHANNEL_OPTIONS) as channel, \
                    SotwClient(channel, "envoy-1", "inferlb") as envoy:
                await envoy.subscribe(CLUSTER)
                assert (await envoy.next(CLUSTER)).names == ("workers",)
            refused = {
                "no client certificate": grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)),
                "plaintext": grpc.aio.insecure_channel(address),
            }
            for what, channel in refused.items():
                async with channel, SotwClient(channel, "envoy-2", "inferlb") as stray:
                    with contextlib.suppress(grpc.aio.AioRpcError):  # the write may see the failure first
                        await stray.subscribe(CLUSTER)
                    await stray.wait_for(lambda: stray.ended)
                    assert stray.code == grpc.StatusCode.UNAVAILABLE, what
                    assert stray.received == [], what
            assert [c.node_id for c in cache.clients()] == []
    run(scenario)
