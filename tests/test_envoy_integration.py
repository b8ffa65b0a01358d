"""The control plane and a real Envoy 1.40, end to end on loopback.

Every process is real and on free ports (``tests/stack.py``): ``python -m
control_plane`` or the xDS server in this test's own event loop, Envoy on the
bootstrap ``render_bootstrap`` writes, and workers (one real ONNX worker where
the model's answer is the point, simulated ones elsewhere). Nothing waits a
fixed time: every wait polls a condition and gives up at a deadline. Nothing
listens on the ext_proc port the resources name, so Envoy's ext_proc filter
fails open and routes on the weights alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable, ContextManager, Sequence, TypeVar

import httpx
import pytest

from control_plane.model import DataPlaneSettings, Endpoint, ExtProcSettings, FleetState
from control_plane.resources import build_resources, weights_of
from control_plane.type_urls import CLUSTER, ENDPOINT, LISTENER, PUSH_ORDER, ROUTE
from control_plane.xds import Snapshot, SnapshotCache, TypeStatus, make_epoch, serve_xds, stop_xds

from .conftest import WorkerProcess, free_port
from .stack import (
    BackgroundLoad,
    ControlPlane,
    Envoy,
    Proc,
    SimWorker,
    http,
    running_control_plane,
    running_envoy,
    running_sim_workers,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

T = TypeVar("T")
MODES = pytest.mark.parametrize("delta", [False, True], ids=["sotw", "delta"])
# About 60 tokens: long enough that a simulated worker's busy time is measurable at modest load.
LOAD_BODY = {"input": " ".join(["the quick brown fox jumps over the lazy dog"] * 6)}


def embeddings_url(listener_port: int) -> str:
    return f"http://127.0.0.1:{listener_port}/v1/embeddings"


def post(listener_port: int, body: dict) -> httpx.Response:
    with http() as client:
        return client.post(embeddings_url(listener_port), json=body, timeout=30)


def serves(listener_port: int, body: dict | None = None) -> httpx.Response | None:
    """One request through Envoy; the response if it is a 200, else None (for ``wait_for``)."""
    response = post(listener_port, body or {"input": "hello"})
    return response if response.status_code == 200 else None


def assert_serves(listener_port: int, count: int = 5) -> None:
    for _ in range(count):
        response = post(listener_port, {"input": "still serving"})
        assert response.status_code == 200, response.text


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def cp_metric(cp: ControlPlane, name: str, **labels: str) -> float | None:
    return sample(cp.metrics(), name, **labels)


# --- 1. requests flow, SotW and Delta --------------------------------------------------------------


@MODES
def test_requests_flow_through_envoy_to_a_real_worker(delta: bool, worker: WorkerProcess, reference: dict,
                                                       tmp_path: Path) -> None:
    mode = "delta" if delta else "sotw"
    worker_id = worker.url.removeprefix("http://")
    with running_control_plane(tmp_path, endpoints=[worker_id]) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id=f"envoy-{mode}", delta=delta) as envoy:
        procs = [cp.proc, envoy.proc]
        wait_for(lambda: worker_id in envoy.healthy_hosts(), 30, "Envoy to health-check the worker", procs)
        wait_for(lambda: serves(cp.listener_port), 30, "a first 200 through the Envoy listener", procs)

        items = reference["items"][:4]
        response = post(cp.listener_port, {"model": "all-MiniLM-L6-v2", "input": [it["text"] for it in items]})
        assert response.status_code == 200, response.text
        assert response.headers["server"] == "envoy"  # it did go through Envoy
        data = response.json()["data"]
        assert len(data) == len(items)
        for item, got in zip(items, data):
            assert cosine(got["embedding"], item["embedding"]) >= 0.99, item["text"]

        hosts = envoy.hosts()
        assert set(hosts) == {worker_id}
        assert int(hosts[worker_id]["weight"]) >= 1
        assert int(hosts[worker_id]["rq_success"]) >= 1

        metrics = cp.metrics()
        assert sample(metrics, "inferlb_cp_xds_clients", mode=mode) == 1
        assert sample(metrics, "inferlb_cp_xds_clients", mode="delta" if mode == "sotw" else "sotw") in (None, 0)
        for kind in ("cds", "eds", "lds", "rds"):
            assert (sample(metrics, "inferlb_cp_xds_acks_total", type=kind) or 0) >= 1, kind
            assert (sample(metrics, "inferlb_cp_xds_nacks_total", type=kind) or 0) == 0, kind


# --- 2. weights follow slowness -------------------------------------------------------------------


def _agreeing_weights(cp: ControlPlane, envoy: Envoy) -> dict[str, int] | None:
    """The control plane's effective weights if Envoy has exactly them (read CP, Envoy, CP: a stable read)."""
    before = cp.effective_weights()
    in_envoy = envoy.weights()
    after = cp.effective_weights()
    return in_envoy if before == in_envoy == after else None


