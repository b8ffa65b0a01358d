"""``inferlb bench faults``: issue 20's faults under open-loop load, one per run, against the real stack.

The live part is ``faults_live.py``; this module parses the arguments and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

from .faults_plan import FAULTS, FaultPlan

DESCRIPTION = """\
Faults under load (issue 20). For each fault, a fresh stack on loopback: simulated workers (python -m workers
--simulate), the control plane, ext_proc and Envoy, with the product's retries (2), health checks and outlier
detection. Open-loop Poisson load at LOAD of the fleet's capacity (every slot busy on the mix's mean
request); once BASELINE requests have been served the fault is injected, left until the stack reacts (the
worker leaves Envoy's healthy set, Envoy fails open, a quota check fails, Envoy NACKs, ...; at most
REACT_TIMEOUT seconds), then restored (restart, SIGCONT, fail rate 0, delay 0, the good config); TAIL more
requests are sent once routing is back. Per fault: requests sent, succeeded, failed, retried (Envoy's
cluster.workers.upstream_rq_retry), the reaction and the recovery time (from the injection to the later of
the last failed request's send time and routing being back).
worker_delay puts a delaying TCP proxy (in this process) in front of one worker; the redis_* faults give
ext_proc a throwaway redis-server for its quotas and cache (redis_slow: behind the delaying proxy) and send
the load with an API key whose quota is checked there; config_nack runs the control plane with an injected
endpoint Envoy cannot parse; postgres_down runs two control-plane replicas on a throwaway PostgreSQL server
(Envoy and ext_proc on the first), shuts it down at once, pins a weight through each replica (503 expected),
starts it again and pins through the second until the first and its Envoy show it. Faults: """ + ", ".join(FAULTS) + "."

EPILOG = """\
examples:
  inferlb bench faults --json docs/bench/faults.json
  inferlb bench faults --fault worker_kill --fault ext_proc_kill --load 0.5"""

COLUMNS = ("fault", "sent", "succeeded", "failed", "retried", "reacted_s", "recovery_s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = FaultPlan()
    parser.add_argument("--fault", action="append", choices=FAULTS, metavar="FAULT",
                        help=f"run only this fault (repeat; default all: {', '.join(FAULTS)})")
    parser.add_argument("--load", type=float, default=d.load, help=f"of the fleet's capacity (default {d.load:g})")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    parser.add_argument("--baseline", type=int, default=d.baseline,
                        help=f"requests served before the fault (default {d.baseline})")
    parser.add_argument("--tail", type=int, default=d.tail,
                        help=f"requests sent after routing is back (default {d.tail})")
    parser.add_argument("--react-timeout", type=float, default=d.react_timeout_s, metavar="S",
                        help=f"longest a fault is left in place (default {d.react_timeout_s:g})")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/faults)")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The table as Markdown (what docs/reliability.md shows)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from .faults_live import FaultRunner
    from ..processes import ComponentDied
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy

    plan = FaultPlan(faults=tuple(args.fault or FAULTS), load=args.load, workers=args.workers,
                     baseline=args.baseline, tail=args.tail, react_timeout_s=args.react_timeout)
    problems = plan.problems()
    if problems:
        print(f"inferlb bench faults: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if missing_envoy("inferlb bench faults"):
        return 1
    out = (args.out or Path("bench-results") / "faults").resolve()
    _report(f"faults: {', '.join(plan.faults)}; {plan.workers} simulated workers at {plan.load:.0%}; logs in {out}")
    started = time.monotonic()
    try:
        rows = run_on_uvloop(FaultRunner(plan, out, _report).run_all())
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    except (ComponentDied, RuntimeError, TimeoutError) as exc:
        print(f"inferlb bench faults: FAILED: {exc}", file=sys.stderr)
        return 1
    print(render(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"plan": asdict(plan), "faults": rows, "wall_s": round(time.monotonic() - started, 1)}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0
