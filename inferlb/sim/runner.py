"""One simulated run (configuration x load) from a scenario, and its figures as a ``RunResult``.

The run replays ``build_trace(workload, load * capacity, warmup + duration,
seed)``, the very trace the live bench sends for that load, and measures the
requests scheduled after the warm-up, like the bench's load generator:
latency from the scheduled send time to completion, plus the scenario's
constant hop (and ext_proc) overhead, a timeout when that exceeds ``request_timeout_s``. The slowdown
run multiplies one worker's speed by ``slowdown.factor`` at ``slowdown.at_s``
seconds into the measured window (after the warm-up), as the bench does, and
restores it ``slowdown.duration_s`` later when that is set.

With a class mix (``workload.classes``) each request gets its class as the
live overload bench sends it (``inferlb.bench.load.classes``), the workers' queues
order by class as the workers order theirs (``workers/queue_order.py``), ext_proc sheds by the scenario's ``shed_slo_ms``, and the
result's ``extra["classes"]`` holds each class's figures. A shed request is a
non-2xx answer (an error, as the live load generator counts a 429), answered
after the hop and ext_proc overhead.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from inferlb.bench.routing.capacity import theoretical_capacity_rps
from inferlb.bench.load.classes import is_mixed, trace_classes
from inferlb.bench.report.histogram import LatencyHistogram
from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import CONFIGURATIONS, PICK_PREFIX, Scenario
from inferlb.bench.load.trace import build_trace
from inferlb_runtime.request_class import Priority
from workers.queue_order import QueueOrder

from .balancers import (
    CswrrOrca,
    CswrrParams,
    LeastRequest,
    NginxLeastConn,
    RoundRobin,
    WeightedLeastRequest,
)
from .engine import SHED, Balancer, Clock, Engine
from .ext_proc_model import ExtProcBalancer
from .fleet import LOAD_SAMPLE_PERIOD_S, SimFleet
from .oracles import ORACLES, Oracle, is_oracle
from .weights import ControlPlaneModel

STEADY, SLOWDOWN = "steady", "slowdown"


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the models that the scenario file does not hold."""

    cswrr: CswrrParams = field(default_factory=CswrrParams)
    push_delay_s: float = 0.1  # control plane debounce between a scrape and EDS reaching the data plane
    shed_queue_model: Literal["priority", "fifo"] | None = None  # the shed plugin's (None: its default)
    fair_queue_depth: int = 0  # ext_proc's fair admission gate (0: not modelled, every request routed on arrival)


def capacity_rps(scenario: Scenario) -> float:
    """Requests/s at load 1.0: the scenario's, else the fleet's theoretical throughput (sum of speed x slots
    over the mean service time). The live bench searches for it instead (p99 crossing the SLO)."""
    if scenario.capacity_rps > 0:
        return scenario.capacity_rps
    return theoretical_capacity_rps(scenario)


def _uses_ext_proc(configuration: str) -> bool:
    return configuration == "inferlb_ext_proc" or configuration.startswith(PICK_PREFIX)


def _seed(scenario: Scenario, configuration: str, load: float, run: str) -> int:
    """A balancer's random stream: fixed per (scenario seed, configuration, load, run), so runs replay."""
    text = f"{scenario.seed}|{configuration}|{load:.6f}|{run}"
    return int.from_bytes(text.encode(), "little") % (1 << 61)


def shedding_params(slo_ms: float, queue_model: str | None) -> dict[str, Any]:
    """The pick policy's params for shedding at ``slo_ms``: the preset's own ``slo_ms``, or (another
    ``queue_model``) the ``shed`` plugin named in its ``admit`` list with that model, as an operator would."""
    if queue_model is None or not slo_ms > 0:
        return {"slo_ms": slo_ms}
    return {"slo_ms": 0, "admit": [{"plugin": "shed", "params": {"slo_ms": slo_ms, "queue_model": queue_model}}]}


def build_balancer(configuration: str, scenario: Scenario, fleet: SimFleet, engine_at: Callable, clock: Clock,
                   rng: random.Random, options: SimOptions) -> Balancer:
    """The data plane named ``configuration`` over ``fleet``; the control-plane loop scheduled where needed."""
    if configuration == "envoy_round_robin":
        return RoundRobin(fleet, rng)
    if configuration == "envoy_least_request":
        return LeastRequest(fleet, rng)
    if configuration == "nginx_least_conn":
        return NginxLeastConn(fleet, rng)
    if configuration == "envoy_cswrr_orca":
        return CswrrOrca(fleet, rng, options.cswrr)
    if is_oracle(configuration):
        return Oracle(fleet, configuration)
    if configuration == "inferlb_weights":
        balancer: Any = WeightedLeastRequest(fleet, rng)
        balancer.name = configuration
        on_weights = lambda weights, telemetry: balancer.set_weights(weights)
    elif _uses_ext_proc(configuration):
        policy = configuration[len(PICK_PREFIX):] if configuration.startswith(PICK_PREFIX) else None
        ids = tuple(f"127.0.0.1:{8101 + i}" for i in range(len(fleet)))
        kwargs = {"policy": policy} if policy else {}
        balancer = ExtProcBalancer(fleet, rng, ids, scenario.ext_proc_replicas, clock,
                                   params=shedding_params(scenario.shed_slo_ms, options.shed_queue_model),
                                   inputs_per_request=scenario.workload.inputs_per_request,
                                   fair_queue_depth=options.fair_queue_depth, **kwargs)
        balancer.name = configuration
        on_weights = balancer.set_eds
    else:
        raise ValueError(f"unknown configuration {configuration!r}; known: {', '.join(CONFIGURATIONS + ORACLES)}, "
                         f"{PICK_PREFIX}<policy>")
    control = ControlPlaneModel(fleet, scenario.scrape_interval_s, on_weights, engine_at,
                                push_delay_s=options.push_delay_s)
    engine_at(scenario.scrape_interval_s, control.scrape)
    balancer.control_plane = control
    return balancer


