"""The PostgreSQL store on a real server (tests/postgres.py): the store contract, migrations, concurrent
start-up, the LISTEN/NOTIFY change feed, reconnection, and two replicas' admin services converging."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Self

import httpx
import psycopg
import pytest

from control_plane.admin import AdminService, create_admin_app
from control_plane.auth import AdminToken
from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.store import (
    OperatorState,
    Override,
    StoreChange,
    StoredPolicy,
    StoreError,
    open_store,
)
from control_plane.store.follow import follow
from control_plane.store.postgres import SCHEMA_VERSION, PostgresStore, redact
from control_plane.xds import SnapshotCache

from .conftest import free_port
from .test_store import _fill

if TYPE_CHECKING:
    from .postgres import PostgresServer

pytest_plugins = ("tests.postgres",)  # the postgres_server and postgres_url fixtures

TOKEN = "t" * 40


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def next_change(changes: AsyncIterator[StoreChange], timeout: float = 10) -> StoreChange:
    return await asyncio.wait_for(anext(changes), timeout)


async def wait_async(predicate: Any, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def test_migrates_from_empty_and_reopens(postgres_url: str) -> None:
    store = PostgresStore.open(postgres_url)
    try:
        assert store.schema_version() == SCHEMA_VERSION
        assert store.load() == OperatorState()
    finally:
        store.close()
    with psycopg.connect(postgres_url) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"endpoints", "endpoint_overrides", "policies", "meta", "schema_version"} <= tables
    store = PostgresStore.open(postgres_url)  # migrates nothing, loses nothing
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_round_trip_of_all_state(postgres_url: str) -> None:
    store = open_store(postgres_url, "/nonexistent-not-used")
    assert isinstance(store, PostgresStore)
    try:
        run(_fill(store))
    finally:
        store.close()
    store = PostgresStore.open(postgres_url)
    try:
        loaded = store.load()
        assert loaded.endpoints == (("10.0.0.9", 8109), ("10.0.0.8", 8108))  # registration order
        assert loaded.overrides == {"10.0.0.9:8109": Override(250, False), "127.0.0.1:8101": Override(None, True),
                                    "127.0.0.1:8102": Override(7, True)}
        assert loaded.weight_policy == StoredPolicy("equal", {})
        assert loaded.pick_policy == StoredPolicy("round_robin", {"fallbacks": 1})

        async def undo() -> OperatorState:
            await store.set_override("127.0.0.1:8101", None, False)  # neither pinned nor draining: row gone
            await store.remove_endpoint("10.0.0.9:8109")  # its pin goes with it
            await store.set_policies({"pick": StoredPolicy("least_outstanding", {"d": 2})})
            return await store.aload()
        loaded = run(undo())
        assert loaded.endpoints == (("10.0.0.8", 8108),)
        assert loaded.overrides == {"127.0.0.1:8102": Override(7, True)}
        assert loaded.weight_policy == StoredPolicy("equal", {})
        assert loaded.pick_policy == StoredPolicy("least_outstanding", {"d": 2})
    finally:
        store.close()


def test_two_replicas_starting_at_once_migrate_once(postgres_url: str) -> None:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresStore.open(postgres_url), range(4)))
    try:
        assert [s.schema_version() for s in stores] == [SCHEMA_VERSION] * 4
        run(stores[0].add_endpoint("10.0.0.1", 1))
        assert stores[3].load().endpoints == (("10.0.0.1", 1),)  # one database, seen by all
    finally:
        for s in stores:
            s.close()
    with psycopg.connect(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM schema_version").fetchone() == (1,)


def test_a_newer_schema_version_is_refused(postgres_url: str) -> None:
    PostgresStore.open(postgres_url).close()
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError) as info:
        PostgresStore.open(postgres_url)
    assert "newer inferlb" in str(info.value) and "downgrade" in str(info.value)
    with psycopg.connect(postgres_url) as conn:  # untouched
        assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION + 1,)


@pytest.mark.parametrize("url, message", [
    ("mysql://root@127.0.0.1/db", "expected postgresql://"),
    ("postgresql://user:secret@127.0.0.1/db?nosuchoption=1", "invalid URI query parameter"),
    ("postgresql://user:secret@[::1/db", "not a valid PostgreSQL URL"),
])
def test_a_bad_url_is_refused_without_its_password(url: str, message: str) -> None:
    with pytest.raises(StoreError) as info:
        PostgresStore.open(url)
    assert message in str(info.value) and "secret" not in str(info.value)


def test_an_unreachable_server_is_refused_at_startup() -> None:
    url = f"postgresql://postgres:hunter2@127.0.0.1:{free_port()}/inferlb"
    with pytest.raises(StoreError) as info:
        PostgresStore.open(url, connect_timeout_s=2)
    assert "cannot connect" in str(info.value) and "hunter2" not in str(info.value)
    assert redact(url) in str(info.value)


def test_a_notification_reaches_another_replicas_feed(postgres_url: str) -> None:
    a, b = PostgresStore.open(postgres_url), PostgresStore.open(postgres_url)

    async def scenario() -> None:
        changes = b.changes(reload_interval_s=3600)
        try:
            assert (await next_change(changes)).reason == "connected"  # listening from here on
            await a.set_override("127.0.0.1:8101", 640, False)
            change = await next_change(changes)
            assert (change.reason, change.origin) == ("notified", a.replica_id)
            assert change.revision is not None and change.revision >= 1
            assert (await b.aload()).overrides == {"127.0.0.1:8101": Override(640, False)}
            await b.set_policies({"weight": StoredPolicy("equal", {})})  # b hears its own write too
            change = await next_change(changes)
            assert change.origin == b.replica_id
        finally:
            await changes.aclose()

    try:
        run(scenario())
    finally:
        a.close()
        b.close()


def test_the_feed_reconnects_and_says_so_and_the_safety_net_reloads(postgres_server: PostgresServer,
                                                                    postgres_url: str) -> None:
    """A lost LISTEN connection comes back as ``connected`` (the reader reloads: notifications sent meanwhile
    are lost); with nothing happening, ``periodic`` arrives anyway."""
    store = PostgresStore.open(postgres_url)

    async def scenario() -> None:
        changes = store.changes(reload_interval_s=0.3)
        try:
            assert (await next_change(changes)).reason == "connected"
            assert (await next_change(changes)).reason == "periodic"
            killed = await asyncio.to_thread(postgres_server.terminate_backends, f"%{store.replica_id}%")
            assert killed >= 1
            reasons = [(await next_change(changes)).reason for _ in range(3)]
            assert "connected" in reasons
        finally:
            await changes.aclose()

    try:
        run(scenario())
    finally:
        store.close()


def test_writes_survive_a_dropped_connection_and_fail_cleanly_while_the_database_is_away(
        postgres_server: PostgresServer, postgres_url: str) -> None:
    store = PostgresStore.open(postgres_url)
    database = postgres_url.rsplit("/", 1)[1]
    try:
        run(store.set_override("127.0.0.1:8101", 1, False))
        assert postgres_server.terminate_backends(f"%{store.replica_id}%") == 1
        run(store.set_override("127.0.0.1:8101", 2, False))  # reconnects and retries, unseen by the caller
        assert store.load().overrides["127.0.0.1:8101"] == Override(2, False)
        with postgres_server.admin() as conn:
            conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
        postgres_server.terminate_backends(f"%{store.replica_id}%")
        with pytest.raises(StoreError) as info:
            run(store.set_override("127.0.0.1:8101", 3, False))
        assert redact(postgres_url) in str(info.value)
        with postgres_server.admin() as conn:
            conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
        run(store.set_override("127.0.0.1:8101", 4, False))  # back by itself
        assert store.load().overrides["127.0.0.1:8101"] == Override(4, False)
    finally:
        store.close()


# --- two replicas' admin services, in process ---------------------------------------------------------


class Replica:
    """One control plane's controller + admin service + follower on the shared store, without the network."""

    def __init__(self, url: str, endpoints: list[str]) -> None:
        self.config = ControlPlaneConfig(endpoints=endpoints, deregistration_drain_s=0.2, scrape_interval_s=0.05)
        self.store = PostgresStore.open(url)
        self.controller = Controller(self.config, SnapshotCache())
        self.metrics = ControlPlaneMetrics(lambda: self.controller.state)
        self.service = AdminService(self.controller, self.store,
                                    deregistration_drain_s=self.config.deregistration_drain_s)
        self.app = create_admin_app(self.controller, self.metrics, self.service, AdminToken(TOKEN, "config"))
        self._follower: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self.controller.start()
        self._follower = asyncio.create_task(follow(self.store, self.service.reload_from_store, self.metrics))
        await wait_async(lambda: self.metrics.store_changes.labels(reason="connected")._value.get() >= 1, 10,
                         "the change feed to connect")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._follower is not None
        self._follower.cancel()
        await asyncio.gather(self._follower, return_exceptions=True)
        await self.service.stop()
        await self.controller.stop()
        self.store.close()

    def client(self) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=self.app, client=("127.0.0.1", 12345))
        return httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                 headers={"Authorization": f"Bearer {TOKEN}"})


