"""``inferlb bench run --rounds``: the rotated plan, the medians over the rounds and the paired ratios, and
the table they make. Pure functions; tests/test_bench_run.py runs rounds through the real fleet."""

from __future__ import annotations

from dataclasses import replace

import pytest

from inferlb.bench.report.results import RunResult
from inferlb.bench.report.rounds import MEDIAN_ROUND, median_over_rounds, per_round_ratios, rounds_in
from inferlb.bench.routing.runner import ConfigurationPlan, RunSpec, plan_rounds
from inferlb.bench.report.table import render_markdown


def _run(configuration: str, p99: float, round_: int, *, load: float = 0.8, goodput: float = 100.0,
         completed: int = 100, spread: dict[str, int] | None = None, cpu: float = 0.5) -> RunResult:
    return RunResult(configuration=configuration, load=load, offered_rps=200 * load, duration_s=20, sent=completed,
                     completed=completed, errors=0, timeouts=0, p50_s=p99 / 4, p90_s=p99 / 2, p99_s=p99,
                     p999_s=p99 * 2, mean_s=p99 / 3, goodput_rps=goodput, slo_s=0.25,
                     spread=spread or {"h:1": completed}, cdf=((p99, 0.99), (p99 * 2, 1.0)),
                     extra={"host_cpu": cpu}, round=round_)


def test_each_round_starts_one_place_further_down_the_list() -> None:
    plans = [ConfigurationPlan(c, (RunSpec(0.8),)) for c in ("a", "b", "c")]
    got = plan_rounds(plans, 4)
    assert [(p.round, p.configuration) for p in got] == [
        (1, "a"), (1, "b"), (1, "c"), (2, "b"), (2, "c"), (2, "a"), (3, "c"), (3, "a"), (3, "b"),
        (4, "a"), (4, "b"), (4, "c")]
    assert all(p.runs == (RunSpec(0.8),) for p in got)
    assert plan_rounds(plans, 1) == plans  # one round: the plan as it was
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        plan_rounds(plans, 0)


def test_the_median_over_rounds_keeps_what_the_figures_rest_on() -> None:
    runs = [_run("x", 0.300, 1, goodput=90.0, spread={"h:1": 60, "h:2": 40}, cpu=0.4),
            _run("x", 0.100, 2, goodput=110.0, spread={"h:1": 70, "h:2": 30}, cpu=0.6),
            _run("x", 0.200, 3, goodput=100.0, spread={"h:1": 50, "h:2": 50}, cpu=0.5),
            _run("y", 0.400, 1), _run("y", 0.400, 2, load=0.5)]
    x, y80, y50 = median_over_rounds(runs)  # in the order each first appears
    assert (x.configuration, x.round, x.p99_s, x.p50_s, x.goodput_rps) == ("x", MEDIAN_ROUND, 0.2, 0.05, 100.0)
    assert (x.completed, x.duration_s, x.spread) == (300, 60, {"h:1": 180, "h:2": 120})
    assert x.cdf == ((0.2, 0.99), (0.4, 1.0))  # the median round's own curve
    assert x.extra == {"rounds": 3, "p99_min_s": 0.1, "p99_max_s": 0.3, "host_cpu": 0.5}
    assert (y80.load, y80.extra["rounds"], y50.load, y50.extra["rounds"]) == (0.8, 1, 0.5, 1)  # loads apart
    even = median_over_rounds([_run("z", 0.1, 1), _run("z", 0.3, 2)])[0]
    assert even.p99_s == pytest.approx(0.2) and even.cdf == ((0.1, 0.99), (0.2, 1.0))  # the lower run's CDF
    assert rounds_in(runs) == 3 and rounds_in([]) == 1


def test_per_round_ratios_pair_the_rounds_both_ran() -> None:
    runs = [_run("inferlb_ext_proc", 0.1, 1), _run("inferlb_ext_proc", 0.3, 2), _run("inferlb_ext_proc", 0.2, 3),
            _run("envoy_least_request", 0.2, 1), _run("envoy_least_request", 0.2, 2)]  # its round 3 failed
    assert per_round_ratios(runs, "inferlb_ext_proc", "envoy_least_request", 0.8) == pytest.approx([0.5, 1.5])
    assert per_round_ratios(runs, "inferlb_ext_proc", "envoy_least_request", 0.5) == []


def test_a_table_of_rounds_judges_by_the_medians_and_shows_each_round() -> None:
    runs = [_run("inferlb_ext_proc", p, n) for n, p in ((1, 0.1), (2, 0.3), (3, 0.2))]
    runs += [_run("envoy_least_request", p, n) for n, p in ((1, 0.2), (2, 0.2), (3, 0.5))]
    md = render_markdown(runs)
    assert "| configuration | run | load | round | offered req/s |" in md
    assert "| inferlb_ext_proc | steady | 80% | 2 | 160.0 | 75.0 | 150.0 | 300.0 | 600.0 |" in md
    assert "## Medians over 3 rounds" in md
    assert "| inferlb_ext_proc | steady | 80% | 3 | 50.0 | 200.0 | 100.0 - 300.0 | 100.0 | 300 | 50% |" in md
    # median 0.2 over median 0.2, and each round's own: 0.5x, 1.5x, 0.4x
    assert "| inferlb_ext_proc p99 / envoy_least_request p99 (80% load) | 1.00x | lower | 0.50x, 1.50x, 0.40x |" in md
    single = render_markdown([replace(r, round=1) for r in runs if r.round == 1])
    assert "round" not in single and "Medians" not in single  # one round: the table as before
