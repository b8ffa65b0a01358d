"""Priority classes and shedding in the simulator: the class mix of a scenario, the workers' class order
(with aging), ext_proc's shed answers from the real Router, and the per-class report. Deterministic:
every figure comes from the simulated clock."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.load.classes import trace_classes
from inferlb.bench.load.scenario import ClassMix, Fleet, Scenario, ScenarioError, WorkerSpec, Workload, load_scenario, \
    scenario_from_mapping
from inferlb.bench.load.trace import build_trace
from inferlb.sim.engine import SHED, Clock, Engine
from inferlb.sim.fleet import SimFleet
from inferlb.sim.runner import simulate
from inferlb_runtime.request_class import Priority
from workers.queue_order import JobQueue, QueueOrder

ROOT = Path(__file__).resolve().parent.parent
MIX = ClassMix(critical=0.2, standard=0.5, sheddable=0.3)
C, S, X = int(Priority.CRITICAL), int(Priority.STANDARD), int(Priority.SHEDDABLE)


def overloaded(**changes) -> Scenario:  # type: ignore[no-untyped-def]
    """A short run of the overload mix on four workers (no constant overheads unless given)."""
    base = Scenario(name="classes", seed=13, duration_s=8.0, warmup_s=2.0, slo_s=0.5, shed_slo_ms=500.0,
                    slowdown=None, loads=(1.3,), configurations=("inferlb_ext_proc",),
                    workload=Workload(classes=MIX),
                    fleet=Fleet(workers=tuple(WorkerSpec(s) for s in (1.0, 1.0, 0.5, 0.5))),
                    hop_overhead_s=0.0, ext_proc_overhead_s=0.0)
    return replace(base, **changes)


# --- the class order of a worker's queue ------------------------------------------------------------


class First:
    """A balancer that sends everything to worker 0 (the queue order alone decides)."""

    name = "first"

    def pick(self, request: int, tokens: int, now: float) -> int:
        return 0

    def completed(self, request: int, worker: int, now: float, service_s: float, inflight: int) -> None:
        pass

    def ticks(self) -> tuple:
        return ()


def one_worker_order(send_at: list[float], priorities: list[int]) -> list[int]:
    """Requests in the order one simulated worker (1 s per request) finishes them."""
    fleet = SimFleet(Fleet(workers=(WorkerSpec(1.0),), fixed_s=1.0, per_token_s=0.0, cost_scale=1.0),
                     queue_order=QueueOrder())
    outcome = Engine(fleet, First(), Clock()).run(np.array(send_at), np.full(len(send_at), 10), until_s=100.0,
                                                 priorities=np.array(priorities, dtype=np.int8))
    return np.argsort(outcome.finished_at, kind="stable").tolist()


def test_the_simulated_queues_are_the_workers_own() -> None:
    fleet = SimFleet(Fleet(), queue_order=QueueOrder())
    assert all(type(w.queue) is JobQueue for w in fleet.workers)
    assert all(type(w.queue) is not JobQueue for w in SimFleet(Fleet()).workers)  # no classes: FIFO deques


def test_a_worker_serves_the_best_class_first_and_arrival_order_within_one() -> None:
    # request 0 runs; 1-4 queue behind it: critical 3, then standard 1 and 4 in arrival order, sheddable 2
    assert one_worker_order([0.0, 0.1, 0.2, 0.3, 0.4], [S, S, X, C, S]) == [0, 3, 1, 4, 2]


def test_a_waiting_request_climbs_one_class_per_aging_interval() -> None:
    # at 2.0 s the sheddable request (1) has waited 1.9 s and still ranks last: standard 3 goes; at 3.0 s it
    # has waited 2.9 s, ranks as standard, and is older than standard 4 (without aging: [0, 2, 3, 4, 1])
    assert one_worker_order([0.0, 0.1, 0.2, 1.5, 1.6], [S, X, C, S, S]) == [0, 2, 3, 1, 4]


def test_all_standard_in_class_order_is_the_fifo_order() -> None:
    scenario = replace(overloaded(), workload=Workload())
    fifo, raw_fifo = simulate(scenario, "envoy_round_robin", 1.1)
    # the same run with every queue the workers' JobQueue and every request standard
    classed = replace(scenario, workload=Workload(classes=ClassMix(critical=1e-12, standard=1 - 1e-12)))
    ordered, raw_ordered = simulate(classed, "envoy_round_robin", 1.1)
    assert np.all(raw_ordered["classes"] == S)
    assert np.array_equal(raw_fifo["latency"], raw_ordered["latency"])
    assert "classes" not in fifo.extra and "classes" in ordered.extra


# --- which class each request is ---------------------------------------------------------------------


def test_classes_follow_the_mix_and_replay_per_seed_without_moving_the_trace() -> None:
    a = trace_classes(MIX, 20_000, seed=5)
    assert np.array_equal(a, trace_classes(MIX, 20_000, seed=5))
    assert not np.array_equal(a, trace_classes(MIX, 20_000, seed=6))
    shares = np.bincount(a, minlength=3) / a.size
    assert np.allclose(shares, MIX.shares(), atol=0.02)
    assert np.all(trace_classes(ClassMix(), 10, seed=5) == S)
    # the trace's arrivals and lengths do not depend on the class mix
    plain = build_trace(Workload(), 50.0, 5.0, 5)
    mixed = build_trace(Workload(classes=MIX), 50.0, 5.0, 5)
    assert np.array_equal(plain.send_at_s, mixed.send_at_s) and np.array_equal(plain.tokens, mixed.tokens)


@pytest.mark.parametrize("classes, message", [
    ({"critical": 0.5, "standard": 0.6}, "add up to 1"),
    ({"critical": -0.1, "standard": 1.1}, ">= 0"),
    ({"urgent": 1.0}, "unknown key(s) urgent"),
])
def test_a_bad_class_mix_is_refused_by_name(classes: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match="classes") as caught:
        scenario_from_mapping({"workload": {"classes": classes}})
    assert message in str(caught.value)


def test_a_negative_shed_slo_is_refused() -> None:
    with pytest.raises(ScenarioError, match="shed_slo_ms"):
        scenario_from_mapping({"shed_slo_ms": -1})


# --- shedding by the real Router, in the overloaded fleet ---------------------------------------------


def test_at_130_percent_only_sheddable_requests_are_shed_and_critical_stays_within_the_slo() -> None:
    result, raw = simulate(overloaded(), "inferlb_ext_proc", 1.3)
    classes = result.extra["classes"]
    assert classes["sheddable"]["shed"] > 0
    assert classes["critical"]["shed"] == 0 and classes["standard"]["shed"] == 0
    assert classes["critical"]["timeouts"] == 0 and classes["critical"]["completed"] == classes["critical"]["sent"]
    assert classes["critical"]["p99_s"] <= result.slo_s
    assert classes["critical"]["p99_s"] < classes["standard"]["p99_s"]  # the workers serve critical first
    # a shed request never reached a worker: the spread counts only the served
    assert sum(result.spread.values()) == result.completed
    shed = raw["shed"]
    assert np.all(raw["worker"][shed] == SHED) and np.all(raw["classes"][shed] == X)
    assert result.errors == int(shed.sum()) == classes["sheddable"]["shed"]
    assert np.all(raw["latency"][shed] == 0.0)  # answered at once (no overhead configured here)


def test_a_shed_answer_costs_the_hop_and_ext_proc_overheads() -> None:
    result, raw = simulate(overloaded(hop_overhead_s=0.003, ext_proc_overhead_s=0.004), "inferlb_ext_proc", 1.3)
    assert np.allclose(raw["latency"][raw["shed"]], 0.007, rtol=0, atol=1e-12)
    assert result.extra["classes"]["sheddable"]["shed_p99_s"] == pytest.approx(0.007)


def test_shedding_keeps_goodput_that_the_baseline_loses() -> None:
    shedding, _ = simulate(overloaded(), "inferlb_ext_proc", 1.3)
    baseline, raw = simulate(overloaded(shed_slo_ms=0.0), "inferlb_ext_proc", 1.3)
    assert not raw["shed"].any() and baseline.errors == 0
    assert shedding.goodput_rps > 1.5 * baseline.goodput_rps
    assert shedding.extra["classes"]["critical"]["p99_s"] < baseline.extra["classes"]["critical"]["p99_s"]
    assert shedding.extra["goodput_of_capacity"] == pytest.approx(shedding.goodput_rps / shedding.extra["capacity_rps"])


def test_below_the_slo_nothing_is_shed() -> None:
    result, _ = simulate(overloaded(), "inferlb_ext_proc", 0.4)
    assert result.errors == 0 and result.extra["classes"]["sheddable"]["shed"] == 0


def test_balancers_without_ext_proc_never_shed_but_order_by_class() -> None:
    result, raw = simulate(overloaded(), "envoy_least_request", 1.0)
    assert result.errors == 0 and not raw["shed"].any()
    classes = result.extra["classes"]
    assert classes["critical"]["p99_s"] < classes["sheddable"]["p99_s"]


# --- the scenario file and the CLI ------------------------------------------------------------------


def test_the_overload_scenario_file_loads() -> None:
    scenario = load_scenario(ROOT / "scenarios" / "overload.toml")
    assert scenario.workload.classes == MIX and scenario.loads == (1.3,) and scenario.shed_slo_ms > 0


@pytest.mark.subprocess
def test_cli_prints_the_class_table_and_takes_the_shed_slo(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, "-m", "inferlb.cli", "sim", "--scenario", str(ROOT / "scenarios" / "overload.toml"),
                           "--duration", "3", "--warmup", "1", "--shed-slo-ms", "0", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "## Classes" in done.stdout and "| sheddable |" in done.stdout
    (result,) = json.loads(out.read_text())
    assert result["errors"] == 0 and result["extra"]["classes"]["sheddable"]["shed"] == 0
