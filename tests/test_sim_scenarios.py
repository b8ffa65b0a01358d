"""Scenario variety in the simulator (issue 19, item 4): each new scenario file loads and simulates with the
oracles, its defining property shows in the run, a slowed worker recovers when the scenario says so, and
``--summary`` writes figures per (configuration, run, load) without per-request or per-worker data."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.load.scenario import Fleet, Scenario, Slowdown, WorkerSpec, load_scenario
from inferlb.sim.oracles import ORACLE_CLAIRVOYANT, ORACLES
from inferlb.sim.report import VS_ORACLE, against_oracles
from inferlb.sim.runner import SLOWDOWN, STEADY, simulate

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"
NEW = ("multi_input", "bimodal", "multi_slot", "slowdown_recover")


def short(name: str) -> Scenario:
    """The scenario file shortened to a few simulated seconds at 80% load; everything else as written."""
    return replace(load_scenario(SCENARIOS / f"{name}.toml"), duration_s=4.0, warmup_s=1.0, loads=(0.8,))


@pytest.mark.parametrize("name", NEW)
def test_each_new_scenario_simulates_against_the_oracles(name: str) -> None:
    scenario = short(name)
    runs = [(STEADY, 0.8)] + ([(SLOWDOWN, scenario.slowdown.load)] if scenario.slowdown is not None else [])
    results = [simulate(scenario, c, load, run=run)[0]
               for run, load in runs for c in ("inferlb_ext_proc", *ORACLES)]
    for r in against_oracles(results):
        assert r.sent > 100 and r.completed > 0.9 * r.sent, (r.configuration, r.run)
        if r.configuration == "inferlb_ext_proc":
            assert r.extra[VS_ORACLE]["p99_ratio"] > 0 and r.extra[VS_ORACLE]["goodput_ratio"] > 0


def test_multi_input_requests_cost_their_inputs() -> None:
    scenario = short("multi_input")
    assert scenario.workload.inputs_per_request == 4
    four, _ = simulate(scenario, ORACLE_CLAIRVOYANT, 0.8)
    one, _ = simulate(replace(scenario, workload=replace(scenario.workload, inputs_per_request=1)),
                      ORACLE_CLAIRVOYANT, 0.8)
    assert four.offered_rps < one.offered_rps / 3  # capacity counts the inputs
    assert four.p50_s > 2 * one.p50_s  # and so does each request's service time


def test_bimodal_lengths_come_from_the_two_buckets_only() -> None:
    _, raw = simulate(short("bimodal"), ORACLE_CLAIRVOYANT, 0.8)
    tokens = raw["tokens"]
    short_ones, long_ones = (tokens >= 8) & (tokens <= 16), (tokens >= 240) & (tokens <= 256)
    assert np.all(short_ones | long_ones)
    assert 0.4 < short_ones.mean() < 0.6


def test_multi_slot_workers_take_work_by_slots() -> None:
    scenario = short("multi_slot")
    assert [w.slots for w in scenario.fleet.workers] == [4, 4, 2, 2, 1, 1]
    result, _ = simulate(scenario, ORACLE_CLAIRVOYANT, 0.8)
    per_worker = [result.spread[str(i)] for i in range(6)]
    assert min(per_worker[:2]) > max(per_worker[2:4]) > max(per_worker[4:])


def test_a_slowed_worker_recovers_after_duration_s() -> None:
    # Round robin sends every request to the same worker whatever the speeds, so the two runs differ only in
    # worker 0's speed after the recovery: no request is later, and some are earlier.
    base = Scenario(name="recover", duration_s=6.0, warmup_s=1.0, loads=(0.5,), hop_overhead_s=0.0,
                    fleet=Fleet(workers=(WorkerSpec(1.0), WorkerSpec(1.0))))
    forever = replace(base, slowdown=Slowdown(worker=0, factor=0.5, at_s=1.0, duration_s=0.0, load=0.5))
    recover = replace(base, slowdown=Slowdown(worker=0, factor=0.5, at_s=1.0, duration_s=2.0, load=0.5))
    _, a = simulate(forever, "envoy_round_robin", 0.5, run=SLOWDOWN)
    _, b = simulate(recover, "envoy_round_robin", 0.5, run=SLOWDOWN)
    assert np.array_equal(a["worker"], b["worker"])
    assert np.all(b["latency"] <= a["latency"] + 1e-12)
    assert np.sum(b["latency"] < a["latency"] - 1e-9) > 50


@pytest.mark.subprocess
def test_summary_has_figures_per_run_and_no_per_request_data(tmp_path: Path) -> None:
    out, full = tmp_path / "summary.json", tmp_path / "full.json"
    done = subprocess.run([sys.executable, "-m", "inferlb.cli", "sim", "--scenario", str(SCENARIOS / "smoke.toml"),
                           "--oracles", "--workers", "300", "--no-progress", "--summary", str(out), "--json", str(full)],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert (summary["scenario"], summary["workers"], summary["slots"]) == ("smoke", 300, 300)
    assert summary["capacity_rps"] == 30.0 and summary["slowdown"] is None
    runs = summary["results"]
    assert [(r["configuration"], r["run"], r["load"]) for r in runs] == [
        (c, STEADY, 0.5) for c in ("envoy_round_robin", "nginx_least_conn", "inferlb_ext_proc", *ORACLES)]
    for r in runs:
        assert {"p50_s", "p99_s", "goodput_rps", "sent", "completed", "timeouts", "spread"} <= set(r)
        assert "cdf" not in r and "weights" not in r
        # the spread per kind of worker: smoke's speeds 1, 0.5, 0.25 repeated to 300 workers
        assert set(r["spread"]) == {"speed 1, 1 slot", "speed 0.5, 1 slot", "speed 0.25, 1 slot"}
        assert sum(k["workers"] for k in r["spread"].values()) == 300
        assert (VS_ORACLE in r) == (r["configuration"] not in ORACLES)
    inferlb = runs[2]
    assert inferlb[VS_ORACLE]["p99_ratio"] == pytest.approx(
        inferlb["p99_s"] / min(r["p99_s"] for r in runs if r["configuration"] in ORACLES))
    # the full RunResults carry every worker's count and the CDF; the summary does not grow with the fleet
    assert len(out.read_bytes()) < len(full.read_bytes()) / 4
