"""``inferlb bench overload``: 130% of capacity in three classes, with ext_proc's shedding and without.

Issue 13's overload target, measured live on loopback and then simulated:

1. capacity is measured as ``inferlb bench run`` measures it (the load where p99 crosses the SLO, every
   request standard, under ``inferlb_ext_proc``), unless given, with probes as long as the runs (the
   scenario's ``probe_duration_s``): goodput is judged as a share of it, and a shorter probe ends before
   the queues have grown, so it finds a load above what the fleet can complete;
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
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..load.scenario import Scenario

DEFAULT_SCENARIO = Path(__file__).resolve().parents[3] / "scenarios" / "overload.toml"
QUICK = {"duration_s": 6.0, "warmup_s": 2.0}
CONFIGURATION = "inferlb_ext_proc"  # the bench's capacity configuration: the stack the overload runs on
SIM_TIMEOUT_S = 600.0

DESCRIPTION = """\
Issue 13's overload benchmark. Measures capacity (p99 crossing the SLO, all requests standard, under
inferlb_ext_proc, in probes as long as the runs), then sends LOAD x capacity (default 130%) of 20%
critical / 50% standard / 30% sheddable requests (x-gateway-inference-objective) to one live stack on
loopback (simulated workers, control plane, ext_proc, Envoy) twice with the same trace: with shedding
(the pick policy's slo_ms = the scenario's shed_slo_ms, set through the admin API) and without (slo_ms
0). Then simulates the same scenario both ways (inferlb sim). Prints critical p99 against the SLO and
its errors, the sheddable 429s' p99 (target <= 5 ms) and goodput as a share of capacity (target >=
95%). Takes about 3 minutes; --quick about 2."""

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


def simulated_runs(scenario_file: Path, scenario: Scenario, rate_rps: float, capacity_rps: float,
                   work_dir: Path) -> list[dict[str, Any]]:
    """The same scenario through ``inferlb sim`` (its own process) at the live rate, with and without shedding."""
    from .overload_report import run_figures, sim_classes

    runs = []
    for name, slo_ms in (("shedding", scenario.shed_slo_ms), ("baseline", 0.0)):
        out = work_dir / f"sim-{name}.json"
        argv = [sys.executable, "-m", "inferlb.cli", "sim", "--scenario", str(scenario_file), "--rate", str(rate_rps),
                "--duration", str(scenario.duration_s), "--warmup", str(scenario.warmup_s),
                "--configurations", CONFIGURATION, "--shed-slo-ms", str(slo_ms), "--no-slowdown",
                "--no-progress", "--json", str(out)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=SIM_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"inferlb sim failed ({done.returncode}): {done.stderr.strip()}")
        (result,) = json.loads(out.read_text())
        runs.append(run_figures(name, "sim", result["offered_rps"], capacity_rps, scenario.slo_s,
                                sim_classes(result["extra"]), scenario.duration_s))
    return runs


def _fail(message: str) -> int:
    print(f"inferlb bench overload: {message}", file=sys.stderr)
    return 2


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The scenario with the flags applied (raises ``ScenarioError``)."""
    from ..load.scenario import load_scenario

    scenario = load_scenario(args.scenario)
    changes: dict[str, Any] = dict(QUICK) if args.quick else {}
    for flag, name in (("duration", "duration_s"), ("warmup", "warmup_s"), ("capacity", "capacity_rps")):
        if getattr(args, flag) is not None:
            changes[name] = getattr(args, flag)
    if args.load is not None:
        changes["loads"] = (args.load,)
    return dataclasses.replace(scenario, **changes)


def main(args: argparse.Namespace) -> int:
    from ..load.classes import is_mixed
    from .overload_live import OverloadRunner
    from .overload_report import render
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy
    from ..load.scenario import ScenarioError

    try:
        scenario = scenario_from_args(args)
    except ScenarioError as exc:
        return _fail(str(exc))
    if not is_mixed(scenario.workload.classes):
        return _fail(f"scenario {scenario.name} has no class mix (workload.classes): nothing to shed")
    if not scenario.shed_slo_ms > 0:
        return _fail("the scenario's shed_slo_ms is 0: the shedding run would be the baseline")
    load = scenario.loads[0]
    if missing_envoy("inferlb bench overload"):
        return 1
    out = (args.out or Path("bench-results") / f"{scenario.name}-overload").resolve()
    print(f"overload: scenario {scenario.name}, {load:.0%} of capacity, two {scenario.warmup_s:g}+"
          f"{scenario.duration_s:g} s runs after the capacity search; logs in {out}", file=sys.stderr, flush=True)
    runner = OverloadRunner(scenario, out, plans=(), progress=not args.no_progress)
    started = time.monotonic()
    try:
        live = run_on_uvloop(runner.overload(load, scenario.shed_slo_ms))
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    runs = live["runs"]
    if not args.no_sim:
        print("simulating the same scenario (inferlb sim)", file=sys.stderr, flush=True)
        capacity = float(live["capacity"]["rps"])
        try:
            runs += simulated_runs(args.scenario, scenario, load * capacity, capacity, out)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"inferlb bench overload: the simulation failed: {exc}", file=sys.stderr)
    mix = scenario.workload.classes
    report = {"scenario": scenario.name, "load": load, "slo_s": scenario.slo_s, "shed_slo_ms": scenario.shed_slo_ms,
              "classes": f"{mix.critical:.0%} critical / {mix.standard:.0%} standard / {mix.sheddable:.0%} sheddable",
              "capacity": live["capacity"], "runs": runs, "wall_s": round(time.monotonic() - started, 1)}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
