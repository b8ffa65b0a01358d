"""``inferlb bench cache``: its plan, the rules that read throughput at the SLO and a hit's latency off
the measurements, the verdicts and the table, bad arguments, and a tiny run through the real stack
(simulated workers, control plane, ext_proc, Envoy) with the gateway cache off and on."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from inferlb.bench.cache import cache as cache_command
from inferlb.bench.cache.cache_live import search_crossings, build_sweep, cache_scenario, refine_rate
from inferlb.bench.cache.cache_report import (
    CachePlan,
    bracket,
    cache_counts,
    hit_ratio,
    latency_figures,
    meets,
    midpoint,
    render,
    repeat_work_share,
    slo_crossing,
    throughput_at_slo,
    verdicts,
    with_refinement,
)
from inferlb.bench.routing.capacity import theoretical_capacity_rps

from .test_bench_run import INFERLB, ROOT, leftovers, out  # noqa: F401 (out: the fixture that reaps leaks)


def point(load: float, p99_ms: float, errors: int = 0, timeouts: int = 0, completed: int = 100,
          hit: float | None = None) -> dict:
    return {"load": load, "rps": load * 50, "sent": 100, "completed": completed, "errors": errors,
            "timeouts": timeouts, "p50_s": p99_ms / 2e3, "p99_s": p99_ms / 1e3, "hit_ratio": hit}


def test_the_sweeps_loads_rise_geometrically_within_bounds() -> None:
    loads = CachePlan().loads()
    assert loads[0] == 0.8 and loads[-1] <= 2.0 and len(loads) == 31
    assert all(b / a == pytest.approx(1.03, rel=1e-3) for a, b in zip(loads, loads[1:]))
    assert CachePlan(load_min=1.0, load_max=1.0).loads() == (1.0,)
    assert len(CachePlan(load_min=0.01, load_max=2.0, load_step=1.0001).loads()) == 40  # bounded


def test_throughput_at_the_slo_is_the_last_rate_met_before_the_first_miss() -> None:
    slo = 0.5
    assert throughput_at_slo([point(0.6, 100), point(0.8, 300), point(1.0, 600)], slo) == 0.8 * 50
    # an error or a timeout misses as surely as a slow p99; a later lucky rate does not count
    assert throughput_at_slo([point(0.6, 100), point(0.8, 100, errors=1), point(1.0, 100)], slo) == 0.6 * 50
    assert throughput_at_slo([point(0.6, 100, timeouts=2)], slo) == 0.0
    assert throughput_at_slo([point(0.6, 100, completed=0)], slo) == 0.0
    assert throughput_at_slo([], slo) == 0.0
    assert meets(point(1.0, 500), slo) and not meets(point(1.0, 501), slo)


def test_the_slo_crossing_interpolates_between_the_last_rate_met_and_the_first_missed() -> None:
    slo = 0.5
    assert slo_crossing([point(0.6, 100), point(0.8, 400), point(1.0, 600)], slo) == pytest.approx(45.0)
    assert slo_crossing([point(0.6, 100), point(0.8, 400, errors=1)], slo) == 30.0  # an error: no interpolation
    assert slo_crossing([point(0.6, 100), point(0.8, 400)], slo) == 40.0  # nothing missed: the last rate
    assert slo_crossing([point(0.6, 900)], slo) == 0.0


def test_hit_ratio_and_counts_from_ext_procs_metrics() -> None:
    text = """# TYPE inferlb_ext_proc_cache_requests counter
