"""``inferlb bench fair``: two tenants on a saturated fleet, with ext_proc's fair queue and without.

Issue 14's fair shares, live on loopback: when the fleet is saturated, tenants get capacity in
proportion to their API keys' weights. Per mode, fair queue on (ext_proc's ``fair_queue_depth``, 8) and
off (0: the baseline, every request goes straight to the workers' queues), one fresh stack (simulated
workers, control plane, ext_proc, Envoy; ``ProcessGroup`` stops it on the way out, on errors and Ctrl-C
too); two keys issued through the admin API (``POST /v1/api-keys``): tenants ``light`` (weight 1) and
``heavy`` (weight 3), no quotas. Each scenario then sends both tenants' open-loop loads side by side, the
same traces in both modes, together ``load`` x the fleet's capacity (150%):

- ``heavy-under-share``: light offers 5/6 of it, heavy 1/6: heavy asks less than its weighted share, so
  fair queuing gives it all it asks and light the rest; arrival order gives heavy only 1/6;
- ``both-over-share``: light 40%, heavy 60%: both ask more than their shares, so fair queuing serves them
  1:3 (the weights); arrival order 2:3 (the offers).

``tests/test_fair_queue_sim.py`` simulates the same two cases. The live runs are ``fair_live.py``, the
figures and the table ``fair_report.py``; this module keeps the command's light part (imported by
``inferlb --help``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .fair_plan import MAX_REQUESTS, TENANTS, FairPlan

DESCRIPTION = """\
Issue 14's fair shares, live. Two tenants (API keys issued on the admin API: light, weight 1; heavy, weight
3; no quotas) offer open-loop load together LOAD x the fleet's capacity (default 150%) to a fresh stack on
loopback (simulated workers, control plane, ext_proc, Envoy), twice: with ext_proc's fair queue
(fair_queue_depth 8) and without (0: everyone queues at the workers). Scenarios: heavy-under-share (light
offers 5/6 of the load, heavy 1/6) and both-over-share (40% / 60%). Prints per run and tenant the offered
and served (2xx) tokens/s, the share of the served total against the one expected (weighted max-min
fairness with the queue, in proportion to offered load without), 429s and p50/p99 latency. Served tokens
are ext_proc's exact count (inferlb_ext_proc_tenant_tokens_total{outcome="served"}) over the measured
window. Takes about 5 minutes; --quick about 2."""

EPILOG = """\
examples:
  inferlb bench fair                                 both scenarios, 5 + 55 s per run
  inferlb bench fair --quick --json /tmp/fair.json
  inferlb bench fair --weights 1,4 --scenarios both-over-share"""


QUICK = {"duration_s": 20.0, "warmup_s": 3.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = FairPlan()
    parser.add_argument("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    parser.add_argument("--slots", type=int, default=d.slots,
                        help=f"requests each worker serves at once (default {d.slots})")
    parser.add_argument("--weights", default=",".join(f"{w:g}" for w in d.weights), metavar="LIGHT,HEAVY",
                        help="the two tenants' key weights (default 1,3)")
    parser.add_argument("--load", type=float, default=d.load, metavar="F",
                        help=f"both tenants' offered load together, in capacities (default {d.load:g})")
    parser.add_argument("--capacity", type=float, default=0.0, metavar="TOKENS_PER_S",
                        help="tokens/s at 100%% (default: the simulated workers' cost model)")
    parser.add_argument("--duration", type=float, metavar="S", help=f"measured seconds per run (default "
                        f"{d.duration_s:g}; --quick {QUICK['duration_s']:g})")
    parser.add_argument("--warmup", type=float, metavar="S", help=f"warm-up seconds per run, sent but not "
                        f"measured (default {d.warmup_s:g}; --quick {QUICK['warmup_s']:g})")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                        help=f"Envoy's route timeout (default {d.timeout_s:g})")
    parser.add_argument("--depth", type=int, default=d.fair_queue_depth, metavar="N",
                        help=f"ext_proc's fair_queue_depth in the fair run (default {d.fair_queue_depth})")
    parser.add_argument("--scenarios", default=",".join(d.scenarios), metavar="LIST",
                        help=f"which scenarios, in order (default {','.join(d.scenarios)})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"the traces' seed (default {d.seed})")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/fair)")


def plan_from_args(args: argparse.Namespace) -> FairPlan:
    """The plan the flags ask for (``ValueError`` for a --weights that is not two numbers)."""
    d = FairPlan()
    quick: dict[str, float] = QUICK if args.quick else {}
    try:
        light, heavy = (float(w) for w in args.weights.split(","))
    except ValueError:
        raise ValueError(f"--weights takes two numbers, LIGHT,HEAVY; got {args.weights!r}") from None
    return FairPlan(
        workers=args.workers, slots=args.slots, weights=(light, heavy), load=args.load,
        duration_s=args.duration if args.duration is not None else quick.get("duration_s", d.duration_s),
        warmup_s=args.warmup if args.warmup is not None else quick.get("warmup_s", d.warmup_s),
        timeout_s=args.timeout, fair_queue_depth=args.depth, capacity_tps=args.capacity,
        scenarios=tuple(s.strip() for s in args.scenarios.split(",") if s.strip()), seed=args.seed)


def _fail(message: str) -> int:
    print(f"inferlb bench fair: {message}", file=sys.stderr)
    return 2


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from .fair_live import capacity_tps, fair_scenario, run_fair, tenant_rates
    from .fair_report import render
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy

    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        return _fail(str(exc))
    problems = plan.problems()
    if problems:
        return _fail("; ".join(problems))
    scenario = fair_scenario(plan)
    capacity, _ = capacity_tps(plan, scenario)
    over = [f"{tenant} in {name}" for name, rates in tenant_rates(plan, scenario, capacity).items()
            for tenant, rps in rates.items() if rps * (plan.warmup_s + plan.duration_s) > MAX_REQUESTS]
    if over:
        return _fail(f"over {MAX_REQUESTS} requests per run for {', '.join(over)}: lower --load or --duration")
    if missing_envoy("inferlb bench fair"):
        return 1
    out = (args.out or Path("bench-results") / "fair").resolve()
    _report(f"fair: weights {', '.join(f'{t} {w:g}' for t, w in zip(TENANTS, plan.weights))}; "
            f"{plan.load:.0%} of {capacity:.0f} tokens/s; scenarios {', '.join(plan.scenarios)}; fair queue on, "
            f"then off; {plan.warmup_s:g}+{plan.duration_s:g} s per run; logs in {out}")
    started = time.monotonic()
    try:
        live = run_on_uvloop(run_fair(plan, out, _report))
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    report: dict[str, Any] = {"plan": {**asdict(plan), "weights": dict(zip(TENANTS, plan.weights))}, **live,
                              "wall_s": round(time.monotonic() - started, 1)}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0
