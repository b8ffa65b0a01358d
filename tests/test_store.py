"""The control plane's SQLite store: migrations, reopening, refusals, round trips, restore."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sqlite3
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from envoy.config.core.v3 import health_check_pb2
from envoy.config.endpoint.v3 import endpoint_pb2

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller, initial_state
from control_plane.model import Endpoint, FleetState, PickPolicySpec
from control_plane.resources import build_load_assignment, weights_of
from control_plane.store import (
    DB_NAME,
    MIGRATIONS,
    SCHEMA_VERSION,
    OperatorState,
    Override,
    Store,
    StoredPolicy,
    StoreError,
    reconcile,
    restore,
)
from control_plane.type_urls import ENDPOINT
from control_plane.xds import Snapshot, SnapshotCache, make_epoch

from .conftest import ROOT


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def _fill(store: Store) -> None:
    await store.add_endpoint("10.0.0.9", 8109)
    await store.add_endpoint("10.0.0.8", 8108)
    await store.set_override("10.0.0.9:8109", 250, False)
    await store.set_override("127.0.0.1:8101", None, True)
    await store.set_override("127.0.0.1:8102", 7, True)
    await store.set_policies({"weight": StoredPolicy("equal", {}),
                              "pick": StoredPolicy("round_robin", {"fallbacks": 1})})


def test_migrates_from_empty_and_reopens(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "new" / "dir")  # the directory is created
    try:
        assert store.path == tmp_path / "new" / "dir" / DB_NAME
        assert store.schema_version() == SCHEMA_VERSION == len(MIGRATIONS)
        assert store.load() == OperatorState()
    finally:
        store.close()
    with sqlite3.connect(tmp_path / "new" / "dir" / DB_NAME) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert {"endpoints", "endpoint_overrides", "policies", "meta"} <= tables
    store = Store.open(tmp_path / "new" / "dir")  # a second open migrates nothing and loses nothing
    try:
        assert store.schema_version() == SCHEMA_VERSION
    finally:
        store.close()


def test_round_trip_of_all_state(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    try:
        run(_fill(store))
    finally:
        store.close()
    store = Store.open(tmp_path)
    try:
        loaded = store.load()
        assert loaded.endpoints == (("10.0.0.9", 8109), ("10.0.0.8", 8108))  # registration order
        assert loaded.overrides == {"10.0.0.9:8109": Override(250, False), "127.0.0.1:8101": Override(None, True),
                                    "127.0.0.1:8102": Override(7, True)}
        assert loaded.weight_policy == StoredPolicy("equal", {})
        assert loaded.pick_policy == StoredPolicy("round_robin", {"fallbacks": 1})

        async def undo() -> None:
            await store.set_override("127.0.0.1:8101", None, False)  # neither pinned nor draining: row gone
            await store.remove_endpoint("10.0.0.9:8109")  # its pin goes with it
            await store.set_policies({"pick": StoredPolicy("least_outstanding", {"d": 2})})
        run(undo())
        loaded = store.load()
        assert loaded.endpoints == (("10.0.0.8", 8108),)
        assert loaded.overrides == {"127.0.0.1:8102": Override(7, True)}
        assert loaded.weight_policy == StoredPolicy("equal", {})
        assert loaded.pick_policy == StoredPolicy("least_outstanding", {"d": 2})
    finally:
        store.close()


def test_a_newer_schema_version_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path).close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError) as info:
        Store.open(tmp_path)
    message = str(info.value)
    assert str(tmp_path / DB_NAME) in message and "newer inferlb" in message and "downgrade" in message
    with sqlite3.connect(tmp_path / DB_NAME) as db:  # untouched
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1


def test_a_corrupt_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    garbage = b"this is not a database, it is a shopping list\n" * 200
    (tmp_path / DB_NAME).write_bytes(garbage)
    with pytest.raises(StoreError) as info:
        Store.open(tmp_path)
    assert str(tmp_path / DB_NAME) in str(info.value)
    assert "not a usable SQLite database" in str(info.value)
    assert (tmp_path / DB_NAME).read_bytes() == garbage  # never deleted or recreated


def test_a_damaged_database_is_refused(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    try:
        run(_fill(store))
    finally:
        store.close()
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray((tmp_path / DB_NAME).read_bytes())
    page = 4096
    assert len(data) >= 3 * page
    data[page + 8: 2 * page] = b"\xff" * (page - 8)  # scribble over page 2 (a b-tree page), keep the header
    (tmp_path / DB_NAME).write_bytes(bytes(data))
    with pytest.raises(StoreError) as info:
        Store.open(tmp_path)
    assert str(tmp_path / DB_NAME) in str(info.value)


def test_an_unwritable_location_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError) as info:
        Store.open(blocker / "data")
    assert str(blocker / "data" / DB_NAME) in str(info.value)
    assert "cannot create the data directory" in str(info.value)
    (tmp_path / "dir-db" / DB_NAME).mkdir(parents=True)  # the database path is a directory
    with pytest.raises(StoreError, match="not a file"):
        Store.open(tmp_path / "dir-db")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through file modes")
def test_a_read_only_directory_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path / "ro").close()
    os.chmod(tmp_path / "ro" / DB_NAME, stat.S_IRUSR)
    os.chmod(tmp_path / "ro", stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(StoreError) as info:
            Store.open(tmp_path / "ro")
        assert str(tmp_path / "ro" / DB_NAME) in str(info.value)
    finally:
        os.chmod(tmp_path / "ro", stat.S_IRWXU)


@pytest.mark.subprocess
def test_the_control_plane_refuses_to_start_on_a_corrupt_database(tmp_path: Path) -> None:
    (tmp_path / DB_NAME).write_bytes(b"\x00garbage" * 1000)
    done = subprocess.run([sys.executable, "-m", "control_plane", "--data-dir", str(tmp_path), "--admin-port", "1",
                           "--xds-port", "1"], check=False, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert str(tmp_path / DB_NAME) in done.stderr and "state database" in done.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    done = subprocess.run([sys.executable, "-m", "control_plane", "--data-dir", str(blocker / "sub"),
                           "--admin-port", "1", "--xds-port", "1"], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert str(blocker / "sub") in done.stderr


# --- restore: the operator's state is in the first snapshot ------------------------------------------


STORED = OperatorState(
    endpoints=(("10.0.0.9", 8109), ("127.0.0.1", 8101)),  # the second is also static: static wins
    overrides={"127.0.0.1:8101": Override(333, False), "127.0.0.1:8102": Override(None, True),
               "10.0.0.9:8109": Override(5, True), "10.9.9.9:1": Override(9, False)},  # the last one: gone
    pick_policy=StoredPolicy("round_robin", {"fallbacks": 1}),
)


def test_restore_folds_the_operator_state_into_the_initial_state() -> None:
    config = ControlPlaneConfig(endpoints=["127.0.0.1:8101", "127.0.0.1:8102"])
    state = restore(initial_state(config), STORED)
    by_id = {e.id: e for e in state.endpoints}
    assert set(by_id) == {"127.0.0.1:8101", "127.0.0.1:8102", "10.0.0.9:8109"}
    assert by_id["127.0.0.1:8101"].source == "static" and by_id["127.0.0.1:8101"].pinned_weight == 333
    assert by_id["127.0.0.1:8102"].draining and by_id["127.0.0.1:8102"].pinned_weight is None
    assert by_id["10.0.0.9:8109"] == Endpoint("10.0.0.9", 8109, source="api", draining=True, pinned_weight=5)
    assert state.pick_policy == PickPolicySpec("round_robin", {"fallbacks": 1})


def test_the_first_published_snapshot_already_carries_pins_drains_and_the_pick_policy() -> None:
    config = ControlPlaneConfig(endpoints=["127.0.0.1:8101", "127.0.0.1:8102"])

    async def scenario() -> None:
        cache = SnapshotCache()
        controller = Controller(config, cache, None, restore(initial_state(config), STORED))
        await controller.start()
        try:
            first = controller.snapshot
            assert first is not None
            cla = endpoint_pb2.ClusterLoadAssignment.FromString(
                first.resources(ENDPOINT)["workers"].any.value)
            assert weights_of(cla) == {"127.0.0.1:8101": 333, "127.0.0.1:8102": 100, "10.0.0.9:8109": 5}
            health = {f"{e.endpoint.address.socket_address.address}:{e.endpoint.address.socket_address.port_value}":
                      e.health_status for loc in cla.endpoints for e in loc.lb_endpoints}
            assert health["127.0.0.1:8102"] == health["10.0.0.9:8109"] == health_check_pb2.DRAINING
            rich = build_load_assignment(controller.state, ext_proc=True)
            policy = rich.endpoints[0].metadata.filter_metadata["inferlb"]["pick_policy"]
            assert policy["name"] == "round_robin" and policy["params"]["fallbacks"] == 1
        finally:
            await controller.stop()

    run(scenario())


def test_restore_on_an_empty_store_is_the_config() -> None:
    config = ControlPlaneConfig(endpoints=["127.0.0.1:8101"])
    assert restore(initial_state(config), OperatorState()) == initial_state(config) == FleetState(
        endpoints=(Endpoint("127.0.0.1", 8101),), settings=config.data_plane.settings())


# --- reconcile: another replica changed the shared store ------------------------------------------------


def _live_state() -> FleetState:
    """A running replica's state: static 8101 (pinned, with telemetry), 8102, API 10.0.0.7 and 10.0.0.9."""
    config = ControlPlaneConfig(endpoints=["127.0.0.1:8101", "127.0.0.1:8102"])
    base = initial_state(config)
    static = tuple(dataclasses.replace(e, computed_weight=42, pinned_weight=5 if e.port == 8101 else None)
                   for e in base.endpoints)
    api = (Endpoint("10.0.0.7", 8107, source="api", draining=True), Endpoint("10.0.0.9", 8109, source="api"))
    return dataclasses.replace(base, endpoints=static + api)