def test_weight_follows_a_slow_worker_and_recovers(tmp_path: Path) -> None:
    with running_sim_workers(tmp_path, 3) as workers, \
            running_control_plane(tmp_path, endpoints=[w.id for w in workers], scrape_interval_s=0.25) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-weights") as envoy:
        procs = [cp.proc, envoy.proc, *(w.proc for w in workers)]
        ids = {w.id for w in workers}
        slow, others = workers[0].id, ids - {workers[0].id}
        wait_for(lambda: envoy.healthy_hosts() == ids, 30, "Envoy to see all three workers healthy", procs)
        wait_for(lambda: serves(cp.listener_port), 30, "a first 200 through the Envoy listener", procs)

        def ratio() -> float:
            weights = envoy.weights()
            return weights[slow] / min(weights[o] for o in others)

        with BackgroundLoad(embeddings_url(cp.listener_port), LOAD_BODY, concurrency=4,
                            max_requests=60_000, max_seconds=150) as load:
            # Populated: the control plane scrapes all three as healthy and Envoy sends each of them traffic.
            wait_for(lambda: all(cp_metric(cp, "inferlb_cp_endpoint_healthy", endpoint=i) == 1 for i in ids)
                     and all(int(h.get("rq_success", 0)) > 0 for h in envoy.hosts().values())
                     and set(envoy.weights()) == ids,
                     30, "weights for all three workers, with traffic to each", procs)

            workers[0].set_speed(0.25)
            wait_for(lambda: ratio() < 0.7, 30,
                     lambda: f"the slowed worker's weight in Envoy to drop: {envoy.weights()}", procs, interval=0.1)
            slowed = wait_for(lambda: _agreeing_weights(cp, envoy), 15,
                              "Envoy's weights to equal the control plane's", procs)
            assert slowed[slow] < min(slowed[o] for o in others)

            workers[0].set_speed(1.0)
            wait_for(lambda: ratio() > 0.8, 30,
                     lambda: f"the worker's weight in Envoy to rise again: {envoy.weights()}", procs, interval=0.1)
            wait_for(lambda: _agreeing_weights(cp, envoy), 15, "Envoy's weights to equal the control plane's",
                     procs)

        result = load.snapshot()
        assert not result.errors, result.errors
        assert set(result.codes) == {200}, result.codes  # no request failed while weights moved


# --- in-process control plane (3 and 5) ------------------------------------------------------------


