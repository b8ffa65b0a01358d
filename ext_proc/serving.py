"""Serving ext_proc's gRPC: the server's options and the grpc.health.v1 status that follows the view."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from .server import ExtProcServicer
from .wire import SERVICE_NAME
from .xds_client import FleetView, ViewSource


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


class HealthReporter:
    """grpc.health.v1: NOT_SERVING until the first EDS view, then SERVING; NOT_SERVING while stopping.
    ``liveness`` is SERVING from the start."""

    def __init__(self, source: ViewSource) -> None:
        self.servicer = health_aio.HealthServicer()
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving = False
        source.add_listener(self._on_view)

    async def start(self, ready: bool) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
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
            await self.servicer.set(service, status)

    async def stop(self) -> None:
        await self.servicer.enter_graceful_shutdown()


async def serve_grpc(servicer: ExtProcServicer, health: HealthReporter, targets: Sequence[str],
                     max_message_bytes: int, reuse_port: bool = False) -> grpc.aio.Server:
    """One server on every target (``host:port``, ``unix:/path``): the same servicer behind each."""
    server = grpc.aio.server(options=server_options(max_message_bytes, reuse_port))
    servicer.add_to_server(server)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    for target in targets:
        if server.add_insecure_port(target) == 0:
            raise OSError(f"cannot listen on {target}")
    await server.start()
    await health.start(ready=servicer.source.view is not None)
    return server
