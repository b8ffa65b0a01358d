"""The pool scaler live, with real workers (the real all-MiniLM-L6-v2) behind real Envoy and ext_proc.

The signal is the test's (it says 2, then 1); everything else is the real thing: the scaler starts a
worker process through a Supervisor, registers it on the control plane's admin API only once its
/readyz answers, and later drains, deregisters and stops it while a bounded client loop keeps sending
requests through Envoy. Not one of those requests may fail.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import httpx

from inferlb.components import WorkerOptions, worker_component
from inferlb.pool_scaler import AdminClient, PoolScaler, ScalerSettings, SupervisorWorkers
from inferlb.supervisor import Component, Supervisor

import pytest

from .conftest import free_port, running_worker
from .test_envoy_integration import until_blocking
from .stack import (
    BackgroundLoad,
    http,
    prometheus_samples,
    running_control_plane,
    running_envoy,
    running_ext_proc,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.model]

BODY = {"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat."]}


class TestSignal(AdminClient):
    """The real admin API, with the test's signal, recording whether each worker was ready when registered."""

    __test__ = False

    def __init__(self, client: httpx.AsyncClient, base_url: str, token: str) -> None:
        super().__init__(client, base_url, token)
        self.desired = 1
        self.ready_at_registration: dict[int, int] = {}  # port -> /readyz status when registered

    async def desired_replicas(self, pool: str) -> int | None:
        return self.desired

    async def register(self, address: str, port: int) -> None:
        self.ready_at_registration[port] = (await self.client.get(f"http://{address}:{port}/readyz")).status_code
        await super().register(address, port)


def served(port: int) -> float:
    """Requests the worker answered 200 (its own /metrics)."""
    with http() as client:
        samples = prometheus_samples(client.get(f"http://127.0.0.1:{port}/metrics").text)
    return samples.get(("inferlb_worker_requests_total", frozenset({("code", "200")})), 0.0)


def test_scale_up_after_readyz_and_scale_down_under_load_fails_no_request(data_dir: Path, tmp_path: Path) -> None:
    ext_proc_port = free_port()
    with running_worker(data_dir, tmp_path, "--threads", "1") as fixed, \
            running_control_plane(tmp_path, endpoints=[fixed.url.removeprefix("http://")],
                                  ext_proc_port=ext_proc_port) as cp, \
            running_ext_proc(tmp_path, xds_port=cp.xds_port, port=ext_proc_port), \
            running_envoy(tmp_path, xds_port=cp.xds_port) as envoy:
        wait_for(lambda: len(envoy.healthy_hosts()) == 1, 30, "Envoy to see the fixed worker", [cp.proc])
        url = f"http://127.0.0.1:{cp.listener_port}/v1/embeddings"
        with BackgroundLoad(url, BODY, concurrency=4, max_requests=20_000, max_seconds=300) as load:
            asyncio.run(asyncio.wait_for(_scale_up_then_down(data_dir, tmp_path, cp.admin_url, cp.admin_token(),
                                                             envoy.healthy_hosts, load), timeout=300))
        result = load.snapshot()
    assert result.sent > 0 and set(result.codes) == {200} and not result.errors, (result.codes, result.errors)


async def _scale_up_then_down(data_dir: Path, tmp_path: Path, admin_url: str, token: str, envoy_hosts,  # type: ignore[no-untyped-def]
                              load: BackgroundLoad) -> None:
    def component(port: int) -> Component:  # a real int8 worker, its log in the test's directory
        spec = worker_component(port, WorkerOptions(data_dir, models=()))
        return dataclasses.replace(spec, log_path=tmp_path / f"scaled-worker-{port}.log")

    lines: list[str] = []
    supervisor = Supervisor([], report=lines.append, stop_timeout_s=30)
    settings = ScalerSettings(min_workers=1, max_workers=2, scale_up_cooldown_s=0, scale_down_cooldown_s=0,
                              ready_timeout_s=120, drain_timeout_s=60)
    try:
        async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
            admin = TestSignal(client, admin_url, token)
            # below the ephemeral range: the port found free is not taken by a client connection meanwhile
            scaler = PoolScaler(settings, admin, SupervisorWorkers(supervisor, component, client), fixed=1,
                                first_port=22000)
            admin.desired = 2
            decision = await scaler.round()
            assert (decision.action, scaler.size) == ("up", 2), lines
            [member] = scaler.members
            assert admin.ready_at_registration == {member.port: 200}  # registered only once /readyz said ready
            # the new worker takes its share of the load through Envoy before it is removed
            await until_blocking(lambda: member.id in envoy_hosts() and served(member.port) >= 20, 60,
                         "the added worker to serve requests through Envoy")
            before = load.snapshot().sent
            admin.desired = 1
            decision = await scaler.round()
            assert (decision.action, scaler.size, scaler.members) == ("down", 1, []), lines
            assert supervisor.running == {}  # its process exited and was reaped
            assert member.id not in envoy_hosts()
            async with httpx.AsyncClient(timeout=5, trust_env=False) as probe:
                assert (await probe.get(f"{admin_url}/v1/endpoints/{member.id}")).status_code == 404
            # and the fixed worker goes on serving everything
            await until_blocking(lambda: load.snapshot().sent >= before + 50, 60, "50 more requests after the scale-down")
    finally:
        await supervisor.stop_all()
