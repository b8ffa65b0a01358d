"""``inferlb bench hogs``: one-sentence requests beside a client's largest requests, through Envoy.

Issue 37's measurement: one client keeps 32 hogs of 32 inputs x 256 tokens in flight through Envoy while
one-sentence requests come at 10/s; a sentence's p99 is <= 100 ms with 0 errors, the hogs keep >= 90% of
their throughput alone (work-conserving), and the hogs' 429s come at once (p99 <= 5 ms), never after a
wait. Issue 13's bench sent the hogs straight to the workers, so it never measured ext_proc's door; that
is now one mode of four:

- same-client: hogs and sentences from 127.0.0.1, no key (one flow per client address: the sentences
  overtake the hogs within it, least work first);
- other-client: the hogs from 127.0.0.2, no key (two flows);
- other-tenant: the hogs with one tenant's API key, the sentences with another's (issued through the
  admin API);
- direct: the hogs straight to each worker (issue 13's run), the sentences through Envoy.

Every run is on a fresh stack (``hogs_live``); every input is unique, so no cache answers. The plan and
run list are in ``hogs_plan``, the closed loop in ``hogs_load``, the figures and verdicts in
``hogs_report``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from workers.queue_order import SCHEDULINGS

from ..report.table import ms
from .hogs_plan import DIRECT, MODES, ORDERS, HogsPlan, default_schedulings, parse_list, plan_runs

DESCRIPTION = """\
Issue 37's hogs benchmark, through Envoy. Per mode (same-client, other-client, other-tenant, direct) and
ext_proc order (--orders: smallest, fifo), a fresh stack on loopback (N real ONNX workers, control plane,
ext_proc, Envoy). Envoy modes: one client keeps --hog-concurrency hogs of --hog-inputs x --hog-tokens in
flight through Envoy (closed loop, every input unique); first the hogs alone (--alone-seconds: the fleet's
tokens/s), then one-sentence requests at --rate for --duration s beside them. Direct: issue 13's hogs
straight to each worker. Prints per run the sentences' p50/p99 and errors (target p99 <= 100 ms, 0 errors),
the hogs' tokens/s alone and beside the sentences (target ratio >= 90%), the hogs' 429s and time to them
(target p99 <= 5 ms, none after waiting). Takes about 45 s per run; --quick about 30 s."""

EPILOG = """\
examples:
  inferlb bench hogs                                    the four modes, order smallest, las
  inferlb bench hogs --orders smallest,fifo --rounds 3 --json /tmp/hogs.json
  inferlb bench hogs --modes direct                     issue 13's run: las, round_robin, fifo
  inferlb bench hogs --quick"""

QUICK = {"hog_concurrency": 8, "inputs_per_worker": 512, "duration_s": 4.0, "alone_s": 3.0, "ramp_s": 1.0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    d = HogsPlan()
    parser.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                        help=f"where the hogs come from, in order (default {','.join(MODES)})")
    parser.add_argument("--orders", default=ORDERS[0], metavar="LIST",
                        help=f"ext_proc's fair_queue_order per run: {', '.join(ORDERS)} (default {ORDERS[0]})")
    parser.add_argument("--schedulings", metavar="LIST",
                        help=f"worker scheduling options: {', '.join(SCHEDULINGS)} (default las with an Envoy "
                             f"mode, all of them with --modes direct alone)")
    parser.add_argument("--rounds", type=int, default=1, metavar="N",
                        help="repeat the comparison N times, each round rotated; medians (default 1)")
    parser.add_argument("--workers", type=int, default=d.workers, help=f"real ONNX workers (default {d.workers})")
    parser.add_argument("--hog-concurrency", type=int, metavar="N",
                        help=f"hogs kept in flight through Envoy (default {d.hog_concurrency}; "
                             f"--quick {QUICK['hog_concurrency']})")
    parser.add_argument("--hog-inputs", type=int, default=d.hog_inputs, help=f"inputs per hog (default {d.hog_inputs})")
    parser.add_argument("--hog-tokens", type=int, default=d.hog_tokens,
                        help=f"tokens per hog input (default {d.hog_tokens}, the model's limit)")
    parser.add_argument("--hog-backoff", type=float, default=d.hog_backoff_s, metavar="S",
                        help=f"a refused hog is replaced after min(Retry-After, S) (default {d.hog_backoff_s:g}; "
                             "0: at once)")
    parser.add_argument("--inputs-per-worker", type=int, metavar="N",
                        help=f"direct mode: hog inputs sent to each worker (default {d.inputs_per_worker}; "
                             f"--quick {QUICK['inputs_per_worker']})")
    parser.add_argument("--rate", type=float, default=d.rate_rps, metavar="RPS",
                        help=f"one-sentence requests per second (default {d.rate_rps:g})")
    parser.add_argument("--duration", type=float, metavar="S",
                        help=f"seconds of sentences (default {d.sentences / d.rate_rps:g}; --quick "
                             f"{QUICK['duration_s']:g})")
    parser.add_argument("--sentences", type=int, metavar="N", help="one-sentence requests per run (instead of "
                                                                   "--duration)")
    parser.add_argument("--alone-seconds", type=float, metavar="S",
                        help=f"hogs alone before the sentences (default {d.alone_s:g}; --quick {QUICK['alone_s']:g})")
    parser.add_argument("--ramp-seconds", type=float, metavar="S",
                        help=f"hogs running before the hogs-alone window (default {d.ramp_s:g}; --quick "
                             f"{QUICK['ramp_s']:g})")
    parser.add_argument("--max-batch-tokens", type=int, metavar="N",
                        help="the workers' --max-batch-tokens (default: the workers' own default)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                        help=f"per-request timeout, Envoy's route timeout too (default {d.timeout_s:g})")
    parser.add_argument("--quick", action="store_true", help="fewer hogs, shorter phases")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument("--out", type=Path, metavar="DIR", help="logs (default: bench-results/hogs)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def plan_from_args(args: argparse.Namespace) -> HogsPlan:
    quick: dict[str, float] = QUICK if args.quick else {}
    d = HogsPlan()

    def pick(value: Any, name: str) -> Any:
        return value if value is not None else quick.get(name, getattr(d, name, None))

    duration = pick(args.duration, "duration_s") or d.sentences / d.rate_rps
    sentences = args.sentences if args.sentences is not None else max(1, round(duration * args.rate))
    return HogsPlan(
        workers=args.workers, hog_inputs=args.hog_inputs, hog_tokens=args.hog_tokens,
        hog_concurrency=int(pick(args.hog_concurrency, "hog_concurrency")),
        inputs_per_worker=int(pick(args.inputs_per_worker, "inputs_per_worker")), sentences=sentences,
        rate_rps=args.rate, alone_s=pick(args.alone_seconds, "alone_s"), ramp_s=pick(args.ramp_seconds, "ramp_s"),
        hog_backoff_s=args.hog_backoff, timeout_s=args.timeout, max_batch_tokens=args.max_batch_tokens)


def _report(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _fail(message: str) -> int:
    print(f"inferlb bench hogs: {message}", file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    from workers.config import WorkerConfig, default_data_dir

    from ..processes import ComponentDied
    from ..routing.run_command import run_on_uvloop
    from ..routing.runner import missing_envoy
    from ..stack.dataplanes.launch import DataPlaneError
    from .hogs_live import run_direct, run_envoy
    from .hogs_report import figures, medians, render

    try:
        modes = parse_list("--modes", args.modes, MODES)
        orders = parse_list("--orders", args.orders, ORDERS)
        schedulings = (parse_list("--schedulings", args.schedulings, SCHEDULINGS) if args.schedulings
                       else default_schedulings(modes))
        runs = plan_runs(modes, orders, schedulings, args.rounds)
    except ValueError as exc:
        return _fail(str(exc))
    plan = plan_from_args(args)
    problems = plan.problems(WorkerConfig().max_request_tokens)
    if problems:
        return _fail("; ".join(problems))
    if missing_envoy("inferlb bench hogs"):
        return 1
    data_dir = default_data_dir()
    out = (args.out or Path("bench-results") / "hogs").resolve()
    _report(f"hogs: {len(runs)} runs ({', '.join(modes)}; orders {', '.join(orders)}; schedulings "
            f"{', '.join(schedulings)}; {args.rounds} round(s)), each on a fresh stack; model from {data_dir}; "
            f"logs in {out}")
    report: dict[str, Any] = {"plan": asdict(plan), "modes": modes, "orders": orders, "schedulings": schedulings,
                              "rounds": args.rounds, "runs": [], "failures": []}
    started = time.monotonic()
    for index, spec in enumerate(runs, 1):
        _report(f"[{index}/{len(runs)}] round {spec.round} mode {spec.mode} order {spec.order} "
                f"scheduling {spec.scheduling}")
        run = run_direct if spec.mode == DIRECT else run_envoy
        try:
            row = figures(run_on_uvloop(run(plan, spec, out, data_dir, not args.no_progress, _report)))
        except KeyboardInterrupt:
            print("interrupted; every process stopped", file=sys.stderr)
            return 130
        except (DataPlaneError, ComponentDied, RuntimeError, TimeoutError, OSError) as exc:
            _report(f"  FAILED: {spec.name}: {exc}")
            report["failures"].append({"round": spec.round, "run": spec.name, "error": str(exc)})
            continue
        report["runs"].append(row)
        _report(f"  sentences p50 {ms(row['sentence_p50_s'])} ms, p99 {ms(row['sentence_p99_s'])} ms, errors "
                f"{row['sentence_errors']}; hogs {row['hogs_ok']} ok, {row['hog_429s']} 429s "
                f"({row['hog_429_after_waiting']} after waiting), ratio {row.get('hog_throughput_ratio')}")
    report["medians"] = medians(report["runs"])
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0
