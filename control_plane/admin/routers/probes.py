"""Liveness, readiness and Prometheus metrics: open, for orchestrators and scrapers."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ...controller import Controller
from ...metrics import ControlPlaneMetrics
from ...nginx.applier import NginxApplier


def probes_router(controller: Controller, metrics: ControlPlaneMetrics, nginx: NginxApplier | None) -> APIRouter:
    router = APIRouter(tags=["probes"])

    @router.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @router.get("/readyz", summary="Ready once the first snapshot is published and xDS is serving; not ready while "
                "publishing fails")
    async def readyz() -> JSONResponse:
        if nginx is not None and not nginx.ready:  # NGINX mode: ready once nginx serves a validated config
            return JSONResponse({"status": "not ready", "reason": "nginx is not serving yet"}, status_code=503)
        publishing = controller.publishing
        if publishing.failing:  # the state Envoys and ext_procs get is stale until a publish succeeds
            return JSONResponse({"status": "not ready", "reason": f"publishing snapshots is failing "
                                 f"({publishing.consecutive_failures} in a row, retrying): {publishing.last_error}"},
                                status_code=503)
        if controller.published.is_set():
            return JSONResponse({"status": "ready", "endpoints": len(controller.state.endpoints)})
        return JSONResponse({"status": "not ready", "reason": "no snapshot published yet"}, status_code=503)

    @router.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return router
