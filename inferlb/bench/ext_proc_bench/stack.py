"""The ext_proc bench's processes: the stack, static Envoys, the fake worker and the trivial servicer.

Everything runs in ``ProcessGroup``s (``inferlb.bench.processes``): stopped on
the way out, on errors and on Ctrl-C alike. The stack is ``inferlb bench run``'s
own ``inferlb_ext_proc`` data plane (``plan_data_plane``: the control plane, then
ext_proc and Envoy over ADS) in front of simulated workers; every static Envoy
is the bench's one static config (``dataplanes.envoy_static``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ...bootstrap import envoy_startup_stats_url
from ...supervisor import Component
from ..stack.dataplanes import DataPlanePorts, plan_data_plane
from ..stack.dataplanes.envoy_static import bootstrap_dict, static_bootstrap
from ..stack.dataplanes.launch import grpc_front, healthy_hosts, pick_decisions, start_data_plane
from ..stack.fleet import FLEET_GROUP, HOST, child_env
from ..processes import ProcessGroup, free_port
from .workload import PATH

REQUEST_TIMEOUT_S = 60.0
EXT_PROC_STATS = ("streams_started", "failure_mode_allowed", "message_timeouts", "streams_failed")
Log = Callable[[str], None]


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str,
                     group: ProcessGroup) -> None:
    """Poll ``check`` until true; raise naming ``what`` after ``timeout_s``, or at once if a process died."""
    deadline = time.monotonic() + timeout_s
    while True:
        group.check_alive()
        try:
            if await check():
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(0.1)


def envoy_component(envoy: str, name: str, bootstrap: Path, admin_port: int, log_dir: Path) -> Component:
    """Envoy on ``bootstrap`` with one worker thread, ready when its admin /ready says LIVE."""
    argv = [envoy, "-c", str(bootstrap), "--disable-hot-restart", "--concurrency", "1",
            "-l", os.environ.get("BENCH_ENVOY_LOG", "warn")]
    return Component(name=f"envoy-{name}", argv=argv, ready_url=f"http://127.0.0.1:{admin_port}/ready",
                     log_path=log_dir / f"envoy-{name}.log", env=child_env(), ready_timeout_s=30.0,
                     diagnose_url=envoy_startup_stats_url(f"http://127.0.0.1:{admin_port}"))


@dataclass(frozen=True)
class StaticEnvoy:
    component: Component
    listener_port: int
    admin_url: str


def static_envoy(envoy: str, log_dir: Path, name: str, endpoints: Sequence[tuple[str, int]], *,
                 ext_proc_port: int | None, messages: int = 3, ext_proc_uds: Path | None = None) -> StaticEnvoy:
    """The bench's static Envoy config in front of ``endpoints``: with the ext_proc filter (``messages``
    per request) pointing at ``ext_proc_port`` (or its Unix socket ``ext_proc_uds``), or without it (``None``).
    No retries, like the stack."""
    from control_plane.config import DataPlaneConfig

    listener_port, admin_port = free_port(), free_port()
    settings = DataPlaneConfig(listener_port=listener_port, ext_proc_port=ext_proc_port or 1, retries=0,
                               request_timeout_s=REQUEST_TIMEOUT_S,
                               ext_proc_enabled=ext_proc_port is not None,
                               ext_proc_uds_path=str(ext_proc_uds) if ext_proc_uds else None).settings()
    path = log_dir / f"envoy-{name}-bootstrap.json"
    path.write_text(json.dumps(bootstrap_dict(static_bootstrap(settings, endpoints, admin_port=admin_port,
                                                               node_id=name, ext_proc_messages=messages))))
    return StaticEnvoy(envoy_component(envoy, name, path, admin_port, log_dir), listener_port,
                       f"http://127.0.0.1:{admin_port}")


async def post(client: httpx.AsyncClient, url: str, body: bytes) -> httpx.Response:
    return await client.post(url, content=body, headers={"content-type": "application/json"})


async def decisions(client: httpx.AsyncClient, metrics_url: str) -> float:
    """ext_proc's decisions so far, every policy and endpoint summed."""
    return float(sum(pick_decisions((await client.get(f"{metrics_url}/metrics")).text).values()))


