"""Serving ext_proc's gRPC: on the native front or grpcio's, the server's options, and the grpc.health.v1 status
that follows the view."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Literal, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from ..server import ExtProcServicer
from ..wire import PROCESS_METHOD, SERVICE_NAME
from ..xds.client import FleetView, ViewSource
from .native import NOT_FOUND, Invocation, Messages, NativeServer, StreamAbort, load_front

log = logging.getLogger(__name__)


def server_options(max_message_bytes: int, reuse_port: bool = False) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Envoy PINGs the ext_proc connection (HTTP/2 keepalive) even when idle; gRPC's
        # defaults would answer that with GOAWAY "too_many_pings".
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        # By default fail loudly if the port is taken instead of silently sharing it. With reuse_port,
        # several ext_proc processes share the port and the kernel spreads Envoy's connections (not
        # streams) over them: scaling past one core needs as many connections as processes.
        ("grpc.so_reuseport", 1 if reuse_port else 0),
    ]


# The Endpoint Picker Protocol's health services (docs/epp.md): ``liveness`` answers SERVING as long as the
# process does; ``readiness``, the ext_proc service and the server ("") follow the view.
LIVENESS = "liveness"
READINESS = "readiness"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
GrpcFront = Literal["auto", "native", "grpcio"]


class GrpcServer(Protocol):
    front: str  # "native" or "grpcio"

    async def stop(self, grace: float | None) -> None: ...


class _GrpcioServer:
    """grpcio's aio server as a GrpcServer."""

    front = "grpcio"

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)


class HealthReporter:
    """grpc.health.v1: NOT_SERVING until the first EDS view, then SERVING; NOT_SERVING while stopping.
    ``liveness`` is SERVING from the start. grpcio's front serves ``servicer``; the native front, ``check``
    and ``watch`` (grpc.health.v1's semantics, on the same statuses)."""

    def __init__(self, source: ViewSource) -> None:
        self.servicer = health_aio.HealthServicer()
        self.statuses: dict[str, int] = {}
        self._change: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving = False
        self._stopping = False
        source.add_listener(self._on_view)

    async def start(self, ready: bool) -> None:
        await self._set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._set_all(health_pb2.HealthCheckResponse.SERVING if ready
                            else health_pb2.HealthCheckResponse.NOT_SERVING)
        self._serving = ready

    def _on_view(self, view: FleetView) -> None:
        if not self._serving:
            self._serving = True
            task = asyncio.get_running_loop().create_task(self._set_all(health_pb2.HealthCheckResponse.SERVING))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _set_all(self, status: int) -> None:
        for service in ("", SERVICE_NAME, READINESS):
            await self._set(service, status)

    async def _set(self, service: str, status: int) -> None:
        if self._stopping:
            return
        self.statuses[service] = status
        await self.servicer.set(service, status)
        self._changed()

    def _changed(self) -> None:
        change, self._change = self._change, None
        if change is not None and not change.done():
            change.set_result(None)

    async def stop(self) -> None:
        await self.servicer.enter_graceful_shutdown()
        self._stopping = True
        for service in self.statuses:
            self.statuses[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._changed()

    async def check(self, messages: Messages, invocation: Invocation) -> AsyncIterator[bytes]:
        """Check on the native front: the service's status, or NOT_FOUND for a service it does not know."""
        async for raw in messages:
            service = health_pb2.HealthCheckRequest.FromString(raw).service
            status = self.statuses.get(service)
            if status is None:
                raise StreamAbort(NOT_FOUND, f"unknown service {service!r}")
            yield health_pb2.HealthCheckResponse(status=status).SerializeToString()
            return

    async def watch(self, messages: Messages, invocation: Invocation) -> AsyncIterator[bytes]:
        """Watch on the native front: the status now (SERVICE_UNKNOWN for one it does not know), then each
        change, until the client goes."""
        async for raw in messages:
            service = health_pb2.HealthCheckRequest.FromString(raw).service
            last = None
            while True:
                status = self.statuses.get(service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                if status != last:
                    yield health_pb2.HealthCheckResponse(status=status).SerializeToString()
                    last = status
                if self._change is None:
                    self._change = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._change)  # one watcher's cancellation must not cancel the others'


async def serve_grpc(servicer: ExtProcServicer, health: HealthReporter, targets: Sequence[str],
                     max_message_bytes: int, reuse_port: bool = False, front: GrpcFront = "auto") -> GrpcServer:
    """One server on every target (``host:port``, ``unix:/path``): the same servicer behind each. ``front``:
    the native front when built (``auto``) or asked for (``native``: an error when not built), else grpcio's."""
    native = load_front() if front != "grpcio" else None
    if front == "native" and native is None:
        raise OSError("ext_proc's native gRPC front is not built: install gRPC C++ (Debian: libgrpc++-dev) and "
                      "reinstall inferlb, or use grpc_front = \"grpcio\"")
    server: GrpcServer
    if native is not None:
        handlers = {f"/{SERVICE_NAME}/{PROCESS_METHOD}": servicer.process, HEALTH_CHECK: health.check,
                    HEALTH_WATCH: health.watch}
        server = NativeServer(native, handlers, targets, max_message_bytes, reuse_port,
                              with_metadata=servicer.tracing is not None)
    else:
        server = await _serve_grpcio(servicer, health, targets, max_message_bytes, reuse_port)
    log.info("ext_proc's gRPC front", extra={"grpc_front": server.front, "asked": front})
    await health.start(ready=servicer.source.view is not None)
    return server


async def _serve_grpcio(servicer: ExtProcServicer, health: HealthReporter, targets: Sequence[str],
                        max_message_bytes: int, reuse_port: bool) -> _GrpcioServer:
    server = grpc.aio.server(options=server_options(max_message_bytes, reuse_port))
    servicer.add_to_server(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    for target in targets:
        if server.add_insecure_port(target) == 0:
            raise OSError(f"cannot listen on {target}")
    await server.start()
    return _GrpcioServer(server)
