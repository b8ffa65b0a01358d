"""API keys through the admin API over real HTTP (``python -m control_plane``), and in both stores.

The key is in the 201 answer only; listings show its hint, never the key nor its
hash; every route needs the admin token, reads included; bad input is a 422
naming the field; keys and revocations survive a restart (SQLite), live in
PostgreSQL as in SQLite, and reach the other replicas sharing it (its change
feed). What ext_proc receives is tests/test_api_keys_xds.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.store import Store, StoredApiKey, open_store
from control_plane.store.base import OperatorStore
from control_plane.type_urls import KEYS
from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEY_PREFIX, Quota, hash_key, new_key
from inferlb_runtime.request_class import Priority

from .stack import ControlPlane, running_control_plane
from .test_admin_api import Admin, assert_error
from .test_store_postgres import Replica, wait_async

pytestmark = [pytest.mark.slow, pytest.mark.servers]

pytest_plugins = ("tests.postgres",)  # the postgres_url fixture

FIELDS = {"id", "key_hint", "tenant", "name", "priority", "weight", "tokens_per_minute", "requests_per_minute",
          "max_tokens_in_flight", "created_at", "revoked_at", "reserved_tenant"}


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with running_control_plane(tmp_path_factory.mktemp("api-keys"), endpoints=[]) as cp:
        yield cp


@pytest.fixture()
def admin(control_plane: ControlPlane) -> Admin:
    return Admin(control_plane)


def create(admin: Admin, **body: object) -> dict:
    return admin.ok("POST", "/v1/api-keys", 201, json=body)


def never_leaks(text: str, key: str) -> None:
    assert key not in text and hash_key(key) not in text and key[len(KEY_PREFIX):] not in text


def test_create_shows_the_key_once_and_listings_never(admin: Admin, control_plane: ControlPlane) -> None:
    created = create(admin, tenant="acme", name="batch jobs", priority="critical", weight=2.5,
                     tokens_per_minute=100_000, requests_per_minute=600)
    key = created["key"]
    assert key.startswith(KEY_PREFIX) and len(key) > 40
    assert set(created) == FIELDS | {"key"}
    assert created["id"].startswith("key_") and len(created["id"]) == 4 + 16
    assert created["key_hint"] == key[len(KEY_PREFIX):][:8]
    assert {k: created[k] for k in ("tenant", "name", "priority", "weight", "tokens_per_minute",
                                    "requests_per_minute", "max_tokens_in_flight", "revoked_at")} == {
        "tenant": "acme", "name": "batch jobs", "priority": "critical", "weight": 2.5, "tokens_per_minute": 100_000,
        "requests_per_minute": 600, "max_tokens_in_flight": None, "revoked_at": None}
    defaults = create(admin, tenant="acme")
    assert (defaults["priority"], defaults["weight"], defaults["name"]) == ("standard", 1.0, None)

    listed = admin.call("GET", "/v1/api-keys")
    got = admin.call("GET", f"/v1/api-keys/{created['id']}")
    assert listed.status_code == got.status_code == 200
    for response in (listed, got):
        never_leaks(response.text, key)
        never_leaks(response.text, defaults["key"])
    assert got.json() == {k: v for k, v in created.items() if k != "key"}
    ids = [k["id"] for k in listed.json()["api_keys"]]
    assert ids.index(created["id"]) < ids.index(defaults["id"])  # oldest first
    assert all(set(k) == FIELDS for k in listed.json()["api_keys"])
    # nothing else shows it either: not the log, not the database file
    never_leaks(control_plane.proc.log(), key)
    assert control_plane.data_dir is not None
    stored = b"".join(path.read_bytes() for path in control_plane.data_dir.glob("control-plane.db*"))
    assert hash_key(key).encode() in stored and key.encode() not in stored


def test_list_filters_by_tenant_and_revoked(admin: Admin) -> None:
    mine = create(admin, tenant="filter-me")
    other = create(admin, tenant="filter-other")
    assert [k["id"] for k in admin.ok("GET", "/v1/api-keys", params={"tenant": "filter-me"})["api_keys"]] == [mine["id"]]
    admin.ok("DELETE", f"/v1/api-keys/{mine['id']}")
    assert admin.ok("GET", "/v1/api-keys", params={"tenant": "filter-me"})["api_keys"] == []
    listed = admin.ok("GET", "/v1/api-keys", params={"tenant": "filter-me", "include_revoked": "true"})["api_keys"]
    assert [(k["id"], k["revoked_at"] is not None) for k in listed] == [(mine["id"], True)]
    assert other["id"] in {k["id"] for k in admin.ok("GET", "/v1/api-keys")["api_keys"]}


def test_revoke_keeps_the_first_time_and_unknown_ids_are_404(admin: Admin) -> None:
    created = create(admin, tenant="revoker")
    first = admin.ok("DELETE", f"/v1/api-keys/{created['id']}")
    assert first["id"] == created["id"] and first["revoked_at"] >= created["created_at"]
    assert "key" not in first
    again = admin.ok("DELETE", f"/v1/api-keys/{created['id']}")
    assert again == first
    assert admin.ok("GET", f"/v1/api-keys/{created['id']}")["revoked_at"] == first["revoked_at"]
    assert_error(admin.call("DELETE", "/v1/api-keys/key_0000000000000000"), 404, "api_key_not_found")
    assert_error(admin.call("GET", "/v1/api-keys/key_0000000000000000"), 404, "api_key_not_found")


def test_every_route_needs_the_token_and_nothing_changes_without_it(admin: Admin) -> None:
    created = create(admin, tenant="guarded")
    before = admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"})
    for token in (None, "wrong-token"):
        # from loopback, where other reads are open: keys are tenant data
        assert_error(admin.call("GET", "/v1/api-keys", token=token), 401, "unauthorized")
        assert_error(admin.call("GET", f"/v1/api-keys/{created['id']}", token=token), 401, "unauthorized")
        assert_error(admin.call("POST", "/v1/api-keys", token=token, json={"tenant": "intruder"}), 401,
                     "unauthorized")
        assert_error(admin.call("DELETE", f"/v1/api-keys/{created['id']}", token=token), 401, "unauthorized")
    assert admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"}) == before


@pytest.mark.parametrize(("body", "field"), [
    ({}, "tenant"),
    ({"tenant": "Acme"}, "tenant"),
    ({"tenant": "acme\n"}, "tenant"),
    ({"tenant": "a" * 64}, "tenant"),
    ({"tenant": "acme", "priority": "urgent"}, "priority"),
    ({"tenant": "acme", "weight": 0}, "weight"),
    ({"tenant": "acme", "weight": 1001}, "weight"),
    ({"tenant": "acme", "weight": True}, "weight"),
    ({"tenant": "acme", "tokens_per_minute": 0}, "tokens_per_minute"),
    ({"tenant": "acme", "requests_per_minute": 1.5}, "requests_per_minute"),
    ({"tenant": "acme", "max_tokens_in_flight": "10"}, "max_tokens_in_flight"),
    ({"tenant": "acme", "tokens_per_minute": 2**60}, "tokens_per_minute"),
    ({"tenant": "acme", "name": ""}, "name"),
    ({"tenant": "acme", "key": "ilb-chosen"}, "key"),  # the operator cannot choose the key
])
def test_bad_input_is_a_422_naming_the_field(admin: Admin, body: dict, field: str) -> None:
    before = admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"})
    error = assert_error(admin.call("POST", "/v1/api-keys", json=body), 422, "validation_error")
    assert [d["loc"] for d in error["detail"]] == [["body", field]], error
    assert admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"}) == before


def test_bad_query_and_path_are_422(admin: Admin) -> None:
    error = assert_error(admin.call("GET", "/v1/api-keys", params={"include_revoked": "maybe"}), 422)
    assert error["detail"][0]["loc"] == ["query", "include_revoked"]
    assert_error(admin.call("GET", "/v1/api-keys/" + "k" * 101), 422)


def test_keys_and_revocations_survive_a_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with running_control_plane(tmp_path, endpoints=[], data_dir=data) as cp:
        admin = Admin(cp)
        kept = create(admin, tenant="durable", max_tokens_in_flight=5000)
        revoked = create(admin, tenant="durable")
        admin.ok("DELETE", f"/v1/api-keys/{revoked['id']}")
        before = admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"})
    with running_control_plane(tmp_path, endpoints=[], data_dir=data) as cp:
        admin = Admin(cp)
        assert admin.ok("GET", "/v1/api-keys", params={"include_revoked": "true"}) == before
        assert [k["id"] for k in admin.ok("GET", "/v1/api-keys")["api_keys"]] == [kept["id"]]
        assert admin.ok("GET", f"/v1/api-keys/{kept['id']}")["max_tokens_in_flight"] == 5000


# --- the stores ---------------------------------------------------------------------------------------


def record(key_id: str, tenant: str = "acme", **changes: object) -> StoredApiKey:
    fields: dict = {"id": key_id, "tenant": tenant, "key_hash": hash_key(new_key()), "key_hint": "abcdefgh",
                    "name": "label", "priority": Priority.SHEDDABLE, "weight": 0.5,
                    "quota": Quota(1000, None, 70), "created_at": 1_700_000_000.25}
    return StoredApiKey(**{**fields, **changes})


async def store_contract(store: OperatorStore) -> None:
    first, second = record("key_1"), record("key_2", "other", created_at=1_700_000_001.5, name=None,
                                             quota=Quota())
    await store.add_api_key(first)
    await store.add_api_key(second)
    assert (await store.aload()).api_keys == (first, second)
    revoked = await store.revoke_api_key("key_1", 1_700_000_100.75)
    assert revoked == StoredApiKey(**{**first.__dict__, "revoked_at": 1_700_000_100.75})
    again = await store.revoke_api_key("key_1", 1_700_000_200.0)
    assert again is not None and again.revoked_at == 1_700_000_100.75  # the first time stays
    assert await store.revoke_api_key("key_nope", 1.0) is None
    assert (await store.aload()).api_keys == (revoked, second)


def test_sqlite_store_keeps_keys(tmp_path: Path) -> None:
    store = Store.open(tmp_path)
    try:
        asyncio.run(store_contract(store))
    finally:
        store.close()
    reopened = Store.open(tmp_path)
    try:
        assert [k.id for k in reopened.load().api_keys] == ["key_1", "key_2"]
    finally:
        reopened.close()


def test_postgres_store_keeps_keys(postgres_url: str) -> None:
    store = open_store(postgres_url, "/nonexistent-not-used")
    try:
        asyncio.run(store_contract(store))
    finally:
        store.close()
    reopened = open_store(postgres_url, "/nonexistent-not-used")
    try:
        assert [(k.id, k.revoked_at) for k in reopened.load().api_keys] == [("key_1", 1_700_000_100.75),
                                                                          ("key_2", None)]
    finally:
        reopened.close()


def test_a_key_created_or_revoked_on_one_replica_reaches_the_other(postgres_url: str) -> None:
    async def scenario() -> None:
        async with Replica(postgres_url, []) as a, Replica(postgres_url, []) as b, a.client() as ca, \
                b.client() as cb:
            response = await ca.post("/v1/api-keys", json={"tenant": "shared", "requests_per_minute": 60})
            assert response.status_code == 201, response.text
            created = response.json()
            digest = hash_key(created["key"])
            # what a answered is what the store keeps (times to the microsecond): a reload changes nothing
            assert await a.service.reload_from_store() is False
            group = b.controller.state.settings.ext_proc_node_cluster

            def pushed_by_b() -> bytes:
                snapshot = b.controller.cache.get(group)
                table = snapshot.resources(KEYS).get(API_KEYS_RESOURCE) if snapshot is not None else None
                return table.any.value if table is not None else b""

            await wait_async(lambda: digest.encode() in pushed_by_b(), 10, "the key in replica b's pushed table")
            assert [(e.hash, e.quota) for e in b.controller.api_keys] == [(digest, Quota(None, 60, None))]
            assert (await cb.get(f"/v1/api-keys/{created['id']}")).json()["tenant"] == "shared"

            revoked = await cb.delete(f"/v1/api-keys/{created['id']}")
            assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
            await wait_async(lambda: a.controller.api_keys == () and a.controller.ext_proc_snapshot is not None
                             and digest.encode() not in a.controller.ext_proc_snapshot.resources(KEYS)[
                                 API_KEYS_RESOURCE].any.value, 10, "the revocation pushed by replica a")
            assert (await ca.get(f"/v1/api-keys/{created['id']}")).json()["revoked_at"] == \
                revoked.json()["revoked_at"]

    asyncio.run(scenario())
