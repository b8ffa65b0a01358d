"""``inferlb bench xds``: its options, the matrix of configurations, one process per configuration."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import __doc__ as PACKAGE_DOC
from .report import progress_line, table
from .spec import CONV_TARGET_MS, SINGLE_TARGET_MS, Spec

_PARTS = (PACKAGE_DOC or "").split("\n\n")
DESCRIPTION = "\n\n".join(_PARTS[:-1])  # all but the list of modules
EPILOG = ("Each configuration runs in its own control-plane process; every process and server listens on "
          "127.0.0.1 only, is bounded by --sync-timeout/--round-timeout, and is stopped at the end.")
QUICK = {"endpoints": "1000", "clients": "1,10", "modes": "sotw,delta", "rounds": "3", "single_clients": "10"}


def run_isolated(spec: Spec) -> dict[str, Any]:
    """One configuration in a fresh process (clean RSS and CPU), in its own process group."""
    timeout = spec.sync_timeout_s + (spec.rounds + spec.warmup) * spec.round_timeout_s + 120
    with tempfile.TemporaryDirectory(prefix="bench_xds_") as tmp:
        result_path = Path(tmp) / "result.json"
        proc = subprocess.Popen([sys.executable, "-m", "inferlb.bench.xds_bench.configuration",
                                 json.dumps(asdict(spec)), str(result_path)], start_new_session=True,
                                # gRPC's INFO lines about fork() (the children start after the server) are noise
                                env={**os.environ, "GRPC_VERBOSITY": os.environ.get("GRPC_VERBOSITY", "ERROR")})
        try:
            proc.wait(timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the configuration; its fleet and Envoy die with it
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if not isinstance(exc, subprocess.TimeoutExpired):
                raise
            return {"spec": asdict(spec), "ok": False, "error": f"configuration timed out after {timeout:.0f} s",
                    "rounds": [], "summary": {}}
        if proc.returncode != 0 or not result_path.exists():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stragglers, if the server died without cleaning up
            return {"spec": asdict(spec), "ok": False, "error": f"control-plane process exited {proc.returncode}",
                    "rounds": [], "summary": {}}
        return json.loads(result_path.read_text())


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--endpoints", type=int_list, default=[1000, 10000], metavar="N,N",
                   help="endpoint counts (default 1000,10000)")
    p.add_argument("--clients", type=int_list, default=[1, 10, 50], metavar="N,N",
                   help="xDS clients per configuration, the Envoy included (default 1,10,50)")
    p.add_argument("--modes", default="sotw,delta", help="sotw, delta or both (default sotw,delta)")
    p.add_argument("--rounds", type=int, default=5, help="measured weight changes per configuration (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured weight changes first (default 1)")
    p.add_argument("--single-clients", type=int, default=10, metavar="N",
                   help="clients for the single-weight Delta change, run at every --endpoints (default 10; 0: skip)")
    p.add_argument("--no-envoy", action="store_true", help="lightweight clients only (no real Envoy)")
    p.add_argument("--no-telemetry", action="store_true", help="endpoints without telemetry in the EDS metadata")
    p.add_argument("--envoy-health-check-interval", type=float, default=60.0, metavar="S",
                   help="the workers cluster's health-check interval while benchmarking (default 60)")
    p.add_argument("--round-timeout", type=float, default=60.0, metavar="S",
                   help="give up on a weight change after this long (default 60)")
    p.add_argument("--sync-timeout", type=float, default=180.0, metavar="S",
                   help="give up on the initial sync of all clients after this long (default 180)")
    p.add_argument("--envoy", dest="envoy_path", default=None, metavar="PATH",
                   help="the Envoy binary (default: envoy on PATH, else next to this Python)")
    p.add_argument("--quick", action="store_true",
                   help="about a minute: " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    p.add_argument("--json", type=Path, metavar="FILE", help="write every round and the summary here")


def main(args: argparse.Namespace) -> int:
    if args.quick:
        args.endpoints, args.clients = int_list(QUICK["endpoints"]), int_list(QUICK["clients"])
        args.modes, args.rounds, args.single_clients = QUICK["modes"], int(QUICK["rounds"]), int(QUICK["single_clients"])
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("sotw", "delta") for m in modes):
        raise SystemExit("--modes takes sotw, delta or sotw,delta")
    if any(c < 1 for c in args.clients) or any(n < 1 for n in args.endpoints) or args.rounds < 1:
        raise SystemExit("--clients, --endpoints and --rounds must be >= 1")
    envoy_path = ""
    if not args.no_envoy:
        envoy_path = args.envoy_path or shutil.which("envoy") or str(Path(sys.executable).parent / "envoy")
        if not os.access(envoy_path, os.X_OK):
            raise SystemExit(f"no Envoy binary at {envoy_path} (use --envoy PATH or --no-envoy)")

    def spec(mode: str, change: str, endpoints: int, clients: int) -> Spec:
        return Spec(mode=mode, change=change, endpoints=endpoints, clients=clients, envoy=not args.no_envoy,
                    rounds=args.rounds, warmup=args.warmup, telemetry=not args.no_telemetry,
                    health_check_interval_s=args.envoy_health_check_interval, round_timeout_s=args.round_timeout,
                    sync_timeout_s=args.sync_timeout, envoy_path=envoy_path)

    specs = [spec(mode, "all", n, c) for n in args.endpoints for mode in modes for c in args.clients]
    if args.single_clients > 0:
        specs += [spec("delta", "one", n, args.single_clients) for n in args.endpoints]
    envoy_version = ""
    if envoy_path:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            envoy_version = subprocess.run([envoy_path, "--version"], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
    meta = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
            "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_at_start": os.getloadavg(),
            "envoy": envoy_version, "targets_ms": {"10k_x_50_conv": CONV_TARGET_MS, "single_delta_10": SINGLE_TARGET_MS}}
    print(f"inferlb bench xds: {len(specs)} configurations, {args.warmup} warm-up + {args.rounds} rounds each; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}", flush=True)
    results: list[dict[str, Any]] = []
    for index, s in enumerate(specs, 1):
        print(f"[{index}/{len(specs)}] {s.label} ...", flush=True)
        result = run_isolated(s)
        results.append(result)
        print(f"[{index}/{len(specs)}] {progress_line(s, result)}", flush=True)
        if args.json:
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print()
    print(table(results))
    print("\nconv: weight change -> every client's EDS ACK processed by the server (build included); "
          "+E: one of the clients is a real Envoy; EDS B: one EDS response (one ClusterLoadAssignment "
          "holding every endpoint); CPU/RSS: the control-plane process alone.")
    if args.json:
        print(f"wrote {args.json}")
    return 0 if all(r.get("ok") for r in results) else 1
