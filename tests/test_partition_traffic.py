"""ext_proc's partitions follow the replicas that carry traffic, not the connected streams.

Real ``python -m control_plane``, Envoy, two ``python -m ext_proc`` replicas and simulated workers.
Envoy's ext_proc filter reaches replica A only; replica B is connected to the control plane but gets no
request (as a replica that Envoy no longer sends to, or that is wedged). Before: both stayed listed, so A
picked from half of a large fleet and the other half was left to B, which picks nothing. Now the control
plane reads each replica's decision count every scrape interval and lists only those whose count grew:
A alone while it carries the traffic, both while both do (B's requests sent straight to its gRPC port, as
a second Envoy would), A alone again once B stops, and both again once the fleet is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from control_plane.telemetry.replica_activity import watch_replicas
from control_plane.telemetry.scraper import ScraperConfig

from .conftest import free_port
from .stack import (
    BackgroundLoad,
    ExtProc,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    running_sim_workers,
    sample,
    wait_for,
)

from .test_ext_proc_service import request_body, request_headers

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


def partition(ext_proc: ExtProc) -> tuple[float | None, float | None]:
    metrics = ext_proc.metrics()
    return (sample(metrics, "inferlb_ext_proc_partition_index"), sample(metrics, "inferlb_ext_proc_partition_replicas"))


class DirectDecisions:
    """Asks one ext_proc for picks over its gRPC port (headers, body, then the stream is cancelled, as when a
    client leaves), one at a time, until stopped, ``max_requests`` are sent or ``max_seconds`` pass."""

    def __init__(self, port: int, *, max_requests: int = 5_000, max_seconds: float = 90) -> None:
        self.port, self.max_requests, self.max_seconds = port, max_requests, max_seconds
        self.stop_event = threading.Event()
        self.picked = 0
        self._thread = threading.Thread(target=self._loop, name="direct-decisions", daemon=True)

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            while not self.stop_event.is_set() and time.monotonic() < deadline and self.picked < self.max_requests:
                call = stub.Process(iter([request_headers(), request_body({"input": "partition me too"})]),
                                    timeout=30)
                try:
                    next(call), next(call)  # the headers' and the body's answers: the pick is made
                    self.picked += 1
                finally:
                    call.cancel()

    def __enter__(self) -> "DirectDecisions":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self._thread.join(60)


def test_an_idle_replica_gives_its_partition_to_the_one_carrying_traffic(tmp_path: Path) -> None:
    ext_proc_port = free_port()
    with ExitStack() as exits:
        workers = exits.enter_context(running_sim_workers(tmp_path, 2, speed=20.0))
        cp = exits.enter_context(running_control_plane(tmp_path, endpoints=[w.id for w in workers],
                                                       ext_proc_port=ext_proc_port))
        busy = exits.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port,
                                                    node_id="ext-proc-a"))
        idle = exits.enter_context(running_ext_proc(tmp_path, xds_port=cp.xds_port, node_id="ext-proc-b"))
        envoy = exits.enter_context(running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-partitions"))
        procs = [cp.proc, busy.proc, idle.proc, envoy.proc, *(w.proc for w in workers)]
        wait_for(lambda: len(envoy.healthy_hosts()) == 2, 30, "Envoy to see both workers healthy", procs)

        # Idle fleet: both connected replicas are listed (A is index 0 of 2, B index 1 of 2).
        wait_for(lambda: partition(busy) == (0, 2) and partition(idle) == (1, 2), 30,
                 lambda: f"both replicas listed; A {partition(busy)}, B {partition(idle)}", procs)

        url = f"http://127.0.0.1:{cp.listener_port}/v1/embeddings"
        with BackgroundLoad(url, {"input": "partition me"}, concurrency=2, max_requests=20_000,
                            max_seconds=90) as load:
            # A carries the traffic, B none: A is listed alone (B, unlisted, would pick from the whole fleet).
            wait_for(lambda: partition(busy) == (0, 1) and partition(idle) == (0, 1), 60,
                     lambda: f"A to be listed alone; A {partition(busy)}, B {partition(idle)}", procs)
            assert sample(idle.metrics(), "inferlb_ext_proc_decision_seconds_count") in (None, 0.0)

            # B carries traffic too: both are listed again while both do.
            with DirectDecisions(idle.port) as direct:
                wait_for(lambda: partition(busy) == (0, 2) and partition(idle) == (1, 2), 60,
                         lambda: f"both busy replicas listed; A {partition(busy)}, B {partition(idle)}", procs)
            assert direct.picked > 0
            # B stopped carrying traffic: it drops out again.
            wait_for(lambda: partition(busy) == (0, 1) and partition(idle) == (0, 1), 60,
                     lambda: f"A to be listed alone again; A {partition(busy)}, B {partition(idle)}", procs)
        assert load.result.codes.get(200, 0) > 0 and set(load.result.codes) == {200}, load.result

        # Idle again: both listed again.
        wait_for(lambda: partition(busy) == (0, 2) and partition(idle) == (1, 2), 60,
                 lambda: f"both replicas listed again; A {partition(busy)}, B {partition(idle)}", procs)


def test_a_replica_whose_decisions_cannot_be_read_is_named_once_and_not_listed(
        caplog: pytest.LogCaptureFixture) -> None:
    """A replica whose /metrics does not answer where its stream comes from (listening on loopback on another
    host, say) cannot be seen carrying traffic: the operator is told once, not every interval."""
    class Sink:
        def __init__(self) -> None:
            self.looks: list[frozenset[str]] = []

        def ext_proc_targets(self) -> dict[str, tuple[str, int]]:
            return {"ext-proc-deaf": ("127.0.0.1", free_port())}  # nothing listens there

        def set_active_replicas(self, active: frozenset[str]) -> None:
            self.looks.append(active)

    async def scenario() -> Sink:
        sink = Sink()
        task = asyncio.create_task(watch_replicas(sink, ScraperConfig(interval_s=0.01, timeout_s=5)))
        try:
            async with asyncio.timeout(30):
                while len(sink.looks) < 3:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return sink

    with caplog.at_level(logging.WARNING, logger="inferlb.control_plane.replicas"):
        sink = asyncio.run(scenario())
    assert set(sink.looks) == {frozenset()}
    named = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(named) == 1 and "ext-proc-deaf" in named[0].replicas, caplog.text  # type: ignore[attr-defined]
