"""Tenant names the metrics give traffic without a tenant cannot have API keys (issue 41), through the admin API
of a real ``python -m control_plane``.

A key for ``anonymous`` (requests without a key) or ``other`` (ext_proc's
tenants beyond its cap) would be billed for everybody's unkeyed or overflow
traffic: creating one is refused 422 ``tenant_reserved``, saying why. Keys
stored before the rule are kept, flagged in ``GET /v1/api-keys`` and named in
a start-up warning.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from control_plane.reserved_tenants import OVERFLOW_TENANT, RESERVED_TENANTS
from control_plane.store import Store, StoredApiKey
from ext_proc.metrics import MAX_TENANTS, ExtProcMetrics
from inferlb_runtime.api_keys import ANONYMOUS_TENANT, Quota, hash_key, new_key
from inferlb_runtime.request_class import Priority

from .stack import ControlPlane, http, running_control_plane
from .test_admin_api import assert_error

pytestmark = [pytest.mark.slow, pytest.mark.servers]


def _headers(cp: ControlPlane) -> dict[str, str]:
    return {"authorization": f"Bearer {cp.admin_token()}"}


def _stored_key(key_id: str, tenant: str) -> StoredApiKey:
    return StoredApiKey(id=key_id, tenant=tenant, key_hash=hash_key(new_key()), key_hint="abcdefgh", name=None,
                        priority=Priority.STANDARD, weight=1.0, quota=Quota(None, None, None),
                        created_at=1_700_000_000.0)


def test_the_reserved_names_are_the_labels_ext_proc_gives_traffic_without_a_tenant() -> None:
    metrics = ExtProcMetrics()
    for i in range(MAX_TENANTS + 1):
        metrics.tenant_usage(f"t{i}", "served", 1)
    overflow = {tenant for tenant, _ in metrics.tenant_counts} - {f"t{i}" for i in range(MAX_TENANTS)}
    assert overflow == {OVERFLOW_TENANT}
    assert RESERVED_TENANTS == {ANONYMOUS_TENANT, OVERFLOW_TENANT}


def test_keys_for_reserved_tenants_are_refused_and_stored_ones_are_flagged(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    store = Store.open(data_dir)
    stored = [_stored_key("key_anon_live", "anonymous"), _stored_key("key_other_gone", "other"),
              _stored_key("key_acme", "acme")]

    async def fill() -> None:  # as a version from before the rule left them
        for key in stored:
            await store.add_api_key(key)
        await store.revoke_api_key("key_other_gone", 1_700_000_100.0)

    asyncio.run(fill())
    store.close()
    with running_control_plane(tmp_path, endpoints=[], data_dir=data_dir) as cp, http() as client:
        url = f"{cp.admin_url}/v1/api-keys"
        for tenant in sorted(RESERVED_TENANTS):
            error = assert_error(client.post(url, json={"tenant": tenant}, headers=_headers(cp)), 422,
                                 "tenant_reserved")
            assert f"{tenant!r} is reserved" in error["message"] and "billed" in error["message"]
            assert error["detail"] == {"tenant": tenant}
        assert client.post(url, json={"tenant": "acme"}, headers=_headers(cp)).status_code == 201

        listed = client.get(url, params={"include_revoked": "true"}, headers=_headers(cp)).json()["api_keys"]
        flags = {k["id"]: k["reserved_tenant"] for k in listed}
        # Kept, not deleted, and flagged; the live one still listed among the live keys.
        assert {k: flags[k] for k in ("key_anon_live", "key_other_gone", "key_acme")} == \
            {"key_anon_live": True, "key_other_gone": True, "key_acme": False}
        live = client.get(url, headers=_headers(cp)).json()["api_keys"]
        assert "key_anon_live" in {k["id"] for k in live}
        assert sum(1 for k in listed if k["tenant"] == "acme") == 2
        warnings = [json.loads(line) for line in cp.proc.log().splitlines()
                    if line.startswith("{") and "reserved tenant" in line]
    assert len(warnings) == 1
    assert warnings[0]["level"].lower() == "warning"
    assert warnings[0]["key_ids"] == ["key_anon_live", "key_other_gone"]
    assert warnings[0]["live"] == ["key_anon_live"]
