"""Rollouts in the store (issue 15), on SQLite and on a real PostgreSQL (tests/postgres.py): the round
trip with the previous split, deletion, the migration from schema version 3 keeping what was there,
refusal of a row that breaks the contract, and restore/reconcile putting them into the FleetState."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from control_plane.model import Endpoint, FleetState
from control_plane.store import (
    DB_NAME,
    OperatorState,
    OperatorStore,
    Store,
    StoredRollout,
    StoreError,
    reconcile,
    restore,
)
from control_plane.store import postgres as pg
from control_plane.store import sqlite as lite
from inferlb_runtime.model_routing import Rollout

pytest_plugins = ("tests.postgres",)  # the postgres_server and postgres_url fixtures

INT8, FP32, FAMILY = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32", "all-MiniLM-L6-v2"
CANARY = Rollout(FAMILY, ((INT8, 90.0), (FP32, 10.0)), "api_key")
FLIPPED = Rollout(FAMILY, ((FP32, 100.0),))
OTHER = Rollout("embed", ((FP32, 33.5), (INT8, 66.5)), "user")


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=[pytest.mark.postgres, pytest.mark.servers, pytest.mark.slow])])
def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], OperatorStore]]:
    """Opens the store under test (again and again: each open is a restart); closes every one."""
    opened: list[OperatorStore] = []

    def opener() -> OperatorStore:
        store: OperatorStore
        if request.param == "sqlite":
            store = Store.open(tmp_path)
        else:
            store = pg.PostgresStore.open(request.getfixturevalue("postgres_url"))
        opened.append(store)
        return store

    try:
        yield opener
    finally:
        for store in opened:
            store.close()


def test_rollouts_round_trip_with_their_previous_split_and_deletion(open_store: Callable[[], OperatorStore]) -> None:
    store = open_store()
    run(store.set_rollout(StoredRollout(CANARY)))
    run(store.set_rollout(StoredRollout(OTHER)))
    run(store.set_rollout(StoredRollout(FLIPPED, previous=CANARY)))  # the canary moved on: kept for a rollback
    store.close()
    store = open_store()  # a restart
    loaded = store.load()
    assert loaded.rollouts == (StoredRollout(FLIPPED, CANARY), StoredRollout(OTHER))  # by alias
    assert [r.versions for r in loaded.current_rollouts()] == [FLIPPED.versions, OTHER.versions]  # order kept
    assert loaded.rollouts[1].rollout.sticky == "user" and loaded.rollouts[0].previous.sticky == "api_key"
    run(store.delete_rollout(FAMILY))
    run(store.delete_rollout("never-there"))  # nothing to delete: nothing happens
    assert store.load().rollouts == (StoredRollout(OTHER),)


def _bad_row(store: OperatorStore) -> None:
    """A row that breaks the contract (percentages summing to 50), written behind the store's back."""
    if isinstance(store, Store):
        with sqlite3.connect(store.path) as db:
            db.execute("UPDATE rollouts SET versions = '[{\"model\": \"m\", \"percent\": 50}]'")
    else:
        with psycopg.connect(store._url, autocommit=True) as conn:  # noqa: SLF001 - the test's own database
            conn.execute("UPDATE rollouts SET versions = '[{\"model\": \"m\", \"percent\": 50}]'::jsonb")


def test_a_stored_rollout_that_breaks_the_contract_is_refused_saying_which(
        open_store: Callable[[], OperatorStore]) -> None:
    store = open_store()
    run(store.set_rollout(StoredRollout(CANARY)))
    _bad_row(store)
    with pytest.raises(StoreError, match=f"rollout of '{FAMILY}' is not valid: .*sum to 100"):
        store.load()


def test_sqlite_migrates_a_version_3_database_keeping_its_state(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / DB_NAME, isolation_level=None) as db:
        for migration in lite.MIGRATIONS[:3]:
            migration(db)
        db.execute("PRAGMA user_version = 3")
        db.execute("INSERT INTO endpoints (id, address, port, created_at) VALUES ('10.0.0.1:1', '10.0.0.1', 1, 0)")
    db.close()
    store = Store.open(tmp_path)
    try:
        assert store.schema_version() == lite.SCHEMA_VERSION == 4
        assert store.load() == OperatorState(endpoints=(("10.0.0.1", 1),))
        run(store.set_rollout(StoredRollout(CANARY)))
        assert store.load().rollouts == (StoredRollout(CANARY),)
    finally:
        store.close()


