"""The admin API's effects as a real Envoy 1.40 sees them (admin ``/clusters``), with simulated
workers and the real control plane; and a restart that Envoy never notices.

Nothing listens on the ext_proc port, so Envoy fails open and routes on the
weights: what the weights and drains do is what Envoy does. Every wait polls
against a deadline.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
from envoy.config.core.v3 import health_check_pb2

from control_plane.type_urls import ENDPOINT

from .conftest import free_port
from .stack import (
    Envoy,
    http,
    running_control_plane,
    running_envoy,
    running_sim_workers,
    wait_for,
)
from .test_admin_api import Admin
from .xds_client import SotwClient

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]

T = TypeVar("T")


def flags(envoy: Envoy, host: str) -> str | None:
    return envoy.hosts().get(host, {}).get("health_flags")


def rq_total(envoy: Envoy, host: str) -> int:
    return int(envoy.hosts().get(host, {}).get("rq_total", "0"))


def post(listener_port: int) -> httpx.Response:
    with http() as client:
        return client.post(f"http://127.0.0.1:{listener_port}/v1/embeddings", json={"input": "hello"}, timeout=30)


def test_pins_drains_and_registrations_reach_envoy(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 3) as (w1, w2, w3), \
            running_control_plane(tmp_path, endpoints=[w1.id, w2.id]) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port) as envoy:
        procs = [cp.proc, envoy.proc]
        admin = Admin(cp)
        wait_for(lambda: envoy.healthy_hosts() == {w1.id, w2.id}, 30, "Envoy to see both workers healthy", procs)

        # pin, then unpin
        admin.ok("PUT", f"/v1/endpoints/{w1.id}/weight", json={"weight": 640})
        wait_for(lambda: envoy.weights().get(w1.id) == 640, 10, lambda: f"the pin in Envoy: {envoy.weights()}", procs)
        unpinned = admin.ok("DELETE", f"/v1/endpoints/{w1.id}/weight")
        assert unpinned["weight"]["pinned"] is None
        wait_for(lambda: envoy.weights().get(w1.id) == admin.endpoint(w1.id)["weight"]["effective"] != 640, 10,
                 lambda: f"the unpin in Envoy: {envoy.weights()}", procs)

        # drain: Envoy marks it and sends it nothing new; undrain brings it back
        admin.ok("POST", f"/v1/endpoints/{w2.id}/drain")
        wait_for(lambda: "eds_status_draining" in (flags(envoy, w2.id) or ""), 10,
                 lambda: f"w2 draining in Envoy: {envoy.hosts().get(w2.id)}", procs)
        before = rq_total(envoy, w2.id)
        for _ in range(20):
            assert post(cp.listener_port).status_code == 200
        assert rq_total(envoy, w2.id) == before  # not one new request
        admin.ok("DELETE", f"/v1/endpoints/{w2.id}/drain")
        wait_for(lambda: flags(envoy, w2.id) == "healthy", 10,
                 lambda: f"w2 undrained in Envoy: {envoy.hosts().get(w2.id)}", procs)

        # register: it appears, gets health-checked and serves
        admin.ok("POST", "/v1/endpoints", 201, json={"address": "127.0.0.1", "port": w3.port})
        wait_for(lambda: flags(envoy, w3.id) == "healthy", 15,
                 lambda: f"w3 registered in Envoy: {envoy.hosts().get(w3.id)}", procs)
        admin.ok("PUT", f"/v1/endpoints/{w3.id}/weight", json={"weight": 1000})
        wait_for(lambda: envoy.weights().get(w3.id) == 1000, 10, "w3's pin in Envoy", procs)
        wait_for(lambda: post(cp.listener_port).status_code == 200 and rq_total(envoy, w3.id) > 0, 30,
                 "a request served by w3", procs)

        # deregister: drained first, then removed from Envoy
        removing = admin.ok("DELETE", f"/v1/endpoints/{w3.id}", 202)
        assert removing["removing"] and removing["draining"]
        wait_for(lambda: admin.endpoint(w3.id) is None, 15, "the control plane to remove w3", procs)
        # The cluster sets ignore_health_on_host_removal: Envoy drops the host at once, even though
        # the worker is still up and healthy.
        wait_for(lambda: w3.id not in envoy.hosts(), 15, lambda: f"w3 gone from Envoy: {envoy.hosts()}", procs)
        assert set(envoy.hosts()) == {w1.id, w2.id}


# --- restarts ------------------------------------------------------------------------------------------


class EagerSotwClient(SotwClient):
    """Waits for the server to exist and connects as soon as it listens (fast reconnect backoff)."""

    def _open(self, stub: Any) -> grpc.aio.StreamStreamCall:
        return stub.StreamAggregatedResources(wait_for_ready=True)


class BackgroundLoop:
    """An asyncio loop in a thread, so a gRPC client keeps reading while the test blocks."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="xds-client-loop", daemon=True)
        self.thread.start()

    def run(self, factory: Callable[[], Awaitable[T]], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(factory(), self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def eds_view(received: Any) -> dict[str, tuple[int, int]]:
    """host:port -> (weight, health status) of one EDS response."""
    cla = received.resources()["workers"]
    return {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
            (e.load_balancing_weight.value, e.health_status) for loc in cla.endpoints for e in loc.lb_endpoints}


def test_a_restart_preserves_what_envoy_sees_from_the_first_push(tmp_path: Path) -> None:
    xds_port, listener_port = free_port(), free_port()
    data = tmp_path / "cp-data"
    expected: dict[str, tuple[int | None, int | None]] = {}

    def as_expected(view: dict[str, tuple[int, int]]) -> bool:
        return set(view) == set(expected) and all(
            (weight is None or view[host][0] == weight) and (health is None or view[host][1] == health)
            for host, (weight, health) in expected.items())

    def envoy_shows_it(envoy: Envoy) -> bool:
        hosts = envoy.hosts()
        return set(hosts) == set(expected) and all(
            (weight is None or int(hosts[host].get("weight", 0)) == weight)
            and (health is None or "eds_status_draining" in hosts[host].get("health_flags", ""))
            for host, (weight, health) in expected.items())

    with running_sim_workers(tmp_path, 3) as (w1, w2, w3), ExitStack() as outer:
        expected.update({w1.id: (700, None), w2.id: (None, health_check_pb2.DRAINING), w3.id: (55, None)})
        with ExitStack() as first:
            cp = first.enter_context(running_control_plane(tmp_path, endpoints=[w1.id, w2.id], xds_port=xds_port,
                                                            listener_port=listener_port, data_dir=data))
            admin = Admin(cp)
            admin.ok("PUT", f"/v1/endpoints/{w1.id}/weight", json={"weight": 700})
            admin.ok("POST", f"/v1/endpoints/{w2.id}/drain")
            admin.ok("POST", "/v1/endpoints", 201, json={"address": "127.0.0.1", "port": w3.port})
            admin.ok("PUT", f"/v1/endpoints/{w3.id}/weight", json={"weight": 55})
            envoy = outer.enter_context(running_envoy(tmp_path, xds_port=xds_port, node_id="envoy-restart"))
            wait_for(lambda: envoy_shows_it(envoy), 30, lambda: f"Envoy with the state: {envoy.hosts()}",
                     [cp.proc, envoy.proc])
        # the first control plane is stopped; Envoy keeps serving what it had

        background = BackgroundLoop()
        channel_options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.min_reconnect_backoff_ms", 20),
                           ("grpc.max_reconnect_backoff_ms", 100)]

        subscribing: list[asyncio.Task[None]] = []

        async def connect() -> EagerSotwClient:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{xds_port}", options=channel_options)
            client = EagerSotwClient(channel, "envoy-watcher", "inferlb")
            await client.start()
            # the request goes out once the server is up (the write waits for the channel)
            subscribing.append(asyncio.get_running_loop().create_task(client.subscribe(ENDPOINT, ["workers"])))
            return client

        client = background.run(connect)  # it waits for a server that is not there yet
        try:
            with running_control_plane(tmp_path, endpoints=[w1.id, w2.id], xds_port=xds_port,
                                       listener_port=listener_port, data_dir=data) as cp:
                procs = [cp.proc, envoy.proc]
                first_eds = background.run(lambda: client.next(ENDPOINT, timeout=30))
                # The new control plane's first EDS already has the pins, the drain and the registration.
                assert as_expected(eds_view(first_eds)), eds_view(first_eds)
                admin = Admin(cp)

                def envoy_synced() -> bool:
                    clients = admin.ok("GET", "/v1/xds/clients")["clients"]
                    return any(c["node_id"] == "envoy-restart" and c["types"].get("eds", {}).get("in_sync")
                               for c in clients)
                wait_for(envoy_synced, 30, "Envoy to reconnect to the new control plane and ACK its EDS", procs)
                assert envoy_shows_it(envoy), envoy.hosts()
                # Every EDS the watcher got from the new control plane had the operator's state.
                received = background.run(lambda: _eds_of(client))
                assert received and all(as_expected(eds_view(r)) for r in received)
        finally:
            background.run(lambda: _close(client))
            background.close()


async def _eds_of(client: SotwClient) -> list[Any]:
    return client.of_type(ENDPOINT)


async def _close(client: SotwClient) -> None:
    await client.close()
    await client._channel.close()