def simulate(scenario: Scenario, configuration: str, load: float | None = None, *, run: str = STEADY,
             rate_rps: float | None = None, options: SimOptions | None = None,
             progress: Callable[[int], None] | None = None) -> tuple[RunResult, dict[str, Any]]:
    """Simulate one run; returns its RunResult (source "sim") and raw arrays for tests
    (``latency`` per measured request, NaN when it never completed, ``worker``, ``tokens``).

    ``rate_rps`` offers that rate instead of ``load * capacity`` (``load`` is then reported as the fraction).
    """
    options = options or SimOptions()
    load, rate_rps = _load_and_rate(scenario, load, rate_rps, run)
    total_s = scenario.warmup_s + scenario.duration_s
    trace = build_trace(scenario.workload, rate_rps, total_s, scenario.seed)
    classes = trace_classes(scenario.workload.classes, trace.send_at_s.size, scenario.seed) \
        if is_mixed(scenario.workload.classes) else None
    fleet = SimFleet(scenario.fleet, scenario.workload.inputs_per_request,
                     queue_order=QueueOrder() if classes is not None else None)  # the workers' default order
    engine, balancer = _engine(scenario, configuration, fleet, random.Random(_seed(scenario, configuration, load, run)),
                               options)
    if classes is not None and isinstance(balancer, ExtProcBalancer):
        balancer.priorities = classes.tolist()
    engine.at(LOAD_SAMPLE_PERIOD_S, lambda now: (fleet.sample_load(now), now + LOAD_SAMPLE_PERIOD_S)[1])
    if run == SLOWDOWN and scenario.slowdown is not None:
        _slow_down(scenario, fleet, engine, balancer)
    until = total_s + scenario.request_timeout_s
    cpu = time.process_time()
    outcome = engine.run(trace.send_at_s, trace.tokens, until, progress, priorities=classes)
    cpu = time.process_time() - cpu
    result, raw = _result(scenario, configuration, load, rate_rps, run, trace, outcome, balancer, classes)
    raw["cpu_s"] = cpu  # not in the RunResult: it would make equal runs differ
    return result, raw


def _load_and_rate(scenario: Scenario, load: float | None, rate_rps: float | None,
                   run: str) -> tuple[float, float]:
    """The run's load (a fraction of the fleet's capacity) and its rate, from whichever was given."""
    capacity = capacity_rps(scenario)
    if rate_rps is None:
        if load is None:
            raise ValueError("give a load or a rate")
        if run == SLOWDOWN and scenario.slowdown is None:
            raise ValueError("the scenario has no slowdown")
        return load, load * capacity
    return rate_rps / capacity, rate_rps


def _engine(scenario: Scenario, configuration: str, fleet: SimFleet, rng: random.Random,
            options: SimOptions) -> tuple[Engine, Balancer]:
    """The configuration's balancer and the engine that runs it. A balancer schedules its periodic work
    while it is built, before the engine exists: those calls are queued, then handed to the engine in order."""
    clock = Clock()
    engine_calls: list[tuple[float, Callable]] = []
    engine: Engine | None = None

    def at(when: float, call: Callable) -> None:  # scheduling before the engine exists is queued
        if engine is None:
            engine_calls.append((when, call))
        else:
            engine.at(when, call)

    balancer = build_balancer(configuration, scenario, fleet, at, clock, rng, options)
    engine = Engine(fleet, balancer, clock)
    for when, call in engine_calls:
        engine.at(when, call)
    return engine, balancer


def _slow_down(scenario: Scenario, fleet: SimFleet, engine: Engine, balancer: Balancer) -> None:
    """The slowdown run: one worker slows by the scenario's factor at its time (from the measured window, as in
    the bench), and recovers after its duration if it has one; an oracle knows the schedule in advance."""
    slow = scenario.slowdown
    assert slow is not None
    worker = fleet.workers[slow.worker]
    normal = worker.speed

    def slow_down(now: float) -> None:
        worker.speed = normal * slow.factor

    def recover(now: float) -> None:
        worker.speed = normal

    engine.at(scenario.warmup_s + slow.at_s, slow_down)
    if slow.duration_s > 0:
        engine.at(scenario.warmup_s + slow.at_s + slow.duration_s, recover)
    if isinstance(balancer, Oracle):  # clairvoyant about the speed schedule too
        balancer.expect_slowdown(slow.worker, slow.factor, scenario.warmup_s + slow.at_s,
                                 scenario.warmup_s + slow.at_s + slow.duration_s if slow.duration_s > 0
                                 else math.inf)


