"""The API key table as an xDS resource: the pure builder, and the snapshots that carry it (ext_proc's only)."""

from __future__ import annotations

import asyncio

from google.protobuf import json_format, struct_pb2

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller, build_ext_proc_snapshot, build_snapshot, initial_state
from control_plane.resources import build_api_keys
from control_plane.store import StoredApiKey, live_key_entries
from control_plane.type_urls import ENDPOINT, KEYS, PUSH_ORDER
from control_plane.xds import SnapshotCache, make_epoch
from inferlb_runtime.api_keys import API_KEYS_RESOURCE, KEYS_TYPE_URL, KeyEntry, Quota, decode_table, hash_key
from inferlb_runtime.request_class import Priority

A = KeyEntry(hash_key("ilb-a"), "key_a", "acme", Priority.CRITICAL, 2.5, Quota(1000, 10, None))
B = KeyEntry(hash_key("ilb-b"), "key_b", "beta")


def decoded(data: bytes) -> tuple[KeyEntry, ...]:
    struct = struct_pb2.Struct()
    struct.ParseFromString(data)
    return decode_table(json_format.MessageToDict(struct))


def test_the_builder_is_deterministic_and_round_trips() -> None:
    first, again, reordered = build_api_keys([A, B]), build_api_keys([A, B]), build_api_keys([B, A])
    assert (first.type_url, first.name) == (KEYS_TYPE_URL, API_KEYS_RESOURCE)
    assert first.data == again.data == reordered.data
    assert decoded(first.data) == (A, B)
    assert decoded(build_api_keys([]).data) == ()
    assert build_api_keys([A]).data != first.data


def test_revoked_keys_are_not_in_the_table() -> None:
    live = StoredApiKey("key_a", "acme", A.hash, "hint", priority=Priority.CRITICAL, weight=2.5,
                        quota=A.quota, created_at=1.0)
    revoked = StoredApiKey("key_b", "beta", B.hash, "hint", created_at=2.0, revoked_at=3.0)
    assert live_key_entries([revoked, live]) == (A,)
    assert decoded(build_api_keys(live_key_entries([revoked, live])).data) == (A,)


def test_only_ext_procs_snapshot_carries_the_table() -> None:
    state = initial_state(ControlPlaneConfig(endpoints=["127.0.0.1:8101"]))
    envoys = build_snapshot(state, make_epoch())
    assert KEYS not in envoys.by_type and envoys.version(KEYS) == ""
    assert envoys.changed_types(None) == frozenset(PUSH_ORDER)
    keys = build_api_keys([A])
    ext_proc = build_ext_proc_snapshot(state, envoys, api_keys=keys)
    assert list(ext_proc.resources(KEYS)) == [API_KEYS_RESOURCE]
    assert ext_proc.resources(KEYS)[API_KEYS_RESOURCE].any.value == keys.data
    # replacing the table changes that type alone
    other = ext_proc.replace_type(KEYS, {API_KEYS_RESOURCE: build_api_keys([A, B])})
    assert other.changed_types(ext_proc) == {KEYS}
    assert build_ext_proc_snapshot(state, envoys).changed_types(ext_proc) == {KEYS}  # None: the empty table


def test_the_controller_pushes_a_new_table_at_once_and_leaves_the_envoys_alone() -> None:
    async def scenario() -> None:
        config = ControlPlaneConfig(endpoints=["127.0.0.1:8101"], debounce_s=60.0, debounce_max_s=60.0)
        cache = SnapshotCache()
        controller = Controller(config, cache, api_keys=[A])
        await controller.start()
        try:
            group = controller.state.settings.ext_proc_node_cluster
            before, envoys = cache.get(group), controller.snapshot
            assert before is not None and envoys is not None
            assert decoded(before.resources(KEYS)[API_KEYS_RESOURCE].any.value) == (A,)
            await controller.set_api_keys([A, B])  # no debounce to wait for (it is a minute here)
            after = cache.get(group)
            assert after is not None and after.changed_types(before) == {KEYS}
            assert decoded(after.resources(KEYS)[API_KEYS_RESOURCE].any.value) == (A, B)
            assert controller.snapshot is envoys and KEYS not in envoys.by_type
            assert after.version(ENDPOINT) == before.version(ENDPOINT)
        finally:
            await controller.stop()
    asyncio.run(scenario())
