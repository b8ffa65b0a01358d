"""The ADS server over real gRPC: a grpc.aio server on a free loopback port and
the small ADS client in ``tests/xds_client.py``.

Absence of a response is never asserted by waiting: each such test makes the
server send something that must come *after* the response it must not send
(responses on one stream are ordered), or waits until ``cache.clients()``
shows that the server has digested a request (the server decides what to
send in the same synchronous step in which it records the request).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, Mapping, TypeVar

import grpc
import pytest
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from google.protobuf import duration_pb2, wrappers_pb2

from envoy.service.discovery.v3 import discovery_pb2

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.model import Endpoint, FleetState, Health, Telemetry
from control_plane.type_urls import CLUSTER, ENDPOINT, LISTENER, PUSH_ORDER, ROUTE
from control_plane.xds import ClientStatus, Snapshot, SnapshotCache, TypeStatus, serve_xds, stop_xds
from control_plane.xds.delta import encode_delta_response
from control_plane.xds.server import XdsServerSettings
from control_plane.xds.sotw import encode_sotw_response
from control_plane.xds.snapshot import Encoded
from tests.conftest import free_port
from tests.xds_client import DeltaClient, Received, SotwClient

pytestmark = pytest.mark.servers

T = TypeVar("T")
EPOCH = "e1"
WORKERS = {"10.0.0.1:8101": 100, "10.0.0.2:8102": 100}
TIMEOUT = 10.0


# -- resources -------------------------------------------------------------------------------


def cluster(name: str, connect_timeout_ms: int = 1000) -> cluster_pb2.Cluster:
    return cluster_pb2.Cluster(
        name=name, type=cluster_pb2.Cluster.EDS,
        connect_timeout=duration_pb2.Duration(nanos=connect_timeout_ms * 1_000_000 % 1_000_000_000,
                                              seconds=connect_timeout_ms // 1000),
        eds_cluster_config=cluster_pb2.Cluster.EdsClusterConfig(
            eds_config=config_source_pb2.ConfigSource(ads=config_source_pb2.AggregatedConfigSource())))


def load_assignment(name: str, weights: Mapping[str, int]) -> endpoint_pb2.ClusterLoadAssignment:
    endpoints = []
    for endpoint_id, weight in weights.items():
        host, port = endpoint_id.split(":")
        endpoints.append(endpoint_components_pb2.LbEndpoint(
            endpoint=endpoint_components_pb2.Endpoint(address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=host, port_value=int(port)))),
            load_balancing_weight=wrappers_pb2.UInt32Value(value=weight)))
    return endpoint_pb2.ClusterLoadAssignment(
        cluster_name=name, endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=endpoints)])


def route_config(name: str, cluster_name: str) -> route_pb2.RouteConfiguration:
    return route_pb2.RouteConfiguration(name=name, virtual_hosts=[route_components_pb2.VirtualHost(
        name="all", domains=["*"], routes=[route_components_pb2.Route(
            match=route_components_pb2.RouteMatch(prefix="/"),
            route=route_components_pb2.RouteAction(cluster=cluster_name))])])


def snapshot(*, clusters: Mapping[str, int] | None = None, weights: Mapping[str, Mapping[str, int]] | None = None,
             route_to: str = "workers", listener_prefix: str = "http", epoch: str = EPOCH) -> Snapshot:
    """clusters: name -> connect timeout (ms); weights: cluster -> endpoint -> weight."""
    clusters = {"workers": 1000} if clusters is None else clusters
    weights = {"workers": WORKERS} if weights is None else weights
    return Snapshot.from_resources({
        CLUSTER: {n: cluster(n, t) for n, t in clusters.items()},
        ENDPOINT: {n: load_assignment(n, w) for n, w in weights.items()},
        LISTENER: {"http": listener_pb2.Listener(name="http", stat_prefix=listener_prefix)},
        ROUTE: {"routes": route_config("routes", route_to)},
    }, epoch)


def weights_of(received: Received, name: str = "workers") -> dict[str, int]:
    assignment = received.resources()[name]
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            e.load_balancing_weight.value for group in assignment.endpoints for e in group.lb_endpoints}


# -- harness ---------------------------------------------------------------------------------


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


@asynccontextmanager
async def xds_server(cache: SnapshotCache, metrics: object = None,
                     settings: XdsServerSettings | None = None) -> AsyncIterator[str]:
    address = f"127.0.0.1:{free_port()}"
    server = await serve_xds(cache, address, metrics, settings)  # type: ignore[arg-type]
    try:
        yield address
    finally:
        await stop_xds(server, cache, grace=1.0)


async def until(predicate: Callable[[], T], what: str, timeout: float = TIMEOUT) -> T:
    """Poll a condition on the server's state until it holds (or fail after ``timeout``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def client_status(cache: SnapshotCache, node_id: str) -> ClientStatus | None:
    return next((c for c in cache.clients() if c.node_id == node_id), None)


