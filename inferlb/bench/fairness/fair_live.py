"""The live half of ``inferlb bench fair``: per mode (fair queue on, then off) one fresh stack, two tenants'
keys issued on its admin API, and each scenario's two open-loop loads sent side by side (see ``fair.py``).

Served tokens come from ext_proc's own exact count,
``inferlb_ext_proc_tenant_tokens_total{tenant,outcome="served"}``, read when the measured window opens and
when it closes: the tokens of the 2xx answers that finished inside it, while both tenants were offering
their load. Offered tokens are the traces' (each body's token count is exact by construction).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from ..routing.capacity import mean_tokens, theoretical_capacity_rps
from ..stack.dataplanes import DataPlanePlan
from ..ext_proc_bench.stack import wait_until
from .fair_plan import SCENARIOS, TENANTS, FairPlan
from .fair_report import add_shares, tenant_figures
from ..load.loadgen import run_load
from .overload_live import live_class_figures
from ..processes import ProcessGroup
from ..quota.quota_accuracy import replica_figures
from ..quota.quota_accuracy_stack import create_key
from ..routing.runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner
from ..load.scenario import Fleet, Scenario, WorkerSpec
from ..load.texts import bodies_for, embeddings_body
from ..load.trace import Trace, build_trace

DEPTH_ENV = "INFERLB_EXT_PROC_FAIR_QUEUE_DEPTH"
KEYS_TIMEOUT_S = 30.0  # for ext_proc to receive the key table over xDS
PROGRESS_EVERY_S = 15.0
CLIENT_GRACE_S = 5.0  # the client waits this much beyond Envoy's route timeout: Envoy's 504 comes first

Traces = Mapping[str, Mapping[str, tuple[Trace, list[bytes]]]]  # scenario -> tenant -> (trace, bodies)


def fair_scenario(plan: FairPlan) -> Scenario:
    """The bench scenario the stack is built from: the plan's fleet, its timings, the default request mix."""
    return Scenario(name="fair", seed=plan.seed, duration_s=plan.duration_s, warmup_s=plan.warmup_s,
                    slo_s=plan.timeout_s, request_timeout_s=plan.timeout_s, loads=(1.0,), slowdown=None,
                    fleet=Fleet(workers=tuple(WorkerSpec(1.0, plan.slots) for _ in range(plan.workers))),
                    configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


def capacity_tps(plan: FairPlan, scenario: Scenario) -> tuple[float, str]:
    """Tokens per second at 100%: the plan's, or the simulated fleet's model (every slot always busy)."""
    if plan.capacity_tps > 0:
        return plan.capacity_tps, "given"
    return theoretical_capacity_rps(scenario) * mean_tokens(scenario), "the simulated workers' cost model"


def tenant_rates(plan: FairPlan, scenario: Scenario, capacity: float) -> dict[str, dict[str, float]]:
    """Requests per second each tenant offers in each scenario (scenario -> tenant -> rate)."""
    rps_per_load = capacity / mean_tokens(scenario)
    return {name: {tenant: plan.load * fraction * rps_per_load for tenant, fraction in zip(TENANTS, SCENARIOS[name])}
            for name in plan.scenarios}


def tenant_traces(plan: FairPlan, scenario: Scenario, capacity: float) -> Traces:
    """Each scenario's two traces (tenant ``i`` seeded ``seed + i``), the same for both modes."""
    out: dict[str, dict[str, tuple[Trace, list[bytes]]]] = {}
    for name, rates in tenant_rates(plan, scenario, capacity).items():
        out[name] = {}
        for i, (tenant, rps) in enumerate(rates.items()):
            trace = build_trace(scenario.workload, rps, plan.warmup_s + plan.duration_s, plan.seed + i)
            out[name][tenant] = (trace, bodies_for(trace.tokens.tolist()))
    return out


def with_ext_proc_env(plan: DataPlanePlan, env: Mapping[str, str]) -> DataPlanePlan:
    """``plan`` with ``env`` added to its ext_proc's environment."""
    stages = tuple(tuple(dataclasses.replace(c, env={**c.env, **env}) if c.name == "ext_proc" else c for c in stage)
                   for stage in plan.stages)
    return dataclasses.replace(plan, stages=stages)


async def served(client: httpx.AsyncClient, metrics_url: str, tenants: Mapping[str, Any]) -> dict[str, tuple[float,
                                                                                                              float]]:
    """ext_proc's (tokens, requests) served so far, per tenant."""
    figures = await asyncio.gather(*(replica_figures(client, metrics_url, t) for t in tenants))
    return {t: (f["tenant_tokens"].get("served", 0), f["tenant_requests"].get("served", 0))
            for t, f in zip(tenants, figures)}


class FairRunner(ScenarioRunner):
    """One mode's stack (the scenario runner's fleet and data plane), its keys, its scenario runs."""

    def __init__(self, plan: FairPlan, out_dir: Path, *, fair_queue: bool, report: Report) -> None:
        super().__init__(fair_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.plan = plan
        self.fair_queue = fair_queue

    @property
    def mode(self) -> str:
        return "on" if self.fair_queue else "off"

    async def runs(self, client: httpx.AsyncClient, traces: Traces, capacity: float) -> list[dict[str, Any]]:
        """Start the stack, issue the keys, run every scenario; everything is stopped on the way out."""
        self._log.parent.mkdir(parents=True, exist_ok=True)
        depth = self.plan.fair_queue_depth if self.fair_queue else 0
        dp = with_ext_proc_env(self._plan(CAPACITY_CONFIGURATION), {DEPTH_ENV: str(depth)})
        assert dp.control_plane_url is not None and dp.admin_token is not None and dp.ext_proc_metrics_url
        out = []
        async with ProcessGroup(report=self._log_line) as group:
            await self._start(group, dp, client)
            keys = {}
            for tenant, weight in zip(TENANTS, self.plan.weights):
                keys[tenant] = await create_key(client, dp.control_plane_url, dp.admin_token,
                                                {"tenant": tenant, "weight": float(weight)})
            await self._wait_for_keys(client, group, dp, keys)
            self.report(f"  fair queue {self.mode} (fair_queue_depth {depth}): keys issued for "
                        + ", ".join(f"{t} (weight {w:g})" for t, w in zip(TENANTS, self.plan.weights)))
            for name in self.plan.scenarios:
                out.append(await self._scenario(client, group, dp, keys, name, traces[name], capacity))
        return out

    async def _wait_for_keys(self, client: httpx.AsyncClient, group: ProcessGroup, dp: DataPlanePlan,
                             keys: Mapping[str, str]) -> None:
        """Until ext_proc counts a probe request through Envoy under each tenant (it has the key table)."""
        assert dp.ext_proc_metrics_url is not None
        body = embeddings_body(8)
        for tenant, key in keys.items():
            async def counted(tenant: str = tenant, key: str = key) -> bool:
                await client.post(dp.url, content=body, headers={"content-type": "application/json",
                                                                 "authorization": f"Bearer {key}"})
                figures = await replica_figures(client, dp.ext_proc_metrics_url, tenant)
                return bool(figures["tenant_requests"])

            await wait_until(counted, KEYS_TIMEOUT_S, f"ext_proc to know tenant {tenant}'s key", group)

    async def _scenario(self, client: httpx.AsyncClient, group: ProcessGroup, dp: DataPlanePlan,
                        keys: Mapping[str, str], name: str, traces: Mapping[str, tuple[Trace, list[bytes]]],
                        capacity: float) -> dict[str, Any]:
        plan = self.plan
        assert dp.ext_proc_metrics_url is not None
        await self._wait_idle(client, group)
        offers = ", ".join(f"{t} {float(tr.tokens.sum()) / tr.duration_s:.0f} tokens/s" for t, (tr, _) in
                           traces.items())
        self.report(f"  {name}, fair queue {self.mode}: {offers} for {plan.warmup_s:g} s warm-up + "
                    f"{plan.duration_s:g} s")
        loads = [run_load(dp.url, trace, bodies, slo_s=plan.timeout_s, timeout_s=plan.timeout_s + CLIENT_GRACE_S,
                          warmup_s=plan.warmup_s, progress=False, headers={"authorization": f"Bearer {keys[t]}"})
                 for t, (trace, bodies) in traces.items()]
        window = asyncio.ensure_future(self._window(client, dp.ext_proc_metrics_url, keys))
        try:
            outcomes = await asyncio.gather(*loads)
            start, end = await window
        finally:
            window.cancel()
        group.check_alive()
        tenants = {}
        for (tenant, (trace, _)), outcome, weight in zip(traces.items(), outcomes, plan.weights):
            offered = int(trace.tokens[trace.window(plan.warmup_s)].sum())
            tenants[tenant] = tenant_figures(
                weight=weight, offered_tokens=offered, served_tokens=end[tenant][0] - start[tenant][0],
                served_requests=end[tenant][1] - start[tenant][1], window_s=plan.duration_s, capacity_tps=capacity,
                load=live_class_figures(outcome))
        add_shares(tenants, self.fair_queue)
        total = sum(t["served_tps"] for t in tenants.values())
        self.report(f"    served {total:.0f} tokens/s: " + ", ".join(
            f"{t} {f['served_share']:.1%} (expected {f['expected_share']:.1%}), {f['rejected_429']} 429s"
            for t, f in tenants.items()))
        return {"scenario": name, "fair_queue": self.fair_queue,
                "fair_queue_depth": plan.fair_queue_depth if self.fair_queue else 0,
                "served_tps": round(total, 1), "served_of_capacity": round(total / capacity, 4), "tenants": tenants}

    async def _window(self, client: httpx.AsyncClient, metrics_url: str,
                      tenants: Mapping[str, Any]) -> tuple[dict[str, tuple[float, float]], ...]:
        """ext_proc's served counts when the measured window opens and when it closes, with a progress line
        every ``PROGRESS_EVERY_S`` in between (the loads run meanwhile: these are scheduled reads)."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        opens, closes = t0 + self.plan.warmup_s, t0 + self.plan.warmup_s + self.plan.duration_s
        await asyncio.sleep(max(0.0, opens - loop.time()))
        start = await served(client, metrics_url, tenants)
        while loop.time() + PROGRESS_EVERY_S < closes:
            await asyncio.sleep(PROGRESS_EVERY_S)
            now = await served(client, metrics_url, tenants)
            spent = loop.time() - opens
            self.report(f"    {spent:.0f} s in: served " + ", ".join(
                f"{t} {(now[t][0] - start[t][0]) / spent:.0f} tokens/s" for t in tenants))
        await asyncio.sleep(max(0.0, closes - loop.time()))
        return start, await served(client, metrics_url, tenants)


async def run_fair(plan: FairPlan, out: Path, report: Report) -> dict[str, Any]:
    """Both modes, fair queue on first; a mode that fails is recorded and the other still runs."""
    from ..stack.dataplanes.launch import DataPlaneError
    from ..processes import ComponentDied

    scenario = fair_scenario(plan)
    capacity, source = capacity_tps(plan, scenario)
    traces = await asyncio.to_thread(tenant_traces, plan, scenario, capacity)
    runs: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for index, fair_queue in enumerate((True, False), 1):
            runner = FairRunner(plan, out / ("fair-queue-on" if fair_queue else "fair-queue-off"),
                                fair_queue=fair_queue, report=report)
            report(f"[{index}/2] fair queue {runner.mode}: a fresh stack")
            try:
                runs += await runner.runs(client, traces, capacity)
            except (DataPlaneError, ComponentDied, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                report(f"  FAILED: fair queue {runner.mode}: {exc}")
                failures.append({"mode": runner.mode, "error": str(exc)})
    return {"capacity_tps": round(capacity, 1), "capacity_source": source, "runs": runs, "failures": failures}
