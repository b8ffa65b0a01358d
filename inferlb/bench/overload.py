"""``inferlb bench overload``: 130% of capacity in three classes, with ext_proc's shedding and without.

Issue 13's overload target, measured live on loopback and then simulated:

1. capacity is measured as ``inferlb bench run`` measures it (the load where p99 crosses the SLO, every
   request standard, under ``inferlb_ext_proc``), unless given;
2. one stack (simulated workers, control plane, ext_proc, Envoy) then takes ``load`` x capacity (130%) of
   the scenario's class mix (20% critical, 50% standard, 30% sheddable) twice: with shedding (the pick
   policy's ``slo_ms`` set to the scenario's ``shed_slo_ms`` through the admin API) and as the baseline
   (``slo_ms`` 0), the same trace both times, from idle workers;
3. the simulator runs the same scenario at the measured capacity, both ways.

Each class is sent by its own open-loop generator (``loadgen.run_load``, with the class header) over
the requests of the one trace that have that class (``classes.trace_classes``: the simulator's classes),
concurrently, so each class's figures come out separately. Printed per run: critical p99 against the SLO
and its errors, the sheddable 429s' p99 (target <= 5 ms), standard p99, goodput (answers within the SLO
per second) as a share of capacity (target >= 95%). The live runs are ``overload_live.py``; this
module keeps the command's light part (imported by ``inferlb --help``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scenario import Scenario

DEFAULT_SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "overload.toml"
SHED_P99_TARGET_S = 0.005
GOODPUT_TARGET = 0.95
QUICK = {"duration_s": 6.0, "warmup_s": 2.0}

DESCRIPTION = """\
Issue 13's overload benchmark. Measures capacity (p99 crossing the SLO, all requests standard, under
inferlb_ext_proc), then sends LOAD x capacity (default 130%) of 20% critical / 50% standard / 30% sheddable
requests (x-gateway-inference-objective) to one live stack on loopback (simulated workers, control plane,
ext_proc, Envoy) twice with the same trace: with shedding (the pick policy's slo_ms = the scenario's
shed_slo_ms, set through the admin API) and without (slo_ms 0). Then simulates the same scenario both
ways (inferlb sim). Prints critical p99 against the SLO and its errors, the sheddable 429s' p99 (target
<= 5 ms) and goodput as a share of capacity (target >= 95%). Takes about 4 minutes; --quick about 2."""

EPILOG = """\
examples:
  inferlb bench overload                           scenarios/overload.toml
  inferlb bench overload --quick --json /tmp/overload.json
  inferlb bench overload --capacity 80 --load 1.5  skip the capacity search"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--scenario", type=Path, metavar="FILE", default=DEFAULT_SCENARIO,
                        help="scenario TOML with a class mix (default: scenarios/overload.toml)")
    parser.add_argument("--load", type=float, metavar="F", help="fraction of capacity (default: the scenario's)")
    parser.add_argument("--capacity", type=float, metavar="RPS", help="req/s at 100%%; skips the capacity search")
    parser.add_argument("--duration", type=float, metavar="S", help="measured seconds per run")
    parser.add_argument("--warmup", type=float, metavar="S", help="warm-up seconds per run, sent but not measured")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['duration_s']:g} s runs after {QUICK['warmup_s']:g} s of warm-up")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulated runs")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/<scenario>-overload)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


# --- figures ------------------------------------------------------------------------------------


def run_figures(name: str, source: str, offered_rps: float, capacity_rps: float, slo_s: float,
                classes: dict[str, dict[str, Any]], duration_s: float) -> dict[str, Any]:
    """One run's headline figures from its per-class ones (same keys live and simulated)."""
    goodput = sum(c["goodput_rps"] for c in classes.values())
    critical = classes.get("critical", {})
    sheddable = classes.get("sheddable", {})
    return {
        "run": name, "source": source, "offered_rps": round(offered_rps, 2), "capacity_rps": round(capacity_rps, 2),
        "slo_s": slo_s, "duration_s": duration_s,
        "critical_p99_s": critical.get("p99_s"), "critical_errors": critical.get("errors", 0),
        "standard_p99_s": classes.get("standard", {}).get("p99_s"),
        "shed": sheddable.get("shed", 0), "shed_p99_s": sheddable.get("shed_p99_s"),
        "goodput_rps": round(goodput, 2), "goodput_of_capacity": round(goodput / capacity_rps, 4),
        "classes": classes,
    }


