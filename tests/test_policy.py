"""Weight policies on hand-made fleet views: no servers, deterministic rounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from control_plane.model import Endpoint, Health, Telemetry
from control_plane.policies.contract import EndpointView, FleetView, WeightPolicy, fleet_view
from control_plane.policies.registry import make_weight_policy, weight_policy_params
from control_plane.policies.builtins import CapacityParams, CapacityWeightPolicy, builtin_weight_policies, damp

NOW = 100.0


def tel(
    *, tokens: float = 4000.0, cpu: float = 0.8, rps: float = 40.0, lpt: float = 0.0005, qw: float = 0.002,
    err: float = 0.0,
) -> Telemetry:
    """A worker's smoothed telemetry; the defaults are a healthy, busy worker (capacity 5000 tokens/CPU-s)."""
    return Telemetry(observed_at=NOW, tokens_per_s=tokens, cpu_utilization=cpu, rps=rps, latency_per_token_s=lpt,
                     queue_wait_mean_s=qw, error_rate=err, latency_mean_s=lpt * 100)


def view(weights: dict[str, int], fleet: dict[str, Telemetry | None], **per_endpoint: dict) -> FleetView:
    return FleetView(
        endpoints=tuple(
            EndpointView(id=i, health=Health.HEALTHY, weight=weights[i], telemetry=fleet[i], stale=fleet[i] is None,
                         **per_endpoint.get(i, {}))
            for i in weights
        ),
        now=NOW,
    )


def run_rounds(policy: WeightPolicy, weights: dict[str, int], fleet: dict[str, Telemetry | None],
               n: int) -> list[dict[str, int]]:
    """``n`` control rounds with fixed telemetry, each round's weights fed back as the next one's current."""
    history = []
    for _ in range(n):
        weights = dict(policy.compute(view(weights, fleet)))
        history.append(weights)
    return history


def test_a_slow_worker_loses_weight_within_a_few_rounds_and_recovers() -> None:
    policy = CapacityWeightPolicy()
    weights = {"a": 100, "b": 100, "c": 100}
    slow = {"a": tel(), "b": tel(), "c": tel(lpt=0.0015, qw=0.05)}
    history = run_rounds(policy, weights, slow, 5)
    assert all(h["c"] < prev["c"] for prev, h in zip([weights, *history], history))  # falls every round
    assert history[-1]["c"] < 0.5 * history[-1]["a"]
    assert history[-1]["a"] == history[-1]["b"] > 100

    recovered = run_rounds(policy, history[-1], {"a": tel(), "b": tel(), "c": tel()}, 10)
    assert recovered[-1]["c"] == pytest.approx(recovered[-1]["a"], rel=0.1)


def test_share_follows_capacity_across_fast_and_slow_machines() -> None:
    fleet = {"fast": tel(tokens=8000, cpu=0.8), "slow": tel(tokens=2000, cpu=0.8)}
    final = run_rounds(CapacityWeightPolicy(), {"fast": 100, "slow": 100}, fleet, 10)[-1]
    assert final["fast"] / final["slow"] == pytest.approx(4.0, rel=0.05)
    assert (final["fast"] + final["slow"]) / 2 == pytest.approx(100, abs=2)


def test_capacity_is_per_cpu_not_per_traffic() -> None:
    # Same machine, one simply got less traffic: its weight must not sink because of it.
    fleet = {"busy": tel(tokens=4000, cpu=0.8, rps=40), "light": tel(tokens=1000, cpu=0.2, rps=10)}
    final = run_rounds(CapacityWeightPolicy(), {"busy": 100, "light": 100}, fleet, 10)[-1]
    assert final == {"busy": 100, "light": 100}


def test_a_fail_fast_worker_loses_weight() -> None:
    fleet = {"a": tel(), "b": tel(), "f": tel(tokens=800, cpu=0.3, rps=200, lpt=0.00005, qw=0.0, err=0.6)}
    history = run_rounds(CapacityWeightPolicy(), {"a": 100, "b": 100, "f": 100}, fleet, 8)
    assert all(h["f"] < prev["f"] for prev, h in zip([{"f": 100}, *history], history[:6]))
    assert history[-1]["f"] < 10
    assert history[-1]["a"] > 100


def test_fail_fast_with_too_little_cpu_to_measure_is_still_cut() -> None:
    fleet = {"a": tel(), "f": tel(tokens=0, cpu=0.01, rps=50, lpt=0.0, qw=0.0, err=0.9)}
    history = run_rounds(CapacityWeightPolicy(), {"a": 100, "f": 100}, fleet, 15)
    assert history[-1]["f"] == 1


def test_failures_do_not_poison_the_remembered_capacity() -> None:
    policy = CapacityWeightPolicy()
    weights = {"a": 100, "b": 100}
    weights = run_rounds(policy, weights, {"a": tel(), "b": tel()}, 2)[-1]  # b's capacity is measured
    failing = {"a": tel(), "b": tel(tokens=50, cpu=0.5, rps=100, err=0.8)}
    weights = run_rounds(policy, weights, failing, 10)[-1]
    assert weights["b"] < 10
    # b is fine again but, at a low weight, gets too little traffic to measure its CPU: its last capacity holds
    healed = {"a": tel(), "b": tel(tokens=40, cpu=0.01, rps=1.0)}
    assert run_rounds(policy, weights, healed, 12)[-1]["b"] == pytest.approx(100, abs=3)


