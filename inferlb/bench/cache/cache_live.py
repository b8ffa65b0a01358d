"""The live half of ``inferlb bench cache``: per mode (cache off and on) one fresh stack of simulated
workers, control plane, ext_proc and Envoy, the same closed-loop series and the same load sweep.

Both stacks stay up for the whole sweep and each rate is measured in both modes back to back (which
goes first alternates), so a busy spell on the host falls on both modes' figures for that rate rather
than on one mode's whole sweep: the ratio is what the bench judges. A mode's sweep stops at its first
rate that misses the SLO; the idle stack costs next to nothing meanwhile. Then each mode's crossing is
searched again in longer windows (``Crossing``), the modes taking turns.

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
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from .cache_report import (
    CachePlan,
    bracket,
    cache_counts,
    hit_ratio,
    latency_figures,
    meets,
    midpoint,
    repeat_work_share,
)
from ..routing.capacity import theoretical_capacity_rps
from ..stack.dataplanes import EXT_PROC_CACHE_ENV, DataPlanePlan
from ..fairness.fair_live import with_ext_proc_env
from ..load.loadgen import run_load
from ..processes import ProcessGroup
from ..routing.runner import CAPACITY_CONFIGURATION, Report, ScenarioRunner
from ..load.scenario import Fleet, Scenario, Workload, WorkerSpec
from ..load.texts import bodies_for, embeddings_body
from ..load.trace import Trace, build_trace

WORKER_CACHE_ENV = "INFERLB_WORKER_CACHE_MAX_BYTES"
CACHE_HEADER = "x-inferlb-cache"
HIT_TOKENS = 16  # the closed-loop series' body: one short sentence
HIT_SALT = 0  # the sweep's rates use salts 1.. (their fresh texts differ from the series' body)
CLIENT_GRACE_S = 5.0  # the client waits beyond Envoy's route timeout: Envoy's 504 comes first

Sweep = list[tuple[float, float, Trace, list[bytes]]]  # (load, rps, trace, bodies)
REFINE_SALT = 1 << 10  # the refinement's rates' fresh texts: past every sweep rate's salt (MAX_LOADS)


def cache_scenario(plan: CachePlan) -> Scenario:
    """The stack's scenario: the plan's simulated fleet and SLO, the default mix with the plan's repeats."""
    workload = Workload(repeat_rate=plan.repeat_rate, repeat_pool=plan.repeat_pool, repeat_zipf_s=plan.zipf_s)
    fleet = Fleet(workers=tuple(WorkerSpec(1.0, plan.slots) for _ in range(plan.workers)),
                  cost_scale=plan.cost_scale)
    return Scenario(name="cache", seed=plan.seed, duration_s=plan.duration_s, warmup_s=plan.warmup_s,
                    slo_s=plan.slo_s, request_timeout_s=plan.timeout_s, loads=(1.0,), slowdown=None,
                    workload=workload, fleet=fleet, configurations=(CAPACITY_CONFIGURATION,), pick_policy_loads=())


def _rate(plan: CachePlan, scenario: Scenario, rps: float, measured_s: float,
          salt: int) -> tuple[Trace, list[bytes]]:
    """One rate's trace (the warm-up, then ``measured_s``) and its bodies, fresh texts salted by ``salt``."""
    trace = build_trace(scenario.workload, rps, plan.warmup_s + measured_s, plan.seed)
    return trace, bodies_for(trace.tokens.tolist(), repeat_of=trace.repeat_of.tolist(), salt=salt)


def build_sweep(plan: CachePlan, scenario: Scenario, capacity_rps: float) -> Sweep:
    """Every rate's trace and bodies, built once for both modes."""
    return [(load, load * capacity_rps, *_rate(plan, scenario, load * capacity_rps, plan.duration_s, i))
            for i, load in enumerate(plan.loads(), 1)]