def sim_classes(extra: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The simulator's per-class figures with ``errors`` (it has no errors but timeouts)."""
    return {name: {**c, "errors": c["timeouts"]} for name, c in extra["classes"].items()}


def verdicts(run: dict[str, Any]) -> dict[str, bool | None]:
    """Each target met or not (None: nothing to judge; the simulator's 429 time is its constant overheads)."""
    critical = run["critical_p99_s"]
    shed_p99 = run["shed_p99_s"] if run["source"] == "live" else None
    return {
        "critical_within_slo": None if critical is None else critical <= run["slo_s"] and run["critical_errors"] == 0,
        "shed_429_within_5ms": None if shed_p99 is None else shed_p99 <= SHED_P99_TARGET_S,
        "goodput_95pct": run["goodput_of_capacity"] >= GOODPUT_TARGET,
    }


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def render(report: dict[str, Any]) -> str:
    lines = [f"# inferlb bench overload: {report['scenario']}", "",
             f"Capacity {report['capacity']['rps']:.1f} req/s ({report['capacity']['source']}); load "
             f"{report['load']:.0%}; classes {report['classes']}; SLO {report['slo_s'] * 1000:.0f} ms; ext_proc "
             f"slo_ms {report['shed_slo_ms']:g} with shedding, 0 for the baseline.", "",
             "| run | source | offered req/s | critical p99 ms | critical errors | standard p99 ms | shed (429) "
             "| 429 p99 ms | goodput/s | goodput / capacity | targets |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in report["runs"]:
        v = verdicts(run)
        marks = ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in v.items() if ok is not None)
        lines.append(f"| {run['run']} | {run['source']} | {run['offered_rps']:.1f} | {ms(run['critical_p99_s'])} "
                     f"| {run['critical_errors']} | {ms(run['standard_p99_s'])} | {run['shed']} "
                     f"| {ms(run['shed_p99_s'])} | {run['goodput_rps']:.1f} | {run['goodput_of_capacity']:.0%} "
                     f"| {marks} |")
    lines += ["", "Per class (served p50/p99; errors: non-2xx other than the sheddable 429s, and timeouts)", "",
              "| run | source | class | sent | served | p50 ms | p99 ms | shed | errors | goodput/s |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for name, c in run["classes"].items():
            lines.append(f"| {run['run']} | {run['source']} | {name} | {c['sent']} | {c['completed']} "
                         f"| {ms(c['p50_s'])} | {ms(c['p99_s'])} | {c['shed']} | {c['errors']} "
                         f"| {c['goodput_rps']:.1f} |")
    return "\n".join(lines) + "\n"


def simulated_runs(scenario: Scenario, load: float, capacity_rps: float) -> list[dict[str, Any]]:
    """The same scenario in ``inferlb sim`` at the measured capacity, with and without shedding."""
    from inferlb.sim.runner import simulate

    from .runner import CAPACITY_CONFIGURATION

    runs = []
    for name, slo_ms in (("shedding", scenario.shed_slo_ms), ("baseline", 0.0)):
        s = dataclasses.replace(scenario, capacity_rps=capacity_rps, shed_slo_ms=slo_ms)
        result, _ = simulate(s, CAPACITY_CONFIGURATION, load)
        runs.append(run_figures(name, "sim", result.offered_rps, capacity_rps, s.slo_s,
                                sim_classes(dict(result.extra)), s.duration_s))
    return runs


def _fail(message: str) -> int:
    print(f"inferlb bench overload: {message}", file=sys.stderr)
    return 2


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario with the flags applied (raises ``ScenarioError``)."""
    from .scenario import load_scenario

    scenario = load_scenario(args.scenario)
    changes: dict[str, Any] = dict(QUICK) if args.quick else {}
    for flag, name in (("duration", "duration_s"), ("warmup", "warmup_s"), ("capacity", "capacity_rps")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if args.load is not None:
        changes["loads"] = (args.load,)
    return dataclasses.replace(scenario, **changes)


def main(args: argparse.Namespace) -> int:
    from .classes import is_mixed
    from .overload_live import OverloadRunner
    from .run_command import _run
    from .runner import find_envoy
    from .scenario import ScenarioError

    try:
        scenario = scenario_from_args(args)
    except ScenarioError as exc:
        return _fail(str(exc))
    if not is_mixed(scenario.workload.classes):
        return _fail(f"scenario {scenario.name} has no class mix (workload.classes): nothing to shed")
    if not scenario.shed_slo_ms > 0:
        return _fail("the scenario's shed_slo_ms is 0: the shedding run would be the baseline")
    load = scenario.loads[0]
    try:
        find_envoy()
    except RuntimeError as exc:
        print(f"inferlb bench overload: {exc}", file=sys.stderr)
        return 1
    out = (args.out or Path("bench-results") / f"{scenario.name}-overload").resolve()
    print(f"overload: scenario {scenario.name}, {load:.0%} of capacity, two {scenario.warmup_s:g}+"
          f"{scenario.duration_s:g} s runs after the capacity search; logs in {out}", file=sys.stderr, flush=True)
    runner = OverloadRunner(scenario, out, plans=(), progress=not args.no_progress)
    started = time.monotonic()
    try:
        live = _run(runner.overload(load, scenario.shed_slo_ms))
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    runs = live["runs"]
    if not args.no_sim:
        print("simulating the same scenario (inferlb sim)", file=sys.stderr, flush=True)
        runs += simulated_runs(scenario, load, float(live["capacity"]["rps"]))
    mix = scenario.workload.classes
    report = {"scenario": scenario.name, "load": load, "slo_s": scenario.slo_s, "shed_slo_ms": scenario.shed_slo_ms,
              "classes": f"{mix.critical:.0%} critical / {mix.standard:.0%} standard / {mix.sheddable:.0%} sheddable",
              "capacity": live["capacity"], "runs": runs, "wall_s": round(time.monotonic() - started, 1)}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
