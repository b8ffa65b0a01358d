"""``/v1/policy``: the active weight and pick policies, and switching them (``policy_actions``)."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter
from fastapi.params import Depends

from ...api_models import PolicyState, PolicyUpdate
from ..errors import E400, E401, E422, E503, responses
from ..policy_actions import PolicyActions


def policy_router(policies: PolicyActions, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1/policy", tags=["policy"], dependencies=auth, responses=E401)

    @router.get("", response_model=PolicyState,
                summary="The active weight and pick policies, and the available ones with their parameter schemas")
    async def get_policy() -> PolicyState:
        return policies.policy()

    @router.put("", response_model=PolicyState,
                summary="Switch the weight and/or pick policy (parameters validated against its schema)",
                responses=responses(E400, E422, E503))
    async def put_policy(body: PolicyUpdate) -> PolicyState:
        return await policies.set_policy(body)

    return router