inferlb_ext_proc_cache_requests_total{level="memory",result="hit"} 30.0
inferlb_ext_proc_cache_requests_total{level="memory",result="miss"} 70.0
inferlb_ext_proc_cache_requests_total{level="redis",result="hit"} 5.0
inferlb_ext_proc_cache_requests_total{level="memory",result="bypass"} 2.0
"""
    counts = cache_counts(text)
    assert counts == {"hit": 35.0, "miss": 70.0, "bypass": 2.0}
    assert hit_ratio({"hit": 5.0, "miss": 20.0}, counts) == round(30 / 80, 4)
    assert hit_ratio(counts, counts) is None and hit_ratio({}, {}) is None  # off: no lookups
    assert cache_counts("") == {}


def test_latency_figures_count_hits_and_take_the_hits_percentiles() -> None:
    figures = latency_figures([0.001, 0.002, 0.003, 0.050], ["hit", "hit", "hit", "miss"])
    assert figures["requests"] == 4 and figures["hits"] == 3 and figures["hit_p50_ms"] == 2.0
    assert figures["all_p50_ms"] == 2.5
    none = latency_figures([0.01, 0.02], [None, "miss"])
    assert none["hits"] == 0 and "hit_p50_ms" not in none


def test_verdicts_and_the_table() -> None:
    off = [point(0.6, 100), point(0.8, 200), point(1.0, 900)]
    on = [point(0.6, 80, hit=0.3), point(0.8, 90, hit=0.31), point(1.0, 150, hit=0.3), point(1.2, 400, hit=0.3),
          point(1.4, 800, hit=0.3)]
    hits = latency_figures([0.0012] * 10, ["hit"] * 10)
    v = verdicts(off, on, hits, 0.5)
    assert v["throughput_off_rps"] == 40.0 and v["throughput_on_rps"] == 60.0 and v["ratio"] == 1.5
    assert v["ratio_met"] and v["hit_met"] and v["hit_p50_ms"] == 1.2
    assert v["crossing_off_rps"] == pytest.approx(40 + 10 * 300 / 700, abs=0.01)
    assert v["crossing_on_rps"] == pytest.approx(60 + 10 * 100 / 400, abs=0.01)
    slow = verdicts(off, on[:2], latency_figures([0.003] * 4, ["hit"] * 4), 0.5)
    assert slow["ratio"] == 1.0 and not slow["ratio_met"] and not slow["hit_met"]
    nothing = verdicts([point(0.6, 900)], on, latency_figures([0.001], [None]), 0.5)
    assert nothing["ratio"] is None and not nothing["ratio_met"] and not nothing["hit_met"]
    report = {"plan": {"repeat_rate": 0.3, "zipf_s": 1.1, "repeat_pool": 1000, "workers": 2, "slo_s": 0.5},
              "capacity_rps": 50.0, "verdicts": v, "off": {"sweep": off, "hit_series": latency_figures([0.03], [None])},
              "on": {"sweep": on, "hit_series": hits}}
    table = render(report)
    assert "1.500x (target >= 1.4x): met" in table and "p50 1.20 ms over 10 hits of 10" in table
    assert "cache off, the same body: p50 30.00 ms" in table and "30.0%" in table
    assert "p99 crosses the SLO (interpolated): off 44.3 req/s, on 62.5 req/s = 1.411x" in table
    assert len(table.splitlines()) == 2 + 5 + 3  # header, columns, one row per load, the crossing, two verdicts
    shared = {**report, "on": {**report["on"], "sweep": [{**p, "repeat_work_share": 0.3} for p in on]}}
    assert "the repeats carry 30.0% of the work (the cost model's), so an exact-match cache's ceiling is 1.43x" \
        in render(shared)


def test_the_bracket_is_the_last_rate_met_and_the_first_missed_and_bisects_geometrically() -> None:
    assert bracket([point(0.6, 100), point(0.8, 200), point(1.0, 900), point(1.2, 950)], 0.5) == (40.0, 50.0)
    assert bracket([point(0.6, 100), point(0.8, 200)], 0.5) is None  # nothing missed
    assert bracket([point(0.6, 900)], 0.5) is None  # nothing met
    assert midpoint(40.0, 90.0) == pytest.approx(60.0)


def fake_measure(crossing: float, calls: list, mode: str, fail_at: int | None = None):  # type: ignore[no-untyped-def]
    """A mode whose p99 rises through the 0.5 s SLO at ``crossing`` req/s; its ``fail_at``-th call fails."""
    async def measure(rps: float, salt: int) -> dict | None:
        calls.append((mode, rps, salt))
        if fail_at is not None and sum(c[0] == mode for c in calls) == fail_at:
            return None
        return {"rps": rps, "completed": 10, "errors": 0, "timeouts": 0, "p99_s": 0.5 * rps / crossing}
    return measure


def test_the_refinement_confirms_each_bracket_then_bisects_it_taking_turns() -> None:
    calls: list[tuple[str, float, int]] = []
    points = asyncio.run(search_crossings(
        {"off": (40.0, 50.0), "on": (60.0, 70.0)},
        {"off": fake_measure(47.0, calls, "off"), "on": fake_measure(66.0, calls, "on")}, 4, 0.5, 1.25))
    assert [c[0] for c in calls] == ["off", "on"] * 6 and len({c[2] for c in calls}) == 12  # turns, own texts
    assert [c[1] for c in calls if c[0] == "off"][:2] == [50.0, 40.0]  # both ends again, long windows
    for mode, crossing, (low, high) in (("off", 47.0, (40.0, 50.0)), ("on", 66.0, (60.0, 70.0))):
        met = [p["rps"] for p in points[mode] if meets(p, 0.5)]
        missed = [p["rps"] for p in points[mode] if not meets(p, 0.5)]
        assert max(met) < crossing < min(missed) and min(missed) / max(met) <= (high / low) ** (1 / 16) + 1e-9
        swept = [{**point(0, 400), "rps": low * 0.9}, {**point(0, 100), "rps": low}, {**point(0, 600), "rps": high}]
        assert throughput_at_slo(with_refinement(swept, points[mode]), 0.5) == max(met)


def test_a_bracket_the_long_windows_disagree_with_moves_and_a_failed_mode_stops() -> None:
    calls: list[tuple[str, float, int]] = []
    # the sweep missed 50 by chance (crossing 61): the search steps up; it met 50 by chance (crossing 48): down
    points = asyncio.run(search_crossings(
        {"up": (40.0, 50.0), "down": (50.0, 60.0)},
        {"up": fake_measure(61.0, calls, "up"), "down": fake_measure(48.0, calls, "down")}, 2, 0.5, 1.25))
    up = [c[1] for c in calls if c[0] == "up"]
    assert up[:2] == [50.0, 62.5] and len(up) == 4  # met (so the low end is confirmed), missed, 2 bisections
    down = [c[1] for c in calls if c[0] == "down"]
    assert down[:3] == [60.0, 50.0, 40.0] and len(down) == 5  # missed, missed (a step down), met, 2 bisections
    assert max(p["rps"] for p in points["down"] if meets(p, 0.5)) < 48 < min(
        p["rps"] for p in points["down"] if not meets(p, 0.5))
    assert max(p["rps"] for p in points["up"] if meets(p, 0.5)) < 61 < min(
        p["rps"] for p in points["up"] if not meets(p, 0.5))
    calls.clear()
    dropped = asyncio.run(search_crossings(
        {"off": (40.0, 50.0), "on": (60.0, 70.0)},
        {"off": fake_measure(47.0, calls, "off", fail_at=2), "on": fake_measure(66.0, calls, "on")}, 3, 0.5, 1.25))
    assert len(dropped["off"]) == 1 and len(dropped["on"]) == 5


def test_a_refinement_rate_has_its_own_texts_and_the_longer_window() -> None:
    plan = CachePlan(duration_s=2.0, warmup_s=0.5, load_step=1.5, refine_duration_s=3.0)
    scenario = cache_scenario(plan)
    capacity = theoretical_capacity_rps(scenario)
    sweep = build_sweep(plan, scenario, capacity)
    load, rps, trace, bodies = refine_rate(plan, scenario, capacity, capacity * 0.9, 1)
    assert load == 0.9 and trace.duration_s == 3.5 and (trace.repeat_of >= 0).sum() == round(0.3 * len(trace))
    _, _, _, other = refine_rate(plan, scenario, capacity, capacity * 0.9, 2)
    assert not set(bodies) & set(other) and not any(set(bodies) & set(b) for *_, b in sweep)


def test_the_verdict_reads_the_refinement_and_the_table_marks_it() -> None:
    off = [point(0.6, 100), point(0.8, 200), point(1.0, 900)]
    on = [point(0.6, 80, hit=0.3), point(1.0, 300, hit=0.3), point(1.2, 800, hit=0.3)]
    refine_on = [{**point(1.1, 450, hit=0.3), "measured_s": 45.0}, {**point(1.15, 600, hit=0.3), "measured_s": 45.0}]
    refine_off = [{**point(0.8, 350), "measured_s": 45.0}, {**point(0.9, 700), "measured_s": 45.0}]
    hits = latency_figures([0.001] * 4, ["hit"] * 4)
    assert [p["rps"] for p in with_refinement(on, refine_on)] == pytest.approx([30, 50, 55, 57.5])  # 60: superseded
    v = verdicts(with_refinement(off, refine_off), with_refinement(on, refine_on), hits, 0.5)
    assert v["throughput_off_rps"] == 40.0 and v["throughput_on_rps"] == 55.0 and v["ratio"] == 1.375
    close = verdicts([{**point(1, 100), "rps": 65.32}], [{**point(1, 100), "rps": 91.43}], hits, 0.5)
    assert close["ratio"] == 1.3997 and not close["ratio_met"]  # judged unrounded
    assert v["crossing_on_rps"] == pytest.approx(55 + 2.5 * 50 / 150, abs=0.01)
    report = {"plan": {"repeat_rate": 0.3, "zipf_s": 1.1, "repeat_pool": 1000, "workers": 2, "slo_s": 0.5},
              "capacity_rps": 50.0, "verdicts": v,
              "off": {"sweep": off, "refine": refine_off, "hit_series": latency_figures([0.03], [None])},
              "on": {"sweep": on, "refine": refine_on, "hit_series": hits}}
    table = render(report).splitlines()
    assert sum("*" in line.split("|")[0] for line in table if "|" in line) == 4  # 0.8, 0.9 (off), 1.1, 1.15
    assert [line.split("|")[1].split() for line in table if line.startswith("   0.800")] == [["200.0", "0"],
                                                                                        ["350.0", "0"]]
    assert "  * the refinement's rates (each mode's crossing bisected), 45 s each" in table


def test_the_repeats_share_of_the_work_weighs_each_request_by_the_cost_model() -> None:
    # fixed 1 + 0.5 per token: costs 5, 11, 5, 11 -> the repeats (indices 2 and 3) carry 16 / 32
    assert repeat_work_share(np.array([8, 20, 8, 20]), np.array([-1, -1, 0, 1]), 1.0, 0.5) == 0.5
    assert repeat_work_share(np.array([8, 20]), np.array([-1, -1]), 1.0, 0.5) == 0.0
    assert repeat_work_share(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1.0, 0.5) == 0.0


def test_the_sweep_replays_repeats_and_each_rate_has_its_own_fresh_texts() -> None:
    plan = CachePlan(duration_s=2.0, warmup_s=0.5, load_step=1.5)
    scenario = cache_scenario(plan)
    capacity = theoretical_capacity_rps(scenario)
    sweep = build_sweep(plan, scenario, capacity)
    assert [round(load, 4) for load, *_ in sweep] == list(plan.loads())
    (_, rps0, t0, b0), (_, rps1, t1, b1) = sweep[:2]
    assert rps1 > rps0 and not set(b0) & set(b1)
    assert (t0.repeat_of >= 0).sum() == round(0.3 * len(t0))
    assert len(set(b0)) == (t0.repeat_of < 0).sum()  # only the deliberate repeats are identical


def test_without_repeats_every_request_of_the_sweep_is_a_text_of_its_own() -> None:
    """``--repeat-rate 0`` is the cache's worst case: no body may repeat, within a rate or across rates."""
    plan = CachePlan(repeat_rate=0.0, duration_s=2.0, warmup_s=0.5, load_step=1.5)
    scenario = cache_scenario(plan)
    sweep = build_sweep(plan, scenario, theoretical_capacity_rps(scenario))
    bodies = [b for *_, rate in sweep[:2] for b in rate]
    assert len(set(bodies)) == len(bodies)


