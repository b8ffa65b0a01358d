"""The live dashboard at ``/dashboard``: the page, its static files, a JSON snapshot and an SSE feed.

The page (``dashboard_static/``) is static and open, so an operator can load
it and type the admin token; the data routes (``/dashboard/api/snapshot``,
``/dashboard/events``) are reads like ``GET /v1/...``: open from loopback,
the token otherwise or with ``admin_auth_reads``. Changes made from the page
go through the ordinary ``/v1`` routes with the token.

No background task: the feed samples when someone asks (a page's stream or a
snapshot), at most once per ``interval_s`` however many pages watch, so an
unwatched dashboard costs nothing. The history is kept between viewers (the
last ``MAX_POINTS`` samples). Each stream ends when its client goes away
(Starlette cancels it on the disconnect) and when the admin service stops
(``AdminService.closing``), so it never holds up the server's shutdown.
Static files are served from a fixed table, read once: a path never chooses
a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson
from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..api_models import EndpointList, ModelCatalogueOut, PolicyState, XdsClients
from ..config import ControlPlaneConfig
from ..telemetry.parse import parse_families
from ..telemetry.replica_activity import MetricsTarget
from ..telemetry.scraper import ScrapeError, Scraper, ScraperConfig, fetch_metrics
from . import dashboard_view as view
from .dashboard_view import GatewayCounters, GatewayStatus, History, Sources
from .errors import ApiError

log = logging.getLogger("inferlb.control_plane.dashboard")

# The files stay beside the package (control_plane/dashboard_static): the package data names them there.
STATIC_DIR = Path(__file__).resolve().parent.parent / "dashboard_static"
# The only files served (name -> media type): a request names a key of this table, never a path.
STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "vendor/uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "vendor/uPlot.min.css": "text/css; charset=utf-8",
}
# No inline script or style anywhere: the strictest policy the page works under.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cache-Control": "no-cache",
}
DEFAULT_INTERVAL_S = 1.0
RETRY_MS = 2000  # what the page waits before reconnecting a dropped stream


class FleetSource(Protocol):
    """What the feed reads through the controller: its config and the ext_proc replicas' /metrics."""

    @property
    def config(self) -> ControlPlaneConfig: ...

    def ext_proc_targets(self) -> Mapping[str, tuple[str, int]]: ...


class AdminViews(Protocol):
    """What the feed reads of the admin service (``service.AdminService``): the same views as ``/v1``."""

    @property
    def controller(self) -> FleetSource: ...

    closing: asyncio.Event  # set when the service stops: every stream ends

    def endpoints(self) -> EndpointList: ...

    def xds_clients(self) -> XdsClients: ...

    def policy(self) -> PolicyState: ...

    async def models(self) -> ModelCatalogueOut: ...


def load_static() -> dict[str, bytes]:
    """Every file of ``STATIC_FILES``; a missing one fails the start (a broken install), not a request."""
    return {name: (STATIC_DIR / name).read_bytes() for name in STATIC_FILES}