def overhead_s(scenario: Scenario, configuration: str) -> float:
    """The constant per-request time the model leaves out (see ``Scenario.hop_overhead_s``)."""
    return scenario.hop_overhead_s + (scenario.ext_proc_overhead_s if _uses_ext_proc(configuration) else 0.0)


def _histogram(latency: np.ndarray) -> LatencyHistogram:
    """The bench's HDR histogram of ``latency`` (seconds), recorded at microsecond resolution."""
    hist = LatencyHistogram()
    if latency.size:
        us = np.clip(np.rint(latency * 1e6), 1, 60_000_000)
        values, counts = np.unique(us, return_counts=True)
        for v, c in zip(values.tolist(), counts.tolist()):
            hist.record(v / 1e6, c)
    return hist


def class_figures(latency: np.ndarray, served: np.ndarray, shed: np.ndarray, classes: np.ndarray,
                  slo_s: float, duration_s: float) -> dict[str, dict[str, Any]]:
    """Per class present: sent, completed, shed, timeouts (neither), served p50/p99, the shed answers' p99,
    and goodput (served within ``slo_s``, per second)."""
    out: dict[str, dict[str, Any]] = {}
    for priority in Priority:
        mine = classes == int(priority)
        if not mine.any():
            continue
        ok = latency[served & mine]
        refused = latency[shed & mine]
        s = _histogram(ok).summary()
        out[priority.name.lower()] = {
            "sent": int(mine.sum()), "completed": int(ok.size), "shed": int(refused.size),
            "timeouts": int(mine.sum()) - int(ok.size) - int(refused.size),
            "p50_s": s.p50_s, "p99_s": s.p99_s,
            "shed_p99_s": float(np.percentile(refused, 99)) if refused.size else None,
            "goodput_rps": float((ok <= slo_s).sum()) / duration_s,
        }
    return out


def _result(scenario: Scenario, configuration: str, load: float, rate_rps: float, run: str, trace, outcome,
            balancer, classes: np.ndarray | None = None) -> tuple[RunResult, dict[str, Any]]:  # type: ignore[no-untyped-def]
    measured = trace.send_at_s >= scenario.warmup_s
    latency = outcome.finished_at[measured] - trace.send_at_s[measured] + overhead_s(scenario, configuration)
    worker = outcome.worker[measured]
    done = np.isfinite(latency) & (latency <= scenario.request_timeout_s)
    shed = worker == SHED
    served = done & ~shed
    ok = latency[served]
    hist = _histogram(ok)
    s = hist.summary()
    spread_counts = np.bincount(worker[served], minlength=len(scenario.fleet.workers))
    extra: dict[str, Any] = {"events": outcome.events, "capacity_rps": capacity_rps(scenario),
                             "workers": len(scenario.fleet.workers)}
    replicas = getattr(balancer, "replicas", None)
    if replicas:
        extra["ext_proc_replicas"] = len(replicas)
        extra["ext_proc_picks"] = [r.picks for r in replicas]
        extra["ext_proc_fallbacks"] = sum(r.fallbacks for r in replicas)
        mapes = [r.router.cost.mape() for r in replicas]
        finite = [m for m in mapes if math.isfinite(m)]
        if finite:
            extra["cost_mape"] = round(sum(finite) / len(finite), 4)
        extra["ext_proc_shed"] = sum(r.shed for r in replicas)  # warm-up included
        if getattr(balancer, "fair_queue_depth", 0):
            extra["ext_proc_held"] = sum(r.held for r in replicas)  # waited in the fair queue, warm-up included
    goodput_rps = float((ok <= scenario.slo_s).sum()) / scenario.duration_s
    extra["goodput_of_capacity"] = goodput_rps / capacity_rps(scenario)
    if classes is not None:
        extra["classes"] = class_figures(latency, served, shed, classes[measured], scenario.slo_s,
                                         scenario.duration_s)
    control = getattr(balancer, "control_plane", None)
    if control is not None and len(control.weights) <= 64:
        extra["weights"] = list(control.weights)
    result = RunResult(
        configuration=configuration, load=round(load, 6), offered_rps=rate_rps, duration_s=scenario.duration_s,
        sent=int(measured.sum()), completed=int(served.sum()), errors=int(shed.sum()), timeouts=int((~done).sum()),
        p50_s=s.p50_s, p90_s=s.p90_s, p99_s=s.p99_s, p999_s=s.p999_s, mean_s=s.mean_s,
        goodput_rps=goodput_rps, slo_s=scenario.slo_s,
        run=run, source="sim", spread={str(i): int(c) for i, c in enumerate(spread_counts.tolist())},
        cdf=hist.cdf_points(), extra=extra,
    )
    raw = {"latency": latency, "worker": worker, "tokens": trace.tokens[measured], "shed": shed,
           "classes": classes[measured] if classes is not None else None}
    return result, raw
