"""``inferlb sim``: argument parsing only; the simulator lives beside it (imported lazily)."""

from __future__ import annotations

import argparse

DESCRIPTION = """\
Discrete-event simulation of the data planes the bench compares, on a simulated fleet: no servers, no
sleeps. It replays the bench's own trace for each load and runs the product's real pick and weight
policies (ext_proc's Router: its pick chain, CostModel and Outstanding; the control plane's telemetry smoothing and
WeightPolicy) on a simulated clock, over 1 to 10,000+ workers. Prints the comparison table and writes
the RunResults as JSON. --validate compares it with a live `inferlb bench run` results.json.

Two ideal balancers to measure the others against (simulator only; greedy, so close bounds rather than
strict ones; in the slowdown run they know the speed schedule too):
oracle_clairvoyant sends each request where it finishes first, knowing every service time and backlog;
oracle_central_queue is one FIFO queue feeding whichever slot frees first. Name them in --configurations
or add both with --oracles; every other configuration's p99 and goodput are then reported as a ratio to
the better oracle's at the same load ("p99 / best oracle")."""

EPILOG = """\
examples:
  inferlb sim                                        the default scenario, every configuration
  inferlb sim --scenario scenarios/sim_scale.toml --configurations envoy_least_request,inferlb_ext_proc
  inferlb sim --workers 10000 --rate 100000 --duration 5 --replicas 10 --json scale.json
  inferlb sim --scenario scenarios/sim_scale.toml --summary docs/bench/sim_scale.json   what git keeps
  inferlb sim --scenario scenarios/overload.toml --shed-slo-ms 0     the overload without shedding
  inferlb sim --configurations inferlb_ext_proc,oracle_clairvoyant  inferlb against the clairvoyant bound
  inferlb sim --scenario scenarios/bursty.toml --oracles --loads 0.7,0.8,0.9 --no-slowdown
  inferlb sim --validate bench-results/default/results.json"""


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_sim_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sim = sub.add_parser("sim", help="discrete-event fleet simulator", description=DESCRIPTION, epilog=EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    sim.add_argument("--scenario", metavar="FILE", help="scenario TOML (default: the built-in default scenario)")
    sim.add_argument("--configurations", metavar="LIST", type=_csv,
                     help="comma-separated configurations (default: the scenario's, plus its pick_policies); "
                          "also oracle_clairvoyant and oracle_central_queue")
    sim.add_argument("--oracles", action="store_true",
                     help="add both oracles and report each configuration against the better one")
    sim.add_argument("--loads", metavar="LIST", type=_csv, help="comma-separated fractions of capacity, e.g. 0.5,0.8")
    sim.add_argument("--workers", metavar="N", type=int,
                     help="scale the scenario fleet to N workers by repeating its speed mix")
    sim.add_argument("--rate", metavar="RPS", type=float,
                     help="offer exactly RPS requests/s (one run per configuration) instead of the loads")
    sim.add_argument("--duration", metavar="S", type=float, help="measured seconds per run")
    sim.add_argument("--warmup", metavar="S", type=float, help="unmeasured seconds before each run")
    sim.add_argument("--replicas", metavar="N", type=int, help="ext_proc replicas (default: the scenario's)")
    sim.add_argument("--scrape-interval", metavar="S", type=float, help="control-plane scrape interval")
    sim.add_argument("--seed", metavar="N", type=int, help="trace and balancer seed (default: the scenario's)")
    sim.add_argument("--no-slowdown", action="store_true", help="skip the slowdown run")
    sim.add_argument("--shed-slo-ms", metavar="MS", type=float,
                     help="ext_proc's slo_ms: shed sheddable requests predicted to complete later (0: no shedding)")
    sim.add_argument("--fair-queue-depth", metavar="N", type=int, default=0,
                     help="model ext_proc's fair admission gate at this fair_queue_depth: requests wait in ext_proc "
                          "once it has N per endpoint in flight (default 0: not modelled, every request is routed "
                          "on arrival)")
    sim.add_argument("--json", metavar="FILE", help="write the RunResults (or, with --validate, the comparison)")
    sim.add_argument("--summary", metavar="FILE",
                     help="write a small JSON summary: per configuration, run and load the figures, the ratios to "
                          "the better oracle and the spread per kind of worker (no per-request or per-worker data)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument("--validate", metavar="BENCH_RESULTS", help="compare with a live bench results.json")
    sim.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from .command import (
        main,  # numpy, hdrh and the services' modules only when the command runs
    )

    return main(args)