def type_status(cache: SnapshotCache, node_id: str, type_url: str) -> TypeStatus | None:
    status = client_status(cache, node_id)
    return status.types.get(type_url) if status is not None else None


async def acked(cache: SnapshotCache, node_id: str, type_url: str, version: str) -> None:
    await until(lambda: (s := type_status(cache, node_id, type_url)) is not None and s.acked_version == version,
                f"{node_id} to ACK {type_url} {version}")


async def synced(cache: SnapshotCache, node_id: str, snap: Snapshot, types: tuple[str, ...] = PUSH_ORDER) -> None:
    for type_url in types:
        await acked(cache, node_id, type_url, snap.version(type_url))


async def envoy_like_sync(client: SotwClient) -> None:
    """What Envoy asks for: every cluster and listener; EDS follows the clusters; the route by name."""
    await client.subscribe(CLUSTER)
    await client.subscribe(LISTENER)
    await client.subscribe(ROUTE, ["routes"])


class RecordingMetrics:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.push_seconds: list[float] = []
        self.backpressure = 0

    def on_connect(self, mode: str) -> None:
        self.events.append(("connect", mode))

    def on_disconnect(self, mode: str) -> None:
        self.events.append(("disconnect", mode))

    def on_push(self, type_url: str, seconds: float) -> None:
        self.events.append(("push", type_url))
        self.push_seconds.append(seconds)

    def on_ack(self, type_url: str) -> None:
        self.events.append(("ack", type_url))

    def on_nack(self, type_url: str) -> None:
        self.events.append(("nack", type_url))

    def on_refused(self, reason: str) -> None:
        self.events.append(("refused", reason))

    def on_backpressure(self) -> None:
        self.backpressure += 1


# -- snapshot --------------------------------------------------------------------------------


def test_snapshot_versions_are_content_hashes_under_the_epoch() -> None:
    first = snapshot()
    same = snapshot()
    reweighted = snapshot(weights={"workers": {**WORKERS, "10.0.0.1:8101": 300}})
    assert {t: first.version(t) for t in PUSH_ORDER} == {t: same.version(t) for t in PUSH_ORDER}
    assert reweighted.changed_types(first) == {ENDPOINT}
    assert reweighted.resources(CLUSTER)["workers"].version == first.resources(CLUSTER)["workers"].version
    assert reweighted.resources(ENDPOINT)["workers"].version != first.resources(ENDPOINT)["workers"].version
    assert all(r.version.startswith(f"{EPOCH}.") for t in PUSH_ORDER for r in first.resources(t).values())
    restarted = snapshot(epoch="e2")
    assert restarted.changed_types(first) == set(PUSH_ORDER)
    assert first.eds_names == {"workers": "workers"}
    assert first.resources(CLUSTER)["workers"].any.type_url == CLUSTER


def test_snapshot_rejects_builder_mistakes() -> None:
    with pytest.raises(ValueError, match="differs"):
        Snapshot.from_resources({CLUSTER: {"a": cluster("b")}}, EPOCH)
    with pytest.raises(ValueError, match="is not a"):
        Snapshot.from_resources({CLUSTER: {"a": load_assignment("a", WORKERS)}}, EPOCH)
    with pytest.raises(ValueError, match="unsupported"):
        Snapshot.from_resources({"type.googleapis.com/x.Y": {}}, EPOCH)


def test_encoded_resources_and_replace_type() -> None:
    first = snapshot()
    data = load_assignment("workers", {"10.0.0.1:8101": 5}).SerializeToString(deterministic=True)
    replaced = first.replace_type(ENDPOINT, {"workers": Encoded(ENDPOINT, "workers", data)})
    assert replaced.changed_types(first) == {ENDPOINT}
    assert replaced.resources(CLUSTER) is first.resources(CLUSTER)  # shared, not re-encoded
    assert replaced.eds_names == first.eds_names
    assert replaced.resources(ENDPOINT)["workers"].any.value == data
    same = Snapshot.from_resources({ENDPOINT: {"workers": load_assignment("workers", {"10.0.0.1:8101": 5})}}, EPOCH)
    assert same.version(ENDPOINT) == replaced.version(ENDPOINT)  # bytes in, or the message: one version
    with pytest.raises(ValueError, match="differs"):
        Snapshot.from_resources({ENDPOINT: {"a": Encoded(ENDPOINT, "b", data)}}, EPOCH)
    with pytest.raises(ValueError, match="is not a"):
        Snapshot.from_resources({ENDPOINT: {"a": Encoded(CLUSTER, "a", data)}}, EPOCH)