class InProcessControlPlane:
    """The xDS server and snapshot cache in the running event loop; the test publishes states."""

    def __init__(self) -> None:
        self.cache = SnapshotCache()
        self.xds_port = free_port()
        self.epoch = make_epoch()
        self._server = None

    async def __aenter__(self) -> "InProcessControlPlane":
        self._server = await serve_xds(self.cache, f"127.0.0.1:{self.xds_port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop_xds(self._server, self.cache, grace=1.0)

    async def publish(self, state: FleetState) -> Snapshot:
        """As the controller does: build and serialise in a thread, set on the loop."""
        snapshot = await asyncio.to_thread(lambda: Snapshot.from_resources(build_resources(state), self.epoch))
        self.cache.set_default_snapshot(snapshot)
        return snapshot

    def status(self, node_id: str, type_url: str) -> TypeStatus | None:
        client = next((c for c in self.cache.clients() if c.node_id == node_id), None)
        return client.types.get(type_url) if client is not None else None

    def acked(self, node_id: str, snapshot: Snapshot, types: tuple[str, ...] = PUSH_ORDER) -> bool:
        return all((s := self.status(node_id, t)) is not None and s.acked_version == snapshot.version(t)
                   for t in types)


async def until(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll a condition on this loop's state (the cache); give up after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


async def until_blocking(predicate: Callable[[], T | None], timeout: float, what: str,
                         procs: Sequence[Proc] = ()) -> T:
    """``wait_for`` (HTTP to Envoy, blocking) in a thread, so the xDS server on this loop keeps serving."""
    return await asyncio.to_thread(wait_for, predicate, timeout, what, procs)


@asynccontextmanager
async def entered_in_thread(manager: ContextManager[T]) -> AsyncIterator[T]:
    """Enter and exit a blocking context manager (a process launcher) off the loop."""
    value = await asyncio.to_thread(manager.__enter__)
    try:
        yield value
    except BaseException as exc:
        if not await asyncio.to_thread(manager.__exit__, type(exc), exc, exc.__traceback__):
            raise
    else:
        await asyncio.to_thread(manager.__exit__, None, None, None)


def fleet(workers: list[SimWorker], settings: DataPlaneSettings, weights: dict[str, int] | None = None) -> FleetState:
    weights = weights or {}
    return FleetState(
        endpoints=tuple(Endpoint("127.0.0.1", w.port, computed_weight=weights.get(w.id, 100)) for w in workers),
        settings=settings,
    )


def dp_settings() -> DataPlaneSettings:
    return DataPlaneSettings(listener_port=free_port(), ext_proc=ExtProcSettings(port=free_port()),
                             health_check_interval_s=0.25)


# --- 3. a NACKed snapshot ---------------------------------------------------------------------------


@MODES
def test_a_nacked_snapshot_is_recorded_not_resent_and_envoy_keeps_the_last_good_config(
        delta: bool, tmp_path: Path) -> None:
    node = f"envoy-nack-{'delta' if delta else 'sotw'}"

    async def scenario(workers: list[SimWorker]) -> None:
        good = fleet(workers, dp_settings(), {workers[0].id: 100, workers[1].id: 200})
        async with InProcessControlPlane() as cp:
            good_snap = await cp.publish(good)  # before Envoy starts: it waits for its first CDS and LDS
            async with entered_in_thread(running_envoy(tmp_path, xds_port=cp.xds_port, node_id=node,
                                                       delta=delta)) as envoy:
                await nack_scenario(cp, envoy, workers, good, good_snap)

    with running_sim_workers(tmp_path, 2) as workers:
        asyncio.run(scenario(workers))


async def nack_scenario(cp: InProcessControlPlane, envoy: Envoy, workers: list[SimWorker], good: FleetState,
                        good_snap: Snapshot) -> None:
    node, settings, ids = envoy.node_id, good.settings, {w.id for w in workers}
    port = settings.listener_port
    procs = [envoy.proc]
    await until(lambda: cp.acked(node, good_snap), 20, "Envoy to ACK the first snapshot")
    await until_blocking(lambda: envoy.healthy_hosts() == ids, 30, "both workers healthy in Envoy", procs)
    await until_blocking(lambda: serves(port), 30, "a first 200 through the listener", procs)
    good_weights = weights_of(build_resources(good)[ENDPOINT]["workers"])
    assert await asyncio.to_thread(envoy.weights) == good_weights

    # An endpoint address Envoy cannot parse: the whole ClusterLoadAssignment is rejected.
    bad = dataclasses.replace(good, endpoints=(*good.endpoints, Endpoint("not-an-ip", 1234)))
    bad_snap = await cp.publish(bad)
    assert bad_snap.changed_types(good_snap) == {ENDPOINT}
    eds = await until(lambda: (s := cp.status(node, ENDPOINT)) is not None and s.nack_count >= 1 and s,
                      20, "Envoy to NACK the bad ClusterLoadAssignment")
    assert eds.nack_count == 1
    # Envoy's own words, e.g. "malformed IP address: not-an-ip. Consider setting resolver_name ..."
    assert eds.last_nack is not None and "malformed IP address: not-an-ip" in eds.last_nack.message, eds.last_nack
    assert eds.last_nack.version == bad_snap.version(ENDPOINT)
    assert eds.acked_version == good_snap.version(ENDPOINT)
    pushes_after_nack = eds.push_count
    assert await until_blocking(lambda: envoy.stat("cluster.workers.update_rejected") == 1, 10,
                                "Envoy's EDS update_rejected stat", procs)

    # Not resent: a change to another type (routes only) goes out and is ACKed, and
    # meanwhile EDS was not pushed again (responses on one stream are ordered).
    routes_changed = dataclasses.replace(bad, settings=dataclasses.replace(settings, retries=3))
    routes_snap = await cp.publish(routes_changed)
    assert routes_snap.changed_types(bad_snap) == {ROUTE}
    await until(lambda: cp.acked(node, routes_snap, (ROUTE,)), 20, "Envoy to ACK the new routes")
    eds = cp.status(node, ENDPOINT)
    assert eds is not None
    assert (eds.nack_count, eds.push_count) == (1, pushes_after_nack)
    assert eds.acked_version == good_snap.version(ENDPOINT)
    assert cp.cache.counters().nacks == {ENDPOINT: 1}
    for type_url in (CLUSTER, LISTENER, ROUTE):
        assert cp.status(node, type_url).nack_count == 0  # type: ignore[union-attr]

    # Envoy runs on the last good endpoints, and traffic flows.
    assert await asyncio.to_thread(envoy.weights) == good_weights
    await asyncio.to_thread(assert_serves, port)
    assert await asyncio.to_thread(envoy.stat, "cluster.workers.update_rejected") == 1

    # A good snapshot again: ACKed and applied.
    fixed = dataclasses.replace(routes_changed, endpoints=tuple(
        dataclasses.replace(e, computed_weight=300) if e.id == workers[1].id else e
        for e in good.endpoints))
    fixed_snap = await cp.publish(fixed)
    await until(lambda: cp.acked(node, fixed_snap), 20, "Envoy to ACK the fixed snapshot")
    fixed_weights = weights_of(build_resources(fixed)[ENDPOINT]["workers"])
    await until_blocking(lambda: envoy.weights() == fixed_weights, 10, "Envoy to apply the fixed weights",
                         procs)
    eds = cp.status(node, ENDPOINT)
    assert eds is not None and eds.nack_count == 1
    assert cp.cache.counters().nacks == {ENDPOINT: 1}
    assert await asyncio.to_thread(envoy.stat, "cluster.workers.update_rejected") == 1
    await asyncio.to_thread(assert_serves, port)


# --- 4. the control plane dies and comes back -------------------------------------------------------


UPDATES = ("cluster_manager.cds.update_success", "cluster.workers.update_success",
           "listener_manager.lds.update_success")


def _updates(envoy: Envoy) -> dict[str, int]:
    """Envoy's counts of accepted CDS, EDS and LDS responses."""
    return {name: envoy.stat(name) or 0 for name in UPDATES}


@MODES
def test_envoy_serves_through_a_control_plane_crash_and_reconnects(delta: bool, tmp_path: Path) -> None:
    mode = "delta" if delta else "sotw"
    with running_sim_workers(tmp_path, 2) as workers:
        ids = {w.id for w in workers}
        xds_port, listener_port = free_port(), free_port()
        # The restarted process gets the same flags and environment: the same configuration.
        same = dict(endpoints=[w.id for w in workers], xds_port=xds_port, admin_port=free_port(),
                    listener_port=listener_port, ext_proc_port=free_port(), weight_policy="equal")
        with ExitStack() as stack:
            first = stack.enter_context(running_control_plane(tmp_path, **same))  # type: ignore[arg-type]
            envoy = stack.enter_context(running_envoy(tmp_path, xds_port=xds_port, node_id=f"envoy-crash-{mode}",
                                                      delta=delta))
            wait_for(lambda: envoy.healthy_hosts() == ids, 30, "both workers healthy in Envoy", [envoy.proc])
            wait_for(lambda: serves(listener_port), 30, "a first 200 through the listener", [envoy.proc])
            before = envoy.weights()
            assert set(before) == ids
            accepted = _updates(envoy)
            assert envoy.stat("control_plane.connected_state") == 1

            first.kill()  # SIGKILL: no goodbye on the stream
            wait_for(lambda: envoy.stat("control_plane.connected_state") == 0, 30,
                     "Envoy to notice the control plane is gone", [envoy.proc])
            assert_serves(listener_port, 10)
            assert envoy.weights() == before

            second = stack.enter_context(running_control_plane(tmp_path, **same))  # type: ignore[arg-type]
            procs = [second.proc, envoy.proc]
            wait_for(lambda: envoy.stat("control_plane.connected_state") == 1, 60, "Envoy to reconnect", procs)
            wait_for(lambda: cp_metric(second, "inferlb_cp_xds_clients", mode=mode) == 1
                     and (cp_metric(second, "inferlb_cp_xds_acks_total", type="eds") or 0) >= 1,
                     30, "the new control plane to see Envoy connected and ACKing", procs)
            # Envoy accepted the new process's CDS, EDS and LDS, and runs the same endpoints and weights.
            wait_for(lambda: all(n > accepted[k] for k, n in _updates(envoy).items()), 30,
                     "Envoy to accept the new control plane's responses", procs)
            assert envoy.weights() == before
            # Same bytes from the new process: Envoy rebuilt no cluster and no listener (no warming, no drain).
            assert envoy.stat("cluster_manager.cluster_modified") == 0
            assert envoy.stat("listener_manager.listener_modified") == 0
            assert_serves(listener_port, 10)


# --- 5. two Envoys ------------------------------------------------------------------------------------


def test_two_envoys_converge_to_the_same_weights(tmp_path: Path) -> None:
    """One SotW and one Delta Envoy (different node ids and admin ports) on one shared listener port."""

    async def scenario(workers: list[SimWorker]) -> None:
        settings = dp_settings()
        async with InProcessControlPlane() as cp:
            snap = await cp.publish(fleet(workers, settings))  # before the Envoys start
            async with entered_in_thread(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-a")) as one, \
                    entered_in_thread(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-b",
                                                    delta=True)) as two:
                await two_envoys_scenario(cp, [one, two], workers, settings, snap)

    with running_sim_workers(tmp_path, 2) as workers:
        asyncio.run(scenario(workers))


async def two_envoys_scenario(cp: InProcessControlPlane, envoys: list[Envoy], workers: list[SimWorker],
                              settings: DataPlaneSettings, snap: Snapshot) -> None:
    ids, port = {w.id for w in workers}, settings.listener_port
    a, b = workers[0].id, workers[1].id
    procs = [e.proc for e in envoys]
    for envoy in envoys:
        await until(lambda: cp.acked(envoy.node_id, snap), 20, f"{envoy.node_id} to ACK")
        await until_blocking(lambda: envoy.healthy_hosts() == ids, 30, "both workers healthy", procs)
        # Both bound the shared listener port (SO_REUSEPORT, Envoy's default on Linux).
        await until_blocking(lambda: envoy.stat("listener_manager.total_listeners_active") == 1, 20,
                             f"{envoy.node_id}'s listener to be active", procs)
    await until_blocking(lambda: serves(port), 30, "a first 200 through the shared listener", procs)
    assert {c.node_id: c.mode for c in cp.cache.clients()} == {"envoy-a": "sotw", "envoy-b": "delta"}

    for weights in ({a: 250, b: 40}, {a: 7, b: 700}):
        state = fleet(workers, settings, weights)
        snap = await cp.publish(state)
        expected = weights_of(build_resources(state)[ENDPOINT]["workers"])
        assert expected == weights
        for envoy in envoys:
            await until(lambda: cp.acked(envoy.node_id, snap, (ENDPOINT,)), 20,
                        f"{envoy.node_id} to ACK the new weights")
        seen = await until_blocking(
            lambda: (w := [e.weights() for e in envoys])[0] == w[1] == expected and w, 20,
            f"both Envoys to report {expected}", procs)
        assert seen == [expected, expected]
        await asyncio.to_thread(assert_serves, port, 3)
    assert cp.cache.counters().nacks == {}
