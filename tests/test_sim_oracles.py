"""The simulator's oracles (issue 19): the clairvoyant's choice checked by hand, the central queue never
idles a slot while a request waits, both are no worse than the real balancers on a small fleet, the CLI
takes their names on every scenario file and refuses unknown ones, and the ratio column is right."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import CONFIGURATIONS, Fleet, Scenario, Slowdown, WorkerSpec
from inferlb.bench.load.trace import build_trace
from inferlb.sim.engine import Clock, Engine
from inferlb.sim.fleet import SimFleet
from inferlb.sim.oracles import ORACLE_CENTRAL_QUEUE, ORACLE_CLAIRVOYANT, ORACLES, Oracle
from inferlb.sim.report import VS_ORACLE, against_oracles, render
from inferlb.sim.runner import SLOWDOWN, capacity_rps, simulate

ROOT = Path(__file__).resolve().parent.parent


def small(workers=(WorkerSpec(1.0), WorkerSpec(1.0), WorkerSpec(0.5), WorkerSpec(0.25)), **changes) -> Scenario:  # type: ignore[no-untyped-def]
    # no constant overheads: the oracles' latencies are the queue's alone
    base = Scenario(name="small", duration_s=10.0, warmup_s=1.0, slowdown=None, loads=(0.8,),
                    fleet=Fleet(workers=tuple(workers)), hop_overhead_s=0.0, ext_proc_overhead_s=0.0)
    return replace(base, **changes)


def run_engine(oracle: str, speeds: tuple[float, ...], send: list[float], tokens: list[int]):  # type: ignore[no-untyped-def]
    """The engine under an oracle on a fleet whose service time is 10 ms per token / speed."""
    fleet = SimFleet(Fleet(workers=tuple(WorkerSpec(s) for s in speeds), fixed_s=0.0, per_token_s=0.01,
                           cost_scale=1.0))
    return Engine(fleet, Oracle(fleet, oracle), Clock()).run(np.array(send), np.array(tokens), until_s=100.0)


def test_clairvoyant_sends_each_request_where_it_finishes_first_by_hand() -> None:
    # Speeds 1 and 0.5, one slot each; service = tokens * 10 ms / speed.
    #   t=0.00  10 tok: w0 ends 0.10, w1 0.20                      -> w0 at 0.10
    #   t=0.01  10 tok: w0 (busy to 0.10) ends 0.20, w1 0.21       -> w0 at 0.20
    #   t=0.02  10 tok: w0 ends 0.30, w1 0.22                      -> w1 at 0.22
    #   t=0.03   5 tok: w0 ends 0.25, w1 (busy to 0.22) 0.32       -> w0 at 0.25
    #   t=0.30  10 tok: both idle: w0 0.40, w1 0.50                -> w0 at 0.40
    out = run_engine(ORACLE_CLAIRVOYANT, (1.0, 0.5), [0.0, 0.01, 0.02, 0.03, 0.30], [10, 10, 10, 5, 10])
    assert out.worker.tolist() == [0, 0, 1, 0, 0]
    assert out.finished_at.tolist() == pytest.approx([0.10, 0.20, 0.22, 0.25, 0.40], abs=1e-12)


def test_ties_go_to_the_lowest_index_and_the_central_queue_takes_the_first_free_slot() -> None:
    # Equal speeds, two at once: worker 0 then 1. The third waits for whichever frees first (worker 1,
    # its job is shorter), even though worker 0 would be as good for the clairvoyant later.
    for oracle in ORACLES:
        out = run_engine(oracle, (1.0, 1.0), [0.0, 0.0, 0.01], [20, 10, 10])
        assert out.worker.tolist() == [0, 1, 1]
        assert out.finished_at.tolist() == pytest.approx([0.20, 0.10, 0.20], abs=1e-12)
    # The central queue gives an idle slot at once, the fastest idle one; the clairvoyant waits for a fast one
    # when that finishes earlier: 10 tokens on the busy fast worker (free at 0.05) end at 0.15, on the idle
    # slow one at 0.41.
    cq = run_engine(ORACLE_CENTRAL_QUEUE, (1.0, 0.25), [0.0, 0.01], [5, 10])
    cv = run_engine(ORACLE_CLAIRVOYANT, (1.0, 0.25), [0.0, 0.01], [5, 10])
    assert cq.worker.tolist() == [0, 1] and cq.finished_at[1] == pytest.approx(0.41, abs=1e-12)
    assert cv.worker.tolist() == [0, 0] and cv.finished_at[1] == pytest.approx(0.15, abs=1e-12)


def test_on_a_uniform_fleet_the_two_oracles_are_the_same_schedule() -> None:
    scenario = small(workers=(WorkerSpec(1.0),) * 4)
    _, a = simulate(scenario, ORACLE_CLAIRVOYANT, 0.9)
    _, b = simulate(scenario, ORACLE_CENTRAL_QUEUE, 0.9)
    assert np.array_equal(a["worker"], b["worker"]) and np.array_equal(a["latency"], b["latency"])


def _full_spans(starts: np.ndarray, ends: np.ndarray, slots: int) -> list[tuple[float, float]]:
    """The time spans during which all ``slots`` of a worker are busy (merged), by a sweep over its jobs."""
    events = sorted([(t, 1) for t in starts.tolist()] + [(t, -1) for t in ends.tolist()], key=lambda e: (e[0], e[1]))
    spans: list[tuple[float, float]] = []
    busy, since = 0, 0.0
    for t, step in events:
        was = busy
        busy += step
        if was < slots <= busy:
            since = t
        elif was >= slots > busy and t > since:
            if spans and abs(spans[-1][1] - since) <= 1e-12:
                spans[-1] = (spans[-1][0], t)
            else:
                spans.append((since, t))
    return spans


def test_central_queue_never_leaves_a_slot_idle_while_a_request_waits() -> None:
    workers = (WorkerSpec(1.0, slots=2), WorkerSpec(1.0), WorkerSpec(0.5, slots=3), WorkerSpec(0.25))
    scenario = small(workers=workers, warmup_s=0.0)
    rate = 0.95 * capacity_rps(scenario)
    result, raw = simulate(scenario, ORACLE_CENTRAL_QUEUE, rate_rps=rate)
    trace = build_trace(scenario.workload, rate, scenario.duration_s, scenario.seed)
    assert result.completed == result.sent == len(trace)
    service = np.array([scenario.fleet.service_s(int(w), int(t)) for w, t in zip(raw["worker"], raw["tokens"])])
    ends = trace.send_at_s + raw["latency"]
    starts = ends - service
    spans = {w: _full_spans(starts[raw["worker"] == w], ends[raw["worker"] == w], spec.slots)
             for w, spec in enumerate(workers)}
    waited = np.flatnonzero(starts - trace.send_at_s > 1e-9)
    assert waited.size > 100  # the check has something to check
    for i in waited.tolist():
        a, s = trace.send_at_s[i], starts[i]
        for w in spans:  # every slot of every worker busy from the arrival until the request starts
            assert any(lo <= a + 1e-9 and s - 1e-9 <= hi for lo, hi in spans[w]), (i, w)


COMPARED = ("envoy_round_robin", "envoy_least_request", "envoy_cswrr_orca", "nginx_least_conn",
            "inferlb_weights", "inferlb_ext_proc")


@pytest.mark.parametrize("load", [0.5, 0.7, 0.8, 0.9])
def test_the_better_oracle_is_no_worse_than_any_balancer(load: float) -> None:
    scenario = small()
    oracle = [simulate(scenario, o, load)[0] for o in ORACLES]
    for configuration in COMPARED:
        other, _ = simulate(scenario, configuration, load)
        # Greedy earliest completion is not a strict bound, and inferlb_ext_proc runs within 2% of it on this
        # fleet, on either side of it (p99 1.6% below it at 50% load, mean 0.1% below at 90%, goodput 0.4%
        # above at 80%): it may keep a slow worker for short requests where the oracle commits greedily. So
        # inferlb gets a 2% margin; every other balancer must be no better than the better oracle.
        slack = 1.02 if configuration == "inferlb_ext_proc" else 1.0
        assert min(r.mean_s for r in oracle) <= other.mean_s * slack, configuration
        assert max(r.goodput_rps for r in oracle) * slack >= other.goodput_rps, configuration
        assert min(r.p99_s for r in oracle) <= other.p99_s * slack, configuration


def test_the_clairvoyant_knows_the_speed_schedule_by_hand() -> None:
    # Speeds 1 and 1, one slot each, 10 ms per token / speed; worker 0 runs at half speed for jobs starting in
    # [0.05, 0.25), as the engine's events set it.
    #   t=0.00  10 tok: both idle, 0.10 each (tie)                          -> w0 at 0.10
    #   t=0.06  10 tok: w0 from 0.10 (slow) 0.30, w1 idle 0.16              -> w1 at 0.16
    #   t=0.07  10 tok: w0 from 0.10 (slow) 0.30, w1 from 0.16 0.26         -> w1 at 0.26 (blind: w0, "0.20")
    #   t=0.08   4 tok: w0 from 0.10 (slow) 0.18, w1 from 0.26 0.30         -> w0 at 0.18
    #   t=0.20  10 tok: w0 from 0.20 (slow) 0.40, w1 from 0.26 0.36         -> w1 at 0.36
    #   t=0.30  10 tok: w0 from 0.30 (recovered) 0.40, w1 from 0.36 0.46    -> w0 at 0.40
    fleet = SimFleet(Fleet(workers=(WorkerSpec(1.0), WorkerSpec(1.0)), fixed_s=0.0, per_token_s=0.01,
                           cost_scale=1.0))
    oracle = Oracle(fleet, ORACLE_CLAIRVOYANT)
    oracle.expect_slowdown(0, 0.5, 0.05, 0.25)
    engine = Engine(fleet, oracle, Clock())

    def set_speed(speed: float):  # type: ignore[no-untyped-def]
        def call(now: float) -> None:
            fleet.workers[0].speed = speed
        return call

    engine.at(0.05, set_speed(0.5))
    engine.at(0.25, set_speed(1.0))
    out = engine.run(np.array([0.0, 0.06, 0.07, 0.08, 0.20, 0.30]), np.array([10, 10, 10, 4, 10, 10]), until_s=10.0)
    assert out.worker.tolist() == [0, 1, 1, 0, 1, 0]
    assert out.finished_at.tolist() == pytest.approx([0.10, 0.16, 0.26, 0.18, 0.36, 0.40], abs=1e-12)


@pytest.mark.parametrize("duration_s", [0.0, 3.0])
def test_in_the_slowdown_run_the_oracles_are_no_worse_than_any_balancer(duration_s: float) -> None:
    # Worker 0 (fast) at a quarter of its speed 2 s into the window, for good or for 3 s. At 60% load the fleet
    # keeps up even slowed (73% of its capacity left): in overload the FIFO oracles do not bound goodput.
    scenario = replace(small(), slowdown=Slowdown(worker=0, factor=0.25, at_s=2.0, duration_s=duration_s, load=0.6))
    oracle = [simulate(scenario, o, 0.6, run=SLOWDOWN)[0] for o in ORACLES]
    assert all(r.run == SLOWDOWN and r.timeouts == 0 for r in oracle)
    for configuration in COMPARED:
        other, _ = simulate(scenario, configuration, 0.6, run=SLOWDOWN)
        assert min(r.mean_s for r in oracle) <= other.mean_s, configuration
        assert min(r.p99_s for r in oracle) <= other.p99_s, configuration
        assert max(r.goodput_rps for r in oracle) >= other.goodput_rps, configuration


def _result(configuration: str, p99_s: float, goodput_rps: float, load: float = 0.8) -> RunResult:
    return RunResult(configuration=configuration, load=load, offered_rps=100.0, duration_s=10.0, sent=1000,
                     completed=1000, errors=0, timeouts=0, p50_s=0.01, p90_s=0.02, p99_s=p99_s, p999_s=p99_s,
                     mean_s=0.01, goodput_rps=goodput_rps, slo_s=0.25, source="sim")


def test_the_ratio_is_to_the_better_oracle_per_figure_and_load() -> None:
    results = [_result("inferlb_ext_proc", 0.3, 90.0), _result(ORACLE_CLAIRVOYANT, 0.2, 95.0),
               _result(ORACLE_CENTRAL_QUEUE, 0.25, 100.0), _result("nginx_least_conn", 0.5, 80.0, load=0.7)]
    out = against_oracles(results)
    vs = out[0].extra[VS_ORACLE]
    assert vs["p99_ratio"] == pytest.approx(1.5) and vs["p99_oracle"] == ORACLE_CLAIRVOYANT
    assert vs["goodput_ratio"] == pytest.approx(0.9) and vs["goodput_oracle"] == ORACLE_CENTRAL_QUEUE
    assert VS_ORACLE not in out[1].extra and VS_ORACLE not in out[3].extra  # an oracle; no oracle at 70%
    table = render(out, replace(small(), fleet=Fleet(workers=(WorkerSpec(1.0),))), 100.0)
    assert "| p99 / best oracle |" in table
    assert "| inferlb_ext_proc | steady | 80% | 300.0 | 200.0 | 1.50x | 90.0 | 100.0 | 0.90x |" in table


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferlb.cli", "sim", *args, "--no-progress"], check=False,
                          capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.subprocess
@pytest.mark.parametrize("scenario", sorted((ROOT / "scenarios").glob("*.toml")), ids=lambda p: p.stem)
def test_cli_runs_inferlb_against_the_clairvoyant_on_every_scenario_file(scenario: Path, tmp_path: Path) -> None:
    # Shortened and shrunk to 8 workers so that sim_scale's 10,000 take seconds; the file's other settings stay.
    out = tmp_path / "sim.json"
    done = _cli("--scenario", str(scenario), "--configurations", "inferlb_ext_proc,oracle_clairvoyant",
                "--duration", "1", "--warmup", "0.2", "--loads", "0.7", "--workers", "8", "--json", str(out))
    assert done.returncode == 0, done.stderr
    runs = json.loads(out.read_text())
    results = {r["configuration"]: r for r in runs if r["run"] == "steady"}
    assert set(results) == {"inferlb_ext_proc", ORACLE_CLAIRVOYANT}
    slowdown = {r["configuration"]: r for r in runs if r["run"] == SLOWDOWN}
    if "slowdown = false" in scenario.read_text():
        assert not slowdown
    else:  # the oracles run the slowdown run too, knowing the speed schedule
        assert set(slowdown) == {"inferlb_ext_proc", ORACLE_CLAIRVOYANT}
        assert slowdown["inferlb_ext_proc"]["extra"][VS_ORACLE]["p99_oracle"] == ORACLE_CLAIRVOYANT
    inferlb, oracle = results["inferlb_ext_proc"], results[ORACLE_CLAIRVOYANT]
    assert oracle["completed"] > 0
    assert inferlb["extra"][VS_ORACLE]["p99_ratio"] == pytest.approx(inferlb["p99_s"] / oracle["p99_s"])
    assert "p99 / best oracle" in done.stdout


@pytest.mark.subprocess
def test_cli_oracles_flag_adds_both() -> None:
    done = _cli("--scenario", str(ROOT / "scenarios" / "smoke.toml"), "--oracles")
    assert done.returncode == 0, done.stderr
    assert f"| {ORACLE_CENTRAL_QUEUE} | steady |" in done.stdout and f"| {ORACLE_CLAIRVOYANT} | steady |" in done.stdout


@pytest.mark.subprocess
def test_cli_refuses_an_unknown_configuration_listing_the_valid_ones() -> None:
    done = _cli("--configurations", "inferlb_ext_proc,oracle_magic")
    assert done.returncode == 2
    assert "unknown configuration 'oracle_magic'" in done.stderr
    assert all(name in done.stderr for name in CONFIGURATIONS + ORACLES)
