"""inferlb bench autoscale: its figures from requests and pool samples (pure), the schedule, bad arguments,
and a short run through the real `inferlb up --simulate --autoscale` with nothing left running."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from inferlb.bench.deploy.autoscale import schedule
from inferlb.bench.deploy.autoscale_report import Phase, Request, Sample, p99_recovery_s, summarise, table

from .conftest import ROOT

PHASES = [Phase("low", 0.0, 10.0, 0.1), Phase("high", 10.0, 40.0, 1.5), Phase("after", 40.0, 60.0, 0.1)]


def test_figures_from_requests_and_samples() -> None:
    requests = [Request(t / 10, 0.05, True) for t in range(0, 100)]  # low: fast
    requests += [Request(10 + t / 10, 2.0 if t < 80 else 0.05, True) for t in range(0, 300)]  # slow for 8 s
    requests += [Request(40 + t / 10, 0.05, t != 5) for t in range(0, 200)]  # one failure after
    samples = [Sample(t / 2, 1, 1) for t in range(0, 24)]  # 1 worker until 12 s
    samples += [Sample(12.0, 2, 3), Sample(15.0, 3, 3), Sample(40.0, 3, 3), Sample(52.5, 1, 1)]
    report = summarise(PHASES, requests, samples, slo_s=0.25, rps=[10, 10, 10], min_workers=1)
    assert report["failed"] == 1 and report["requests"] == 600
    assert [p["requests"] for p in report["phases"]] == [100, 300, 200]  # type: ignore[index]
    assert [p["failed"] for p in report["phases"]] == [0, 0, 1]  # type: ignore[index]
    assert (report["peak_workers"], report["scale_up_first_s"], report["scale_up_peak_s"]) == (3, 2.0, 5.0)
    assert report["scale_down_s"] == 12.5
    # requests sent from 18 s on are fast: the first 5 s window starting there is the recovery
    assert report["p99_back_under_slo_s"] == 8.0
    text = table(report)
    assert "failed requests: 1 of 600" in text and "peak workers 3" in text


def test_p99_never_recovering_or_a_late_failure_is_not_recovery() -> None:
    slow = [Request(t / 10, 1.0, True) for t in range(0, 300)]
    assert p99_recovery_s(slow, 0.0, 30.0, 0.25) is None
    late_failure = [Request(t / 10, 0.05, t != 250) for t in range(0, 300)]
    assert p99_recovery_s(late_failure, 0.0, 30.0, 0.25) == 26.0  # the first window after the failure


def test_schedule_is_open_loop_per_phase_and_seeded() -> None:
    sends = schedule(PHASES, [2.0, 40.0, 2.0], seed=3)
    assert (sends == schedule(PHASES, [2.0, 40.0, 2.0], seed=3)).all()
    assert list(sends) == sorted(sends) and sends[-1] < 60.0
    high = ((sends >= 10) & (sends < 40)).sum()
    assert 30 * 40 * 0.8 < high < 30 * 40 * 1.2  # about rate x length: Poisson, not a burst


@pytest.mark.subprocess
@pytest.mark.parametrize("argv", [["--max-workers", "1"], ["--low", "2", "--high", "1.5"], ["--high-s", "0"]])
def test_bad_arguments_exit_2_saying_why(argv: list[str]) -> None:
    out = subprocess.run([sys.executable, "-m", "inferlb.cli", "bench", "autoscale", *argv], cwd=ROOT,
                         capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 2 and "need 2 <= --max-workers" in out.stderr


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_a_short_run_through_the_real_stack_scales_up_and_down_without_failures(tmp_path: Path) -> None:
    from inferlb.bench.deploy.autoscale import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "autoscale.json"
    args = parser.parse_args(["--max-workers", "2", "--low-s", "4", "--high-s", "20", "--after-s", "30",
                              "--scale-down-cooldown", "2", "--downscale-window", "3", "--json", str(out)])
    code = main(args)
    report = json.loads(out.read_text())
    assert code == 0 and report["failed"] == 0, report["phases"]
    assert report["peak_workers"] == 2 and report["scale_up_first_s"] is not None
    assert report["scale_down_s"] is not None  # back to MIN within the after phase
    assert report["requests"] == sum(p["requests"] for p in report["phases"]) > 0
