"""Usage through the wire: a real control plane (``python -m control_plane``) scrapes ext_proc replicas'
/metrics where their xDS streams say, and ``GET /v1/usage`` answers what they counted.

The replicas are STAND-INS, so the counts are the test's own: each is ext_proc's real ``XdsClient`` (its
node metadata names the metrics port, as ``python -m ext_proc`` does) and an HTTP server answering
/metrics with a real ``ExtProcMetrics``' ``render()``, counted with ``ExtProcMetrics.tenant_usage`` as the
request path does. The path through Envoy and a real ext_proc: tests/test_usage_envoy.py. Shown: two replicas' usage summed and growing;
the usage survives a control-plane restart and
the restarted one, reading the same counters again, counts nothing twice; two control-plane replicas on
one PostgreSQL that both scrape one ext_proc count its usage once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ext_proc.metrics import CONTENT_TYPE, ExtProcMetrics
from ext_proc.xds.client import XdsClient, XdsClientSettings

from .conftest import free_port
from .stack import ControlPlane, running_control_plane
from .test_envoy_integration import entered_in_thread
from .test_scraper import serving

pytestmark = [pytest.mark.slow, pytest.mark.servers]

pytest_plugins = ("tests.postgres",)  # the postgres_url fixture

DEADLINE_S = 30.0


class StandInReplica:
    """An ext_proc replica's usage side: its real metrics, served at /metrics, and its xDS stream."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.metrics = ExtProcMetrics()
        self.port = free_port()

    def app(self) -> Starlette:
        async def render(request: Request) -> Response:
            return Response(self.metrics.render(), media_type=CONTENT_TYPE)
        return Starlette(routes=[Route("/metrics", render)])

    def count(self, tenant: str, outcome: str, tokens: int, times: int = 1) -> None:
        for _ in range(times):
            self.metrics.tenant_usage(tenant, outcome, tokens)

    @contextlib.asynccontextmanager
    async def running(self, *control_planes: ControlPlane) -> AsyncIterator[StandInReplica]:
        """Serve /metrics and hold one xDS stream to each control plane (same node id, as a replica that moved)."""
        async with serving(self.app(), self.port), contextlib.AsyncExitStack() as streams:
            for cp in control_planes:
                await streams.enter_async_context(XdsClient(XdsClientSettings(
                    target=f"127.0.0.1:{cp.xds_port}", node_id=self.node_id, metrics_port=self.port)))
            yield self


async def usage(cp: ControlPlane, **params: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        response = await client.get(f"{cp.admin_url}/v1/usage", params=params,
                                    headers={"Authorization": f"Bearer {cp.admin_token()}"})
    assert response.status_code == 200, response.text
    return {t["tenant"]: t["totals"] for t in response.json()["tenants"]}


async def until_usage(cp: ControlPlane, expected: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    while True:
        totals = await usage(cp)
        if expected(totals):
            return totals
        if loop.time() > deadline:
            raise TimeoutError(f"gave up after {DEADLINE_S}s waiting for {what}; last usage {totals}")
        await asyncio.sleep(0.1)


async def until_connected(cp: ControlPlane, node_id: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE_S
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        while node_id not in {c["node_id"] for c in (await client.get(f"{cp.admin_url}/v1/xds/clients")).json()[
                "clients"]}:
            if loop.time() > deadline:
                raise TimeoutError(f"gave up after {DEADLINE_S}s waiting for {node_id}'s stream")
            await asyncio.sleep(0.05)


def requests_of(totals: dict[str, Any], tenant: str) -> int:
    return totals.get(tenant, {}).get("requests", 0)


def test_replicas_usage_reaches_the_api_and_survives_a_restart(tmp_path: Path) -> None:
    xds_port, admin_port = free_port(), free_port()
    data = tmp_path / "data"

    def control_plane() -> contextlib.AbstractContextManager[ControlPlane]:
        return running_control_plane(tmp_path, endpoints=[], xds_port=xds_port, admin_port=admin_port, data_dir=data)

    async def scenario() -> None:
        a, b = StandInReplica("ext-proc-usage-a"), StandInReplica("ext-proc-usage-b")
        a.count("acme", "served", 10, times=3)
        a.count("acme", "failed", 4)
        a.count("anonymous", "unauthenticated", 0, times=2)
        b.count("acme", "served", 5)
        b.count("beta", "shed", 7)
        b.count("beta", "rate_limited", 8)
        async with entered_in_thread(control_plane()) as cp, a.running(cp), b.running(cp):
            totals = await until_usage(cp, lambda t: requests_of(t, "acme") == 5 and requests_of(t, "beta") == 2,
                                       "both replicas' usage")
            assert totals == {
                "acme": {"requests": 5, "tokens": 35, "errors": 1, "sheds": 0, "rate_limited": 0,
                         "unauthenticated": 0},
                "anonymous": {"requests": 2, "tokens": 0, "errors": 0, "sheds": 0, "rate_limited": 0,
                              "unauthenticated": 2},
                "beta": {"requests": 2, "tokens": 0, "errors": 0, "sheds": 1, "rate_limited": 1,
                         "unauthenticated": 0},
            }
            a.count("acme", "served", 10)
            await until_usage(cp, lambda t: requests_of(t, "acme") == 6, "a's next request")
            before = await usage(cp)
        # the usage is in the store; the restarted control plane reads the same counters again
        async with entered_in_thread(control_plane()) as cp, a.running(cp), b.running(cp):
            assert await usage(cp) == before
            b.count("beta", "served", 3)  # a change seen after the restart: everything else was seen again
            totals = await until_usage(cp, lambda t: requests_of(t, "beta") == 3, "b's request after the restart")
            assert totals == {**before, "beta": {**before["beta"], "requests": 3, "tokens": 3}}

    asyncio.run(scenario())


def test_two_control_planes_on_one_postgresql_count_an_ext_proc_once(tmp_path: Path, postgres_url: str) -> None:
    env = {"INFERLB_STORE": postgres_url}

    for name in ("one", "two"):
        (tmp_path / name).mkdir()

    async def scenario() -> None:
        replica = StandInReplica("ext-proc-usage-shared")
        replica.count("acme", "served", 10, times=4)
        async with entered_in_thread(running_control_plane(tmp_path / "one", endpoints=[], env=env)) as one, \
                entered_in_thread(running_control_plane(tmp_path / "two", endpoints=[], env=env)) as two, \
                replica.running(one, two):
            for cp in (one, two):  # each has the replica's stream, so each scrapes it
                await until_connected(cp, replica.node_id)
            await until_usage(one, lambda t: requests_of(t, "acme") == 4, "the usage")
            replica.count("acme", "served", 10, times=2)
            await until_usage(two, lambda t: requests_of(t, "acme") == 6, "the next requests")
            # both control planes scrape the replica every interval and write what they see: once each
            for cp in (one, two):
                assert (await usage(cp))["acme"] == {"requests": 6, "tokens": 60, "errors": 0, "sheds": 0,
                                                     "rate_limited": 0, "unauthenticated": 0}

    asyncio.run(scenario())
