"""``inferlb bench overload``: a short run end to end through the real stack (simulated workers, control
plane, ext_proc, Envoy), then simulated; its bad inputs; how it judges the targets. No timing thresholds:
the end-to-end run checks what the run must hold whatever the host's speed (same trace both times, the
classes the simulator draws, no 429 without shedding, every process stopped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.load.classes import trace_classes
from inferlb.bench.fairness.overload_report import render, run_figures, verdicts
from inferlb.bench.load.scenario import load_scenario
from inferlb.bench.load.trace import build_trace

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)

TINY = """\
name = "tiny-overload"
seed = 3
duration_s = 2.0
warmup_s = 0.5
slo_s = 0.5
shed_slo_ms = 250.0
request_timeout_s = 5.0
capacity_rps = 40.0
loads = [1.3]
slowdown = false
configurations = ["inferlb_ext_proc"]
pick_policy_loads = []

[workload.classes]
critical = 0.2
standard = 0.5
sheddable = 0.3

[fleet]
workers = [1.0, 0.5]
cost_scale = 4.0
"""


def overload(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "overload", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_short_overload_run_live_and_simulated(out: Path, tmp_path: Path) -> None:  # noqa: F811
    scenario_file = tmp_path / "tiny.toml"
    scenario_file.write_text(TINY)
    report_file = tmp_path / "overload.json"
    done = overload("--scenario", str(scenario_file), "--out", str(out), "--json", str(report_file), "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "| shedding | live |" in done.stdout and "| baseline | sim |" in done.stdout
    report = json.loads(report_file.read_text())
    assert [(r["run"], r["source"]) for r in report["runs"]] == [
        ("shedding", "live"), ("baseline", "live"), ("shedding", "sim"), ("baseline", "sim")]
    assert report["capacity"]["rps"] == 40.0 and report["capacity"]["source"] == "scenario"
    # every run sent the same trace, each request as the class the simulator gives it
    scenario = load_scenario(scenario_file)
    trace = build_trace(scenario.workload, 1.3 * 40.0, 2.5, scenario.seed)
    classes = trace_classes(scenario.workload.classes, len(trace), scenario.seed)[trace.send_at_s >= 0.5]
    expected = {name: int((classes == p).sum()) for p, name in enumerate(("critical", "standard", "sheddable"))}
    for run in report["runs"]:
        assert {name: c["sent"] for name, c in run["classes"].items()} == expected, run["run"]
        for c in run["classes"].values():
            assert c["completed"] + c["shed"] + c["errors"] == c["sent"]
    live_baseline = report["runs"][1]
    assert live_baseline["shed"] == 0  # slo_ms 0: ext_proc sheds nothing
    assert all(c["shed"] == 0 for run in report["runs"] for name, c in run["classes"].items() if name != "sheddable")
    for run in report["runs"][:2]:  # live: ext_proc's count of its sheds by step, and Envoy's own times for them
        sheddable = run["classes"]["sheddable"]
        assert set(sheddable["shed_at"]) == {"request_headers", "screen", "fair_queue", "decision"}
        assert sum(sheddable["shed_at"].values()) >= sheddable["shed"]  # the warm-up's sheds too
        gateway = sheddable["gateway_429"]
        assert (gateway["count"] > 0) == (sheddable["shed"] > 0), run["run"]
        assert gateway["count"] <= sum(sheddable["shed_at"].values())
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("text, message", [
    ('name = "plain"\n', "has no class mix"),
    ('shed_slo_ms = 0\n[workload.classes]\ncritical = 0.5\nstandard = 0.5\n', "shed_slo_ms is 0"),
    ('[workload.classes]\ncritical = 0.5\nstandard = 0.6\n', "add up to 1"),
])
def test_bad_scenarios_exit_2_saying_why(tmp_path: Path, text: str, message: str) -> None:
    scenario_file = tmp_path / "s.toml"
    scenario_file.write_text(text)
    done = overload("--scenario", str(scenario_file), timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.subprocess
def test_a_bad_load_exits_2() -> None:
    done = overload("--load", "3", timeout=60)
    assert done.returncode == 2 and "loads" in done.stderr, done.stderr


@pytest.mark.subprocess
def test_help_names_the_targets() -> None:
    done = overload("--help", timeout=60)
    assert done.returncode == 0 and "--quick" in done.stdout and "5 ms" in done.stdout and "95%" in done.stdout


def _classes(critical_p99: float, errors: int, shed_p99: float | None, goodput: float,
             gateway_p99_ms: float | None = None) -> dict:
    gateway = {} if gateway_p99_ms is None else {"gateway_429": {"count": 5, "p50_ms": 1.0, "p99_ms": gateway_p99_ms,
                                                                   "max_ms": 9}}
    return {"critical": {"sent": 10, "completed": 10 - errors, "shed": 0, "errors": errors, "p50_s": 0.01,
                         "p99_s": critical_p99, "goodput_rps": goodput / 2},
            "sheddable": {"sent": 10, "completed": 5, "shed": 5, "errors": 0, "p50_s": 0.01, "p99_s": 0.2,
                          "shed_p99_s": shed_p99, "goodput_rps": goodput / 2, **gateway}}


def test_the_targets_are_judged_as_the_issue_states_them() -> None:
    met = run_figures("shedding", "live", 130.0, 100.0, 0.5, _classes(0.4, 0, 0.004, 96.0, 3.0), 10.0)
    assert verdicts(met) == {"critical_within_slo": True, "shed_429_within_5ms": True,
                             "gateway_429_within_5ms": True, "goodput_95pct": True}
    missed = run_figures("shedding", "live", 130.0, 100.0, 0.5, _classes(0.6, 0, 0.006, 94.0, 6.0), 10.0)
    assert verdicts(missed) == {"critical_within_slo": False, "shed_429_within_5ms": False,
                                "gateway_429_within_5ms": False, "goodput_95pct": False}
    errors = run_figures("shedding", "live", 130.0, 100.0, 0.5, _classes(0.1, 1, None, 96.0), 10.0)
    assert verdicts(errors)["critical_within_slo"] is False and verdicts(errors)["shed_429_within_5ms"] is None
    simulated = run_figures("shedding", "sim", 130.0, 100.0, 0.5, _classes(0.1, 0, 0.007, 96.0), 10.0)
    assert verdicts(simulated)["shed_429_within_5ms"] is None  # the simulator's 429 time is a constant
    text = render({"scenario": "s", "capacity": {"rps": 100.0, "source": "scenario"}, "load": 1.3, "classes": "mix",
                   "slo_s": 0.5, "shed_slo_ms": 250.0, "runs": [met, missed]})
    assert "goodput_95pct MISSED" in text and "critical_within_slo met" in text
    assert "gateway_429_within_5ms met" in text and "Envoy's own time for 5 429s" in text
    assert np.isclose(met["goodput_of_capacity"], 0.96)
