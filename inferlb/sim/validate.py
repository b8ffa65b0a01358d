"""The simulator against the live bench: the same scenario, loads and capacity, p50/p99 side by side.

A bench ``results.json`` holds the scenario it ran, the capacity it used and
its RunResults; each live (configuration, load, run) is simulated with that
capacity and the same trace, and the relative difference
``(sim - live) / live`` of p50 and p99 is flagged beyond ``TOLERANCE``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import Scenario, ScenarioError, scenario_from_mapping

from .runner import SimOptions, simulate

TOLERANCE = 0.20


class BenchResultsError(ValueError):
    """A results file that cannot be validated against; the message says why."""


@dataclass(frozen=True)
class Comparison:
    configuration: str
    load: float
    run: str
    live_p50_s: float
    sim_p50_s: float
    live_p99_s: float
    sim_p99_s: float

    @staticmethod
    def _diff(sim: float, live: float) -> float:
        return (sim - live) / live if live > 0 else float("inf")

    @property
    def p50_diff(self) -> float:
        return self._diff(self.sim_p50_s, self.live_p50_s)

    @property
    def p99_diff(self) -> float:
        return self._diff(self.sim_p99_s, self.live_p99_s)

    @property
    def within(self) -> bool:
        return abs(self.p50_diff) <= TOLERANCE and abs(self.p99_diff) <= TOLERANCE


def _capacity(data: Mapping[str, Any]) -> float | None:
    for key in ("capacity_rps", "capacity", "rps"):  # inferlb bench run writes {"capacity": {"rps": ...}}
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
        if isinstance(value, Mapping):
            inner = _capacity(value)
            if inner is not None:
                return inner
    return None


def _scenario_mapping(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A scenario as ``dataclasses.asdict`` wrote it, in the form ``scenario_from_mapping`` reads."""
    data = dict(raw)
    if data.get("slowdown", False) is None:
        data["slowdown"] = False
    return data


def load_bench_results(path: Path, scenario: Scenario | None = None) -> tuple[Scenario, list[RunResult]]:
    """The scenario (with the capacity the bench used) and the live results in a bench ``results.json``.

    ``scenario`` replaces the file's own (for a results file without one).
    """
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise BenchResultsError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise BenchResultsError(f"{path} is not JSON: {exc}") from None
    if isinstance(data, list):
        data = {"results": data}
    if not isinstance(data, Mapping) or not isinstance(data.get("results"), list):
        raise BenchResultsError(f"{path}: expected an object with a 'results' list (inferlb bench run's results.json)")
    if scenario is None:
        if not isinstance(data.get("scenario"), Mapping):
            raise BenchResultsError(f"{path} holds no 'scenario'; pass --scenario")
        try:
            scenario = scenario_from_mapping(_scenario_mapping(data["scenario"]))
        except ScenarioError as exc:
            raise BenchResultsError(f"{path}: bad scenario: {exc}") from None
    try:
        results = [RunResult.from_json(r) for r in data["results"]]
    except (TypeError, ValueError) as exc:
        raise BenchResultsError(f"{path}: a result is not a RunResult: {exc}") from None
    capacity = _capacity(data) or scenario.capacity_rps
    if not capacity:
        raise BenchResultsError(f"{path} records no capacity (capacity_rps) and the scenario sets none")
    return replace(scenario, capacity_rps=capacity), [r for r in results if r.source == "live"]


def compare(scenario: Scenario, live: Sequence[RunResult], options: SimOptions | None = None,
            progress: Callable[[str], None] | None = None) -> list[Comparison]:
    """Simulate each live run and pair the figures."""
    out = []
    for r in live:
        if progress is not None:
            progress(f"{r.configuration} {r.run} {r.load:.0%}")
        sim, _ = simulate(scenario, r.configuration, r.load, run=r.run, options=options)
        out.append(Comparison(r.configuration, r.load, r.run, r.p50_s, sim.p50_s, r.p99_s, sim.p99_s))
    return out


def render(comparisons: Sequence[Comparison]) -> str:
    lines = [f"Simulator vs live bench (flag: |sim - live| / live > {TOLERANCE:.0%})", "",
             "| configuration | run | load | live p50 ms | sim p50 ms | diff | live p99 ms | sim p99 ms | diff | |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in comparisons:
        lines.append(
            f"| {c.configuration} | {c.run} | {c.load:.0%} | {c.live_p50_s * 1000:.1f} | {c.sim_p50_s * 1000:.1f} "
            f"| {c.p50_diff:+.0%} | {c.live_p99_s * 1000:.1f} | {c.sim_p99_s * 1000:.1f} | {c.p99_diff:+.0%} "
            f"| {'ok' if c.within else 'FLAG'} |")
    flagged = sum(not c.within for c in comparisons)
    lines += ["", f"{len(comparisons) - flagged} of {len(comparisons)} within {TOLERANCE:.0%}; {flagged} flagged."]
    return "\n".join(lines) + "\n"


def to_json(comparisons: Sequence[Comparison]) -> list[dict[str, Any]]:
    return [{"configuration": c.configuration, "load": c.load, "run": c.run,
             "live_p50_s": c.live_p50_s, "sim_p50_s": c.sim_p50_s, "p50_diff": c.p50_diff,
             "live_p99_s": c.live_p99_s, "sim_p99_s": c.sim_p99_s, "p99_diff": c.p99_diff,
             "within_tolerance": c.within} for c in comparisons]