async def ext_proc_filter_stats(client: httpx.AsyncClient, admin_url: str) -> dict[str, int]:
    """The ext_proc filter's counters in one Envoy (fail-opens, timeouts...), summed over listeners."""
    text = (await client.get(f"{admin_url}/stats", params={"filter": r"^http\..*\.ext_proc\."})).text
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if value.strip().isdigit():
            stats[name.strip()] = int(value)
    return {key: sum(v for k, v in stats.items() if k.endswith(f".ext_proc.{key}")) for key in EXT_PROC_STATS}


@dataclass
class Stack:
    log_dir: Path
    group: ProcessGroup
    client: httpx.AsyncClient
    envoy: str
    worker_urls: list[str]
    ext_proc_port: int
    ext_proc_metrics_url: str
    envoy_x_port: int
    envoy_x_admin_url: str
    envoy_b_port: int
    xds_port: int
    ext_proc_uds: Path  # ext_proc listens here too, whatever the stack's Envoy uses
    transport: str  # how the stack's Envoy reaches ext_proc: "uds" or "tcp"
    ext_proc_front: str  # the gRPC front ext_proc runs on ("auto" picks it): "native" or "grpcio"

    def ext_proc_target(self, transport: str) -> str:
        """ext_proc's gRPC address for a client: its Unix socket or its TCP port."""
        return f"unix:{self.ext_proc_uds}" if transport == "uds" else f"127.0.0.1:{self.ext_proc_port}"

    def pid(self, name: str) -> int:
        return self.group.pid(name)

    def pids(self) -> dict[str, list[int]]:
        return {
            "ext_proc": [self.pid("ext_proc")],
            "envoy_ext_proc": [self.pid("envoy")],
            "envoy_baseline": [self.pid("envoy-baseline")],
            "workers": [self.pid(f"worker:{url.rsplit(':', 1)[1]}") for url in self.worker_urls],
            "control_plane": [self.pid("control-plane")],
            "bench": [os.getpid()],
        }


def worker_component(port: int, log_dir: Path, sim_fixed_ms: float, sim_per_token_us: float) -> Component:
    """One simulated worker with the bench's tiny cost (so that the workers do not dominate)."""
    argv = [sys.executable, "-m", "workers", "--simulate", "--host", HOST, "--port", str(port),
            "--sim-fixed-ms", f"{sim_fixed_ms:g}", "--sim-per-token-us", f"{sim_per_token_us:g}",
            "--log-level", "warning"]
    return Component(name=f"worker:{port}", argv=argv, ready_url=f"http://{HOST}:{port}/readyz",
                     log_path=log_dir / f"worker-{port}.log",
                     env=child_env({"INFERLB_DATA_DIR": str(log_dir / "worker-data")}),
                     ready_timeout_s=60.0, group=FLEET_GROUP)


async def start_stack(group: ProcessGroup, client: httpx.AsyncClient, args: Any, log_dir: Path,
                      bodies: Sequence[bytes], envoy: str, log: Log) -> Stack:
    """Workers, then the control plane, ext_proc and its Envoy, then the baseline Envoy; ready when both
    Envoys route to every worker and a request through the stack's Envoy was picked by ext_proc."""
    log(f"[stack] starting {args.workers} simulated workers (--sim-fixed-ms {args.sim_fixed_ms:g} "
        f"--sim-per-token-us {args.sim_per_token_us:g})")
    ports = [free_port() for _ in range(args.workers)]
    await group.start([worker_component(p, log_dir, args.sim_fixed_ms, args.sim_per_token_us) for p in ports])
    endpoints = [(HOST, p) for p in ports]
    worker_ids = [f"{HOST}:{p}" for p in ports]
    log(f"[stack] control plane, ext_proc, Envoy (ADS, with the ext_proc filter, to ext_proc over "
        f"{args.transport.upper()}), baseline Envoy (static, without)")
    dp = DataPlanePorts.allocate()
    uds = ext_proc_uds(log_dir)
    plan = plan_data_plane("inferlb_ext_proc", endpoints=endpoints, workdir=log_dir / "stack", ports=dp,
                           request_timeout_s=REQUEST_TIMEOUT_S, envoy=envoy, ext_proc_uds=uds,
                           envoy_ext_proc_uds=args.transport == "uds")
    await start_data_plane(plan, group, client, worker_ids)
    baseline = static_envoy(envoy, log_dir, "baseline", endpoints, ext_proc_port=None)
    await group.start([baseline.component])
    await wait_until(lambda: all_healthy(client, baseline.admin_url, worker_ids), 30,
                     "every worker healthy in the baseline Envoy", group)
    url_x, url_b = plan.url, f"http://127.0.0.1:{baseline.listener_port}{PATH}"

    async def picked() -> bool:
        response = await post(client, url_x, bodies[0])
        return response.status_code == 200 and "x-inferlb-endpoint" in response.headers

    async def answered() -> bool:
        return (await post(client, url_b, bodies[0])).status_code == 200

    await wait_until(picked, 30, "a request through Envoy picked by ext_proc", group)
    await wait_until(answered, 30, "a request through the baseline Envoy", group)
    if "x-inferlb-endpoint" in (await post(client, url_b, bodies[0])).headers:
        raise RuntimeError("the baseline Envoy's answer carries ext_proc's header: it is not a baseline")
    assert plan.envoy_admin_url is not None and plan.ext_proc_metrics_url is not None
    return Stack(log_dir, group, client, envoy, [f"http://{w}" for w in worker_ids], dp.ext_proc,
                 plan.ext_proc_metrics_url, dp.listener, plan.envoy_admin_url, baseline.listener_port, dp.xds,
                 uds, args.transport, await serving_front(client, plan.ext_proc_metrics_url))