def refine_rate(plan: CachePlan, scenario: Scenario, capacity_rps: float, rps: float,
                salt: int) -> tuple[float, float, Trace, list[bytes]]:
    """One refinement rate: its load, rate, trace (``refine_duration_s`` measured) and bodies."""
    return (round(rps / capacity_rps, 4), rps, *_rate(plan, scenario, rps, plan.refine_duration_s, REFINE_SALT + salt))


Measure = Callable[[float, int], Awaitable[dict[str, Any] | None]]  # (rps, salt) -> its point; None: failed


class Crossing:
    """One mode's search for its SLO crossing, in long windows: first the sweep's bracket is confirmed (its
    last rate met and first missed were measured in short windows, whose p99 swings with the trace: an end
    that disagrees moves the bracket a step that way, at most ``MAX_MOVES`` times), then it is bisected."""

    MAX_MOVES = 2

    def __init__(self, low_rps: float, high_rps: float, step: float, bisections: int) -> None:
        self.low, self.high, self.step = low_rps, high_rps, step
        self.high_confirmed = self.low_confirmed = False
        self.moves = 0
        self.bisections = bisections

    def next_rate(self) -> float | None:
        """The rate to measure next; None when the search is over."""
        if not self.high_confirmed:
            return self.high
        if not self.low_confirmed:
            return self.low
        return midpoint(self.low, self.high) if self.bisections > 0 else None

    def record(self, rps: float, met: bool) -> None:
        """What the rate ``next_rate`` gave showed."""
        if not self.high_confirmed:
            if met and self.moves < self.MAX_MOVES:  # the short window missed here by chance: look one step up
                self.low, self.high, self.low_confirmed = rps, rps * self.step, True
                self.moves += 1
            else:
                self.high_confirmed = True
                if met:  # out of moves: a confirmed met rate is still a lower bound
                    self.low, self.low_confirmed = rps, True
        elif not self.low_confirmed:
            if not met and self.moves < self.MAX_MOVES:  # met in the sweep by chance: look one step down
                self.low, self.high = rps / self.step, rps
                self.moves += 1
            else:
                self.low_confirmed = True
        else:
            self.bisections -= 1
            self.low, self.high = (rps, self.high) if met else (self.low, rps)


async def search_crossings(brackets: Mapping[str, tuple[float, float]], measure: Mapping[str, Measure], steps: int,
                           slo_s: float, step: float) -> dict[str, list[dict[str, Any]]]:
    """Per mode, its crossing searched (``Crossing``: the bracket confirmed, then ``steps`` bisections) with
    ``measure``. The modes take turns, one rate each, as the sweep's rates do (a busy spell on the host
    falls on both). A mode whose measurement failed (None) stops there."""
    points: dict[str, list[dict[str, Any]]] = {mode: [] for mode in brackets}
    searches = {mode: Crossing(low, high, step, steps) for mode, (low, high) in brackets.items()}
    salt = 0
    while searches:
        for mode, search in list(searches.items()):
            rps = search.next_rate()
            point = await measure[mode](rps, salt) if rps is not None else None
            salt += 1
            if point is None:
                del searches[mode]
                continue
            points[mode].append(point)
            search.record(rps, meets(point, slo_s))
    return points


