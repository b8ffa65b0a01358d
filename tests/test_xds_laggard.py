"""A client that never ACKs cannot delay other clients' publishes.

Before: every EDS publish held the publish lock and waited up to
``ENVOYS_FIRST_MAX_WAIT_S`` for every Envoy-group stream to ACK, so one
connected client that never answers (a wedged Envoy, a hostile client with an
allowed node cluster) cost every publish the whole wait. Now the first missed
deadline marks it a laggard, publishes stop waiting for it, and it is waited
for again once it has answered its last push.

In process, over real gRPC: the control plane's ADS server, its Controller,
and the test ADS clients. Liveness rather than timing is asserted: with the
wait set to an hour, the publishes after the first miss must finish at all.
"""

from __future__ import annotations

import asyncio
from typing import Callable

import pytest

import control_plane.controller as controller_module
from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Endpoint, FleetState
from control_plane.type_urls import CLUSTER, ENDPOINT
from control_plane.xds import SnapshotCache

from .stack import prometheus_samples, sample
from .test_xds_server import acked, envoy_like_sync, run, snapshot, synced, type_status, until, xds_server
from .xds_client import SotwClient

pytestmark = pytest.mark.servers

HOUR = 3600.0


def reweigh(weight: int) -> Callable[[FleetState], FleetState]:
    return lambda s: FleetState(endpoints=(Endpoint("10.0.0.1", 8101, computed_weight=weight), s.endpoints[1]),
                                settings=s.settings)


def laggard_gauge(metrics: ControlPlaneMetrics) -> float | None:
    return sample(prometheus_samples(metrics.exposition().decode()), "inferlb_cp_xds_laggard_streams")


def test_a_client_that_never_acks_costs_one_deadline_not_one_per_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    state = FleetState(endpoints=(Endpoint("10.0.0.1", 8101), Endpoint("10.0.0.2", 8102)))

    async def scenario() -> None:
        cache = SnapshotCache()
        metrics = ControlPlaneMetrics(lambda: state)
        controller = Controller(ControlPlaneConfig(), cache, metrics, state)
        await controller.publish()
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-good", "inferlb", follow_clusters=True) as good, \
                    SotwClient(address, "envoy-mute", "inferlb", follow_clusters=True) as mute:
                for client in (good, mute):
                    await envoy_like_sync(client)
                    await synced(cache, client.node.id, controller.snapshot)
                mute.auto_ack = False  # from now on it never answers

                # The first publish it does not answer: waited for up to the deadline, then it is a laggard.
                # (On a loaded machine the good client may miss it too: it answers, so it is waited for again.)
                monkeypatch.setattr(controller_module, "ENVOYS_FIRST_MAX_WAIT_S", 0.2)
                controller.update(reweigh(5))
                await controller.publish()
                assert "envoy-mute" in cache.laggards() and (laggard_gauge(metrics) or 0) >= 1

                # Every later publish: the mute client is not waited for. With an hour's deadline they finish.
                monkeypatch.setattr(controller_module, "ENVOYS_FIRST_MAX_WAIT_S", HOUR)
                for weight in range(6, 11):
                    controller.update(reweigh(weight))
                    await asyncio.wait_for(controller.publish(), 30)
                    version = controller.snapshot.version(ENDPOINT)
                    await acked(cache, "envoy-good", ENDPOINT, version)  # the good client gets every one
                    assert type_status(cache, "envoy-mute", ENDPOINT).acked_version != version
                assert "envoy-mute" in cache.laggards()

                # It answers its last push: waited for again from the next publish on (and no longer counted).
                mute.auto_ack = True
                await mute.ack(mute.of_type(ENDPOINT)[-1])
                await until(lambda: (s := type_status(cache, "envoy-mute", ENDPOINT)).acked_version == s.sent_version,
                            "the mute client to answer its last push")
                # Read live: /metrics says so before any publish (it lagged behind until the next one before).
                assert cache.laggards() == frozenset() and laggard_gauge(metrics) == 0
                controller.update(reweigh(11))
                await asyncio.wait_for(controller.publish(), 30)
                assert cache.laggards() == frozenset() and laggard_gauge(metrics) == 0
                controller.update(reweigh(12))
                await asyncio.wait_for(controller.publish(), 30)
                version = controller.snapshot.version(ENDPOINT)
                # Waited for like any other: it had ACKed the new EDS before the publish returned.
                assert type_status(cache, "envoy-mute", ENDPOINT).acked_version == version
                await until(lambda: cache.default_settled(ENDPOINT), "every client to settle")
    run(scenario)


