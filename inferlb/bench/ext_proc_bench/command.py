"""``inferlb bench ext-proc``: its options, and the run (the stack, then the phases in order, then the report)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from . import __doc__ as PACKAGE_DOC

DESCRIPTION = PACKAGE_DOC.split("\n\n", 1)[1].rsplit("\n\nModules:", 1)[0] if PACKAGE_DOC else ""
QUICK = {"duration": 3.0, "rounds": 1, "warmup": 1.0, "wrk_seconds": 2.0, "grpc_seconds": 3.0, "floor_seconds": 2.0,
         "profile_seconds": 3.0}


def _rates(text: str) -> list[int]:
    try:
        rates = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError("--rates takes integers, e.g. 200,500,1000") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("--rates takes positive integers, e.g. 200,500,1000")
    return rates


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", type=_rates, default=[200, 500, 1000],
                   help="open-loop rates, req/s, comma-separated (default 200,500,1000)")
    p.add_argument("--duration", type=float, default=16, help="seconds per configuration and rate (default 16)")
    p.add_argument("--rounds", type=int, default=2,
                   help="split --duration into this many rounds, alternating which configuration goes first (default 2)")
    p.add_argument("--arrivals", choices=["poisson", "uniform"], default="poisson",
                   help="open-loop arrivals (default poisson)")
    p.add_argument("--warmup", type=float, default=2,
                   help="seconds at 500 req/s per configuration before measuring (default 2)")
    p.add_argument("--max-connections", type=int, default=256,
                   help="connections the open-loop generator may open (default 256)")
    p.add_argument("--drain", type=float, default=10,
                   help="an answer later than this many seconds after its scheduled time is a timeout (default 10)")
    p.add_argument("--workers", type=int, default=4, help="simulated workers (default 4)")
    p.add_argument("--sim-fixed-ms", type=float, default=0.1, help="simulated cost per batch (default 0.1 ms)")
    p.add_argument("--sim-per-token-us", type=float, default=1.0,
                   help="simulated cost per padded token (default 1 us)")
    p.add_argument("--transport", choices=["uds", "tcp"], default="uds",
                   help="how the stack's Envoy reaches ext_proc: a Unix domain socket (uds, default: inferlb up's "
                        "sidecar default) or loopback TCP; the gRPC phase measures both either way")
    p.add_argument("--bodies", type=int, default=256, help="distinct request bodies, cycled (default 256)")
    p.add_argument("--wrk-seconds", type=float, default=6,
                   help="each wrk saturation run: 2 through the stack, 6 through Envoy to a fake worker "
                        "(default 6; 0: skip)")
    p.add_argument("--wrk-rounds", type=int, default=1,
                   help="rounds of the fake-worker wrk runs, every variant once per round in a rotated order; "
                        "each variant reports its median round (default 1)")
    p.add_argument("--wrk-connections", type=int, default=64, help="wrk connections (default 64)")
    p.add_argument("--grpc-seconds", type=float, default=8,
                   help="direct gRPC saturation of ext_proc pinned to one core (default 8; 0: skip)")
    p.add_argument("--grpc-streams", type=int, default=32,
                   help="concurrent gRPC streams of the direct client (default 32)")
    p.add_argument("--floor-seconds", type=float, default=5,
                   help="the same for a trivial servicer on each gRPC front: the framework's floor; also adds "
                        "the filter floor to the overhead phase (default 5; 0: skip both)")
    p.add_argument("--profile", choices=["auto", "always", "never"], default="auto",
                   help="perf + cProfile of ext_proc: when a target is missed (auto, default), always or never")
    p.add_argument("--profile-seconds", type=float, default=8, help="length of the profiled load (default 8)")
    p.add_argument("--profile-top", type=int, default=15, help="functions listed by own time (default 15)")
    p.add_argument("--seed", type=int, default=1, help="schedules and bodies (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="about 1.5 minutes: 3 s per rate in 1 round, 2 s wrk runs, 3 s gRPC load, 2 s floor, "
                        "1 s warm-up")
    p.add_argument("--keep-logs", action="store_true", help="keep the processes' logs (kept anyway on failure)")
    p.add_argument("--json", type=Path, help="also write every figure here")


def settle(args: argparse.Namespace) -> None:
    """Apply --quick, then refuse settings that cannot make a run (SystemExit with the reason)."""
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.rounds < 1 or args.duration <= 0 or args.workers < 1 or args.bodies < 1:
        raise SystemExit("inferlb bench ext-proc: --rounds, --workers and --bodies >= 1 and --duration > 0 are needed")
    if args.wrk_rounds < 1:
        raise SystemExit("inferlb bench ext-proc: --wrk-rounds >= 1 is needed")
    if args.max_connections < 1 or args.drain <= 0:
        raise SystemExit("inferlb bench ext-proc: --max-connections >= 1 and --drain > 0 are needed")


def log(message: str) -> None:
    print(message, flush=True)


def estimate_s(args: argparse.Namespace) -> float:
    floor = args.floor_seconds > 0
    configs = 3 if floor else 2  # the overhead phase's baseline, ext_proc and the filter floor
    return (15 + configs * args.warmup + len(args.rates) * configs * (args.duration + args.rounds)
            + (2 + 8 * args.wrk_rounds) * (args.wrk_seconds + 1)
            + (2 * 2 * (args.grpc_seconds + 1 + (args.floor_seconds + 1) * floor) + 10 if args.grpc_seconds else 0)
            + (2 * args.profile_seconds + 8 if args.profile != "never" else 0))


async def run(args: argparse.Namespace, log_dir: Path, results: dict[str, Any]) -> None:
    """Every phase on one stack; figures land in ``results`` as they come (a failure keeps the earlier ones)."""
    import httpx

    from ..processes import ProcessGroup
    from ..routing.runner import find_envoy
    from ..load.wrk import INSTALL_HINT, find_wrk
    from .grpc_load import direct_phase, envoy_messages
    from .overhead import overhead_phase
    from .profile import profile_phase
    from .report import targets
    from .saturation import envoy_saturation_phase, stack_saturation_phase, wrk_script
    from .stack import start_stack
    from .workload import make_bodies

    started = time.monotonic()
    bodies = make_bodies(args.bodies, args.seed)
    envoy = find_envoy()
    async with ProcessGroup() as group, httpx.AsyncClient(timeout=5, trust_env=False) as client:
        st = await start_stack(group, client, args, log_dir, bodies, envoy, log)
        results["ext_proc_front"] = st.ext_proc_front
        log(f"[stack] ready in {time.monotonic() - started:.0f} s: ext_proc Envoy :{st.envoy_x_port}, "
            f"baseline Envoy :{st.envoy_b_port}, ext_proc :{st.ext_proc_port}; logs in {log_dir}")
        results["overhead"] = await overhead_phase(args, st, bodies, log)
        messages, answer = await envoy_messages(client, bodies, st.worker_urls[0], f"127.0.0.1:{st.envoy_x_port}")
        if find_wrk() is None:
            log(f"[saturation/envoy] skipped: {INSTALL_HINT}")
        elif args.wrk_seconds > 0:
            script = wrk_script(log_dir, bodies)
            results["saturation_stack"] = await stack_saturation_phase(args, st, script, log)
            results["saturation_fake_worker"] = await envoy_saturation_phase(args, st, script, bodies, answer, log)
        if args.grpc_seconds > 0:
            results["saturation_grpc"] = await direct_phase(args, st, messages, log)
        results["targets"] = targets(results)
        missed = any(t["met"] is False for t in results["targets"].values())
        if args.profile == "always" or (args.profile == "auto" and missed):
            results["profile"] = await profile_phase(args, st, messages, log)


def main(args: argparse.Namespace) -> int:
    import uvloop

    from .report import report

    settle(args)
    started = time.monotonic()
    log(f"inferlb bench ext-proc: about {estimate_s(args) / 60:.1f} minutes; rates {args.rates} req/s")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-ext-proc-"))
    results: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "processor": platform.processor(),
                    "loadavg_start": os.getloadavg(), "shared": True},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
    }
    ok = False
    try:
        uvloop.run(run(args, log_dir, results))
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["runtime_s"] = time.monotonic() - started
        report(results, args, log)
        log(f"total {results['runtime_s']:.0f} s")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
            log(f"wrote {args.json}")
        ok = True
        return 0
    except KeyboardInterrupt:  # every process was stopped on the way out
        print("inferlb bench ext-proc: interrupted", file=sys.stderr)
        return 130
    finally:
        if ok and not args.keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not ok:
            print(f"inferlb bench ext-proc: failed; the processes' logs are in {log_dir}", file=sys.stderr, flush=True)
