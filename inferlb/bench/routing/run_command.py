"""``inferlb bench run``: a scenario against each data-plane configuration, then the comparison table."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DESCRIPTION = """\
Run one scenario (TOML; default: the issue's 8-worker heterogeneous fleet) against each data-plane
configuration in turn - Envoy round robin, least request and ORCA-fed client-side weighted round robin,
NGINX least_conn, inferlb weights only, inferlb with ext_proc, and inferlb with each other pick policy -
with the same trace and seed, a fresh fleet per configuration, and idle workers before every run.
Writes results.json, table.md and PNG plots to --out and prints the table. When the scenario's
capacity_rps is 0 the capacity (the load where p99 crosses the SLO) is measured first under
inferlb_ext_proc. The default scenario takes about 20 minutes; scenarios/smoke.toml seconds."""

EPILOG = """\
configurations: envoy_round_robin, envoy_least_request, envoy_cswrr_orca, nginx_least_conn,
  inferlb_weights, inferlb_ext_proc, inferlb_pick:<policy>
examples:
  inferlb bench run --scenario scenarios/smoke.toml --out /tmp/smoke
  inferlb bench run --configurations envoy_least_request,inferlb_ext_proc --loads 0.8 --duration 10
  inferlb bench run --configurations envoy_cswrr_orca,inferlb_ext_proc --loads 0.8 --rounds 3"""
MAX_ROUNDS = 20


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--scenario", type=Path, metavar="FILE", help="scenario TOML (default: the default scenario)")
    parser.add_argument("--configurations", metavar="A,B,...",
                        help="run only these configurations (default: the scenario's, plus inferlb_pick:<policy> "
                             "for its pick policies)")
    parser.add_argument("--loads", metavar="F,F,...", help="fractions of capacity, e.g. 0.5,0.8 (default: the scenario's)")
    parser.add_argument("--duration", type=float, metavar="S", help="measured seconds per run (default: the scenario's)")
    parser.add_argument("--warmup", type=float, metavar="S", help="warm-up seconds per run, sent but not measured")
    parser.add_argument("--capacity", type=float, metavar="RPS",
                        help="req/s at 100%% load; skips the capacity search (default: the scenario's, 0 = search)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="run the whole comparison N times (1-20), each round in a rotated order, and judge by "
                             "the medians over the rounds and each round's paired ratios: on a shared host one run "
                             "per configuration can mislead (default 1)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="output directory (default: bench-results/<scenario name>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _fail(message: str) -> int:
    print(f"inferlb bench run: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from .runner import (ScenarioRunner, estimate_seconds, missing_envoy, plan_configurations, plan_rounds,
                         unknown_configurations)
    from ..load.scenario import ScenarioError, load_scenario

    try:
        scenario = load_scenario(args.scenario)
        changes: dict[str, object] = {}
        if args.loads:
            try:
                loads = tuple(float(x) for x in _csv(args.loads))
            except ValueError:
                return _fail(f"--loads must be comma-separated numbers, got {args.loads!r}")
            changes["loads"] = loads
            changes["pick_policy_loads"] = loads if scenario.pick_policy_loads else ()
        if args.duration is not None:
            changes["duration_s"] = args.duration
        if args.warmup is not None:
            changes["warmup_s"] = args.warmup
        if args.capacity is not None:
            changes["capacity_rps"] = args.capacity
        scenario = dataclasses.replace(scenario, **changes)  # validated again
    except ScenarioError as exc:
        return _fail(str(exc))
    only = _csv(args.configurations) if args.configurations else None
    if only is not None:
        unknown = unknown_configurations(only)
        if unknown or not only:
            return _fail(f"unknown configuration(s) {', '.join(unknown) or '(none given)'}; see --help")
    if not 1 <= args.rounds <= MAX_ROUNDS:
        return _fail(f"--rounds must be 1 to {MAX_ROUNDS}, got {args.rounds}")
    configurations = plan_configurations(scenario, only)
    if not configurations:
        return _fail("no configuration to run")
    plans = plan_rounds(configurations, args.rounds)
    out = (args.out or Path("bench-results") / scenario.name).resolve()
    if missing_envoy("inferlb bench run"):
        return 1
    minutes = estimate_seconds(scenario, plans) / 60
    print(f"scenario {scenario.name}: {len(configurations)} configuration(s)"
          + (f" x {args.rounds} rounds" if args.rounds > 1 else "")
          + f", {sum(len(p.runs) for p in plans)} run(s), about {minutes:.0f} min; output {out}",
          file=sys.stderr, flush=True)

    runner = ScenarioRunner(scenario, out, plans=plans, progress=not args.no_progress)
    try:
        outcome = run_on_uvloop(runner.run())
    except KeyboardInterrupt:
        print(f"interrupted; every process stopped; partial results in {out}", file=sys.stderr)
        return 130
    print(runner.table(outcome))
    print(f"wrote {out / 'results.json'}, {out / 'table.md'} and the plots ({outcome.wall_s / 60:.1f} min)",
          file=sys.stderr)
    for failure in outcome.failures:
        where = f" (round {failure['round']})" if args.rounds > 1 else ""
        print(f"FAILED {failure['configuration']}{where}: {failure['error']}", file=sys.stderr)
    return 1 if outcome.failures else 0


def run_on_uvloop(coro):  # type: ignore[no-untyped-def]
    """On uvloop (the load generator's loop of choice), with SIGTERM handled like Ctrl-C."""
    import asyncio
    import signal

    async def guarded():  # type: ignore[no-untyped-def]
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await coro
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None

    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(guarded())
    return uvloop.run(guarded())
