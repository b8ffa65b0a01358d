"""The control plane's HTTP side on 127.0.0.1:8080 (FastAPI): probes and metrics.

The admin REST API (``/v1/...``) grows here with its issue; FastAPI gives it
the OpenAPI schema and ``/docs``.
"""

from __future__ import annotations

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .controller import Controller
from .metrics import ControlPlaneMetrics


def create_admin_app(controller: Controller, metrics: ControlPlaneMetrics) -> FastAPI:
    app = FastAPI(title="inferlb control plane", version="0.1.0")

    @app.get("/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "alive"}

    @app.get("/readyz", summary="Ready once the first snapshot is published and xDS is serving")
    async def readyz() -> JSONResponse:
        if controller.published.is_set():
            return JSONResponse({"status": "ready", "endpoints": len(controller.state.endpoints)})
        return JSONResponse({"status": "not ready", "reason": "no snapshot published yet"}, status_code=503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=Response)
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
