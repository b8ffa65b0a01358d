"""Run a worker under uvicorn with a graceful drain on SIGTERM/SIGINT.

On the signal the worker first fails readiness and answers new requests with
503, then uvicorn stops listening, lets in-flight requests finish (up to
``shutdown_timeout_s``) and runs the lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from types import FrameType
from typing import Callable, Iterator

import uvicorn
from starlette.routing import Route

from inferlb_runtime.logs import configure_json_logging
from inferlb_runtime.tracing import Tracing

from .app import create_app
from .config import WorkerConfig
from .service import EmbeddingService


def configure_logging(level: str, component: str) -> None:
    """One JSON object per line on stderr, for every logger including uvicorn's, with the request's id."""
    configure_json_logging(component, level, quiet=())


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that tells the service to drain before uvicorn's own shutdown."""

    def __init__(self, config: uvicorn.Config, service: EmbeddingService) -> None:
        super().__init__(config)
        self._service = service
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:  # type: ignore[no-untyped-def]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Like uvicorn's, minus re-raising the signal afterwards: a drained worker exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in a signal handler: hand the drain to the loop rather than do it here.
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._service.begin_drain)
        super().handle_exit(sig, frame)


def serve(config: WorkerConfig, service: EmbeddingService, extra_routes: list[Route] | None = None,
          tracing: Tracing | None = None, simulated_failure: Callable[[], bool] | None = None) -> None:
    """Serve until a signal; then drain, and export the spans still queued (``tracing``)."""
    uv_config = uvicorn.Config(
        create_app(service, extra_routes=extra_routes, tracing=tracing, simulated_failure=simulated_failure),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_config=None,
        access_log=config.access_log,
        timeout_graceful_shutdown=int(config.shutdown_timeout_s),
        server_header=False,
    )
    try:
        DrainingServer(uv_config, service).run()
    finally:
        if tracing is not None:
            tracing.shutdown()