async def serving_front(client: httpx.AsyncClient, metrics_url: str) -> str:
    """The gRPC front the stack's ext_proc says it serves on ("native" or "grpcio")."""
    return grpc_front((await client.get(f"{metrics_url}/metrics")).text) or "grpcio"


async def all_healthy(client: httpx.AsyncClient, admin_url: str, worker_ids: Sequence[str]) -> bool:
    return set(worker_ids) <= healthy_hosts((await client.get(f"{admin_url}/clusters")).text)


def ext_proc_uds(log_dir: Path) -> Path:
    """The stack's ext_proc listens here too (a Unix socket: short, so within sun_path's 107 bytes)."""
    return log_dir / "ext_proc.sock"


def trivial_uds(log_dir: Path, front: str = "grpcio") -> Path:
    return log_dir / ("trivial.sock" if front == "grpcio" else f"trivial-{front}.sock")


def fake_worker_bootstrap(listener_port: int, admin_port: int, answer: httpx.Response) -> dict[str, Any]:
    """An Envoy that answers every request itself with a worker's real answer (body and the headers
    ext_proc learns from): a worker that costs (almost) nothing. Not inferlb's config: a stand-in for
    the worker behind it."""
    headers = [{"header": {"key": k, "value": v}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
               for k, v in answer.headers.items() if k.lower() in
               ("content-type", "server-timing", "x-inferlb-tokens", "endpoint-load-metrics")]
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "fake_worker",
        "route_config": {"virtual_hosts": [{
            "name": "fake_worker", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": answer.text}}}],
            "response_headers_to_add": headers}]},
        "http_filters": [
            # Like a worker, answer only once the whole body is in: without this the answer would
            # come at the request headers, before Envoy's ext_proc filter has even released the body.
            {"name": "envoy.filters.http.buffer", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                "max_request_bytes": 4 * 1024 * 1024}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "node": {"id": "bench-fake-worker", "cluster": "inferlb-bench"},
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {"listeners": [{
            "name": "fake_worker",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener_port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}]},
    }


def fake_worker(envoy: str, log_dir: Path, answer: httpx.Response) -> tuple[Component, int]:
    listener_port, admin_port = free_port(), free_port()
    path = log_dir / "envoy-fake-worker-bootstrap.json"
    path.write_text(json.dumps(fake_worker_bootstrap(listener_port, admin_port, answer)))
    return envoy_component(envoy, "fake-worker", path, admin_port, log_dir), listener_port


def trivial_servicer(log_dir: Path, front: str = "grpcio") -> tuple[Component, int]:
    """The trivial ExternalProcessor (``trivial.py``) on ``front`` as a component, and its gRPC port; it also
    listens on the Unix socket ``trivial_uds(log_dir, front)``."""
    port, ready_port = free_port(), free_port()
    argv = [sys.executable, "-m", "inferlb.bench.ext_proc_bench.trivial", str(port), str(ready_port),
            str(trivial_uds(log_dir, front)), "--front", front]
    name = "trivial-ext-proc" if front == "grpcio" else f"trivial-ext-proc-{front}"
    return Component(name=name, argv=argv, ready_url=f"http://127.0.0.1:{ready_port}/",
                     log_path=log_dir / f"{name}.log", env=child_env(), ready_timeout_s=30.0), port
