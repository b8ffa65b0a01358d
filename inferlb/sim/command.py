"""``inferlb sim``'s body: build the scenario from the flags, run every (configuration, load), report."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from inferlb.bench.report.results import RunResult
from inferlb.bench.load.scenario import (
    CONFIGURATIONS,
    PICK_PREFIX,
    Fleet,
    Scenario,
    ScenarioError,
    known_configuration,
    load_scenario,
)

from . import report
from .oracles import ORACLES, is_oracle
from .runner import SLOWDOWN, STEADY, SimOptions, capacity_rps, simulate


class UsageError(ValueError):
    """A flag the simulator cannot use; exit status 2."""


def _floats(values: list[str], flag: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated numbers, got {','.join(values)!r}") from None


def scaled_fleet(fleet: Fleet, n: int) -> Fleet:
    """``n`` workers repeating ``fleet``'s workers (speed and slots) in order."""
    if n < 1:
        raise UsageError(f"--workers must be >= 1, got {n}")
    return replace(fleet, workers=tuple(fleet.workers[i % len(fleet.workers)] for i in range(n)))


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    scenario = load_scenario(Path(args.scenario) if args.scenario else None)
    changes: dict[str, Any] = {}
    if args.configurations:
        unknown = [c for c in args.configurations if not (known_configuration(c) or is_oracle(c))]
        if unknown:
            raise UsageError(f"unknown configuration {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join(CONFIGURATIONS + ORACLES)}, {PICK_PREFIX}<policy>")
        # the oracles are the simulator's own: a Scenario (shared with the live bench) does not list them
        changes["configurations"] = tuple(c for c in args.configurations if not is_oracle(c))
        changes["pick_policies"] = ()
    if args.loads:
        changes["loads"] = _floats(args.loads, "--loads")
    if args.workers is not None:
        changes["fleet"] = scaled_fleet(scenario.fleet, args.workers)
        if scenario.slowdown is not None and scenario.slowdown.worker >= args.workers:
            changes["slowdown"] = replace(scenario.slowdown, worker=0)
    for flag, field_name in (("duration", "duration_s"), ("warmup", "warmup_s"), ("replicas", "ext_proc_replicas"),
                             ("scrape_interval", "scrape_interval_s"), ("seed", "seed"),
                             ("shed_slo_ms", "shed_slo_ms")):
        value = getattr(args, flag)
        if value is not None:
            changes[field_name] = value
    if args.no_slowdown:
        changes["slowdown"] = None
    if args.rate is not None and not args.rate > 0:
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    return replace(scenario, **changes) if changes else scenario


def oracles_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The oracles to run: those named in --configurations, or both with --oracles."""
    named = [c for c in (args.configurations or ()) if is_oracle(c)]
    if getattr(args, "oracles", False):
        named += [o for o in ORACLES if o not in named]
    return tuple(dict.fromkeys(named))


def plan(scenario: Scenario, rate: float | None, oracles: tuple[str, ...] = ()) -> list[tuple[str, float | None, str]]:
    """Every (configuration, load, run) to simulate, in the bench's order, the oracles after the scenario's own
    in each run; load None: at ``rate``."""
    runs: list[tuple[str, float | None, str]] = []
    for c in scenario.configurations + oracles:
        for load in ((None,) if rate is not None else scenario.loads):
            runs.append((c, load, STEADY))
    for p in scenario.pick_policies:
        for load in ((None,) if rate is not None else scenario.pick_policy_loads):
            runs.append((f"{PICK_PREFIX}{p}", load, STEADY))
    if scenario.slowdown is not None:
        runs += [(c, scenario.slowdown.load, SLOWDOWN) for c in scenario.configurations + oracles]
    return runs


def _progress_bar(enabled: bool, total: int, desc: str):  # type: ignore[no-untyped-def]
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)


def options_from_args(args: argparse.Namespace) -> SimOptions:
    depth = getattr(args, "fair_queue_depth", 0) or 0
    if depth < 0:
        raise UsageError(f"--fair-queue-depth must be >= 0 (0: not modelled), got {depth}")
    return SimOptions(fair_queue_depth=depth)


def run_all(scenario: Scenario, rate: float | None, progress: bool, oracles: tuple[str, ...] = (),
            options: SimOptions | None = None) -> list[RunResult]:
    results = []
    capacity = capacity_rps(scenario)
    for configuration, load, run in plan(scenario, rate, oracles):
        offered = rate if load is None else load * capacity
        total = int(offered * (scenario.warmup_s + scenario.duration_s))
        bar = _progress_bar(progress, total, f"{configuration} {run} {offered:.0f} req/s")
        try:
            result, raw = simulate(scenario, configuration, load, run=run, rate_rps=rate if load is None else None,
                                   options=options, progress=bar.update if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        events, cpu = result.extra["events"], raw["cpu_s"]
        print(f"{configuration} {run} {result.offered_rps:.0f} req/s: {result.sent} measured requests, {events} events "
              f"in {cpu:.1f} s CPU ({events / max(cpu, 1e-9):,.0f} events/s)", file=sys.stderr)
        results.append(result)
    return report.against_oracles(results)


def _validate(args: argparse.Namespace) -> int:
    from . import validate

    scenario = load_scenario(Path(args.scenario)) if args.scenario else None
    scenario, live = validate.load_bench_results(Path(args.validate), scenario)
    if not live:
        raise UsageError(f"{args.validate} holds no live results")
    say = (lambda text: print(f"simulating {text}", file=sys.stderr)) if not args.no_progress else None
    comparisons = validate.compare(scenario, live, progress=say)
    print(validate.render(comparisons))
    if args.json:
        Path(args.json).write_text(json.dumps(validate.to_json(comparisons), indent=2) + "\n")
    return 0


def main(args: argparse.Namespace) -> int:
    from .validate import BenchResultsError

    try:
        if args.validate:
            return _validate(args)
        scenario = scenario_from_args(args)
        results = run_all(scenario, args.rate, progress=not args.no_progress and sys.stderr.isatty(),
                          oracles=oracles_from_args(args), options=options_from_args(args))
    except (ScenarioError, UsageError, BenchResultsError) as exc:
        print(f"inferlb sim: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad pick policy name or params, from the real policy registries
        print(f"inferlb sim: error: {exc}", file=sys.stderr)
        return 2
    print(report.render(results, scenario, capacity_rps(scenario)))
    if args.json:
        Path(args.json).write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    if args.summary:
        Path(args.summary).write_text(json.dumps(report.summary(results, scenario, capacity_rps(scenario)),
                                                 indent=2) + "\n")
    return 0
