"""``/v1/dataplane``: which data plane the control plane drives, and NGINX's state in NGINX mode."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter
from fastapi.params import Depends

from ...api_models import DataPlaneStatus
from ...nginx.applier import NginxApplier
from ..errors import E401
from ..views import nginx_status_out


def dataplane_router(nginx: NginxApplier | None, auth: Sequence[Depends]) -> APIRouter:
    router = APIRouter(prefix="/v1/dataplane", tags=["dataplane"], dependencies=auth, responses=E401)

    @router.get("", response_model=DataPlaneStatus,
                summary="The data plane: envoy (xDS), or nginx with its applied config, reloads and last error")
    async def dataplane() -> DataPlaneStatus:
        return DataPlaneStatus(mode="envoy", nginx=None) if nginx is None else nginx_status_out(nginx)

    return router
