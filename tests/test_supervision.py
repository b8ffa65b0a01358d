"""No background task dies silently: a failure is logged, counted and retried, and ``/readyz`` says
not ready while publishing is broken.

Through the real control plane (``tests.faulty_control_plane``: ``python -m control_plane`` with a
switchable fault in the snapshot build), a real Envoy and a simulated worker; the drain-then-remove
task in-process, with an xDS cache that fails a few times.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from control_plane.admin import AdminService
from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller, initial_state
from control_plane.metrics import ControlPlaneMetrics
from control_plane.model import Endpoint
from control_plane.xds import SnapshotCache
from inferlb_runtime.backoff import Backoff
from inferlb_runtime.supervision import Supervised

from .faulty_control_plane import FAULT_ENV
from .stack import (
    ControlPlane,
    http,
    prometheus_samples,
    running_control_plane,
    running_envoy,
    running_sim_workers,
    sample,
    wait_for,
)
from .test_admin_api import Admin
from .test_admin_envoy import post


def task_failures(cp: ControlPlane, task: str) -> float | None:
    return sample(cp.metrics(), "inferlb_cp_task_failures_total", task=task)


def readyz(cp: ControlPlane):  # type: ignore[no-untyped-def]
    with http() as client:
        return client.get(f"{cp.admin_url}/readyz")


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_failing_publish_makes_readyz_503_is_counted_and_publishing_resumes(tmp_path: Path) -> None:
    fault = tmp_path / "publish-fault"
    with running_sim_workers(tmp_path, 1) as (worker,), \
            running_control_plane(tmp_path, endpoints=[], module="tests.faulty_control_plane",
                                  env={FAULT_ENV: str(fault)}) as cp, \
            running_envoy(tmp_path, xds_port=cp.xds_port, node_id="envoy-supervision") as envoy:
        procs = [cp.proc, envoy.proc, worker.proc]
        assert task_failures(cp, "publisher") == 0

        fault.touch()
        Admin(cp).ok("POST", "/v1/endpoints", 201, json={"address": "127.0.0.1", "port": worker.port})
        response = wait_for(lambda: (r := readyz(cp)).status_code == 503 and r, 30,
                            "/readyz to say not ready while publishing fails", procs)
        reason = response.json()["reason"]
        assert "publishing snapshots is failing" in reason and "injected publish fault" in reason, reason
        wait_for(lambda: (task_failures(cp, "publisher") or 0) >= 2, 30, "the retries to be counted", procs)
        assert worker.id not in envoy.hosts()  # nothing was published meanwhile
        log = cp.proc.log()
        assert "background task failed; retrying" in log and "Traceback (most recent call last)" in log

        fault.unlink()
        wait_for(lambda: readyz(cp).status_code == 200, 30, "/readyz to be ready again", procs)
        wait_for(lambda: envoy.healthy_hosts() == {worker.id}, 30, "the registration to reach Envoy", procs)
        wait_for(lambda: post(cp.listener_port).status_code == 200, 30, "a request served by the worker", procs)
        assert "background task recovered" in cp.proc.log()


class FlakyCache(SnapshotCache):
    """The xDS cache, whose "have the Envoys acknowledged?" raises the first ``failures`` times."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def default_settled(self, type_url: str) -> bool:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected cache failure")
        return super().default_settled(type_url)


def test_a_failing_drain_then_remove_is_retried_counted_and_finishes() -> None:
    """Before supervision the first exception ended the task: the endpoint stayed draining for good."""
    async def main() -> tuple[bool, float | None, bool]:
        config = ControlPlaneConfig(scrape_interval_s=0.1, debounce_s=0.01)
        endpoint = Endpoint(address="127.0.0.1", port=9, source="api")
        controller_ref: list[Controller] = []
        metrics = ControlPlaneMetrics(lambda: controller_ref[0].state)
        state = initial_state(config)
        controller = Controller(config, FlakyCache(failures=2), metrics,
                                dataclasses.replace(state, endpoints=(endpoint,)))
        controller_ref.append(controller)
        await controller.start()
        service = AdminService(controller, deregistration_drain_s=0.5)
        try:
            out = await service.deregister(endpoint.id)
            assert out.draining and out.removing
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while controller.state.endpoint(endpoint.id) is not None and loop.time() < deadline:
                await asyncio.sleep(0.02)
            samples = prometheus_samples(metrics.exposition().decode())
            return (controller.state.endpoint(endpoint.id) is None,
                    sample(samples, "inferlb_cp_task_failures_total", task="deregister"),
                    endpoint.id in {e.id for e in service.endpoints().endpoints if e.removing})
        finally:
            await service.stop()
            await controller.stop()

    removed, failures, still_removing = asyncio.run(main())
    assert removed and failures == 2 and not still_removing


def test_cancelling_a_supervised_step_is_not_a_failure() -> None:
    class Count:
        failed = 0

        def task_failed(self, task: str) -> None:
            self.failed += 1

    async def main() -> tuple[int, bool]:
        started = asyncio.Event()

        async def forever() -> None:
            started.set()
            await asyncio.Event().wait()

        count = Count()
        supervised = Supervised("t", observer=count, backoff=Backoff(0.01, 0.01))
        task = asyncio.create_task(supervised.run(forever))
        await started.wait()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return count.failed, task.cancelled()

    assert asyncio.run(main()) == (0, True)