def test_reconcile_applies_pins_drains_registrations_and_the_pick_policy() -> None:
    state = _live_state()
    stored = OperatorState(
        endpoints=(("10.0.0.9", 8109), ("10.0.0.5", 8105)),  # 10.0.0.7 deregistered elsewhere, 10.0.0.5 new
        overrides={"127.0.0.1:8102": Override(77, False), "10.0.0.5:8105": Override(None, True)},
        pick_policy=StoredPolicy("round_robin", {"fallbacks": 1}))
    new, vanished = reconcile(state, stored)
    by_id = {e.id: e for e in new.endpoints}
    assert vanished == ("10.0.0.7:8107",)
    assert by_id["10.0.0.7:8107"] == state.endpoint("10.0.0.7:8107")  # left for the caller to drain and remove
    assert by_id["127.0.0.1:8101"].pinned_weight is None  # no override stored: unpinned
    assert by_id["127.0.0.1:8101"].computed_weight == 42  # what the replica measured survives
    assert by_id["127.0.0.1:8102"].pinned_weight == 77 and not by_id["127.0.0.1:8102"].draining
    assert by_id["10.0.0.5:8105"] == Endpoint("10.0.0.5", 8105, source="api", draining=True)
    assert [e.id for e in new.endpoints][-1] == "10.0.0.5:8105"  # appended
    assert new.pick_policy == PickPolicySpec("round_robin", {"fallbacks": 1})


