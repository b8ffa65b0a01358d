"""``inferlb bench cache``: issue 16's response cache, off and on, on the same trace (see ``cache_live.py``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .cache_report import MIB, QUICK, CachePlan, render, verdicts, with_refinement

DESCRIPTION = """\
Issue 16's gateway cache, live. Two fresh stacks on loopback, one after the other (simulated workers,
control plane, ext_proc, Envoy): cache OFF (ext_proc's and the workers' cache_max_bytes 0) and ON
(ext_proc's cache_max_bytes CACHE_MAX_BYTES). Each first sends one body back to back (a warm-up, then
HIT_REQUESTS timed requests, read x-inferlb-cache), then an open-loop load sweep whose requests repeat
earlier texts at REPEAT_RATE (Zipf over REPEAT_POOL texts; the rest fresh), at rates from LOAD_MIN to
LOAD_MAX times the fleet's no-cache capacity (its cost model), each LOAD_STEP times the one before, until
a rate misses the SLO. Both modes replay the very same requests. Then each mode's crossing is bisected
REFINE_STEPS times between its last rate met and its first missed, each rate measured REFINE_DURATION
seconds (the modes take turns): the sweep's grid alone puts the ratio at LOAD_STEP**k.
Targets: throughput at the SLO (the highest rate with p99 <= SLO, no errors, below every rate that
missed, sweep and refinement together) on / off >= 1.4 at 30% repeats; a hit answers through Envoy in
<= 2 ms at p50. Also printed: where p99 crosses the SLO, interpolated between the last rate met and the
next one missed. Progress on stderr; exit 0 when both targets are met. Takes 11-15 minutes
(--refine-steps 0: about 6; --quick, which does not refine: about 2)."""

EPILOG = """\
examples:
  inferlb bench cache
  inferlb bench cache --quick --json /tmp/cache.json
  inferlb bench cache --repeat-rate 0.5 --zipf-s 0.8"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = CachePlan()
    parser.add_argument("--repeat-rate", type=float, default=d.repeat_rate, metavar="R",
                        help=f"share of requests repeating an earlier text (default {d.repeat_rate:g})")
    parser.add_argument("--repeat-pool", type=int, default=d.repeat_pool, metavar="N",
                        help=f"distinct texts the repeats are drawn from (default {d.repeat_pool})")
    parser.add_argument("--zipf-s", type=float, default=d.zipf_s, metavar="S",
                        help=f"the repeats' Zipf exponent over the pool (default {d.zipf_s:g})")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"simulated workers (default {d.workers})")
    parser.add_argument("--slo-ms", type=float, default=d.slo_s * 1e3,
                        help=f"the SLO on p99 (default {d.slo_s * 1e3:g})")
    parser.add_argument("--load-min", type=float, default=d.load_min,
                        help=f"the sweep's first rate, times the no-cache capacity (default {d.load_min:g})")
    parser.add_argument("--load-max", type=float, default=d.load_max,
                        help=f"its last (default {d.load_max:g})")
    parser.add_argument("--load-step", type=float, default=None,
                        help=f"each rate over the one before (default {d.load_step:g}; --quick {QUICK['load_step']:g})")
    parser.add_argument("--duration", type=float, default=None,
                        help=f"measured seconds per rate (default {d.duration_s:g}; --quick {QUICK['duration_s']:g})")
    parser.add_argument("--refine-steps", type=int, default=None,
                        help=f"bisections of each mode's crossing after the sweep (default {d.refine_steps}; "
                        f"--quick {QUICK['refine_steps']})")
    parser.add_argument("--refine-duration", type=float, default=d.refine_duration_s,
                        help=f"measured seconds per refinement rate (default {d.refine_duration_s:g})")
    parser.add_argument("--hit-requests", type=int, default=None,
                        help=f"timed requests of the one repeated body (default {d.hit_requests}; "
                        f"--quick {QUICK['hit_requests']})")
    parser.add_argument("--cache-max-bytes", type=int, default=d.cache_max_bytes,
                        help=f"ext_proc's cache_max_bytes when on (default {d.cache_max_bytes // MIB} MiB)")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"the traces' seed (default {d.seed})")
    parser.add_argument("--quick", action="store_true", help="shorter rates, coarser steps, fewer timed requests")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/cache)")


def plan_from(args: argparse.Namespace) -> CachePlan:
    """The plan the arguments ask for: --quick's values where a flag was not given."""
    quick = QUICK if args.quick else {}
    d = CachePlan()

    def pick(value: object, name: str) -> object:
        return value if value is not None else quick.get(name, getattr(d, name))

    return CachePlan(repeat_rate=args.repeat_rate, repeat_pool=args.repeat_pool, zipf_s=args.zipf_s,
                     workers=args.workers, slo_s=args.slo_ms / 1e3, load_min=args.load_min, load_max=args.load_max,
                     load_step=float(pick(args.load_step, "load_step")),  # type: ignore[arg-type]
                     duration_s=float(pick(args.duration, "duration_s")),  # type: ignore[arg-type]
                     warmup_s=float(quick.get("warmup_s", d.warmup_s)),
                     hit_requests=int(pick(args.hit_requests, "hit_requests")),  # type: ignore[call-overload]
                     refine_steps=int(pick(args.refine_steps, "refine_steps")),  # type: ignore[call-overload]
                     refine_duration_s=args.refine_duration,
                     cache_max_bytes=args.cache_max_bytes, seed=args.seed)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    from .cache_live import run_cache
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy

    plan = plan_from(args)
    problems = plan.problems()
    if args.seed < 0:
        problems.append(f"--seed must be >= 0, got {args.seed}")
    if problems:
        print(f"inferlb bench cache: {'; '.join(problems)}", file=sys.stderr)
        return 2
    if missing_envoy("inferlb bench cache"):
        return 1
    out = (args.out or Path("bench-results") / "cache").resolve()
    _report(f"cache: {plan.workers} simulated workers, {plan.repeat_rate:.0%} repeats, loads "
            f"{', '.join(f'{x:g}' for x in plan.loads())} x capacity; logs in {out}")
    started = time.monotonic()
    try:
        live = run_on_uvloop(run_cache(plan, out, _report))
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    off, on = (with_refinement(live[m]["sweep"], live[m]["refine"]) for m in ("off", "on"))
    report = {**live, "verdicts": verdicts(off, on, live["on"]["hit_series"], plan.slo_s),
              "wall_s": round(time.monotonic() - started, 1)}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    v = report["verdicts"]
    return 0 if v["ratio_met"] and v["hit_met"] and not report["failures"] else 1