def sse_event(event: str, data: Mapping[str, Any]) -> bytes:
    """One ``text/event-stream`` event (orjson writes no raw newline, so ``data`` is one line)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


async def read_gateway(targets: Mapping[str, tuple[str, int]], config: ScraperConfig
                       ) -> tuple[dict[str, GatewayCounters], dict[str, str]]:
    """Every ext_proc replica's counters (node id -> counters) and why the others could not be read; each
    read bounded in time and size like a worker scrape."""
    async def one(target: tuple[str, int]) -> GatewayCounters | str:
        try:
            text = await fetch_metrics(client, MetricsTarget(*target), config)
            counters = view.gateway_counters(await asyncio.to_thread(parse_families, text))
        except (ScrapeError, ValueError) as exc:
            return str(exc)
        return counters if counters is not None else "no inferlb_ext_proc_decisions: not an ext_proc's /metrics"

    async with Scraper(config).make_client() as client:
        nodes = list(targets)
        results = await asyncio.gather(*(one(targets[node]) for node in nodes))
    read = {node: r for node, r in zip(nodes, results) if isinstance(r, GatewayCounters)}
    return read, {node: r for node, r in zip(nodes, results) if isinstance(r, str)}


class DashboardFeed:
    """Samples the fleet for the dashboard (at most once per ``interval_s``) and streams it to pages."""

    def __init__(self, service: AdminViews, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.service = service
        self.interval_s = interval_s
        cfg = service.controller.config
        self._scrape = ScraperConfig(interval_s=cfg.scrape_interval_s, timeout_s=cfg.scrape_timeout_s,
                                     max_body_bytes=cfg.scrape_max_body_bytes)
        self._lock = asyncio.Lock()
        self._sampled_at: float | None = None  # monotonic
        self._gateway: dict[str, GatewayCounters] = {}
        self._gateway_at: float | None = None
        self.history = History()
        self._snapshot: dict[str, Any] = {}
        self.viewers = 0  # open streams

    async def current(self) -> tuple[dict[str, Any], History]:
        """The latest snapshot and history, sampled first when the last sample is an interval old."""
        async with self._lock:
            now = time.monotonic()
            # 0.9: a stream's wait and the sampling drift by milliseconds; never sample twice in one tick
            if self._sampled_at is None or now - self._sampled_at >= 0.9 * self.interval_s:
                await self._sample()
            return {**self._snapshot, "viewers": self.viewers}, self.history

    async def _sample(self) -> None:
        service = self.service
        models, models_error = None, None
        try:
            models = await service.models()
        except Exception as exc:  # the store (503): the rest of the page still works
            # The answer's message or the kind, never the error's text (a store's names the database): the log has it.
            if not isinstance(exc, ApiError):
                log.exception("the model catalogue could not be read")
            models_error = exc.message if isinstance(exc, ApiError) else f"unreadable ({type(exc).__name__})"
        targets = service.controller.ext_proc_targets()
        read, errors = await read_gateway(targets, self._scrape) if targets else ({}, {})
        now = time.monotonic()
        rates = None if self._gateway_at is None else view.gateway_rates(self._gateway, read, now - self._gateway_at)
        self._gateway, self._gateway_at = read, now
        self._sampled_at = now
        endpoints = service.endpoints()
        wall = time.time()
        self.history = self.history.add(view.point(self.history.next_seq, wall, endpoints, rates))
        self._snapshot = view.snapshot(
            Sources(endpoints=endpoints, xds=service.xds_clients(), policy=service.policy(), models=models,
                    models_error=models_error, rates=rates,
                    gateway=GatewayStatus(replicas=len(targets), read=len(read), errors=errors)),
            at=wall, interval_s=self.interval_s, viewers=self.viewers)

    async def stream(self) -> AsyncIterator[bytes]:
        """Events until the client goes away (the response task is cancelled) or the service stops."""
        closing = self.service.closing
        self.viewers += 1
        log.info("dashboard stream opened", extra={"viewers": self.viewers})
        try:
            yield f"retry: {RETRY_MS}\n\n".encode()
            seen = 0
            while not closing.is_set():
                try:
                    snap, history = await self.current()
                    points = history.since(seen)
                    seen = points[-1].seq if points else seen
                    yield sse_event("snapshot", {**snap, "points": [p.json() for p in points]})
                except Exception as exc:  # a failed sample costs one update, never the stream
                    log.exception("dashboard sample failed")  # the details; the page gets the kind only
                    yield sse_event("problem", {"message": f"sampling failed ({type(exc).__name__}); see the "
                                                           "control plane's log"})
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await closing.wait()
        finally:
            self.viewers -= 1
            log.info("dashboard stream closed", extra={"viewers": self.viewers,
                                                       "reason": "shutdown" if closing.is_set() else "client"})


def _static(files: Mapping[str, bytes], name: str) -> Response:
    body = files.get(name)
    if body is None:
        raise StarletteHTTPException(404, f"no dashboard file {name!r}")
    return Response(body, media_type=STATIC_FILES[name], headers=SECURITY_HEADERS)


def dashboard_router(service: AdminViews, read: Sequence[Any], interval_s: float = DEFAULT_INTERVAL_S
                     ) -> APIRouter:
    """The routes; ``read``: the admin API's read dependencies (the token when reads need one)."""
    files = load_static()
    feed = DashboardFeed(service, interval_s)
    router = APIRouter(include_in_schema=False)  # an endless stream is no operation for schema-driven clients

    @router.get("/dashboard")
    async def page() -> Response:
        return _static(files, "index.html")

    @router.get("/dashboard/static/{name:path}")
    async def static(name: str) -> Response:
        return _static(files, name)

    @router.get("/dashboard/api/snapshot", dependencies=list(read))
    async def snapshot() -> Response:
        snap, history = await feed.current()
        body = orjson.dumps({**snap, "points": [p.json() for p in history.points]})
        return Response(body, media_type="application/json", headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/events", dependencies=list(read))
    async def events() -> StreamingResponse:
        return StreamingResponse(feed.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return router
