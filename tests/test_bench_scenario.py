"""The scenario file: defaults are the issue's default scenario; bad files are refused by field name; a large
fleet is described by groups and expanded deterministically, within a bound."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest

from inferlb.bench.load.scenario import (
    CONFIGURATIONS,
    DEFAULT_SPEEDS,
    MAX_WORKERS,
    Scenario,
    ScenarioError,
    Slowdown,
    WorkerGroup,
    WorkerSpec,
    expand_groups,
    load_scenario,
    scenario_from_mapping,
)

ROOT = Path(__file__).resolve().parent.parent


def test_the_default_scenario_is_the_issues() -> None:
    s = load_scenario(None)
    assert tuple(w.speed for w in s.fleet.workers) == DEFAULT_SPEEDS == (1, 1, 1, 1, 0.5, 0.5, 0.25, 0.25)
    assert s.loads == (0.5, 0.7, 0.8, 0.9)
    assert s.slowdown is not None
    assert [(b.share, b.min_tokens, b.max_tokens) for b in s.workload.mix] == [
        (0.70, 8, 32), (0.25, 64, 128), (0.05, 256, 256)]
    assert s.configurations == CONFIGURATIONS


def test_service_time_scales_with_cost_and_speed() -> None:
    s = scenario_from_mapping({"fleet": {"workers": [1, 0.5], "fixed_s": 0.002, "per_token_s": 0.001,
                                         "cost_scale": 2}})
    assert s.fleet.service_s(0, 10) == pytest.approx((0.002 + 0.010) * 2)
    assert s.fleet.service_s(1, 10) == pytest.approx(2 * s.fleet.service_s(0, 10))
    assert s.fleet.service_s(0, 10, speed=4) == pytest.approx(s.fleet.service_s(0, 10) / 4)


def test_a_toml_file_round_trips(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text("""
name = "small"
seed = 7
loads = [0.8]
slowdown = false
configurations = ["envoy_round_robin", "inferlb_pick:round_robin"]
[fleet]
workers = [1, {speed = 0.5, slots = 2}]
[[workload.mix]]
share = 1.0
min_tokens = 8
max_tokens = 16
""")
    s = load_scenario(f)
    assert (s.name, s.seed, s.loads, s.slowdown) == ("small", 7, (0.8,), None)
    assert s.fleet.workers == (WorkerSpec(1.0, 1), WorkerSpec(0.5, 2))
    assert s.configurations == ("envoy_round_robin", "inferlb_pick:round_robin")


@pytest.mark.parametrize(("data", "message"), [
    ({"fleet": {"bogus": 1}}, "fleet: unknown key(s) bogus"),
    ({"seed": "x"}, "seed must be a number"),
    ({"configurations": ["haproxy"]}, "unknown configuration 'haproxy'"),
    ({"workload": {"mix": [{"share": 0.5, "min_tokens": 8, "max_tokens": 32}]}}, "shares must add up to 1"),
    ({"workload": {"mix": [{"share": 1, "min_tokens": 8, "max_tokens": 300}]}}, "max_tokens <= 256"),
    ({"fleet": {"workers": [1, 0]}}, "speed > 0"),
    ({"loads": [0]}, "loads are fractions"),
    ({"probe_duration_s": -1}, "probe_duration_s must be >= 0"),
    ({"slowdown": {"worker": 9}}, "slowdown.worker"),
    ({"workload": {"arrival": 3}}, "workload.arrival must be a str"),
    ({"workload": {"arrival": "uniform"}}, "workload.arrival must be 'poisson' or 'bursty'"),
    ({"slowdown": {"duration_s": -1}}, "slowdown.duration_s must be >= 0"),
    ({"fleet": {"groups": []}}, "fleet.groups needs at least one group"),
    ({"fleet": {"groups": {"count": 2}}}, "fleet.groups must be an array of tables"),
    ({"fleet": {"groups": [{"count": 0}]}}, "fleet.groups[0].count must be an integer >= 1"),
    ({"fleet": {"groups": [{"count": 1}, {"count": 2.5}]}}, "fleet.groups[1].count must be an integer >= 1"),
    ({"fleet": {"groups": [{"count": True}]}}, "fleet.groups[0].count must be a number"),
    ({"fleet": {"groups": [{"count": "many"}]}}, "fleet.groups[0].count must be a number"),
    ({"fleet": {"groups": [{"count": 1, "speed": 0}]}}, "fleet.groups[0].speed must be > 0"),
    ({"fleet": {"groups": [{"count": 1, "slots": 0}]}}, "fleet.groups[0].slots must be an integer >= 1"),
    ({"fleet": {"groups": [{"count": 1, "slot": 2}]}}, "fleet.groups[0]: unknown key(s) slot"),
    ({"fleet": {"groups": [{"count": 1}], "workers": [1]}}, "fleet: give either workers or groups, not both"),
    ({"fleet": {"repeat": 2}}, "fleet.repeat needs fleet.groups"),
    ({"fleet": {"groups": [{"count": 1}], "repeat": 0}}, "fleet.repeat must be an integer >= 1"),
    ({"fleet": {"groups": [{"count": 1}], "repeat": 1.5}}, "fleet.repeat must be an integer >= 1"),
    ({"fleet": {"groups": [{"count": 10**12}]}}, "fleet.groups describe 1,000,000,000,000 workers; at most 100,000"),
    ({"fleet": {"groups": [{"count": 60_000}], "repeat": 2}}, "fleet.groups describe 120,000 workers"),
    ({"fleet": {"workers": [1] * (MAX_WORKERS + 1)}}, "fleet.workers: at most 100,000 workers"),
])
def test_bad_scenarios_are_refused_by_name(data: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=re.escape(message)):
        scenario_from_mapping(data)


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = = 1")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)


def test_scenario_is_frozen() -> None:
    with pytest.raises(AttributeError):
        Scenario().seed = 3  # type: ignore[misc]


def test_groups_expand_in_order_and_repeat() -> None:
    s = scenario_from_mapping({"fleet": {"groups": [{"count": 2, "speed": 1.0, "slots": 4}, {"count": 1, "speed": 0.5}],
                                         "repeat": 2, "cost_scale": 3}})
    one = (WorkerSpec(1.0, 4), WorkerSpec(1.0, 4), WorkerSpec(0.5, 1))
    assert s.fleet.workers == one + one
    assert s.fleet.cost_scale == 3.0
    # deterministic: the same groups give the same fleet, every time
    assert expand_groups((WorkerGroup(2, 1.0, 4), WorkerGroup(1, 0.5)), 2) == s.fleet.workers


def test_groups_at_the_bound_are_accepted() -> None:
    s = scenario_from_mapping({"fleet": {"groups": [{"count": MAX_WORKERS // 2}, {"count": MAX_WORKERS // 2,
                                                                                  "speed": 0.5}]}})
    assert len(s.fleet.workers) == MAX_WORKERS


def test_sim_scale_groups_are_the_10000_workers_it_used_to_list() -> None:
    s = load_scenario(ROOT / "scenarios" / "sim_scale.toml")
    assert s.fleet.workers == tuple(WorkerSpec(speed) for speed in DEFAULT_SPEEDS) * 1250


def test_a_scenario_from_groups_round_trips_through_its_written_form() -> None:
    # the live bench writes the scenario into results.json (asdict) and the simulator's --validate reads it
    # back: the expanded workers, no groups
    s = scenario_from_mapping({"slowdown": {"duration_s": 10.0}, "fleet": {"groups": [{"count": 3, "slots": 2}]}})
    written = json.loads(json.dumps(asdict(s)))
    assert "groups" not in written["fleet"] and len(written["fleet"]["workers"]) == 3
    assert scenario_from_mapping(written) == s


def test_slowdown_recovery_defaults_to_never() -> None:
    assert Slowdown().duration_s == 0.0
    assert load_scenario(ROOT / "scenarios" / "slowdown_recover.toml").slowdown == Slowdown(
        worker=0, factor=0.25, at_s=5.0, duration_s=10.0, load=0.8)
