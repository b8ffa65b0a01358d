"""``inferlb bench rollout``: a tiny run end to end through the real stack (simulated workers serving two
versions, control plane, ext_proc, Envoy), its bad inputs and its verdicts. No timing thresholds: the run
checks what holds whatever the host's speed (the report's shape, every request accounted for, no failure,
the split's share, every process stopped)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from inferlb.bench.deploy.rollout import render
from inferlb.bench.deploy.rollout_live import summarise

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"


def rollout(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*INFERLB, "bench", "rollout", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_tiny_run_counts_the_canary_and_times_a_switch_and_its_rollback(out: Path,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    report_file = tmp_path / "rollout.json"
    done = rollout("--requests", "200", "--switches", "1", "--workers", "1", "--out", str(out),
                   "--json", str(report_file))
    report = json.loads(report_file.read_text())
    canary = report["canary"]
    assert sum(canary["served"].values()) + sum(canary["failures"].values()) == 200  # every request counted
    assert canary["failures"] == {} and report["summary"]["failures"] == 0
    assert set(canary["served"]) == {INT8, FP32}
    assert abs(canary["served"][FP32] - 20) <= 3  # ext_proc's low-discrepancy split: 10% of 200, near exactly
    (pair,) = report["switches"]
    assert pair["switch"]["to"] == FP32 and pair["rollback"]["to"] == INT8
    for timing in pair.values():  # a response from the version switched to proves the change took effect
        assert timing["first_response_s"] > 0 and timing["acked_s"] > 0 and timing["failures"] == {}
    assert "canary 10%:" in done.stdout and "rollback (max of 1)" in done.stdout
    assert "switch to all-MiniLM-L6-v2-fp32" in done.stderr  # progress on stderr
    assert done.returncode == (0 if report["summary"]["rollback_within_target"] else 1), done.stderr
    assert leftovers(str(out)) == []


@pytest.mark.subprocess
@pytest.mark.parametrize("flags, message", [
    (["--canary-percent", "0"], "--canary-percent must be in (0, 100)"),
    (["--canary-percent", "100"], "--canary-percent must be in (0, 100)"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--workers", "0"], "inferlb bench rollout: --workers must be >= 1"),
])
def test_bad_arguments_are_refused_saying_why(flags: list[str], message: str) -> None:
    done = rollout(*flags, timeout=60)
    assert done.returncode == 2 and message in done.stderr


def _timing(acked: float, first: float, failures: dict[str, int] | None = None) -> dict:
    return {"acked_s": acked, "first_response_s": first, "failures": failures or {}}


def test_the_verdicts_take_the_slowest_switch_and_count_every_failure() -> None:
    canary = {"canary_share": 0.125, "within_target": False, "failures": {"HTTP 503": 1}, "requests": 200,
              "served": {INT8: 174, FP32: 25}}
    switches = [{"switch": _timing(0.02, 0.03), "rollback": _timing(0.04, 0.05)},
                {"switch": _timing(0.01, 0.02), "rollback": _timing(0.03, 1.2, {"ReadTimeout": 2})}]
    summary = summarise(canary, switches)
    assert summary["rollback_first_response_max_s"] == 1.2 and summary["rollback_acked_max_s"] == 0.04
    assert summary["switch_acked_max_s"] == 0.02
    assert not summary["rollback_within_target"] and summary["failures"] == 3
    plan = {"alias": "all-MiniLM-L6-v2", "stable": INT8, "canary": FP32, "canary_percent": 10.0, "switches": 2}
    text = render({"summary": summary, "plan": plan, "canary": canary})
    assert "25 of 200 requests (12.5%" in text and "MISSED" in text and "failed requests: 3" in text