def test_a_change_through_one_replica_reaches_the_other(postgres_url: str) -> None:
    static = ["127.0.0.1:8101", "127.0.0.1:8102"]

    async def scenario() -> None:
        async with Replica(postgres_url, static) as a, Replica(postgres_url, static) as b, \
                a.client() as ca, b.client() as cb:
            assert (await ca.put("/v1/endpoints/127.0.0.1:8101/weight", json={"weight": 640})).status_code == 200
            await wait_async(lambda: b.controller.state.endpoint("127.0.0.1:8101").pinned_weight == 640, 10,
                             "the pin on replica b")
            assert (await cb.post("/v1/endpoints/127.0.0.1:8102/drain")).status_code == 200
            assert (await cb.post("/v1/endpoints", json={"address": "10.0.0.5", "port": 8105})).status_code == 201
            assert (await cb.put("/v1/policy", json={"weight": {"name": "equal"},
                                                     "pick": {"name": "round_robin"}})).status_code == 200
            await wait_async(lambda: (e := a.controller.state.endpoint("10.0.0.5:8105")) is not None
                             and e.source == "api" and a.controller.state.endpoint("127.0.0.1:8102").draining
                             and a.controller.policy.name == "equal"
                             and a.controller.state.pick_policy.name == "round_robin", 10,
                             "b's drain, registration and policies on replica a")
            # deregistration on a: b drains it, then removes it, like a does
            assert (await ca.delete("/v1/endpoints/10.0.0.5:8105")).status_code == 202
            await wait_async(lambda: (e := b.controller.state.endpoint("10.0.0.5:8105")) is None or e.draining, 10,
                             "the deregistration draining on b")
            await wait_async(lambda: b.controller.state.endpoint("10.0.0.5:8105") is None
                             and a.controller.state.endpoint("10.0.0.5:8105") is None, 10,
                             "the endpoint removed on both")
            await wait_async(lambda: a.controller.state.endpoint("127.0.0.1:8102").draining, 1, "nothing undone")
            listed_a = (await ca.get("/v1/endpoints")).json()["endpoints"]
            listed_b = (await cb.get("/v1/endpoints")).json()["endpoints"]
            assert [(e["id"], e["draining"], e["weight"]["pinned"]) for e in listed_a] == \
                   [(e["id"], e["draining"], e["weight"]["pinned"]) for e in listed_b]
            assert a.metrics.store_reloads.labels(result="ok")._value.get() >= 1
            assert a.metrics.store_changes.labels(reason="own")._value.get() >= 1

    run(scenario())


