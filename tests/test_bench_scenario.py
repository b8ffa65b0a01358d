"""The scenario file: defaults are the issue's default scenario; bad files are refused by field name."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferlb.bench.scenario import (
    CONFIGURATIONS,
    DEFAULT_SPEEDS,
    Scenario,
    ScenarioError,
    WorkerSpec,
    load_scenario,
    scenario_from_mapping,
)


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
    ({"slowdown": {"worker": 9}}, "slowdown.worker"),
    ({"workload": {"arrival": 3}}, "workload.arrival must be a str"),
    ({"workload": {"arrival": "uniform"}}, "workload.arrival must be 'poisson' or 'bursty'"),
])
def test_bad_scenarios_are_refused_by_name(data: dict, message: str) -> None:
    with pytest.raises(ScenarioError, match=message.replace("(", r"\(").replace(")", r"\)")):
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
