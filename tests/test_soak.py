"""The soak (``inferlb bench soak``, issue 20): its verdicts on made-up series (a growing one must fail), and its
machinery for a few seconds at low load on the real stack (Envoy, the control plane, ext_proc, simulated
workers). The short run asserts the report's structure, zero client errors and that everything in flight
drained after the load (waited on with a deadline); it asserts no growth verdict: a few seconds say nothing
about a slope. Every process is stopped by the runner's ``ProcessGroup``, even when a test fails.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.reliability.soak_judge import (
    PER,
    TOLERANCES,
    downsample,
    fit,
    judge_bounded,
    judge_growth,
    judge_run,
    judge_zero,
)
from inferlb.bench.reliability.soak_live import JSON_POINTS, SoakPlan, SoakRunner

MIB = 2**20
TIMES = [float(t) for t in range(0, 600, 10)]  # a 10-minute run sampled every 10 s
WARMUP_S = 120.0


def noisy(values: list[float], scale: float, seed: int = 1) -> list[float]:
    rng = np.random.default_rng(seed)
    return [v + float(rng.normal(0, scale)) for v in values]


def test_fit_recovers_a_line_in_units_per_10_minutes() -> None:
    trend = fit([(t, 5.0 + 0.01 * t) for t in TIMES])
    assert trend.growth == pytest.approx(0.01 * PER)
    assert trend.stderr == pytest.approx(0.0, abs=1e-9)
    assert (trend.first, trend.last) == (5.0, pytest.approx(5.0 + 0.01 * TIMES[-1]))


def test_fit_refuses_too_few_samples() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit([(0.0, 1.0), (1.0, 2.0)])


def test_a_leaking_rss_fails() -> None:
    # 20 MiB per 10 minutes, with allocator jitter on top: a leak
    rss = noisy([90 * MIB + 20 * MIB * t / PER for t in TIMES], 0.3 * MIB)
    check = judge_growth("rss", "ext_proc", list(zip(TIMES, rss)), WARMUP_S, TOLERANCES["rss"], MIB)
    assert not check.passed and check.verdict == "FAIL"
    assert check.trend is not None and check.trend.growth == pytest.approx(20, rel=0.1)


def test_a_flat_noisy_rss_passes_and_warm_up_growth_is_not_judged() -> None:
    # grows 30 MiB during the warm-up (pools, caches), then flat with jitter
    rss = noisy([(60 + 30 * min(t, WARMUP_S) / WARMUP_S) * MIB for t in TIMES], 0.3 * MIB)
    check = judge_growth("rss", "envoy", list(zip(TIMES, rss)), WARMUP_S, TOLERANCES["rss"], MIB)
    assert check.passed, check


def test_jittering_connections_pass_but_steadily_growing_ones_fail() -> None:
    jitter = noisy([40.0] * len(TIMES), 10.0, seed=2)
    assert judge_growth("connections", "envoy", list(zip(TIMES, jitter)), WARMUP_S, TOLERANCES["connections"]).passed
    growing = [40.0 + t / 10 for t in TIMES]  # one more every 10 s: 60 per 10 min
    assert not judge_growth("connections", "envoy", list(zip(TIMES, growing)), WARMUP_S,
                            TOLERANCES["connections"]).passed


def test_too_few_samples_after_the_warm_up_fail() -> None:
    check = judge_growth("rss", "envoy", [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0)], 1.5, TOLERANCES["rss"])
    assert not check.passed and "only 1 samples" in check.figure


def test_series_that_flap_are_bounded_but_new_ones_after_the_warm_up_are_not() -> None:
    flapping = [(t, 100.0 + (3 if int(t) % 20 else 0)) for t in TIMES]  # an endpoint's series come and go
    assert judge_bounded("series", "ext_proc", flapping, WARMUP_S).passed
    growing = [(t, 100.0 + (t // 60)) for t in TIMES]  # a series more every minute (a label per client, say)
    check = judge_bounded("series", "ext_proc", growing, WARMUP_S)
    assert not check.passed and "highest 109" in check.figure


def test_zero_means_exactly_zero_and_unread_fails() -> None:
    assert judge_zero("at rest", "ext_proc", 0.0, "outstanding").passed
    assert not judge_zero("at rest", "ext_proc", 1.0, "outstanding").passed
    assert not judge_zero("at rest", "ext_proc", None, "outstanding").passed


def test_judge_run_fails_exactly_the_leaking_process_and_the_errors() -> None:
    flat = list(zip(TIMES, noisy([80 * MIB] * len(TIMES), 0.2 * MIB)))
    series = {
        "rss:envoy": flat, "rss:ext_proc": [(t, 80 * MIB + 50 * MIB * t / PER) for t in TIMES],
        "fds:envoy": [(t, 40.0) for t in TIMES], "fds:ext_proc": [(t, 30.0) for t in TIMES],
        "connections:envoy": [(t, 20.0) for t in TIMES], "connections:ext_proc": [(t, 6.0) for t in TIMES],
        "series:envoy": [(t, 1466.0) for t in TIMES], "series:ext_proc": [(t, 111.0) for t in TIMES],
        "outstanding:requests": list(zip(TIMES, noisy([3.0] * len(TIMES), 1.0))),
    }
    rest = {"outstanding:requests": 0.0, "outstanding:tokens": 0.0, "outstanding:seconds": 0.0,
            "outstanding:streams": 0.0, "outstanding:leaked": 0.0, "inflight:worker:1": 0.0}
    counts = {"failed": 2, "sent": 100, "non_2xx": 1, "no_answer": 1, "timeouts": 0}
    checks = judge_run(series.__getitem__, sorted(series), WARMUP_S, failed=counts, rest=rest, drained_s=0.4)
    failed = {(c.check, c.subject) for c in checks if not c.passed}
    assert failed == {("errors", "clients"), ("rss", "ext_proc")}
    assert {(c.check, c.subject) for c in checks} >= {("rss", "envoy"), ("fds", "ext_proc"), ("series", "envoy"),
                                                      ("outstanding", "ext_proc"), ("leaked", "ext_proc"),
                                                      ("at rest", "workers")}


def test_downsample_keeps_the_ends_and_the_bound() -> None:
    samples = [(float(i), float(i)) for i in range(1000)]
    kept = downsample(samples, 40)
    assert len(kept) == 40 and kept[0] == samples[0] and kept[-1] == samples[-1]
    assert downsample(samples[:5], 40) == samples[:5]


def test_plan_problems_name_the_bad_argument() -> None:
    assert SoakPlan().problems() == []
    assert any("--load" in p for p in SoakPlan(load=0).problems())
    assert any("--every" in p for p in SoakPlan(duration_s=10, every_s=5).problems())


@pytest.mark.slow
@pytest.mark.servers
@pytest.mark.envoy
def test_a_short_soak_of_the_real_stack_reports_every_process_and_no_error(tmp_path: Path) -> None:
    plan = SoakPlan(duration_s=6.0, load=0.2, workers=2, every_s=1.0, warmup=0.2)
    lines: list[str] = []
    runner = SoakRunner(plan, tmp_path, lines.append)
    result = asyncio.run(runner.run())
    log = "\n".join(lines)
    figures = result.load_figures()
    assert figures["sent"] > 0 and figures["failed"] == 0 and figures["succeeded"] == figures["sent"], figures
    processes = {"envoy", "control-plane", "ext_proc", *(f"worker:{p}" for p in runner.layout.ports)}
    assert len(result.samples) >= 3, log
    for _, sample in [(0.0, result.before), *result.samples, (0.0, result.rest)]:
        for p in processes:
            assert sample[f"rss:{p}"] > 0 and sample[f"fds:{p}"] > 0 and sample[f"series:{p}"] > 0, (p, sample)
            assert f"connections:{p}" in sample
    subjects = {(c.check, c.subject) for c in result.checks}
    for p in processes:
        assert {("rss", p), ("fds", p), ("connections", p), ("series", p)} <= subjects
    assert {("errors", "clients"), ("outstanding", "ext_proc"), ("leaked", "ext_proc"), ("at rest", "ext_proc"),
            ("at rest", "workers")} <= subjects
    # No growth verdict after 6 s; but no error, nothing leaked, and nothing in flight once the load stopped.
    assert all(c.passed for c in result.checks if c.check in ("errors", "leaked", "at rest")), \
        [c for c in result.checks if not c.passed]
    assert result.drained_s is not None, log
    report = json.loads(json.dumps(result.to_json()))  # serialisable as is
    assert {"plan", "load", "checks", "samples", "at_rest_before", "at_rest_after", "passed"} <= set(report)
    assert report["samples"]["count"] == len(result.samples)
    assert all(len(points) <= JSON_POINTS for points in report["samples"]["series"].values())
    assert sum("/6 s" in line for line in lines) == len(result.samples), log  # a progress line per sample