def test_with_the_database_away_mutations_answer_503_and_the_state_stays(
        postgres_server: PostgresServer, postgres_url: str) -> None:
    database = postgres_url.rsplit("/", 1)[1]

    async def scenario() -> None:
        async with Replica(postgres_url, ["127.0.0.1:8101"]) as a, a.client() as ca:
            assert (await ca.put("/v1/endpoints/127.0.0.1:8101/weight", json={"weight": 9})).status_code == 200
            await asyncio.to_thread(_block, postgres_server, database, a.store.replica_id)
            before = a.controller.state
            response = await ca.put("/v1/endpoints/127.0.0.1:8101/weight", json={"weight": 10})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "store_unavailable"
            assert "cannot connect" not in response.text and "127.0.0.1" not in response.text
            assert a.controller.state == before and before.endpoint("127.0.0.1:8101").pinned_weight == 9
            assert (await ca.get("/v1/endpoints")).status_code == 200
            await asyncio.to_thread(_unblock, postgres_server, database)
            # the feed comes back (backoff) and reloads; writes work again
            await wait_async(lambda: a.metrics.store_changes.labels(reason="connected")._value.get() >= 2, 15,
                             "the change feed to reconnect")
            assert (await ca.put("/v1/endpoints/127.0.0.1:8101/weight", json={"weight": 10})).status_code == 200

    run(scenario())


def _block(server: PostgresServer, database: str, replica_id: str) -> None:
    with server.admin() as conn:
        conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS false')
    server.terminate_backends(f"%{replica_id}%")


def _unblock(server: PostgresServer, database: str) -> None:
    with server.admin() as conn:
        conn.execute(f'ALTER DATABASE "{database}" ALLOW_CONNECTIONS true')