def test_the_cache_wait_skips_a_laggard_and_forgets_it_when_it_leaves() -> None:
    """The mechanism itself, on the cache: after one missed deadline the wait set holds the good stream only."""
    async def scenario() -> None:
        cache = SnapshotCache()
        cache.set_default_snapshot(snapshot(weights={"workers": {"10.0.0.1:8101": 1}}))
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-good", "inferlb", follow_clusters=True) as good:
                mute = SotwClient(address, "envoy-mute", "inferlb", follow_clusters=True)
                await mute.start()
                try:
                    for client in (good, mute):
                        await envoy_like_sync(client)
                        await acked(cache, client.node.id, ENDPOINT, cache.get("inferlb").version(ENDPOINT))
                    mute.auto_ack = False

                    cache.set_default_snapshot(snapshot(weights={"workers": {"10.0.0.1:8101": 2}}))
                    assert not await cache.wait_default_settled(ENDPOINT, 0.2)  # the mute one never answers
                    # (a loaded machine may make the good one miss it too: it answers, so it is waited for again)
                    await acked(cache, "envoy-good", ENDPOINT, cache.get("inferlb").version(ENDPOINT))
                    assert cache.laggards() == {"envoy-mute"}

                    for weight in range(3, 6):  # an hour's deadline: returns once the good one has ACKed
                        cache.set_default_snapshot(snapshot(weights={"workers": {"10.0.0.1:8101": weight}}))
                        version = cache.get("inferlb").version(ENDPOINT)
                        assert await asyncio.wait_for(cache.wait_default_settled(ENDPOINT, HOUR), 30)
                        assert type_status(cache, "envoy-good", ENDPOINT).acked_version == version
                        assert type_status(cache, "envoy-mute", ENDPOINT).acked_version != version
                    assert cache.laggards() == {"envoy-mute"}
                finally:
                    await mute.close()
                await until(lambda: cache.laggards() == frozenset(), "the laggard that left to be forgotten")
    run(scenario)


def test_a_client_that_never_acked_an_eds_is_not_waited_for_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """One that connects and never answers costs no deadline: it has shown no EDS it serves with."""
    state = FleetState(endpoints=(Endpoint("10.0.0.1", 8101), Endpoint("10.0.0.2", 8102)))

    async def scenario() -> None:
        cache = SnapshotCache()
        controller = Controller(ControlPlaneConfig(), cache, None, state)
        await controller.publish()
        monkeypatch.setattr(controller_module, "ENVOYS_FIRST_MAX_WAIT_S", HOUR)
        async with xds_server(cache) as address:
            async with SotwClient(address, "envoy-good", "inferlb", follow_clusters=True) as good, \
                    SotwClient(address, "envoy-mute", "inferlb", follow_clusters=True, auto_ack=False) as mute:
                await envoy_like_sync(good)
                await synced(cache, "envoy-good", controller.snapshot)
                await mute.subscribe(CLUSTER)  # and EDS for the clusters it gets, as Envoy does; answers nothing
                await until(lambda: (s := type_status(cache, "envoy-mute", ENDPOINT)) and s.sent_version,
                            "the mute client to be sent the endpoints")
                for weight in range(5, 8):
                    controller.update(reweigh(weight))
                    await asyncio.wait_for(controller.publish(), 30)  # an hour's deadline: never reached
                    version = controller.snapshot.version(ENDPOINT)
                    assert type_status(cache, "envoy-good", ENDPOINT).acked_version == version  # waited for
                    assert type_status(cache, "envoy-mute", ENDPOINT).acked_version == ""
                assert cache.laggards() == frozenset()  # never waited for, so never late
    run(scenario)
