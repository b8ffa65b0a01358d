"""The fleet simulator (``inferlb sim``): exact queueing on small cases, the balancers' behaviour,
the real policies wired in, determinism, the CLI and the validation against a bench results file."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import (
    Fleet,
    LengthBucket,
    Scenario,
    Slowdown,
    WorkerSpec,
    Workload,
)
from inferlb.bench.load.trace import build_trace
from inferlb.sim.runner import SLOWDOWN, capacity_rps, simulate
from inferlb.sim.validate import TOLERANCE, compare, load_bench_results

ROOT = Path(__file__).resolve().parent.parent


def small(speeds=(1.0, 1.0, 0.5, 0.25), **changes) -> Scenario:  # type: ignore[no-untyped-def]
    # no constant hop overhead: the exactness tests compare with hand-computed queues
    base = Scenario(name="small", duration_s=4.0, warmup_s=1.0, slowdown=None, loads=(0.6,),
                    fleet=Fleet(workers=tuple(WorkerSpec(s) for s in speeds)),
                    hop_overhead_s=0.0, ext_proc_overhead_s=0.0)
    return replace(base, **changes)


def lindley(arrivals: np.ndarray, services: np.ndarray) -> np.ndarray:
    """Completion times of a single FIFO server, by hand: finish_i = max(arrival_i, finish_{i-1}) + s_i."""
    finish = np.empty_like(arrivals)
    last = 0.0
    for i, (a, s) in enumerate(zip(arrivals, services)):
        last = max(a, last) + s
        finish[i] = last
    return finish


def test_single_worker_at_low_load_latency_is_the_service_time() -> None:
    scenario = small(speeds=(0.5,), warmup_s=0.0, duration_s=20.0)
    result, raw = simulate(scenario, "envoy_round_robin", rate_rps=0.5)
    trace = build_trace(scenario.workload, 0.5, 20.0, scenario.seed)
    expected = lindley(trace.send_at_s, np.array([scenario.fleet.service_s(0, int(t)) for t in trace.tokens]))
    assert np.array_equal(raw["latency"], expected - trace.send_at_s)  # a DES: exact, not approximately
    gaps_idle = trace.send_at_s[1:] >= expected[:-1]  # arrived to an idle worker: latency is the service time
    assert gaps_idle.sum() > 3
    services = np.array([scenario.fleet.service_s(0, int(t)) for t in trace.tokens])
    # (send + s) - send is s up to one rounding of the clock's float
    assert np.allclose(raw["latency"][1:][gaps_idle], services[1:][gaps_idle], rtol=0, atol=1e-12)
    assert result.completed == result.sent == len(trace) and result.timeouts == 0


def test_queueing_matches_a_hand_computation_on_two_round_robin_workers() -> None:
    # Fixed-size requests at 90% of capacity: an M/D/1-like queue per worker, computed by hand per worker.
    scenario = small(speeds=(1.0, 0.5), warmup_s=0.0, duration_s=10.0,
                     workload=Workload(mix=(LengthBucket(1.0, 100, 100),)))
    rate = 0.9 * capacity_rps(scenario)
    result, raw = simulate(scenario, "envoy_round_robin", rate_rps=rate)
    trace = build_trace(scenario.workload, rate, 10.0, scenario.seed)
    first = int(raw["worker"][0])
    for w in (0, 1):
        mine = np.flatnonzero(raw["worker"] == w)
        assert np.array_equal(mine % 2, np.full(mine.size, (w - first) % 2))  # strict alternation
        service = np.full(mine.size, scenario.fleet.service_s(w, 100))
        expected = lindley(trace.send_at_s[mine], service) - trace.send_at_s[mine]
        assert np.allclose(raw["latency"][mine], expected, rtol=0, atol=1e-9)
    assert result.p99_s > result.p50_s > scenario.fleet.service_s(0, 100)  # the slow one queues


def test_same_seed_same_results_and_another_seed_differs() -> None:
    scenario = small()
    for configuration in ("envoy_least_request", "envoy_cswrr_orca", "inferlb_ext_proc"):
        a, _ = simulate(scenario, configuration, 0.7)
        b, _ = simulate(scenario, configuration, 0.7)
        assert a.to_json() == b.to_json()
    c, _ = simulate(replace(scenario, seed=2), "inferlb_ext_proc", 0.7)
    assert c.to_json() != a.to_json()


def test_round_robin_spreads_evenly() -> None:
    result, raw = simulate(small(speeds=(1.0,) * 5), "envoy_round_robin", 0.5)
    counts = np.bincount(raw["worker"], minlength=5)
    assert counts.max() - counts.min() <= 1
    assert sum(result.spread.values()) == result.completed


@pytest.mark.parametrize("configuration", ["envoy_least_request", "nginx_least_conn"])
def test_least_request_avoids_a_slowed_worker(configuration: str) -> None:
    scenario = small(speeds=(1.0, 1.0), slowdown=Slowdown(worker=0, factor=0.1, at_s=0.0, load=0.5))
    slowed, _ = simulate(scenario, configuration, 0.5, run=SLOWDOWN)
    rr, _ = simulate(scenario, "envoy_round_robin", 0.5, run=SLOWDOWN)
    assert slowed.spread["0"] < slowed.spread["1"] / 2
    assert rr.spread["0"] >= rr.spread["1"] - 1 or rr.timeouts > 0  # round robin keeps feeding it
    assert slowed.p99_s < rr.p99_s


def test_cswrr_learns_weights_from_orca_reports() -> None:
    result, _ = simulate(small(speeds=(1.0, 0.25), duration_s=6.0), "envoy_cswrr_orca", 0.6)
    assert result.spread["0"] > 2 * result.spread["1"]


def test_inferlb_weights_come_from_the_real_weight_policy() -> None:
    result, _ = simulate(small(), "inferlb_weights", 0.6)
    weights = result.extra["weights"]
    assert weights[0] > weights[2] > weights[3]  # speed 1 > 0.5 > 0.25
    assert result.spread["0"] > result.spread["3"]


def test_ext_proc_sends_long_requests_to_fast_workers_more_than_round_robin() -> None:
    scenario = small(speeds=(1.0, 1.0, 0.25, 0.25))

    def long_on_fast(configuration: str) -> float:
        _, raw = simulate(scenario, configuration, 0.6)
        long = raw["tokens"] >= 64
        return float(np.mean(raw["worker"][long] <= 1))

    assert long_on_fast("inferlb_ext_proc") > long_on_fast("envoy_round_robin") + 0.2


def test_several_ext_proc_replicas_each_pick() -> None:
    result, _ = simulate(small(ext_proc_replicas=3), "inferlb_ext_proc", 0.6)
    assert result.extra["ext_proc_replicas"] == 3
    assert len(result.extra["ext_proc_picks"]) == 3 and min(result.extra["ext_proc_picks"]) > 0
    assert result.completed == result.sent
    assert result.extra["cost_mape"] < 0.5  # the real cost model learnt the emulated costs


def test_other_pick_policies_run() -> None:
    result, _ = simulate(small(), "inferlb_pick:least_outstanding", 0.6)
    assert result.configuration == "inferlb_pick:least_outstanding" and result.completed == result.sent


def test_scale_path_smoke() -> None:
    workers = tuple(WorkerSpec((1.0, 0.5, 0.25)[i % 3]) for i in range(1000))
    scenario = small(fleet=Fleet(workers=workers), warmup_s=0.1, duration_s=0.4, ext_proc_replicas=4,
                     scrape_interval_s=0.1)
    for configuration in ("inferlb_ext_proc", "nginx_least_conn", "inferlb_weights"):
        result, _ = simulate(scenario, configuration, 0.5)
        assert result.sent > 3000 and result.completed == result.sent
        assert len(result.spread) == 1000


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "inferlb.cli", "sim", *args], check=False, capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


@pytest.mark.subprocess
def test_cli_writes_json_and_prints_the_table(tmp_path: Path) -> None:
    toml = tmp_path / "tiny.toml"
    toml.write_text('name = "tiny"\nduration_s = 2.0\nwarmup_s = 0.5\nloads = [0.5]\nslowdown = false\n'
                    'configurations = ["envoy_round_robin", "inferlb_ext_proc"]\n'
                    '[fleet]\nworkers = [1.0, 0.5]\n')
    out = tmp_path / "sim.json"
    done = _cli("--scenario", str(toml), "--json", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "inferlb_ext_proc" in done.stdout and "p99 ms" in done.stdout
    results = [RunResult.from_json(r) for r in json.loads(out.read_text())]
    assert [r.configuration for r in results] == ["envoy_round_robin", "inferlb_ext_proc"]
    assert all(r.source == "sim" and r.completed > 0 and r.cdf for r in results)


@pytest.mark.subprocess
@pytest.mark.parametrize("args, message", [
    (["--loads", "fast"], "--loads"),
    (["--configurations", "envoy_magic"], "unknown configuration"),
    (["--workers", "0"], "--workers"),
    (["--scenario", "/nonexistent.toml"], "cannot read scenario"),
    (["--validate", "/nonexistent.json"], "cannot read"),
])
def test_cli_bad_input_exits_2_with_a_message(args: list[str], message: str) -> None:
    done = _cli(*args, "--no-progress")
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.subprocess
def test_validate_pairs_live_and_sim_and_flags_differences(tmp_path: Path) -> None:
    scenario = small(capacity_rps=40.0)
    same, _ = simulate(scenario, "envoy_least_request", 0.6)
    off, _ = simulate(scenario, "inferlb_ext_proc", 0.6)
    live = [replace(same, source="live"), replace(off, source="live", p99_s=off.p99_s * 2)]
    path = tmp_path / "results.json"
    scenario_json = dataclasses.asdict(small())  # as inferlb bench run writes it
    path.write_text(json.dumps({"scenario": scenario_json, "capacity": {"rps": 40.0, "source": "scenario"},
                                "results": [r.to_json() for r in live]}))
    loaded, results = load_bench_results(path)
    assert loaded.capacity_rps == 40.0 and len(results) == 2
    comparisons = compare(loaded, results)
    assert comparisons[0].within and comparisons[0].p99_diff == 0.0
    assert not comparisons[1].within and comparisons[1].p99_diff == pytest.approx(-0.5)
    done = _cli("--validate", str(path), "--json", str(tmp_path / "cmp.json"), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "FLAG" in done.stdout and f"{TOLERANCE:.0%}" in done.stdout
    assert len(json.loads((tmp_path / "cmp.json").read_text())) == 2


def test_the_constant_overheads_shift_latency_and_nothing_else() -> None:
    plain = small()
    shifted = replace(plain, hop_overhead_s=0.003, ext_proc_overhead_s=0.004)
    for configuration, added in (("envoy_least_request", 0.003), ("inferlb_ext_proc", 0.007)):
        _, a = simulate(plain, configuration, rate_rps=20.0)
        _, b = simulate(shifted, configuration, rate_rps=20.0)
        assert np.array_equal(a["worker"], b["worker"])  # the same routing
        assert np.allclose(b["latency"] - a["latency"], added, rtol=0, atol=1e-9)


def test_simulated_replicas_each_pick_only_in_their_partition_of_a_large_fleet() -> None:
    import random

    from inferlb.sim.ext_proc_model import ExtProcBalancer
    from inferlb.sim.fleet import SimFleet

    workers = tuple(WorkerSpec(1.0) for _ in range(256))
    ids = tuple(f"127.0.0.1:{8101 + i}" for i in range(256))
    position = {e: i for i, e in enumerate(sorted(ids))}
    balancer = ExtProcBalancer(SimFleet(Fleet(workers=workers)), random.Random(1), ids, 4, lambda: 0.0)
    assert [r.router.partition.partition for r in balancer.replicas] == [(i, 4) for i in range(4)]
    for request in range(400):
        worker = balancer.pick(request, 16, 0.0)
        replica = balancer.replicas.index(balancer._who[request][0])
        assert position[ids[worker]] % 4 == replica
    assert min(r.picks for r in balancer.replicas) > 0
