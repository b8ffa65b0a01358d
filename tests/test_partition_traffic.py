"""ext_proc's partitions follow the replicas that carry traffic, not the connected streams.

Real ``python -m control_plane``, Envoy, two ``python -m ext_proc`` replicas and simulated workers.
Envoy's ext_proc filter reaches replica A only; replica B is connected to the control plane but gets no
request (as a replica that Envoy no longer sends to, or that is wedged). Before: both stayed listed, so A
picked from half of a large fleet and the other half was left to B, which picks nothing. Now the control
plane reads each replica's decision count every scrape interval and lists only those whose count grew:
A alone while it carries the traffic, both again once the fleet is idle.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

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

pytestmark = pytest.mark.slow


def partition(ext_proc: ExtProc) -> tuple[float | None, float | None]:
    metrics = ext_proc.metrics()
    return (sample(metrics, "inferlb_ext_proc_partition_index"), sample(metrics, "inferlb_ext_proc_partition_count"))


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
        assert load.result.codes.get(200, 0) > 0 and set(load.result.codes) == {200}, load.result

        # Idle again: both listed again.
        wait_for(lambda: partition(busy) == (0, 2) and partition(idle) == (1, 2), 60,
                 lambda: f"both replicas listed again; A {partition(busy)}, B {partition(idle)}", procs)
