"""The accuracy bench's processes: a worker, a control plane with the tenant's key, ext_proc replicas on one Redis.

All real and all in one ``ProcessGroup`` (stopped on the way out, on errors
and on Ctrl-C alike; ready by their probes, never by sleeping): one
simulated worker so that ext_proc has a routable view (no request reaches
it: the bench plays Envoy), the control plane as ``inferlb bench run``
starts it (``plan_data_plane``; its Envoy is not started), the tenant's API
key issued on its admin API, and the ext_proc replicas with keys required
and the quota store in Redis. Ready when every replica answers a probe
request, of a second key without quotas (so probing costs the tenant
nothing), with a pick.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from ..stack.dataplanes import DataPlanePorts, plan_data_plane
from ..ext_proc_bench.stack import wait_until, worker_component
from ..stack.fleet import HOST, child_env
from ..processes import ProcessGroup, free_port
from .quota_accuracy_load import RedisClock, Requests, Sent
from ...supervisor import Component

READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class QuotaStack:
    targets: list[str]  # each replica's gRPC address
    metrics_urls: list[str]
    key: str  # the measured tenant's
    pick_header: str


def ext_proc_component(index: int, xds_port: int, redis_url: str, logs: Path, data_dir: Path) -> tuple[Component,
                                                                                                      int, int]:
    """Replica ``index``: keys required, counters in ``redis_url``. Also its gRPC and metrics ports."""
    port, metrics_port = free_port(), free_port()
    argv = [sys.executable, "-m", "ext_proc", "--port", str(port), "--metrics-port", str(metrics_port),
            "--xds-port", str(xds_port), "--node-id", f"ext-proc-accuracy-{index}", "--log-level", "warning"]
    env = child_env({"INFERLB_DATA_DIR": str(data_dir), "INFERLB_EXT_PROC_QUOTA_STORE": redis_url,
                     "INFERLB_EXT_PROC_REQUIRE_API_KEYS": "true"})
    return Component(name=f"ext_proc-{index}", argv=argv, ready_url=f"http://127.0.0.1:{metrics_port}/readyz",
                     log_path=logs / f"ext_proc-{index}.log", env=env, ready_timeout_s=READY_TIMEOUT_S), \
        port, metrics_port


async def create_key(client: httpx.AsyncClient, control_plane_url: str, token: str, body: dict[str, Any]) -> str:
    """A new API key (``POST /v1/api-keys``); the key itself is in this answer only."""
    response = await client.post(f"{control_plane_url}/v1/api-keys", json=body,
                                 headers={"Authorization": f"Bearer {token}"})
    if response.status_code != 201:
        raise RuntimeError(f"the control plane refused the key {body}: {response.status_code} {response.text}")
    return str(response.json()["key"])


async def start_quota_stack(group: ProcessGroup, client: httpx.AsyncClient, work_dir: Path, redis_url: str,
                            tenant: str, tokens_per_minute: int, replicas: int, clock: RedisClock,
                            log: Callable[[str], None]) -> QuotaStack:
    """Everything started and ready; the returned stack names the tenant's key."""
    import grpc

    from ext_proc.config import ExtProcConfig

    logs = work_dir / "logs"
    worker_port = free_port()
    ports = DataPlanePorts.allocate()
    plan = plan_data_plane("inferlb_ext_proc", endpoints=[(HOST, worker_port)], workdir=work_dir / "stack",
                           ports=ports, request_timeout_s=60.0, envoy="envoy")
    for directory in (logs, *plan.directories):
        directory.mkdir(parents=True, exist_ok=True)
    log(f"[stack] a simulated worker and the control plane (logs in {work_dir})")
    await group.start([worker_component(worker_port, logs, 1.0, 1.0), *plan.stages[0]])
    assert plan.control_plane_url is not None and plan.admin_token is not None
    key = await create_key(client, plan.control_plane_url, plan.admin_token,
                           {"tenant": tenant, "tokens_per_minute": tokens_per_minute})
    probe_key = await create_key(client, plan.control_plane_url, plan.admin_token, {"tenant": f"{tenant}-probe"})
    log(f"[stack] tenant {tenant}: {tokens_per_minute} tokens per minute; {replicas} ext_proc replicas on {redis_url}")
    data_dir = work_dir / "stack" / "control-plane-data"
    replicas_ = [ext_proc_component(i, ports.xds, redis_url, logs, data_dir) for i in range(replicas)]
    await group.start([component for component, _, _ in replicas_])
    stack = QuotaStack([f"127.0.0.1:{port}" for _, port, _ in replicas_],
                       [f"http://127.0.0.1:{metrics_port}" for _, _, metrics_port in replicas_], key,
                       ExtProcConfig.model_fields["pick_header"].default)
    for target in stack.targets:
        async with grpc.aio.insecure_channel(target) as channel:
            probe = Requests(channel, probe_key, clock, stack.pick_header)

            async def picked() -> bool:
                return (await probe.send(Sent(-1, 0, clock.now_ms()), b'{"input": "probe"}')).picked

            await wait_until(picked, READY_TIMEOUT_S, f"ext_proc at {target} to pick for the probe key", group)
    return stack
