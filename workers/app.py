"""HTTP routes of a worker (Starlette): the OpenAI API, probes and metrics.

Starlette rather than FastAPI here: five routes on the hot path need no
schema layer, and validation lives in ``workers.protocol`` with OpenAI's
error shape. (The admin API, which needs OpenAPI, uses FastAPI.)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable, TypeVar

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from inferlb_runtime.request_context import RequestContextMiddleware
from inferlb_runtime.tracing import Tracing

from .protocol import APIError, error_body, models_response
from .request_options import parse_request_options
from .service import CLIENT_CLOSED, EmbeddingService
from .simulated import Simulation

JSON = "application/json"
T = TypeVar("T")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {declared} bytes, over the limit of {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the client has gone (``work`` is then cancelled).

    The body has been read, so the next ASGI message can only be the
    disconnect: waiting for it costs nothing while the request computes.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def simulation_routes(simulation: Simulation) -> list[Route]:
    """``GET``/``PUT /v1/simulation``: read or change a simulated worker's speed and its simulated fault (the
    share of requests it answers 500 at once) at run time."""

    async def simulation_state(request: Request) -> Response:
        if request.method == "PUT":
            try:
                doc = orjson.loads(await request.body())
                if not isinstance(doc, dict) or not {"speed", "fail_rate"} & doc.keys():
                    raise ValueError("name speed, fail_rate or both")
                speed = float(doc.get("speed", simulation.speed))
                fail_rate = float(doc.get("fail_rate", simulation.fail_rate))
                if not speed > 0:
                    raise ValueError(f"speed must be > 0, got {speed}")
                simulation.set_fail_rate(fail_rate)
                simulation.set_speed(speed)
            except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
                message = f"expected {{\"speed\": number > 0, \"fail_rate\": number in [0, 1]}}: {exc}"
                return Response(error_body(message, type="invalid_request_error", code="invalid_value"), 400,
                                media_type=JSON)
        body = {"speed": simulation.speed, "fixed_s": simulation.fixed_s, "per_token_s": simulation.per_token_s,
                "fail_rate": simulation.fail_rate}
        return Response(orjson.dumps(body), media_type=JSON)

    return [Route("/v1/simulation", simulation_state, methods=["GET", "PUT"])]


def embeddings_endpoint(service: EmbeddingService, simulated_failure: Callable[[], bool] | None = None
                        ) -> Callable[[Request], Awaitable[Response]]:
    """``POST /v1/embeddings``: refused at once while draining (or on a simulated failure), else read,
    computed, and dropped if the client goes away meanwhile."""

    async def embeddings(request: Request) -> Response:
        if simulated_failure is not None and simulated_failure():
            service.metrics.request_done(500, 0.0)
            err = APIError(500, "simulated failure (--sim-fail-rate)", type="server_error", code="simulated_failure")
            return Response(err.body(), 500, media_type=JSON)
        if service.draining:
            err = APIError(503, "worker is shutting down", type="server_error", code="shutting_down")
            return Response(err.body(), 503, media_type=JSON, headers={"connection": "close"})
        try:
            options = parse_request_options(request.headers, time.perf_counter())
            body = await read_body(request, service.config.max_body_bytes)
        except APIError as exc:
            service.metrics.request_done(exc.status, 0.0)
            return Response(exc.body(), exc.status, media_type=JSON, headers={"connection": "close"})
        reply = await unless_disconnected(request, service.embeddings(body, options))
        if reply is None:  # nobody to answer; the work is cancelled and its queued inputs gone
            return Response(status_code=CLIENT_CLOSED)
        return Response(reply.body, reply.status, media_type=JSON, headers=reply.headers)

    return embeddings


async def http_error(request: Request, exc: Exception) -> Response:
    """404 and 405 in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return Response(
        error_body(message, type="invalid_request_error", code=code), exc.status_code, media_type=JSON,
        headers=exc.headers,
    )


TRACED_PATHS = ("/v1/embeddings",)  # the inference path; probes and /metrics are polled all the time


def create_app(
    service: EmbeddingService, *, manage_lifecycle: bool = True, extra_routes: list[Route] | None = None,
    tracing: Tracing | None = None, simulated_failure: Callable[[], bool] | None = None,
) -> Starlette:
    """Build the app; with ``manage_lifecycle`` the lifespan starts and stops the service. Every request's
    log lines carry its ``x-request-id``; with ``tracing``, each embeddings request is a span.
    ``simulated_failure`` (simulated workers only): when it says so, the request is answered 500 at once."""
    embeddings = embeddings_endpoint(service, simulated_failure)

    async def models(request: Request) -> Response:
        return Response(models_response(service.models, service.created), media_type=JSON)

    async def healthz(request: Request) -> Response:
        return Response(orjson.dumps({"status": "alive"}), media_type=JSON)

    async def readyz(request: Request) -> Response:
        if service.ready:
            names = [model.name for model in service.models]
            return Response(orjson.dumps({"status": "ready", "model": names[0], "models": names}), media_type=JSON)
        return Response(
            orjson.dumps({"status": "not ready", "reason": service.not_ready_reason}), 503, media_type=JSON
        )

    async def metrics(request: Request) -> Response:
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()

    return Starlette(
        routes=[
            Route("/v1/embeddings", embeddings, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            *(extra_routes or []),
        ],
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(RequestContextMiddleware, tracing=tracing, traced_paths=TRACED_PATHS)],
        lifespan=lifespan if manage_lifecycle else None,
    )