def test_pre_serialised_responses_are_what_protobuf_would_send() -> None:
    snap = snapshot(clusters={"workers": 1000, "ext": 1000}, weights={"workers": WORKERS, "ext": WORKERS})
    resources = list(snap.resources(ENDPOINT).values())
    sotw = discovery_pb2.DiscoveryResponse(version_info="v1", type_url=ENDPOINT, nonce="3-7",
                                           resources=[r.any for r in resources])
    assert encode_sotw_response(ENDPOINT, "v1", "3-7", resources) == sotw.SerializeToString(deterministic=True)
    delta = discovery_pb2.DeltaDiscoveryResponse(
        system_version_info="v2", type_url=ENDPOINT, nonce="1-2", removed_resources=["a", "b"],
        resources=[discovery_pb2.Resource(name=r.name, version=r.version, resource=r.any) for r in resources])
    assert encode_delta_response(ENDPOINT, "v2", "1-2", resources, {"b", "a"}) == \
        delta.SerializeToString(deterministic=True)
    empty = discovery_pb2.DiscoveryResponse(type_url=CLUSTER, nonce="1-1")
    assert encode_sotw_response(CLUSTER, "", "1-1", []) == empty.SerializeToString(deterministic=True)


def test_controller_serves_lean_eds_to_envoys_and_rich_eds_to_ext_proc() -> None:
    """Envoys get address, health and weight; ext_proc's node group also gets telemetry and the
    pick policy, and a telemetry-only change reaches ext_proc alone."""
    telemetry = Telemetry(observed_at=1.0, cpu_utilization=0.25, rps=10.0)
    state = FleetState(endpoints=(Endpoint("10.0.0.1", 8101, health=Health.HEALTHY, telemetry=telemetry),
                                  Endpoint("10.0.0.2", 8102)))
    group = state.settings.ext_proc_node_cluster

    async def scenario() -> None:
        cache = SnapshotCache()
        controller = Controller(ControlPlaneConfig(), cache, None, state)
        await controller.publish()
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as envoy, \
                    DeltaClient(address, "ext-proc-1", group) as ext_proc:
                await envoy_like_sync(envoy)
                await ext_proc.subscribe(ENDPOINT, ["workers"])
                lean = (await envoy.next(ENDPOINT)).resources()["workers"]
                rich = (await ext_proc.next(ENDPOINT)).resources()["workers"]
                assert weights_of_cla(lean) == weights_of_cla(rich) == {"10.0.0.1:8101": 100, "10.0.0.2:8102": 100}
                assert not lean.endpoints[0].HasField("metadata")
                assert all(not e.HasField("metadata") for e in lean.endpoints[0].lb_endpoints)
                assert rich.endpoints[0].metadata.filter_metadata["inferlb"].fields["pick_policy"]
                meta = rich.endpoints[0].lb_endpoints[0].metadata.filter_metadata["inferlb"].fields
                assert meta["cpu_utilization"].number_value == 0.25
                await synced(cache, "envoy-1", controller.snapshot)
                envoy_eds = len(envoy.of_type(ENDPOINT))

                hotter = Telemetry(observed_at=2.0, cpu_utilization=0.5, rps=10.0)
                controller.update(lambda s: FleetState(
                    endpoints=(Endpoint("10.0.0.1", 8101, health=Health.HEALTHY, telemetry=hotter), s.endpoints[1]),
                    settings=s.settings))
                await controller.publish()
                update = (await ext_proc.next(ENDPOINT)).resources()["workers"]
                fields = update.endpoints[0].lb_endpoints[0].metadata.filter_metadata["inferlb"].fields
                assert fields["cpu_utilization"].number_value == 0.5
                # A weight change next: the Envoy's next EDS is that one (nothing for the telemetry).
                controller.update(lambda s: FleetState(
                    endpoints=(s.endpoints[0], Endpoint("10.0.0.2", 8102, computed_weight=7)), settings=s.settings))
                await controller.publish()
                reweighted = (await envoy.next(ENDPOINT)).resources()["workers"]
                assert weights_of_cla(reweighted) == {"10.0.0.1:8101": 100, "10.0.0.2:8102": 7}
                assert len(envoy.of_type(ENDPOINT)) == envoy_eds + 1
                assert {c.node_id: c.group for c in cache.clients()} == {"envoy-1": "inferlb", "ext-proc-1": group}
    run(scenario)


