"""The API key table over the wire: a real control plane (``python -m control_plane``) or its ADS server, and
ext_proc's real ``XdsClient``, in Delta and SotW.

A key created through the admin API appears (by hash) in ext_proc's ``key_table``; a revoked one
disappears; an Envoy's node group is never sent the type; a malformed table is NACKed with its reason
and the previous one kept; a control plane that serves no table leaves ext_proc without one, routing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from google.protobuf import struct_pb2

from control_plane.type_urls import KEYS
from control_plane.xds.snapshot import Encoded
from ext_proc.xds.tenants import KeyTable
from ext_proc.xds.client import StaticViewSource, XdsClient, XdsClientSettings
from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KeyEntry, Quota, hash_key
from inferlb_runtime.request_class import Priority

from .stack import ControlPlane, running_control_plane
from .test_ext_proc_service import EXT_PROC_GROUP, MODES, AdsServer, fleet_state, until

pytestmark = [pytest.mark.slow, pytest.mark.servers]

ENVOY_CLUSTER = "inferlb"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    with running_control_plane(tmp_path_factory.mktemp("api-keys-xds"), endpoints=[]) as cp:
        yield cp


class AsyncAdmin:
    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.headers = {"Authorization": f"Bearer {cp.admin_token()}"}

    async def call(self, method: str, path: str, status: int = 200, **kwargs: Any) -> Any:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.request(method, f"{self.cp.admin_url}{path}", headers=self.headers, **kwargs)
        assert response.status_code == status, response.text
        return response.json()

    async def keys_status(self, node_id: str) -> dict | None:
        clients = (await self.call("GET", "/v1/xds/clients"))["clients"]
        client = next((c for c in clients if c["node_id"] == node_id), None)
        return None if client is None else client["types"].get("keys")


def client_settings(cp: ControlPlane, node_id: str, delta: bool, cluster: str = "inferlb-ext-proc") -> XdsClientSettings:
    return XdsClientSettings(target=f"127.0.0.1:{cp.xds_port}", node_id=node_id, node_cluster=cluster, delta=delta)


@MODES
def test_created_keys_reach_ext_proc_and_revoked_ones_leave(control_plane: ControlPlane, delta: bool) -> None:
    mode = "delta" if delta else "sotw"
    node = f"ext-proc-keys-{mode}"

    async def scenario() -> None:
        admin = AsyncAdmin(control_plane)
        async with XdsClient(client_settings(control_plane, node, delta)) as xds, \
                XdsClient(client_settings(control_plane, f"envoy-{mode}", delta, ENVOY_CLUSTER)) as envoy:
            tables: list[KeyTable] = []
            xds.add_key_listener(tables.append)
            await xds.wait_ready(10)
            await until(lambda: xds.key_table is not None, 10, "the first key table")

            created = await admin.call("POST", "/v1/api-keys", 201, json={
                "tenant": f"wire-{mode}", "priority": "sheddable", "weight": 3, "tokens_per_minute": 5000,
                "max_tokens_in_flight": 900})
            key = created["key"]
            entry = await until(lambda: xds.key_table is not None and xds.key_table.lookup(key), 10,
                                "the new key in ext_proc's table")
            assert entry == KeyEntry(hash_key(key), created["id"], f"wire-{mode}", Priority.SHEDDABLE, 3.0,
                                     Quota(5000, None, 900))
            assert xds.key_table.lookup(key + "x") is None
            assert tables and tables[-1] is xds.key_table  # listeners hear of each accepted table
            status = await _in_sync(admin, node)  # /v1/xds/clients shows the acked table
            assert not status["wildcard"] and status["names"] == [API_KEYS_RESOURCE] and status["acked_version"]

            await admin.call("DELETE", f"/v1/api-keys/{created['id']}")
            await until(lambda: xds.key_table is not None and xds.key_table.lookup(key) is None, 10,
                        "the revoked key to leave ext_proc's table")
            await _in_sync(admin, node)

            # The Envoy's node group: its lean EDS, never the key table (it asked, as a test may)
            await envoy.wait_ready(10)
            envoy_keys = await _keys_status(admin, f"envoy-{mode}", lambda s: True, "never asked for the table")
            assert envoy.key_table is None
            assert envoy_keys["push_count"] == 0 and envoy_keys["sent_version"] == ""
            assert envoy_keys["current_version"] == ""

    asyncio.run(scenario())


async def _keys_status(admin: AsyncAdmin, node: str, predicate: Callable[[dict], bool], what: str) -> dict:
    """The node's key table status in /v1/xds/clients once ``predicate`` holds (waits with a deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        status = await admin.keys_status(node)
        if status is not None and predicate(status):
            return status
        if loop.time() > deadline:
            raise TimeoutError(f"{node}: {what}: {status}")
        await asyncio.sleep(0.05)


