"""``inferlb bench soak``: issue 20's soak, the whole stack under steady open-loop load for a long time.

The live part is ``soak_live.py``, the sampling ``soak_sample.py``, the verdicts ``soak_judge.py``; this module
parses the arguments and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from .soak_judge import SIGMAS, TOLERANCES, Check
from .soak_live import SoakPlan

_d = SoakPlan()
DESCRIPTION = f"""\
The soak (issue 20): one fresh stack on loopback, as the faults harness runs it (simulated workers: python -m
workers --simulate, so that the emulated fleet and not the host is the bottleneck; the control plane, ext_proc
and Envoy with the product's retries, health checks and outlier detection), under open-loop Poisson load at
LOAD of the fleet's capacity for DURATION seconds (default {_d.duration_s:g}: not for CI).

Every EVERY seconds it samples each process (Envoy, control plane, ext_proc, each worker): RSS, open
descriptors and inet connections (psutil), the metric series each exports (samples in its /metrics, parsed
with prometheus_client), ext_proc's outstanding work (inferlb_ext_proc_outstanding_requests/_tokens/_seconds
summed over endpoints, _active_streams, _outstanding_leaked) and each worker's in-flight requests. After the
load it waits until nothing is in flight and samples once more at rest.

Checks (PASS/FAIL), growth being a least-squares slope over the samples after the warm-up (the first
WARMUP of the run), failing when above its tolerance by more than {SIGMAS:g} standard errors:
  errors        0 client errors: non-2xx, no answer, timed out
  rss           <= {TOLERANCES['rss'].per_10_min:g} MiB/10 min per process ({TOLERANCES['rss'].why})
  fds           <= {TOLERANCES['fds'].per_10_min:g}/10 min per process ({TOLERANCES['fds'].why})
  connections   <= {TOLERANCES['connections'].per_10_min:g}/10 min per process ({TOLERANCES['connections'].why})
  series        after the warm-up, never more metric series than the most seen during it
  outstanding   ext_proc's outstanding requests <= {TOLERANCES['outstanding'].per_10_min:g}/10 min during the load
  leaked        ext_proc's outstanding_leaked 0 (its age safety net never had to drop an entry)
  at rest       after the load: ext_proc's outstanding requests, tokens, seconds, streams and every worker's
                in-flight requests all 0 (within {_d.drain_timeout_s:g} s)
Exit status: 0 when every check passes, 3 when one fails, 1 when the stack failed, 2 for bad arguments."""

EPILOG = """\
examples:
  inferlb bench soak --json docs/bench/soak.json
  inferlb bench soak --duration 120 --every 5"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("--duration", type=float, default=_d.duration_s, metavar="S",
                        help=f"seconds of load (default {_d.duration_s:g})")
    parser.add_argument("--load", type=float, default=_d.load, help=f"of the fleet's capacity (default {_d.load:g})")
    parser.add_argument("--workers", type=int, default=_d.workers, help=f"simulated workers (default {_d.workers})")
    parser.add_argument("--every", type=float, default=_d.every_s, metavar="S",
                        help=f"seconds between samples (default {_d.every_s:g})")
    parser.add_argument("--warmup", type=float, default=_d.warmup, metavar="FRACTION",
                        help=f"share of the run not judged for growth (default {_d.warmup:g})")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the summary and downsampled samples as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/soak)")


def render(checks: Sequence[Check]) -> str:
    """The checks as a Markdown table (what docs/reliability.md shows)."""
    lines = ["| check | subject | verdict | measured | tolerance |", "|---|---|---|---|---|"]
    lines += [f"| {c.check} | {c.subject} | {c.verdict} | {c.figure} | {c.tolerance} |" for c in checks]
    return "\n".join(lines)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from ..processes import ComponentDied
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy
    from .soak_live import SoakRunner

    plan = SoakPlan(duration_s=args.duration, load=args.load, workers=args.workers, every_s=args.every,
                    warmup=args.warmup)
    problems = plan.problems()
    if problems:
        print(f"inferlb bench soak: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if missing_envoy("inferlb bench soak"):
        return 1
    out = (args.out or Path("bench-results") / "soak").resolve()
    _report(f"soak: {plan.workers} simulated workers at {plan.load:.0%} for {plan.duration_s:g} s; logs in {out}")
    try:
        result = run_on_uvloop(SoakRunner(plan, out, _report).run())
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    except (ComponentDied, RuntimeError, TimeoutError) as exc:
        print(f"inferlb bench soak: FAILED: {exc}", file=sys.stderr)
        return 1
    print(render(result.checks))
    figures = result.load_figures()
    print(f"\n{figures['sent']} requests at {figures['offered_rps']} req/s: {figures['succeeded']} succeeded, "
          f"{figures['failed']} failed; p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms; "
          f"{len(result.samples)} samples; {'PASS' if result.passed else 'FAIL'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return 0 if result.passed else 3
