"""``/v1/models`` and ``/v1/rollouts``: what the fleet serves, and aliases' splits over versions
(``rollout_actions``).

An alias may contain '/' (and a newline must meet the alias's validation, not
miss every route), so the rollout routes take it as an ``anypath``; the rollback
route comes first, or ``.../rollback`` would be read as an alias.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence

from fastapi import APIRouter, Path, Query
from fastapi.params import Depends

from inferlb_runtime.model_routing import MODEL_NAME_PATTERN

from ...api_models import ModelCatalogueOut, RolloutList, RolloutOut, RolloutPut
from ..any_path import ANY_PATH
from ..errors import E400, E401, E404_ROLLOUT, E409_ROLLBACK, E409_ROLLOUT, E422, E503, responses
from ..rollout_actions import RolloutActions

ALIAS = "/rollouts/{alias:" + ANY_PATH + "}"
Alias = typing.Annotated[str, Path(description="the model name requests use; may contain '/'",
                                   examples=["all-MiniLM-L6-v2"], max_length=128,
                                   pattern=MODEL_NAME_PATTERN.pattern)]
Force = typing.Annotated[bool, Query(description="accept versions no endpoint serves (yet)")]


def models_router(rollouts: RolloutActions, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["models"], dependencies=auth, responses=E401)

    @router.get("/models", response_model=ModelCatalogueOut,
                summary="What the fleet serves: per model version its endpoints, whether routable, its aliases; "
                        "and the rollouts", responses=E503)
    async def models() -> ModelCatalogueOut:
        return await rollouts.models()

    @router.get("/rollouts", response_model=RolloutList,
                summary="Every rollout: an alias's traffic split over model versions", responses=E503)
    async def list_rollouts() -> RolloutList:
        return await rollouts.rollouts()

    @router.post(ALIAS + "/rollback", response_model=RolloutOut,
                 summary="Put the previous split back (the current one becomes the previous: a second rollback "
                         "goes forward again)", responses=responses(E404_ROLLOUT, E409_ROLLBACK, E422, E503))
    async def rollback(alias: Alias) -> RolloutOut:
        return await rollouts.rollback(alias)

    @router.get(ALIAS, response_model=RolloutOut,
                summary="One rollout, with the split a rollback would put back",
                responses=responses(E404_ROLLOUT, E422, E503))
    async def get_rollout(alias: Alias) -> RolloutOut:
        return await rollouts.rollout(alias)

    @router.put(ALIAS, response_model=RolloutOut,
                summary="Set an alias's split over versions (canary, blue-green); the split it replaces is kept for "
                        "a rollback. Refused (409) when a version is served by no endpoint, unless force",
                responses=responses(E400, E409_ROLLOUT, E422, E503))
    async def put_rollout(alias: Alias, body: RolloutPut, force: Force = False) -> RolloutOut:
        return await rollouts.set_rollout(alias, body, force)

    @router.delete(ALIAS, response_model=RolloutOut,
                   summary="Remove a rollout: the alias resolves as the workers' alias again",
                   responses=responses(E404_ROLLOUT, E422, E503))
    async def delete_rollout(alias: Alias) -> RolloutOut:
        return await rollouts.delete_rollout(alias)

    return router