class CacheRunner(ScenarioRunner):
    """One mode's stack: started, its closed-loop series, then one rate at a time as ``run_cache`` asks."""

    def __init__(self, plan: CachePlan, out_dir: Path, *, cache: bool, report: Report) -> None:
        super().__init__(cache_scenario(plan), out_dir, plans=(), progress=False, report=report)
        self.plan = plan
        self.cache = cache
        if not cache:
            self.worker_env = {WORKER_CACHE_ENV: "0"}
        self.group: ProcessGroup | None = None
        self.dp: DataPlanePlan | None = None
        self._processes = contextlib.AsyncExitStack()

    @property
    def mode(self) -> str:
        return "on" if self.cache else "off"

    async def start(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """Start the stack (``stop`` stops it) and run the closed-loop series."""
        self._log.parent.mkdir(parents=True, exist_ok=True)
        size = self.plan.cache_max_bytes if self.cache else 0
        self.dp = with_ext_proc_env(self._plan(CAPACITY_CONFIGURATION), {EXT_PROC_CACHE_ENV: str(size)})
        self.group = await self._processes.enter_async_context(ProcessGroup(report=self._log_line))
        await self._start(self.group, self.dp, client)
        series = await self._series(self.dp)
        self.group.check_alive()
        return series

    async def stop(self) -> None:
        """Stop every process of the stack (again: nothing)."""
        await self._processes.aclose()

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

    async def measure(self, client: httpx.AsyncClient, load: float, rps: float, trace: Trace,
                      bodies: list[bytes], refining: bool = False) -> dict[str, Any]:
        """One rate of the sweep (or of the refinement), from idle workers; its figures and the hits ext_proc
        counted over it."""
        plan, group, dp = self.plan, self.group, self.dp
        assert group is not None and dp is not None and dp.ext_proc_metrics_url is not None
        metrics_url = f"{dp.ext_proc_metrics_url}/metrics"
        await self._wait_idle(client, group)
        before = cache_counts((await client.get(metrics_url)).text)
        outcome = await run_load(dp.url, trace, bodies, slo_s=plan.slo_s, timeout_s=plan.timeout_s + CLIENT_GRACE_S,
                                 warmup_s=plan.warmup_s, progress=False)
        group.check_alive()
        after = cache_counts((await client.get(metrics_url)).text)
        s = outcome.histogram.summary()
        measured = trace.window(plan.warmup_s)
        fleet = self.scenario.fleet
        share = repeat_work_share(trace.tokens[measured], trace.repeat_of[measured], fleet.fixed_s, fleet.per_token_s)
        point = {"load": load, "rps": round(rps, 2), "measured_s": round(trace.duration_s - plan.warmup_s, 1),
                 "sent": outcome.sent, "completed": outcome.completed,
                 "errors": outcome.errors, "timeouts": outcome.timeouts, "p50_s": round(s.p50_s, 4),
                 "p99_s": round(s.p99_s, 4), "hit_ratio": hit_ratio(before, after), "repeat_work_share": share,
                 "statuses": {str(k): v for k, v in sorted(outcome.statuses.items())},
                 "client_cpu_s": round(outcome.client_cpu_s, 2), "send_lag_p99_s": round(outcome.send_lag_p99_s, 4)}
        hits = f", hits {point['hit_ratio']:.0%}" if point["hit_ratio"] is not None else ""
        self.report(f"  cache {self.mode}: {load:.2f} x capacity = {rps:.1f} req/s: p99 "
                    f"{s.p99_s * 1e3:.0f} ms, {outcome.errors} errors, {outcome.timeouts} timeouts{hits}: "
                    + ("met" if meets(point, plan.slo_s) else
                       "missed the SLO" if refining else "missed the SLO, its sweep stops"))
        return point


async def run_cache(plan: CachePlan, out: Path, report: Report) -> dict[str, Any]:
    """Both stacks up, the series in each, then every rate off and on back to back until both modes have
    missed the SLO; a mode that fails is recorded and the other goes on."""
    scenario = cache_scenario(plan)
    capacity = theoretical_capacity_rps(scenario)
    sweep = await asyncio.to_thread(build_sweep, plan, scenario, capacity)
    runners = [CacheRunner(plan, out / f"cache-{mode}", cache=mode == "on", report=report) for mode in ("off", "on")]
    run = _CacheRun(plan, scenario, capacity, runners, report)
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client, contextlib.AsyncExitStack() as stack:
        await run.start(client, stack)
        await run.sweep(client, sweep)
        await run.refine(client)
    return {"capacity_rps": round(capacity, 2), "capacity_source": "the simulated workers' cost model",
            "plan": dataclasses.asdict(plan), **run.modes, "failures": run.failures}


class _CacheRun:
    """One ``run_cache``'s state and steps: each mode's figures and failures, the stacks still sweeping
    (``active``) and those kept up, idle, for the refinement (``swept``)."""

    def __init__(self, plan: CachePlan, scenario: Scenario, capacity: float, runners: list[CacheRunner],
                 report: Report) -> None:
        from ..processes import ComponentDied
        from ..stack.dataplanes.launch import DataPlaneError

        self.errors = (DataPlaneError, ComponentDied, RuntimeError, TimeoutError, httpx.HTTPError)  # a mode's end
        self.plan, self.scenario, self.capacity, self.runners, self.report = plan, scenario, capacity, runners, report
        self.modes: dict[str, Any] = {
            r.mode: {"cache": r.cache, "ext_proc_cache_max_bytes": plan.cache_max_bytes if r.cache else 0,
                     "hit_series": {"requests": 0, "hits": 0}, "sweep": [], "refine": []} for r in runners}
        self.failures: list[dict[str, str]] = []
        self.active: list[CacheRunner] = []
        self.swept: list[CacheRunner] = []  # stacks kept up for the refinement

    def fail(self, runner: CacheRunner, exc: BaseException) -> None:
        self.report(f"  FAILED: cache {runner.mode}: {exc}")
        self.failures.append({"mode": runner.mode, "error": str(exc)})

    async def done(self, runner: CacheRunner, failed: bool = False) -> None:
        """``runner``'s sweep is over: its stack stops (the host is the other mode's), or waits for the
        refinement."""
        self.active.remove(runner)
        if failed or not self.plan.refine_steps:
            await runner.stop()
        else:
            self.swept.append(runner)

    async def start(self, client: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> None:
        """Each mode's fresh stack and its series of repeats (the hit rate); stopped on the way out."""
        for index, runner in enumerate(self.runners, 1):
            stack.push_async_callback(runner.stop)  # also on errors and interrupts
            self.report(f"[{index}/2] cache {runner.mode}: a fresh stack")
            try:
                self.modes[runner.mode]["hit_series"] = await runner.start(client)
                self.active.append(runner)
            except self.errors as exc:
                self.fail(runner, exc)
                await runner.stop()

    async def sweep(self, client: httpx.AsyncClient, sweep: Sweep) -> None:
        """Each rate in each active mode, in alternating order, until every mode has missed the SLO."""
        self.report("the sweep: each rate off and on back to back")
        for i, (load, rps, trace, bodies) in enumerate(sweep):
            if not self.active:
                break
            for runner in (list(self.active) if i % 2 == 0 else self.active[::-1]):  # done() shrinks active
                try:
                    point = await runner.measure(client, load, rps, trace, bodies)
                except self.errors as exc:
                    self.fail(runner, exc)
                    await self.done(runner, failed=True)
                    continue
                self.modes[runner.mode]["sweep"].append(point)
                if not meets(point, self.plan.slo_s):
                    await self.done(runner)

    async def refine(self, client: httpx.AsyncClient) -> None:
        """Each swept mode's crossing of the SLO: its last rate met and first missed again, then bisected."""
        plan = self.plan
        brackets = {r.mode: b for r in self.swept
                    if (b := bracket(self.modes[r.mode]["sweep"], plan.slo_s)) is not None}
        if not brackets:
            return
        self.report(f"the refinement, {plan.refine_duration_s:g} s per rate: each mode's last rate met and first "
                    f"missed measured again, then its crossing bisected {plan.refine_steps} times")
        by_mode = {r.mode: r for r in self.swept}
        await search_crossings(brackets, {m: self._measurer(client, by_mode[m]) for m in brackets},
                               plan.refine_steps, plan.slo_s, plan.load_step)

    def _measurer(self, client: httpx.AsyncClient, runner: CacheRunner) -> Measure:
        """One refinement point in ``runner``'s mode at a given rate; None once the mode failed."""
        async def measure(rps: float, salt: int) -> dict[str, Any] | None:
            load, rps, trace, bodies = await asyncio.to_thread(refine_rate, self.plan, self.scenario, self.capacity,
                                                               rps, salt)
            try:
                point = await runner.measure(client, load, rps, trace, bodies, refining=True)
            except self.errors as exc:
                self.fail(runner, exc)
                await runner.stop()
                return None
            self.modes[runner.mode]["refine"].append(point)
            return point
        return measure
