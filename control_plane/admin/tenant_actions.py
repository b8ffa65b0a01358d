"""Tenant actions: API keys (create, list, revoke) and usage for billing.

A key is stored as its SHA-256 hash and shown once, in the answer that
creates it; ext_proc gets the live keys' hashes pushed at once (not after the
debounce), so a revoked key stops working within one push. Usage is read
from the store, where the replica watch writes ext_proc's counters
(``control_plane/usage``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import secrets
from collections.abc import Iterable

from inferlb_runtime.api_keys import KEY_PREFIX, Quota, hash_key, new_key
from inferlb_runtime.request_class import PRIORITIES

from ..api_models import KEY_HINT_LENGTH, ApiKeyCreate, ApiKeyCreated, ApiKeyList, ApiKeyOut, UsageReport
from ..reserved_tenants import is_reserved, reserved_message, warn_reserved
from ..store import StoredApiKey, StoreError, live_key_entries
from ..usage.query import BadUsageQuery, Granularity, usage_query, usage_report
from .actions import Actions, now_us, store_unavailable
from .errors import ApiError
from .views import api_key_out

log = logging.getLogger("inferlb.control_plane.admin")


class TenantActions:
    """Every API key, live and revoked, by id (what the store holds; the controller pushes the live ones)."""

    def __init__(self, actions: Actions, api_keys: Iterable[StoredApiKey] = ()) -> None:
        self.actions = actions
        self._api_keys: dict[str, StoredApiKey] = {k.id: k for k in api_keys}
        warn_reserved(self._api_keys.values(), log)  # at start: kept and flagged, never deleted

    def api_keys(self, tenant: str | None = None, include_revoked: bool = False) -> ApiKeyList:
        keys = sorted(self._api_keys.values(), key=lambda k: (k.created_at, k.id))
        return ApiKeyList(api_keys=[api_key_out(k) for k in keys
                                    if (tenant is None or k.tenant == tenant) and (include_revoked or k.live)])

    def api_key(self, key_id: str) -> ApiKeyOut:
        return api_key_out(self._find_key(key_id))

    def _find_key(self, key_id: str) -> StoredApiKey:
        key = self._api_keys.get(key_id)
        if key is None:
            raise ApiError(404, "api_key_not_found", f"no API key {key_id!r}")
        return key

    async def create_api_key(self, body: ApiKeyCreate) -> ApiKeyCreated:
        """A new key: stored as its hash, pushed to ext_proc at once; the key itself is in this answer only.

        422 ``tenant_reserved`` for a tenant name the metrics give unkeyed or overflow traffic."""
        if is_reserved(body.tenant):
            raise ApiError(422, "tenant_reserved", reserved_message(body.tenant), {"tenant": body.tenant})
        key = new_key()
        record = StoredApiKey(
            id=f"key_{secrets.token_hex(8)}", tenant=body.tenant, key_hash=hash_key(key),
            key_hint=key[len(KEY_PREFIX):][:KEY_HINT_LENGTH], name=body.name, priority=PRIORITIES[body.priority],
            weight=body.weight, quota=Quota(body.tokens_per_minute, body.requests_per_minute,
                                            body.max_tokens_in_flight),
            created_at=now_us())
        async with self.actions.lock:
            await self.actions.commit(lambda s: s.add_api_key(record))
            self._api_keys[record.id] = record
            await self._push_api_keys()
        log.info("API key created", extra={"key_id": record.id, "tenant": record.tenant})
        return ApiKeyCreated(key=key, **api_key_out(record).model_dump())

    async def revoke_api_key(self, key_id: str) -> ApiKeyOut:
        """Revoke (ext_proc drops the key at once); revoking again keeps the first time."""
        async with self.actions.lock:
            record = self._find_key(key_id)
            if record.live:
                at = now_us()
                stored = await self.actions.commit(lambda s: s.revoke_api_key(key_id, at))
                record = stored if stored is not None else dataclasses.replace(record, revoked_at=at)
                self._api_keys[key_id] = record
                await self._push_api_keys()
                log.info("API key revoked", extra={"key_id": key_id, "tenant": record.tenant})
            return api_key_out(record)

    async def replace_keys(self, keys: Iterable[StoredApiKey]) -> bool:
        """Make ``keys`` (the store's, after another replica's change) the keys; True if they changed.
        Called under the action lock."""
        by_id = {k.id: k for k in keys}
        if by_id == self._api_keys:
            return False
        self._api_keys = by_id
        await self._push_api_keys()
        return True

    async def _push_api_keys(self) -> None:
        await self.actions.controller.set_api_keys(live_key_entries(self._api_keys.values()))

    async def usage(self, tenant: str | None, from_text: str | None, to_text: str | None,
                    granularity: Granularity) -> UsageReport:
        """Usage from the store; 422 naming a bad parameter, 503 without a store or when it fails."""
        try:
            query = usage_query(tenant, from_text, to_text, granularity, datetime.datetime.now(datetime.timezone.utc))
        except BadUsageQuery as exc:
            raise ApiError(422, "validation_error", str(exc),
                           [{"loc": ["query", exc.param], "msg": str(exc), "type": "value_error"}]) from None
        store = self.actions.store
        if store is None:
            raise ApiError(503, "store_unavailable", "usage is kept in the store, and this control plane has none")
        try:
            return await usage_report(store, query)
        except StoreError as exc:
            raise store_unavailable("usage could not be read from the store", exc) from exc
