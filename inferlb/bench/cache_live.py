"""The live half of ``inferlb bench cache``: per mode (cache off, then on) one fresh stack of simulated
workers, control plane, ext_proc and Envoy, the same load sweep and the same closed-loop series.

Off means both levels' ``cache_max_bytes`` are 0 (ext_proc's and the workers'); on, ext_proc's is the
plan's and the workers keep their default. The sweep's traces have the plan's repeats; each rate's
fresh texts are its own (``bodies_for``'s salt), so a rate is not answered from an earlier rate's
texts, and both modes replay the very same bodies. Which answers were hits is ext_proc's own count
(``inferlb_ext_proc_cache_requests_total``) over each rate, and the ``x-inferlb-cache`` header in the
closed-loop series. Simulated workers have no worker cache to speak of: the gateway cache is what
this bench measures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

import httpx

from .cache_report import CachePlan, cache_counts, hit_ratio, latency_figures, meets, repeat_work_share
from .capacity import theoretical_capacity_rps
from .dataplanes import EXT_PROC_CACHE_ENV, DataPlanePlan
from .fair_live import with_ext_proc_env
from .loadgen import run_load
from .processes import ProcessGroup
from .runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner
from .scenario import Fleet, Scenario, Workload, WorkerSpec
from .texts import bodies_for, embeddings_body
from .trace import Trace, build_trace

WORKER_CACHE_ENV = "INFERLB_WORKER_CACHE_MAX_BYTES"
CACHE_HEADER = "x-inferlb-cache"
HIT_TOKENS = 16  # the closed-loop series' body: one short sentence
HIT_SALT = 0  # the sweep's rates use salts 1.. (their fresh texts differ from the series' body)
CLIENT_GRACE_S = 5.0  # the client waits beyond Envoy's route timeout: Envoy's 504 comes first

Sweep = list[tuple[float, float, Trace, list[bytes]]]  # (load, rps, trace, bodies)


def cache_scenario(plan: CachePlan) -> Scenario:
    """The stack's scenario: the plan's simulated fleet and SLO, the default mix with the plan's repeats."""
    workload = Workload(repeat_rate=plan.repeat_rate, repeat_pool=plan.repeat_pool, repeat_zipf_s=plan.zipf_s)
    fleet = Fleet(workers=tuple(WorkerSpec(1.0, plan.slots) for _ in range(plan.workers)),
                  cost_scale=plan.cost_scale)
    return Scenario(name="cache", seed=plan.seed, duration_s=plan.duration_s, warmup_s=plan.warmup_s,
                    slo_s=plan.slo_s, request_timeout_s=plan.timeout_s, loads=(1.0,), slowdown=None,
                    workload=workload, fleet=fleet, configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


def build_sweep(plan: CachePlan, scenario: Scenario, capacity_rps: float) -> Sweep:
    """Every rate's trace and bodies, built once for both modes."""
    out: Sweep = []
    for i, load in enumerate(plan.loads(), 1):
        rps = load * capacity_rps
        trace = build_trace(scenario.workload, rps, plan.warmup_s + plan.duration_s, plan.seed)
        out.append((load, rps, trace, bodies_for(trace.tokens.tolist(), repeat_of=trace.repeat_of.tolist(),
                                                 salt=i)))
    return out


class CacheRunner(ScenarioRunner):
    """One mode's stack: the closed-loop series, then the sweep up to the first rate that misses the SLO."""

    def __init__(self, plan: CachePlan, out_dir: Path, *, cache: bool, report: Report) -> None:
        super().__init__(cache_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.plan = plan
        self.cache = cache
        if not cache:
            self.worker_env = {WORKER_CACHE_ENV: "0"}

    @property
    def mode(self) -> str:
        return "on" if self.cache else "off"

    async def run(self, client: httpx.AsyncClient, sweep: Sweep) -> dict[str, Any]:
        """Start the stack, measure, stop everything (also on errors)."""
        self._log.parent.mkdir(parents=True, exist_ok=True)
        size = self.plan.cache_max_bytes if self.cache else 0
        dp = with_ext_proc_env(self._plan(CAPACITY_CONFIGURATION), {EXT_PROC_CACHE_ENV: str(size)})
        async with ProcessGroup(report=self._log_line) as group:
            await self._start(group, dp, client)
            series = await self._series(dp)
            group.check_alive()
            points = await self._sweep(client, group, dp, sweep)
        return {"cache": self.cache, "ext_proc_cache_max_bytes": size, "hit_series": series, "sweep": points}

    async def _series(self, dp: DataPlanePlan) -> dict[str, Any]:
        """One body sent back to back: ``hit_warmup`` requests, then ``hit_requests`` timed ones."""
        import aiohttp

        plan = self.plan
        body = embeddings_body(HIT_TOKENS, HIT_SALT)
        latencies: list[float] = []
        caches: list[str | None] = []
        timeout = aiohttp.ClientTimeout(total=plan.timeout_s + CLIENT_GRACE_S)
        async with aiohttp.ClientSession(timeout=timeout, skip_auto_headers=("User-Agent",)) as session:
            for i in range(plan.hit_warmup + plan.hit_requests):
                started = time.perf_counter()
                try:
                    async with session.post(dp.url, data=body, headers={"content-type": "application/json"}) as r:
                        await r.read()
                        status, cache = r.status, r.headers.get(CACHE_HEADER)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise RuntimeError(f"the closed-loop series failed (cache {self.mode}): {exc!r}") from exc
                elapsed = time.perf_counter() - started
                if status != 200:
                    raise RuntimeError(f"the closed-loop series got HTTP {status} (cache {self.mode})")
                if i >= plan.hit_warmup:
                    latencies.append(elapsed)
                    caches.append(cache)
        figures = latency_figures(latencies, caches)
        p50 = figures.get("hit_p50_ms")
        self.report(f"  cache {self.mode}: one body {plan.hit_requests} times: {figures['hits']} hits"
                    + (f", hit p50 {p50:.2f} ms" if p50 is not None else "")
                    + f", all p50 {figures['all_p50_ms']:.2f} ms")
        return figures

    async def _sweep(self, client: httpx.AsyncClient, group: ProcessGroup, dp: DataPlanePlan,
                     sweep: Sweep) -> list[dict[str, Any]]:
        plan = self.plan
        assert dp.ext_proc_metrics_url is not None
        metrics_url = f"{dp.ext_proc_metrics_url}/metrics"
        points = []
        for load, rps, trace, bodies in sweep:
            await self._wait_idle(client, group)
            before = cache_counts((await client.get(metrics_url)).text)
            outcome = await run_load(dp.url, trace, bodies, slo_s=plan.slo_s,
                                     timeout_s=plan.timeout_s + CLIENT_GRACE_S, warmup_s=plan.warmup_s,
                                     progress=False)
            group.check_alive()
            after = cache_counts((await client.get(metrics_url)).text)
            s = outcome.histogram.summary()
            measured = trace.window(plan.warmup_s)
            fleet = self.scenario.fleet
            share = repeat_work_share(trace.tokens[measured], trace.repeat_of[measured], fleet.fixed_s,
                                      fleet.per_token_s)
            point = {"load": load, "rps": round(rps, 2), "sent": outcome.sent, "completed": outcome.completed,
                     "errors": outcome.errors, "timeouts": outcome.timeouts, "p50_s": round(s.p50_s, 4),
                     "p99_s": round(s.p99_s, 4), "hit_ratio": hit_ratio(before, after), "repeat_work_share": share,
                     "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
                     "client_cpu_s": round(outcome.client_cpu_s, 2), "send_lag_p99_s": round(outcome.send_lag_p99_s, 4)}
            points.append(point)
            ok = meets(point, plan.slo_s)
            hits = f", hits {point['hit_ratio']:.0%}" if point["hit_ratio"] is not None else ""
            self.report(f"  cache {self.mode}: {load:.2f} x capacity = {rps:.1f} req/s: p99 "
                        f"{s.p99_s * 1e3:.0f} ms, {outcome.errors} errors, {outcome.timeouts} timeouts{hits}: "
                        + ("met" if ok else "missed the SLO, the sweep stops"))
            if not ok:
                break
        return points


async def run_cache(plan: CachePlan, out: Path, report: Report) -> dict[str, Any]:
    """Both modes, cache off first, on the same traces; a mode that fails is recorded and the other still runs."""
    from .dataplanes.launch import DataPlaneError
    from .processes import ComponentDied

    scenario = cache_scenario(plan)
    capacity = theoretical_capacity_rps(scenario)
    sweep = await asyncio.to_thread(build_sweep, plan, scenario, capacity)
    modes: dict[str, Any] = {}
    failures: list[dict[str, str]] = []
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for index, cache in enumerate((False, True), 1):
            runner = CacheRunner(plan, out / f"cache-{'on' if cache else 'off'}", cache=cache, report=report)
            report(f"[{index}/2] cache {runner.mode}: a fresh stack")
            try:
                modes[runner.mode] = await runner.run(client, sweep)
            except (DataPlaneError, ComponentDied, RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                report(f"  FAILED: cache {runner.mode}: {exc}")
                failures.append({"mode": runner.mode, "error": str(exc)})
                modes[runner.mode] = {"cache": cache, "hit_series": {"requests": 0, "hits": 0}, "sweep": []}
    return {"capacity_rps": round(capacity, 2), "capacity_source": "the simulated workers' cost model",
            "plan": dataclasses.asdict(plan), **modes, "failures": failures}
