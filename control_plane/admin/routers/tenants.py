"""``/v1/api-keys`` and ``/v1/usage``: tenants' keys and their usage (``tenant_actions``).

Both show tenant data, so the token is needed for reads too (``access.TENANT_DATA``).
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

from fastapi import APIRouter, Path, Query, Response
from fastapi.params import Depends

from inferlb_runtime.api_keys import TENANT_PATTERN

from ...api_models import ApiKeyCreate, ApiKeyCreated, ApiKeyList, ApiKeyOut, UsageReport
from ...usage.query import Granularity
from ..access import API_KEYS_PATH, USAGE_PATH
from ..errors import E400, E401, E404_KEY, E422, E422_KEY, E422_USAGE, E503, responses
from ..tenant_actions import TenantActions

ApiKeyId = typing.Annotated[str, Path(description="the key's id (not the key)", examples=["key_0123456789abcdef"],
                                      max_length=100)]


def api_keys_router(tenants: TenantActions, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix=API_KEYS_PATH, tags=["api keys"], dependencies=auth, responses=E401)

    @router.post("", response_model=ApiKeyCreated, status_code=201,
                 summary="Create an API key for a tenant: the key is in this answer only (stored as its hash)",
                 responses=responses(E400, E422_KEY, E503))
    async def create_api_key(body: ApiKeyCreate, response: Response) -> ApiKeyCreated:
        out = await tenants.create_api_key(body)
        response.headers["Location"] = f"{API_KEYS_PATH}/{out.id}"
        return out

    @router.get("", response_model=ApiKeyList,
                summary="The API keys (live ones unless include_revoked), oldest first; never a key nor its hash",
                responses=E422)
    async def list_api_keys(tenant: typing.Annotated[str | None, Query(max_length=63)] = None,
                            include_revoked: bool = False) -> ApiKeyList:
        return tenants.api_keys(tenant, include_revoked)

    @router.get("/{key_id}", response_model=ApiKeyOut, summary="One API key (revoked ones too)",
                responses=responses(E404_KEY, E422))
    async def get_api_key(key_id: ApiKeyId) -> ApiKeyOut:
        return tenants.api_key(key_id)

    @router.delete("/{key_id}", response_model=ApiKeyOut,
                   summary="Revoke an API key: ext_proc refuses it within a push (revoking again keeps the first time)",
                   responses=responses(E404_KEY, E422, E503))
    async def revoke_api_key(key_id: ApiKeyId) -> ApiKeyOut:
        return await tenants.revoke_api_key(key_id)

    return router


def usage_router(tenants: TenantActions, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix=USAGE_PATH, tags=["usage"], dependencies=auth, responses=E401)

    @router.get("", response_model=UsageReport,
                summary="Usage for billing per tenant (from the store): totals and buckets of requests, tokens, "
                        "errors, sheds, rate-limited and unauthenticated requests",
                responses=responses(E422_USAGE, E503))
    async def usage(
        tenant: typing.Annotated[str | None, Query(max_length=63, pattern=TENANT_PATTERN.pattern,
                                                   description="one tenant; unset: all")] = None,
        from_: typing.Annotated[str | None, Query(alias="from", max_length=64,
                                                  description="RFC 3339; default: 24 h before to")] = None,
        to: typing.Annotated[str | None, Query(max_length=64, description="RFC 3339, exclusive; default: now")] = None,
        granularity: Granularity = "hour",
    ) -> UsageReport:
        return await tenants.usage(tenant, from_, to, granularity)

    return router
