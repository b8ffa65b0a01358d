"""The simulator feeds ext_proc the workers' slots as the control plane would (``inferlb/sim/weights.py``), and
ext_proc's slot-aware costing keeps inferlb close to the clairvoyant on a multi-slot fleet (issue 19, item 2).

Simulated time only: the figures are deterministic for the seed, not timings of this machine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from inferlb.bench.load.scenario import Fleet, WorkerSpec, load_scenario
from inferlb.sim.fleet import SimFleet
from inferlb.sim.oracles import ORACLE_CLAIRVOYANT
from inferlb.sim.runner import simulate
from inferlb.sim.weights import ControlPlaneModel

ROOT = Path(__file__).resolve().parent.parent


def test_the_simulated_scrape_reports_each_workers_slots_in_ext_procs_telemetry() -> None:
    fleet = SimFleet(Fleet(workers=(WorkerSpec(1.0, slots=4), WorkerSpec(0.5, slots=2), WorkerSpec(0.25))))
    pushed: list[Sequence[Mapping[str, float]]] = []
    control = ControlPlaneModel(fleet, 0.5, lambda weights, telemetry: pushed.append(telemetry),
                                lambda when, call: call(when))  # the push, at once
    control.scrape(0.5)
    control.scrape(1.0)  # the second scrape makes the first window, hence telemetry
    assert [t["slots"] for t in pushed[-1]] == [4.0, 2.0, 1.0]


def test_on_the_multi_slot_scenario_ext_proc_stays_within_the_target_of_the_clairvoyant() -> None:
    """Before the slots were costed, its p99 here was 2.15x the clairvoyant's (docs/benchmarks.md): it sent
    hundreds of requests to the single-slot quarter-speed workers. The issue's target is 1.3x."""
    scenario = replace(load_scenario(ROOT / "scenarios" / "multi_slot.toml"), duration_s=8.0)
    ours, _ = simulate(scenario, "inferlb_ext_proc", 0.8)
    ideal, _ = simulate(scenario, ORACLE_CLAIRVOYANT, 0.8)
    assert ours.p99_s <= 1.3 * ideal.p99_s, (ours.p99_s, ideal.p99_s)
    slow = [ours.spread[str(i)] for i in (4, 5)]  # the two quarter-speed single-slot workers
    fast = [ours.spread[str(i)] for i in (0, 1)]  # the two full-speed 4-slot ones
    assert max(slow) * 10 < min(fast), ours.spread
