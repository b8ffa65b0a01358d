"""Start one planned data plane inside a ``ProcessGroup`` and wait until it routes to every worker."""

from __future__ import annotations

import asyncio
import time
from typing import Sequence

import httpx

from ...report.exposition import sums_by_label
from ...processes import ProcessGroup
from . import DataPlanePlan
from .envoy_admin import healthy_hosts


class DataPlaneError(RuntimeError):
    """A data plane that could not be configured or did not become ready; the message says which and why."""


def pick_decisions(metrics_text: str) -> dict[str, int]:
    """ext_proc's decisions by pick policy (``inferlb_ext_proc_decisions_total{policy,endpoint}``, summed)."""
    return {policy: int(n) for policy, n in
            sums_by_label(metrics_text, "inferlb_ext_proc_decisions_total", "policy").items()}


def grpc_front(metrics_text: str) -> str | None:
    """The gRPC front ext_proc serves on (``inferlb_ext_proc_grpc_front{front}``), None when it does not say."""
    fronts = sums_by_label(metrics_text, "inferlb_ext_proc_grpc_front", "front")
    return next((front for front, value in fronts.items() if value), None)


async def _check_config(argv: Sequence[str], configuration: str) -> None:
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise DataPlaneError(f"{configuration}: config check {' '.join(argv)} failed:\n{out.decode(errors='replace')}")


async def _set_pick_policy(client: httpx.AsyncClient, plan: DataPlanePlan) -> None:
    response = await client.put(f"{plan.control_plane_url}/v1/policy", json={"pick": {"name": plan.pick_policy}},
                                headers={"Authorization": f"Bearer {plan.admin_token}"})
    if response.status_code != 200:
        raise DataPlaneError(f"{plan.configuration}: the control plane refused pick policy {plan.pick_policy!r}: "
                             f"{response.status_code} {response.text}")


async def _wait_hosts(client: httpx.AsyncClient, group: ProcessGroup, plan: DataPlanePlan,
                      expected: set[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        group.check_alive()
        try:
            response = await client.get(f"{plan.envoy_admin_url}/clusters")
            seen = healthy_hosts(response.text)
            if expected <= seen:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise DataPlaneError(f"{plan.configuration}: Envoy shows {sorted(seen)} healthy after {timeout_s:.0f}s, "
                         f"expected {sorted(expected)}")


async def start_data_plane(plan: DataPlanePlan, group: ProcessGroup, client: httpx.AsyncClient,
                           worker_ids: Sequence[str], ready_timeout_s: float = 30.0) -> None:
    """Write the plan's files, check them, start its stages in order, wait until every worker is routable."""
    for directory in plan.directories:
        directory.mkdir(parents=True, exist_ok=True)
    for path, text in plan.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if plan.check_argv:
        await _check_config(plan.check_argv, plan.configuration)
    for i, stage in enumerate(plan.stages):
        try:
            await group.start(stage)
        except RuntimeError as exc:
            raise DataPlaneError(f"{plan.configuration}: {exc}") from None
        if i == 0 and plan.pick_policy:
            await _set_pick_policy(client, plan)
    if plan.envoy_admin_url:
        await _wait_hosts(client, group, plan, set(worker_ids), ready_timeout_s)