def test_ext_proc_snapshot_follows_the_envoys_ack_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Envoys first (make before break): ext_proc's EDS changes once every Envoy has ACKed the new
    EDS; an Envoy that does not answer delays it by ENVOYS_FIRST_MAX_WAIT_S at most."""
    import control_plane.controller as controller_module

    monkeypatch.setattr(controller_module, "ENVOYS_FIRST_MAX_WAIT_S", 0.3)
    state = FleetState(endpoints=(Endpoint("10.0.0.1", 8101), Endpoint("10.0.0.2", 8102)))

    def reweigh(weight: int) -> Callable[[FleetState], FleetState]:
        return lambda s: FleetState(endpoints=(Endpoint("10.0.0.1", 8101, computed_weight=weight), s.endpoints[1]),
                                    settings=s.settings)

    async def scenario() -> None:
        cache = SnapshotCache()
        controller = Controller(ControlPlaneConfig(), cache, None, state)
        await controller.publish()
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as envoy:
                await envoy_like_sync(envoy)
                await synced(cache, "envoy-1", controller.snapshot)
                controller.update(reweigh(5))
                await controller.publish()
                assert type_status(cache, "envoy-1", ENDPOINT).acked_version == controller.snapshot.version(ENDPOINT)
                assert cache.get(state.settings.ext_proc_node_cluster) is controller.ext_proc_snapshot
                envoy.auto_ack = False  # from now on the Envoy never answers
                controller.update(reweigh(6))
                started = asyncio.get_running_loop().time()
                await controller.publish()
                assert 0.25 <= asyncio.get_running_loop().time() - started < 5
                assert not cache.default_settled(ENDPOINT)
                rich = controller.ext_proc_snapshot.resources(ENDPOINT)["workers"].any.value
                assert weights_of_cla(endpoint_pb2.ClusterLoadAssignment.FromString(rich))["10.0.0.1:8101"] == 6
    run(scenario)


def weights_of_cla(cla) -> dict[str, int]:  # type: ignore[no-untyped-def]
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            e.load_balancing_weight.value for group in cla.endpoints for e in group.lb_endpoints}


# -- state of the world ----------------------------------------------------------------------


def test_initial_sync_goes_cds_eds_lds_rds() -> None:
    async def scenario() -> None:
        cache, snap = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", snap)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", snap)
                assert [r.type_url for r in client.received] == list(PUSH_ORDER)
                assert [r.version for r in client.received] == [snap.version(t) for t in PUSH_ORDER]
                assert client.received[1].names == ("workers",)
    run(scenario)


def test_lds_and_rds_are_held_until_cds_and_eds_are_acked() -> None:
    async def scenario() -> None:
        cache, snap = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", snap)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", auto_ack=False) as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers"])
                await client.subscribe(LISTENER)
                await client.subscribe(ROUTE, ["routes"])
                cds = await client.next(CLUSTER)
                eds = await client.next(ENDPOINT)
                # The server has seen all four requests, and sent neither LDS nor RDS.
                status = await until(lambda: (s := client_status(cache, "envoy-1")) and len(s.types) == 4 and s,
                                     "all four requests")
                assert status.types[LISTENER].sent_nonce == "" and status.types[ROUTE].sent_nonce == ""
                await client.ack(cds)
                await acked(cache, "envoy-1", CLUSTER, cds.version)
                assert type_status(cache, "envoy-1", LISTENER).sent_nonce == ""  # EDS is still unacked
                await client.ack(eds)
                eds_ack_seq = client.sent[-1][0]
                lds = await client.next(LISTENER)
                rds = await client.next(ROUTE)
                assert eds_ack_seq < lds.seq < rds.seq
                assert [r.type_url for r in client.received] == list(PUSH_ORDER)
    run(scenario)


def test_one_unacked_response_per_type_then_the_latest() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", auto_ack=False) as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers"])
                cds1 = await client.next(CLUSTER)
                eds1 = await client.next(ENDPOINT)
                await client.ack(cds1)  # EDS stays unacked from here on
                await acked(cache, "envoy-1", CLUSTER, cds1.version)
                second = snapshot(clusters={"workers": 2000}, weights={"workers": {"10.0.0.1:8101": 2}})
                cache.set_snapshot("inferlb", second)
                cds2 = await client.next(CLUSTER)
                latest = snapshot(clusters={"workers": 3000}, weights={"workers": {"10.0.0.1:8101": 3}})
                cache.set_snapshot("inferlb", latest)
                await client.ack(cds2)
                cds3 = await client.next(CLUSTER)
                # Any EDS sent for the second snapshot would have arrived before cds3.
                assert [r.seq for r in client.of_type(ENDPOINT)] == [eds1.seq]
                assert cds3.version == latest.version(CLUSTER)
                await client.ack(eds1)
                eds = await client.next(ENDPOINT)
                assert eds.version == latest.version(ENDPOINT)
                assert weights_of(eds) == {"10.0.0.1:8101": 3}
    run(scenario)


def test_stale_nonce_is_ignored() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot(weights={"workers": WORKERS, "ext": WORKERS}))
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", auto_ack=False) as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers"])
                cds1, eds1 = await client.next(CLUSTER), await client.next(ENDPOINT)
                await client.ack(cds1)
                await client.ack(eds1)
                await acked(cache, "envoy-1", ENDPOINT, eds1.version)
                second = snapshot(clusters={"workers": 2000}, weights={"workers": WORKERS, "ext": WORKERS})
                cache.set_snapshot("inferlb", second)
                cds2 = await client.next(CLUSTER)
                eds2 = await client.next(ENDPOINT)  # the changed cluster's endpoints, resent for warming
                # Stale: a NACK of the old CDS nonce, and a resubscription on the old EDS nonce.
                await client.request(CLUSTER, nonce=cds1.nonce, error="late complaint")
                client.names[ENDPOINT] = ["workers", "ext"]
                await client.request(ENDPOINT, nonce=eds1.nonce)
                client.names[ENDPOINT] = ["workers"]
                await client.ack(cds2)
                await client.ack(eds2)
                await acked(cache, "envoy-1", CLUSTER, second.version(CLUSTER))  # so the stale ones were read
                status = type_status(cache, "envoy-1", CLUSTER)
                assert status.nack_count == 0 and status.last_nack is None
                assert status.acked_version == second.version(CLUSTER)
                third = snapshot(clusters={"workers": 3000}, weights={"workers": WORKERS, "ext": WORKERS})
                cache.set_snapshot("inferlb", third)
                cds3 = await client.next(CLUSTER)
                assert [r.seq for r in client.of_type(CLUSTER)] == [cds1.seq, cds2.seq, cds3.seq]
                assert all(r.names == ("workers",) for r in client.of_type(ENDPOINT))
    run(scenario)


def test_nack_is_recorded_and_not_resent_until_the_state_changes() -> None:
    async def scenario() -> None:
        cache, metrics = SnapshotCache(), RecordingMetrics()
        first = snapshot()
        cache.set_snapshot("inferlb", first)
        bad = snapshot(clusters={"workers": 2000})
        reject = {bad.version(CLUSTER)}
        async with xds_server(cache, metrics) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True,
                                  decide=lambda r: "bad cluster" if r.version in reject else None) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", first)
                cache.set_snapshot("inferlb", bad)
                status = await until(lambda: (s := type_status(cache, "envoy-1", CLUSTER)) and s.nack_count and s,
                                     "the NACK")
                assert status.last_nack is not None and status.last_nack.message == "bad cluster"
                assert status.last_nack.version == bad.version(CLUSTER)
                assert status.acked_version == first.version(CLUSTER)
                rejected_at = client.of_type(CLUSTER)[-1].seq
                # Other traffic flows; the rejected CDS is not sent again.
                reweighted = snapshot(clusters={"workers": 2000}, weights={"workers": {"10.0.0.1:8101": 7}})
                cache.set_snapshot("inferlb", reweighted)
                await client.wait_for(lambda: any(r.version == reweighted.version(ENDPOINT)
                                                  for r in client.of_type(ENDPOINT)))
                await acked(cache, "envoy-1", ENDPOINT, reweighted.version(ENDPOINT))
                assert [r for r in client.of_type(CLUSTER) if r.seq > rejected_at] == []
                # A real change goes out again.
                fixed = snapshot(clusters={"workers": 3000}, weights={"workers": {"10.0.0.1:8101": 7}})
                cache.set_snapshot("inferlb", fixed)
                await acked(cache, "envoy-1", CLUSTER, fixed.version(CLUSTER))
                status = type_status(cache, "envoy-1", CLUSTER)
                assert status.nack_count == 1
                assert cache.counters().nacks == {CLUSTER: 1}
        assert ("connect", "sotw") in metrics.events and ("disconnect", "sotw") in metrics.events
        assert metrics.events.count(("nack", CLUSTER)) == 1
        assert ("ack", LISTENER) in metrics.events and ("push", ROUTE) in metrics.events
        assert all(seconds >= 0 for seconds in metrics.push_seconds)
    run(scenario)


def test_weight_only_change_pushes_only_eds() -> None:
    async def scenario() -> None:
        cache, first = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", first)
                before = len(client.received)
                reweighted = snapshot(weights={"workers": {**WORKERS, "10.0.0.2:8102": 250}})
                cache.set_snapshot("inferlb", reweighted)
                await acked(cache, "envoy-1", ENDPOINT, reweighted.version(ENDPOINT))
                relistened = snapshot(weights={"workers": {**WORKERS, "10.0.0.2:8102": 250}}, listener_prefix="h2")
                cache.set_snapshot("inferlb", relistened)  # a barrier: LDS must come after anything else
                await acked(cache, "envoy-1", LISTENER, relistened.version(LISTENER))
                after = client.received[before:]
                assert [r.type_url for r in after] == [ENDPOINT, LISTENER]
                assert weights_of(after[0]) == {**WORKERS, "10.0.0.2:8102": 250}
    run(scenario)


def test_cluster_change_resends_its_endpoints_for_warming() -> None:
    async def scenario() -> None:
        cache, first = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", first)
                before = len(client.received)
                changed = snapshot(clusters={"workers": 2500})
                cache.set_snapshot("inferlb", changed)
                await synced(cache, "envoy-1", changed, (CLUSTER, ENDPOINT))
                after = await client.wait_for(lambda: len(client.received) >= before + 2 and client.received[before:])
                assert [r.type_url for r in after] == [CLUSTER, ENDPOINT]
                assert after[1].version == first.version(ENDPOINT) and after[1].names == ("workers",)
    run(scenario)


def test_resubscribe_sends_newly_requested_resources() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        weights = {"workers": WORKERS, "ext": {"10.0.0.9:9002": 1}}
        cache.set_snapshot("inferlb", snapshot(weights=weights))
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb") as client:
                await client.subscribe(ENDPOINT, ["workers"])
                assert (await client.next(ENDPOINT)).names == ("workers",)
                await client.subscribe(ENDPOINT, ["workers", "ext"])
                assert (await client.next(ENDPOINT)).names == ("ext",)
                await client.subscribe(ENDPOINT, ["ext"])  # shrinking needs no response
                await client.subscribe(ENDPOINT, ["ext", "workers"])
                assert (await client.next(ENDPOINT)).names == ("workers",)
                await client.subscribe(ENDPOINT, ["ext", "workers", "later"])  # not there yet
                cache.set_snapshot("inferlb", snapshot(weights={**weights, "later": WORKERS}))
                assert (await client.next(ENDPOINT)).names == ("later",)
                assert len(client.of_type(ENDPOINT)) == 4
    run(scenario)


def test_reconnect_gets_the_current_state() -> None:
    async def scenario() -> None:
        cache, first = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", first)
            await until(lambda: not cache.clients(), "the first stream to be cleaned up")
            second = snapshot(clusters={"workers": 2000}, weights={"workers": {"10.0.0.3:8103": 5}},
                              listener_prefix="h2")
            cache.set_snapshot("inferlb", second)
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", second)
                assert {r.type_url: r.version for r in client.received} == {t: second.version(t) for t in PUSH_ORDER}
                assert weights_of(client.of_type(ENDPOINT)[-1]) == {"10.0.0.3:8103": 5}
                assert len(cache.clients()) == 1
    run(scenario)


def test_removed_cluster_is_dropped_last() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        old = snapshot(clusters={"workers": 1000, "old": 1000}, weights={"workers": WORKERS, "old": WORKERS},
                       route_to="old")
        new = snapshot(clusters={"workers": 1000, "new": 1000}, weights={"workers": WORKERS, "new": WORKERS},
                       route_to="new")
        cache.set_snapshot("inferlb", old)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await envoy_like_sync(client)
                await synced(cache, "envoy-1", old)
                before = len(client.received)
                cache.set_snapshot("inferlb", new)
                await synced(cache, "envoy-1", new, (CLUSTER, ROUTE))
                after = client.received[before:]
                assert [r.type_url for r in after] == [CLUSTER, ENDPOINT, ROUTE, CLUSTER]
                union, endpoints, routes, final = after
                assert set(union.names) == {"workers", "old", "new"}  # make ...
                assert union.version.startswith(new.version(CLUSTER) + "+")
                assert endpoints.names == ("new",)
                assert routes.version == new.version(ROUTE)
                assert set(final.names) == {"workers", "new"}  # ... before break
                assert final.version == new.version(CLUSTER)
    run(scenario)


def test_node_groups_are_isolated() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        alpha, beta = snapshot(clusters={"alpha": 1000}), snapshot(clusters={"beta": 1000})
        cache.set_snapshot("a", alpha)
        cache.set_snapshot("b", beta)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-a", "a") as a, SotwClient(address, "envoy-b", "b") as b:
                await a.subscribe(CLUSTER)
                await b.subscribe(CLUSTER)
                assert (await a.next(CLUSTER)).names == ("alpha",)
                assert (await b.next(CLUSTER)).names == ("beta",)
                cache.set_snapshot("b", snapshot(clusters={"beta": 2000}))
                assert (await b.next(CLUSTER)).version != beta.version(CLUSTER)
                alpha2 = snapshot(clusters={"alpha": 2000})
                cache.set_snapshot("a", alpha2)
                assert (await a.next(CLUSTER)).version == alpha2.version(CLUSTER)
                assert len(a.of_type(CLUSTER)) == 2  # nothing from group b's change
                groups = {c.node_id: c.group for c in cache.clients()}
                assert groups == {"envoy-a": "a", "envoy-b": "b"}
    run(scenario)


def test_a_client_waits_for_its_groups_first_snapshot() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        async with xds_server(cache) as address:
            async with DeltaClient(address, "early", "inferlb") as client:
                await client.subscribe(CLUSTER)
                await until(lambda: type_status(cache, "early", CLUSTER), "the request")
                assert type_status(cache, "early", CLUSTER).sent_nonce == ""
                first = snapshot()
                cache.set_snapshot("inferlb", first)
                assert (await client.next(CLUSTER)).names == ("workers",)
                await acked(cache, "early", CLUSTER, first.version(CLUSTER))
    run(scenario)


def test_disconnect_removes_the_client_and_stop_ends_streams() -> None:
    async def scenario() -> None:
        cache, metrics = SnapshotCache(), RecordingMetrics()
        cache.set_snapshot("inferlb", snapshot())
        address = f"127.0.0.1:{free_port()}"
        server = await serve_xds(cache, address, metrics)  # type: ignore[arg-type]
        try:
            async with SotwClient(address, "gone", "inferlb") as gone, \
                    DeltaClient(address, "stays", "inferlb") as stays:
                await gone.subscribe(CLUSTER)
                await stays.subscribe(CLUSTER)
                await gone.next(CLUSTER)
                await stays.next(CLUSTER)
                status = {c.node_id: c for c in cache.clients()}
                assert status["gone"].mode == "sotw" and status["stays"].mode == "delta"
                await gone.disconnect()
                await until(lambda: [c.node_id for c in cache.clients()] == ["stays"], "cleanup of 'gone'")
                await stop_xds(server, cache, grace=5.0)
                await stays.wait_for(lambda: stays.ended)
                assert stays.code == grpc.StatusCode.OK
                assert cache.clients() == []
        finally:
            await server.stop(None)
        assert metrics.events.count(("disconnect", "sotw")) == 1
        assert metrics.events.count(("disconnect", "delta")) == 1
    run(scenario)


def test_a_second_server_on_a_taken_port_fails_loudly_instead_of_sharing_it() -> None:
    """gRPC's default SO_REUSEPORT would let a second control plane bind the same port and take half the
    Envoys' connections; ours refuses it."""
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_snapshot("inferlb", snapshot())
        address = f"127.0.0.1:{free_port()}"
        server = await serve_xds(cache, address, RecordingMetrics())  # type: ignore[arg-type]
        try:
            with pytest.raises(RuntimeError, match="Failed to bind"):
                second = await serve_xds(SnapshotCache(), address, RecordingMetrics())  # type: ignore[arg-type]
                await second.stop(None)
            async with SotwClient(address, "still-first", "inferlb") as client:  # the first server serves on
                await client.subscribe(CLUSTER)
                assert (await client.next(CLUSTER)).names == ("workers",)
        finally:
            await server.stop(None)
    run(scenario)