def test_reconcile_leaves_local_removals_alone_and_is_idempotent() -> None:
    state = _live_state()
    stored = OperatorState(endpoints=(("10.0.0.9", 8109),), overrides={"127.0.0.1:8101": Override(5, False)})
    new, vanished = reconcile(state, stored, removing=frozenset({"10.0.0.7:8107"}))
    assert vanished == ()  # being removed here already
    assert new.endpoint("10.0.0.7:8107").draining  # keeps its drain though the store has no row for it
    assert new == state  # nothing else differs from the store
    assert reconcile(new, stored, removing=frozenset({"10.0.0.7:8107"})) == (new, ())


def test_reconcile_never_removes_static_endpoints() -> None:
    state = _live_state()
    new, vanished = reconcile(state, OperatorState())
    assert set(vanished) == {"10.0.0.7:8107", "10.0.0.9:8109"}
    assert {e.id for e in new.endpoints} == {e.id for e in state.endpoints}
    assert all(e.pinned_weight is None for e in new.endpoints if e.source == "static")


def test_two_control_planes_never_share_an_epoch_or_a_version() -> None:
    """Replicas serving the same state must still differ, so an Envoy moving between them gets a full push."""
    config = ControlPlaneConfig(endpoints=["127.0.0.1:8101", "127.0.0.1:8102"])

    async def published() -> Snapshot:
        controller = Controller(config, SnapshotCache())
        await controller.start()
        try:
            assert controller.snapshot is not None
            return controller.snapshot
        finally:
            await controller.stop()

    a, b = run(published()), run(published())
    assert a.epoch != b.epoch
    assert a.versions.keys() == b.versions.keys() and a.versions
    for type_url in a.versions:
        assert a.versions[type_url] != b.versions[type_url]
        ours, theirs = a.resources(type_url), b.resources(type_url)
        assert {n: r.any.value for n, r in ours.items()} == {n: r.any.value for n, r in theirs.items()}  # same bytes
        assert all(ours[n].version != theirs[n].version for n in ours)
    epochs = {make_epoch() for _ in range(1000)}
    assert len(epochs) == 1000


def test_epochs_differ_even_when_the_clocks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two replicas starting in the same nanosecond (or with skewed clocks) still get different epochs."""
    from control_plane.xds import snapshot

    monkeypatch.setattr(snapshot.time, "time_ns", lambda: 1_700_000_000_000_000_000)
    assert len({make_epoch() for _ in range(100)}) == 100