def test_damping_bounds_the_change_per_round() -> None:
    fleet = {"fast": tel(tokens=40000, cpu=0.8), "slow": tel(tokens=400, cpu=0.8)}
    first = CapacityWeightPolicy().compute(view({"fast": 100, "slow": 100}, fleet))
    assert first == {"fast": 150, "slow": 67}
    tight = CapacityWeightPolicy(CapacityParams(max_step=1.1))
    assert tight.compute(view({"fast": 100, "slow": 100}, fleet)) == {"fast": 110, "slow": 91}


def test_damp() -> None:
    assert damp(100, 1000.0, 1.5) == 150
    assert damp(100, 0.0, 1.5) == 67
    assert damp(1, 0.0, 1.5) == 1  # never zero
    assert damp(1, 50.0, 1.5) == 2
    assert damp(1, 50.0, 1.01) == 2  # low weights still move a whole unit
    assert damp(1000, 5000.0, 1.5) == 1000
    assert damp(100, 103.0, 1.5, min_change=0.05) == 100  # not worth a push


def test_weights_are_never_zero_and_stay_in_range() -> None:
    fleet = {"dead": tel(tokens=0.0, cpu=0.9), "ok": tel(), "great": tel(tokens=40000, cpu=0.5)}
    history = run_rounds(CapacityWeightPolicy(), {"dead": 100, "ok": 100, "great": 100}, fleet, 30)
    for weights in history:
        assert all(isinstance(w, int) and 1 <= w <= 1000 for w in weights.values())
    assert history[-1]["dead"] == 1


@pytest.mark.parametrize(
    "case",
    [
        {"telemetry": None, "stale": True},
        {"stale": True},
        {"health": Health.UNHEALTHY},
        {"draining": True},
        {"telemetry": tel(rps=0.0, tokens=0.0, cpu=0.0)},  # idle: no fresh capacity figure
    ],
    ids=["no-telemetry", "stale", "unhealthy", "draining", "idle"],
)
def test_no_usable_data_keeps_the_current_weight(case: dict) -> None:
    terrible = tel(tokens=1, cpu=1.0, lpt=1.0, qw=5.0, err=1.0)
    endpoint = replace(EndpointView(id="x", health=Health.HEALTHY, weight=137, telemetry=terrible, stale=False), **case)
    others = [EndpointView(id=i, health=Health.HEALTHY, weight=100, telemetry=tel(), stale=False) for i in "ab"]
    weights = CapacityWeightPolicy().compute(FleetView((endpoint, *others), NOW))
    assert weights["x"] == 137 and set(weights) == {"x", "a", "b"}


def test_cold_start_with_no_data_keeps_everything() -> None:
    weights = {"a": 100, "b": 250}
    assert CapacityWeightPolicy().compute(view(weights, {"a": None, "b": None})) == weights


def test_fleet_view_marks_stale_telemetry() -> None:
    endpoints = (
        Endpoint("127.0.0.1", 8101, telemetry=Telemetry(observed_at=99.0), computed_weight=120),
        Endpoint("127.0.0.1", 8102, telemetry=Telemetry(observed_at=90.0)),
        Endpoint("127.0.0.1", 8103, health=Health.UNHEALTHY, draining=True),
    )
    v = fleet_view(endpoints, now=100.0, max_age_s=2.0)
    assert [(e.id, e.stale, e.weight) for e in v.endpoints] == [
        ("127.0.0.1:8101", False, 120), ("127.0.0.1:8102", True, 100), ("127.0.0.1:8103", True, 100),
    ]
    assert v.endpoints[2].health is Health.UNHEALTHY and v.endpoints[2].draining


def test_equal_policy() -> None:
    policy = make_weight_policy("equal", {})
    assert policy.name == "equal"
    fleet = {"a": tel(), "b": tel(err=1.0)}
    assert policy.compute(view({"a": 3, "b": 700}, fleet)) == {"a": 100, "b": 100}


def test_registry_builds_and_validates() -> None:
    assert set(builtin_weight_policies()) == {"capacity", "equal"}
    policy = make_weight_policy("capacity", {"max_step": 2, "error_exponent": 8.0})
    assert isinstance(policy, CapacityWeightPolicy) and policy.name == "capacity"
    assert weight_policy_params(policy)["max_step"] == 2.0
    assert weight_policy_params(make_weight_policy("capacity"))["cpu_floor"] == CapacityParams().cpu_floor

    with pytest.raises(ValueError, match="unknown weight policy 'fastest'.*capacity, equal"):
        make_weight_policy("fastest", {})
    with pytest.raises(ValueError, match="unknown parameter.*max_stepp.*accepted: cpu_floor"):
        make_weight_policy("capacity", {"max_stepp": 2})
    with pytest.raises(ValueError, match="unknown parameter.*accepted: none"):
        make_weight_policy("equal", {"x": 1})
    with pytest.raises(ValueError, match="'max_step'.*finite number"):
        make_weight_policy("capacity", {"max_step": "fast"})
    with pytest.raises(ValueError, match="'min_rps'.*number"):
        make_weight_policy("capacity", {"min_rps": True})
    with pytest.raises(ValueError, match="'cpu_floor'.*finite"):
        make_weight_policy("capacity", {"cpu_floor": float("nan")})
    with pytest.raises(ValueError, match="weight policy 'capacity': out of range: max_step=1.0"):
        make_weight_policy("capacity", {"max_step": 1.0})