def _args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cache_command.add_arguments(parser)
    argv = [f"--{k.replace('_', '-')}={v}" if v is not True else f"--{k.replace('_', '-')}"
            for k, v in overrides.items()]
    return parser.parse_args(argv)


def test_quick_shortens_what_was_not_given() -> None:
    plan = cache_command.plan_from(_args(quick=True, duration=6))
    assert plan.duration_s == 6 and plan.load_step == 1.15 and plan.hit_requests == 100 and plan.warmup_s == 1
    assert plan.refine_steps == 0 and cache_command.plan_from(_args(quick=True, refine_steps=2)).refine_steps == 2
    assert cache_command.plan_from(_args()) == CachePlan()


@pytest.mark.parametrize(("overrides", "message"), [
    ({"repeat_rate": 1.5}, "--repeat-rate must be in [0, 1]"),
    ({"repeat_pool": 0}, "--repeat-pool must be >= 1"),
    ({"zipf_s": 0}, "--zipf-s must be > 0"),
    ({"load_min": 2, "load_max": 1}, "--load-min must be > 0 and <= --load-max"),
    ({"load_step": 1}, "--load-step must be > 1"),
    ({"duration": -1}, "--duration must be > 0"),
    ({"refine_steps": 11}, "--refine-steps must be in [0, 10]"),
    ({"refine_duration": 0}, "--refine-duration must be > 0"),
    ({"slo_ms": 0}, "--slo must be > 0"),
    ({"hit_requests": 0}, "--hit-requests must be >= 1"),
    ({"cache_max_bytes": 0}, "--cache-max-bytes must be >= 1"),
    ({"seed": -1}, "--seed must be >= 0"),
])
def test_bad_arguments_are_refused_by_name(overrides: dict, message: str, capsys: pytest.CaptureFixture) -> None:
    assert cache_command.main(_args(**overrides)) == 2
    assert message in capsys.readouterr().err


