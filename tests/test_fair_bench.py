"""``inferlb bench fair``: a tiny run end to end through the real stack (simulated workers, control plane,
ext_proc, Envoy; keys issued on the admin API), its bad inputs, and the shares it expects. No timing
thresholds: the end-to-end run checks what must hold whatever the host's speed (the report's shape, every
measured request accounted for, no 429 without the fair queue, every process stopped)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.fairness.fair_report import add_shares, fair_shares, fifo_shares, render

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)


def fair(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "fair", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_tiny_run_with_the_fair_queue_and_without(out: Path, tmp_path: Path) -> None:  # noqa: F811
    report_file = tmp_path / "fair.json"
    done = fair("--duration", "1.5", "--warmup", "0.5", "--scenarios", "both-over-share", "--workers", "1",
                "--out", str(out), "--json", str(report_file))
    assert done.returncode == 0, done.stderr
    assert "| both-over-share | on | light | 1 |" in done.stdout and "| both-over-share | off | heavy | 3 |" in done.stdout
    assert "keys issued for light (weight 1), heavy (weight 3)" in done.stderr  # progress on stderr
    report = json.loads(report_file.read_text())
    assert report["failures"] == []
    assert report["plan"]["weights"] == {"light": 1.0, "heavy": 3.0}
    assert [(r["scenario"], r["fair_queue"], r["fair_queue_depth"]) for r in report["runs"]] == [
        ("both-over-share", True, 8), ("both-over-share", False, 0)]
    on, off = report["runs"]
    for run in report["runs"]:
        assert list(run["tenants"]) == ["light", "heavy"]
        for t in run["tenants"].values():
            assert t["ok"] + t["rejected_429"] + t["errors"] == t["sent"]  # every measured request accounted for
            assert t["served_tps"] >= 0 and t["served_requests"] >= 0
        shares = [t["served_share"] for t in run["tenants"].values()]
        assert sum(shares) == 0 or math.isclose(sum(shares), 1.0, abs_tol=1e-3)
    # the same traces in both modes
    assert {n: t["offered_tps"] for n, t in on["tenants"].items()} == \
        {n: t["offered_tps"] for n, t in off["tenants"].items()}
    # without the fair queue (and without quotas) ext_proc refuses nothing
    assert all(t["rejected_429"] == 0 for t in off["tenants"].values())
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("flags, message", [
    (["--weights", "1"], "--weights takes two numbers"),
    (["--weights", "0,3"], "weights must be in (0, 1000]"),
    (["--scenarios", "nope"], "scenarios are a comma-separated list"),
    (["--load", "0"], "load is a multiple of capacity"),
    (["--depth", "0"], "depth must be in 1..10000"),
    (["--load", "5", "--duration", "100000"], "requests per run"),
])
def test_bad_arguments_exit_2_saying_why(flags: list[str], message: str) -> None:
    done = fair(*flags, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.subprocess
def test_help_says_what_it_measures() -> None:
    done = fair("--help", timeout=60)
    assert done.returncode == 0
    for word in ("--weights", "--quick", "fair_queue_depth", "heavy-under-share", "both-over-share"):
        assert word in done.stdout


def test_fair_shares_fill_the_small_asks_then_split_by_weight() -> None:
    weights = {"light": 1.0, "heavy": 3.0}
    # heavy asks less than its 3/4: it gets all it asks, light the rest
    under = fair_shares(weights, {"light": 1.25, "heavy": 0.25})
    assert math.isclose(under["heavy"], 0.25) and math.isclose(under["light"], 0.75)
    # both ask more than their shares: 1:3
    over = fair_shares(weights, {"light": 0.6, "heavy": 0.9})
    assert math.isclose(over["light"], 0.25) and math.isclose(over["heavy"], 0.75)
    # not saturated: everyone gets what it asks
    assert fair_shares(weights, {"light": 0.2, "heavy": 0.5}) == {"light": 0.2, "heavy": 0.5}
    # three tenants, one sated in a second round
    three = fair_shares({"a": 1.0, "b": 1.0, "c": 2.0}, {"a": 0.1, "b": 0.3, "c": 1.0})
    assert math.isclose(three["a"], 0.1) and math.isclose(three["b"], 0.3) and math.isclose(three["c"], 0.6)
    assert fair_shares(weights, {"light": 0.0, "heavy": 2.0}) == {"light": 0.0, "heavy": 1.0}


def test_fifo_shares_follow_the_offered_load_once_saturated() -> None:
    saturated = fifo_shares({"light": 0.6, "heavy": 0.9})
    assert math.isclose(saturated["light"], 0.4) and math.isclose(saturated["heavy"], 0.6)
    assert fifo_shares({"light": 0.2, "heavy": 0.5}) == {"light": 0.2, "heavy": 0.5}


def _tenant(weight: float, offered: float, served: float) -> dict:
    return {"weight": weight, "offered_tps": offered, "offered_of_capacity": offered / 1000, "served_tps": served,
            "served_requests": 10, "sent": 10, "ok": 8, "rejected_429": 2, "errors": 0, "timeouts": 0,
            "p50_s": 0.01, "p99_s": 0.02, "statuses": {"200": 8, "429": 2}}


def test_shares_are_of_what_was_served_and_the_table_shows_them() -> None:
    # the fleet served 800 tokens/s, not the modelled 1000: the expectation is on 800
    on = {"light": _tenant(1.0, 600.0, 200.0), "heavy": _tenant(3.0, 900.0, 600.0)}
    add_shares(on, fair_queue=True)
    assert on["light"]["served_share"] == 0.25 and on["heavy"]["expected_share"] == 0.75
    off = {"light": _tenant(1.0, 600.0, 320.0), "heavy": _tenant(3.0, 900.0, 480.0)}
    add_shares(off, fair_queue=False)
    assert off["light"]["expected_share"] == 0.4 and off["heavy"]["served_share"] == 0.6
    plan = {"weights": {"light": 1.0, "heavy": 3.0}, "workers": 2, "slots": 1, "load": 1.5, "warmup_s": 5.0,
            "duration_s": 55.0, "fair_queue_depth": 8}
    runs = [{"scenario": "both-over-share", "fair_queue": True, "served_tps": 800.0, "served_of_capacity": 0.8,
             "tenants": on},
            {"scenario": "both-over-share", "fair_queue": False, "served_tps": 800.0, "served_of_capacity": 0.8,
             "tenants": off}]
    text = render({"plan": plan, "capacity_tps": 1000.0, "capacity_source": "given", "runs": runs,
                   "failures": [{"mode": "off", "error": "boom"}]})
    assert "| both-over-share | on | heavy | 3 | 900 (90%) | 600 | 75.0% | 75.0% | 2 | 0 |" in text
    assert "| both-over-share | off | light | 1 | 600 (60%) | 320 | 40.0% | 40.0% |" in text
    assert "FAILED: fair queue off: boom" in text