# -- delta -----------------------------------------------------------------------------------


def test_delta_sends_only_changed_resources() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        weights = {"workers": WORKERS, "ext": {"10.0.0.9:9002": 1}}
        first = snapshot(clusters={"workers": 1000, "ext": 1000}, weights=weights)
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with DeltaClient(address, "envoy-1", "inferlb") as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers", "ext"])
                await synced(cache, "envoy-1", first, (CLUSTER, ENDPOINT))
                assert client.state[CLUSTER].keys() == {"workers", "ext"}
                assert client.state[ENDPOINT] == {n: r.version for n, r in first.resources(ENDPOINT).items()}
                before = len(client.received)
                reweighted = snapshot(clusters={"workers": 1000, "ext": 1000},
                                      weights={**weights, "workers": {"10.0.0.1:8101": 9}})
                cache.set_snapshot("inferlb", reweighted)
                await synced(cache, "envoy-1", reweighted, (ENDPOINT,))
                changed = snapshot(clusters={"workers": 1000, "ext": 2000},
                                   weights={**weights, "workers": {"10.0.0.1:8101": 9}})
                cache.set_snapshot("inferlb", changed)  # barrier: CDS comes after anything else
                await synced(cache, "envoy-1", changed, (CLUSTER,))
                after = await client.wait_for(lambda: len(client.received) >= before + 3 and client.received[before:])
                assert [(r.type_url, r.names) for r in after] == [
                    (ENDPOINT, ("workers",)), (CLUSTER, ("ext",)), (ENDPOINT, ("ext",))]
                assert after[0].versions()["workers"] == reweighted.resources(ENDPOINT)["workers"].version
    run(scenario)