def test_postgres_migrates_a_version_3_database_keeping_its_state(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn, conn.transaction(), conn.cursor() as cur:
        cur.execute("CREATE TABLE schema_version (version integer NOT NULL)")
        for migration in pg.MIGRATIONS[:3]:
            migration(cur)
        cur.execute("INSERT INTO schema_version (version) VALUES (3)")
        cur.execute("INSERT INTO endpoints (id, address, port) VALUES ('10.0.0.1:1', '10.0.0.1', 1)")
    store = pg.PostgresStore.open(postgres_url)
    try:
        assert store.schema_version() == pg.SCHEMA_VERSION == 4
        assert store.load() == OperatorState(endpoints=(("10.0.0.1", 1),))
        run(store.set_rollout(StoredRollout(CANARY, FLIPPED)))
        assert store.load().rollouts == (StoredRollout(CANARY, FLIPPED),)
    finally:
        store.close()


def test_restore_and_reconcile_put_the_current_splits_into_the_fleet_state() -> None:
    stored = OperatorState(rollouts=(StoredRollout(OTHER), StoredRollout(FLIPPED, CANARY)))
    base = FleetState(endpoints=(Endpoint("10.0.0.1", 1),))
    assert restore(base, stored).rollouts == (FLIPPED, OTHER)  # current splits only, by alias
    live = FleetState(endpoints=(Endpoint("10.0.0.1", 1),), rollouts=(CANARY,))
    state, vanished = reconcile(live, stored)
    assert state.rollouts == (FLIPPED, OTHER) and vanished == ()
    again, _ = reconcile(state, stored)
    assert again == state  # idempotent
    assert reconcile(state, OperatorState())[0].rollouts == ()  # deleted elsewhere


# --- through the admin service (in process, the app on httpx's ASGI transport) ---------------------------


def test_a_rollout_set_on_one_replica_reaches_the_other_with_its_previous_split(postgres_url: str) -> None:
    from .test_store_postgres import Replica, wait_async

    path = f"/v1/rollouts/{FAMILY}"

    async def scenario() -> None:
        async with Replica(postgres_url, ["127.0.0.1:8101"]) as a, Replica(postgres_url, ["127.0.0.1:8101"]) as b, \
                a.client() as ca, b.client() as cb:
            # forced: these replicas scrape nothing, so no endpoint serves the versions
            put = await ca.put(path, params={"force": "true"}, json={"versions": {INT8: 90, FP32: 10},
                                                                     "sticky": "api_key"})
            assert put.status_code == 200, put.text
            await wait_async(lambda: b.controller.state.rollouts == (CANARY,), 10, "a's rollout on b")
            put = await cb.put(path, params={"force": "true"}, json={"versions": {FP32: 100}})
            assert put.status_code == 200 and put.json()["previous"]["versions"] == {INT8: 90.0, FP32: 10.0}
            await wait_async(lambda: a.controller.state.rollouts == (FLIPPED,), 10, "b's split on a")
            back = await ca.post(f"{path}/rollback")  # a rolls back what b set: it knows b's previous split
            assert back.status_code == 200 and back.json()["previous"]["versions"] == {FP32: 100.0}
            await wait_async(lambda: b.controller.state.rollouts == (CANARY,), 10, "the rollback on b")
            assert (await cb.get(path)).json() == back.json()
            assert (await cb.delete(path)).status_code == 200
            await wait_async(lambda: a.controller.state.rollouts == (), 10, "the deletion on a")
            assert (await ca.get(path)).status_code == 404

    run(scenario())


def test_a_failing_store_answers_503_and_the_rollouts_stay(tmp_path: Path) -> None:
    import httpx

    from control_plane.admin import AdminService, create_admin_app
    from control_plane.auth import AdminToken
    from control_plane.config import ControlPlaneConfig
    from control_plane.controller import Controller
    from control_plane.metrics import ControlPlaneMetrics
    from control_plane.xds import SnapshotCache

    class FailingWrites(Store):
        """A real SQLite store whose writes fail (simulated: a disk that stopped taking them)."""

        async def set_rollout(self, record: StoredRollout) -> None:
            raise StoreError(f"{self.path}: disk I/O error")

    async def scenario() -> None:
        store = FailingWrites.open(tmp_path)
        await Store.set_rollout(store, StoredRollout(CANARY))  # stored before the disk failed
        controller = Controller(ControlPlaneConfig(endpoints=["127.0.0.1:8101"]), SnapshotCache(),
                                state=FleetState(rollouts=(CANARY,)))
        service = AdminService(controller, store)
        app = create_admin_app(controller, ControlPlaneMetrics(lambda: controller.state), service,
                               AdminToken("t" * 40, "config"))
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 12345))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                         headers={"Authorization": f"Bearer {'t' * 40}"}) as client:
                response = await client.put(f"/v1/rollouts/{FAMILY}", params={"force": "true"},
                                            json={"versions": {FP32: 100}})
                assert response.status_code == 503 and response.json()["error"]["code"] == "store_unavailable"
                assert "disk I/O error" not in response.text  # the store's error is logged, not answered
                assert controller.state.rollouts == (CANARY,)
                shown = (await client.get(f"/v1/rollouts/{FAMILY}")).json()
                assert shown["versions"] == {INT8: 90.0, FP32: 10.0} and shown["previous"] is None
        finally:
            await service.stop()
            store.close()

    run(scenario())