@pytest.mark.servers
@pytest.mark.envoy
@pytest.mark.slow
def test_a_tiny_run_through_the_real_stack_hits_only_with_the_cache_on(out: Path, tmp_path: Path) -> None:  # noqa: F811
    """No timing thresholds: which answers were hits, every request accounted for, no failure, all stopped."""
    report_file = tmp_path / "cache.json"
    done = subprocess.run([*INFERLB, "bench", "cache", "--load-min", "0.3", "--load-max", "0.3", "--duration", "2",
                           "--hit-requests", "20", "--out", str(out), "--json", str(report_file)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    report = json.loads(report_file.read_text())
    assert report["failures"] == [], done.stderr
    off, on = report["off"], report["on"]
    assert off["ext_proc_cache_max_bytes"] == 0 and on["ext_proc_cache_max_bytes"] == 64 * 1024 * 1024
    assert off["hit_series"]["requests"] == on["hit_series"]["requests"] == 20
    assert off["hit_series"]["hits"] == 0 and on["hit_series"]["hits"] == 20  # warmed up: every answer a hit
    (p_off,), (p_on,) = off["sweep"], on["sweep"]
    for p in (p_off, p_on):
        assert p["sent"] == p["completed"] and p["statuses"] == {"200": p["sent"]}
    assert p_off["sent"] == p_on["sent"]  # the same trace
    assert p_off["hit_ratio"] is None and 0 < p_on["hit_ratio"] < 1  # off: no lookup; on: the repeats
    assert "throughput at the SLO: off" in done.stdout and "a hit through Envoy: p50" in done.stdout
    assert "cache on: a fresh stack" in done.stderr and "each rate off and on back to back" in done.stderr
    v = report["verdicts"]
    assert done.returncode == (0 if v["ratio_met"] and v["hit_met"] else 1), done.stderr
    assert leftovers(str(out)) == []