def test_delta_reconnect_honours_initial_resource_versions() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        weights = {"workers": WORKERS, "ext": {"10.0.0.9:9002": 1}}
        clusters = {"workers": 1000, "ext": 1000}
        first = snapshot(clusters=clusters, weights=weights)
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with DeltaClient(address, "envoy-1", "inferlb") as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers", "ext"])
                await synced(cache, "envoy-1", first, (CLUSTER, ENDPOINT))
                had = {t: dict(v) for t, v in client.state.items()}
            second = snapshot(clusters=clusters, weights={**weights, "workers": {"10.0.0.1:8101": 4}})
            cache.set_snapshot("inferlb", second)
            async with DeltaClient(address, "envoy-1", "inferlb") as client:
                await client.subscribe(CLUSTER, initial_resource_versions=had[CLUSTER])
                await client.subscribe(ENDPOINT, ["workers", "ext"], initial_resource_versions=had[ENDPOINT])
                cds, eds = await client.next(CLUSTER), await client.next(ENDPOINT)
                assert cds.names == () and cds.removed == ()  # answered, but nothing resent
                assert eds.names == ("workers",)
                assert weights_of(eds) == {"10.0.0.1:8101": 4}
    run(scenario)


def test_delta_removals_come_after_additions() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        old = snapshot(clusters={"workers": 1000, "old": 1000}, weights={"workers": WORKERS, "old": WORKERS},
                       route_to="old")
        new = snapshot(clusters={"workers": 1000, "new": 1000}, weights={"workers": WORKERS, "new": WORKERS},
                       route_to="new")
        cache.set_snapshot("inferlb", old)
        async with xds_server(cache) as address:
            async with DeltaClient(address, "envoy-1", "inferlb", follow_clusters=True) as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(LISTENER)
                await client.subscribe(ROUTE, ["routes"])
                await synced(cache, "envoy-1", old)
                before = len(client.received)
                cache.set_snapshot("inferlb", new)
                await client.wait_for(lambda: "old" not in client.state[CLUSTER])
                after = [(r.type_url, r.names, r.removed) for r in client.received[before:]]
                assert after == [
                    (CLUSTER, ("new",), ()),
                    (ENDPOINT, ("new",), ()),
                    (ROUTE, ("routes",), ()),
                    (ENDPOINT, (), ("old",)),
                    (CLUSTER, (), ("old",)),
                ]
    run(scenario)