async def _in_sync(admin: AsyncAdmin, node: str) -> dict:
    return await _keys_status(admin, node, lambda s: s["in_sync"] and s["nack_count"] == 0,
                              "never ACKed the current key table")


def table_bytes(content: dict) -> bytes:
    struct = struct_pb2.Struct()
    struct.update(content)
    return struct.SerializeToString(deterministic=True)


GOOD = {"keys": [{"hash": hash_key("ilb-good"), "id": "key_good", "tenant": "acme"}]}
BAD_TABLES = [
    (table_bytes({"keys": [{"hash": hash_key("ilb-x"), "id": "key_x", "tenant": "Not A Tenant"}]}), "tenant"),
    (b"\x0a\xff\xff\xff\x0f not a Struct", "does not parse"),
    (table_bytes({"keys": "all of them"}), "'keys' must be a list"),
]


@MODES
@pytest.mark.parametrize(("bad", "reason"), BAD_TABLES, ids=["bad-tenant", "garbage", "not-a-list"])
def test_a_malformed_table_is_nacked_and_the_previous_one_kept(delta: bool, bad: bytes, reason: str) -> None:
    node = f"ext-proc-keys-nack-{'delta' if delta else 'sotw'}"

    def with_table(base: Any, data: bytes) -> Any:
        return base.replace_type(KEYS, {API_KEYS_RESOURCE: Encoded(KEYS, API_KEYS_RESOURCE, data)})

    async def scenario() -> None:
        async with AdsServer() as ads:
            base = ads.publish(fleet_state())
            good = with_table(base, table_bytes(GOOD))
            ads.cache.set_snapshot(EXT_PROC_GROUP, good)
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id=node, delta=delta)) as xds:
                kept = await until(lambda: xds.key_table is not None and xds.key_table.lookup("ilb-good") and
                                   xds.key_table, 10, "the good table")

                def keys_status() -> Any:
                    client = next((c for c in ads.cache.clients() if c.node_id == node), None)
                    return None if client is None else client.types.get(KEYS)

                await until(lambda: (s := keys_status()) is not None and s.acked_version == good.version(KEYS),
                            10, "the ACK of the good table")
                ads.cache.set_snapshot(EXT_PROC_GROUP, with_table(base, bad))
                status = await until(lambda: (s := keys_status()) is not None and s.nack_count == 1 and s, 10,
                                     "the NACK")
                assert reason in status.last_nack.message and reason in (xds.last_error or "")
                assert status.acked_version == good.version(KEYS)
                assert xds.key_table is kept and xds.view is not None  # the previous table, and routing, stay

                # the next good table is taken (a NACK does not stall the type)
                newer = dict(GOOD, keys=[*GOOD["keys"], {"hash": hash_key("ilb-new"), "id": "key_new",
                                                          "tenant": "acme"}])
                ads.cache.set_snapshot(EXT_PROC_GROUP, with_table(base, table_bytes(newer)))
                await until(lambda: xds.key_table is not None and xds.key_table.lookup("ilb-new"), 10,
                            "the next good table")

    asyncio.run(scenario())


@MODES
def test_a_control_plane_without_a_key_table_leaves_ext_proc_without_one(delta: bool) -> None:
    node = f"ext-proc-no-keys-{'delta' if delta else 'sotw'}"

    async def scenario() -> None:
        async with AdsServer() as ads:
            ads.publish(fleet_state())
            ads.cache.clear_snapshot(EXT_PROC_GROUP)  # the Envoys' snapshot only: no key table type at all
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id=node, delta=delta)) as xds:
                view = await xds.wait_ready(10)
                assert view.endpoints and xds.connected
                await until(lambda: (c := next((c for c in ads.cache.clients() if c.node_id == node), None))
                            is not None and KEYS in c.types, 10, "the key table subscription")
                assert xds.key_table is None and xds.rejected == 0

    asyncio.run(scenario())


def test_a_static_source_carries_a_key_table() -> None:
    table = KeyTable.of("v1", [KeyEntry(hash_key("ilb-static"), "key_s", "acme")])
    source = StaticViewSource(key_table=table)
    heard: list[KeyTable] = []
    source.add_key_listener(heard.append)
    assert source.key_table is table and source.key_table.lookup("ilb-static") is not None
    source.set_key_table(KeyTable.empty("v2"))
    assert heard == [KeyTable.empty("v2")] and source.key_table.lookup("ilb-static") is None
