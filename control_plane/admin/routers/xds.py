"""``/v1/xds/clients``: the connected Envoys and ext_procs as the snapshot cache sees them."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter
from fastapi.params import Depends

from ...api_models import XdsClients
from ...controller import Controller
from ..errors import E401
from ..views import xds_clients_out


def xds_router(controller: Controller, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1/xds", tags=["xds"], dependencies=auth, responses=E401)

    @router.get("/clients", response_model=XdsClients,
                summary="Connected Envoys and ext_procs: node, acked versions per type, last NACK")
    async def xds_clients() -> XdsClients:
        return xds_clients_out(controller.cache)

    return router