def test_delta_unsubscribe_and_resubscribe() -> None:
    async def scenario() -> None:
        cache = SnapshotCache()
        weights = {"workers": WORKERS, "ext": {"10.0.0.9:9002": 1}}
        first = snapshot(weights=weights)
        cache.set_snapshot("inferlb", first)
        async with xds_server(cache) as address:
            async with DeltaClient(address, "envoy-1", "inferlb") as client:
                await client.subscribe(ENDPOINT, ["workers", "ext"])
                await synced(cache, "envoy-1", first, (ENDPOINT,))
                initial = await client.next(ENDPOINT)
                assert set(initial.names) == {"workers", "ext"}
                await client.unsubscribe(ENDPOINT, ["ext"])
                await until(lambda: type_status(cache, "envoy-1", ENDPOINT).names == ("workers",), "the unsubscribe")
                second = snapshot(weights={"workers": {"10.0.0.1:8101": 2}, "ext": {"10.0.0.9:9002": 2}})
                cache.set_snapshot("inferlb", second)
                update = await client.next(ENDPOINT)
                assert update.names == ("workers",) and update.removed == ()
                await client.subscribe(ENDPOINT, ["ext"])
                again = await client.next(ENDPOINT)
                assert again.names == ("ext",) and weights_of(again, "ext") == {"10.0.0.9:9002": 2}
    run(scenario)


def test_delta_nack_is_not_resent_until_the_state_changes() -> None:
    async def scenario() -> None:
        cache, first = SnapshotCache(), snapshot()
        cache.set_snapshot("inferlb", first)
        bad = snapshot(clusters={"workers": 2000})
        reject = {bad.version(CLUSTER)}
        async with xds_server(cache) as address:
            async with DeltaClient(address, "envoy-1", "inferlb",
                                   decide=lambda r: "no" if r.version in reject else None) as client:
                await client.subscribe(CLUSTER)
                await client.subscribe(ENDPOINT, ["workers"])
                await synced(cache, "envoy-1", first, (CLUSTER, ENDPOINT))
                cache.set_snapshot("inferlb", bad)
                await until(lambda: (s := type_status(cache, "envoy-1", CLUSTER)) and s.nack_count == 1, "the NACK")
                rejected_at = client.of_type(CLUSTER)[-1].seq
                reweighted = snapshot(clusters={"workers": 2000}, weights={"workers": {"10.0.0.1:8101": 3}})
                cache.set_snapshot("inferlb", reweighted)
                await synced(cache, "envoy-1", reweighted, (ENDPOINT,))
                assert [r for r in client.of_type(CLUSTER) if r.seq > rejected_at] == []
                assert client.state[CLUSTER] == {"workers": first.resources(CLUSTER)["workers"].version}
                fixed = snapshot(clusters={"workers": 3000}, weights={"workers": {"10.0.0.1:8101": 3}})
                cache.set_snapshot("inferlb", fixed)
                await synced(cache, "envoy-1", fixed, (CLUSTER,))
                assert client.state[CLUSTER] == {"workers": fixed.resources(CLUSTER)["workers"].version}
    run(scenario)
