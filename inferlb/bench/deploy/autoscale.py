"""``inferlb bench autoscale``: issue 15's elastic pool under a load step, through the real `inferlb up`.

One `inferlb up --simulate --autoscale 1..N` (simulated workers, the control plane, ext_proc, Envoy, and
the pool scaler; ``ProcessGroup`` stops it on every way out) on free ports in a throwaway data dir. An
open-loop Poisson load through Envoy steps from 10% of one worker's capacity to 150% and back to 10%;
every request is one sentence, every simulated request costs ``--sim-fixed-ms`` (so one worker's
capacity is ``slots / fixed``). Meanwhile the pool's routable workers (the admin API's endpoints) and the
control plane's signal are sampled. Reported (``autoscale_report.py``): per phase the requests, failures
and p50/p99; the time from the step up to the first added worker and to the peak size; the time until
p99 stays under the SLO; the time from the step down back to MIN workers; the pool size over time. The
target: 0 failed requests through both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ...pool_scaler import desired_replicas
from ...pool_scaler import free_port as scaler_free_port
from ...supervisor import Component
from .autoscale_report import Phase, Request, Sample, summarise, table
from ..processes import ComponentDied, ProcessGroup, free_port
from ..load.texts import embeddings_body

DESCRIPTION = """\
Issue 15's elastic pools: `inferlb up --simulate --autoscale 1..N` on free ports, and an open-loop load
through Envoy of 10% of one worker's capacity, then 150%, then 10% again. Reports the time to scale up,
the time until p99 is back under the SLO, the time to scale back down, the pool size over time, p99 per
phase and the failed requests (the target: none). Progress on stderr; --json writes every figure."""

EPILOG = """\
examples:
  inferlb bench autoscale                       1..3 workers, 30 s + 90 s + 120 s
  inferlb bench autoscale --json docs/bench/autoscale.json
  inferlb bench autoscale --low-s 10 --high-s 30 --after-s 40 --scale-down-cooldown 5 --downscale-window 5"""

REQUEST_TIMEOUT_S = 30.0
# no-store: the load is for the pool to serve (one repeated body would be answered by ext_proc's cache)
HEADERS = {"content-type": "application/json", "cache-control": "no-store"}
SAMPLE_EVERY_S = 0.5
STACK_READY_TIMEOUT_S = 120.0
WORKER_PORTS_FROM = 21000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-workers", type=int, default=3, help="the pool's MAX (MIN is 1; default 3)")
    parser.add_argument("--sim-fixed-ms", type=float, default=40.0,
                        help="each simulated request's cost: one worker serves 1000/this req/s (default 40)")
    parser.add_argument("--low", type=float, default=0.10, help="the low load, of one worker's capacity (0.10)")
    parser.add_argument("--high", type=float, default=1.50, help="the high load (default 1.50)")
    parser.add_argument("--low-s", type=float, default=30.0, help="seconds of low load first (default 30)")
    parser.add_argument("--high-s", type=float, default=90.0, help="seconds of high load (default 90)")
    parser.add_argument("--after-s", type=float, default=120.0, help="seconds of low load after (default 120)")
    parser.add_argument("--slo-ms", type=float, default=250.0, help="the p99 SLO (default 250 ms)")
    parser.add_argument("--scale-up-cooldown", type=float, default=5.0, help="the scaler's (default 5 s)")
    parser.add_argument("--scale-down-cooldown", type=float, default=30.0, help="the scaler's (default 30 s)")
    # 60 s, not the 300 s default, to keep the run short; at 20 s a pool whose need sits between two sizes
    # (150% of one worker: 2 workers at 75%, or 3) went 3 -> 2 -> 3 under steady load.
    parser.add_argument("--downscale-window", type=float, default=60.0,
                        help="the control plane's scale-down smoothing window (default 60 s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def up_component(args: argparse.Namespace, data_dir: Path, ports: dict[str, int]) -> Component:
    """`inferlb up` itself, as the bench's one process (it supervises the stack's)."""
    argv = [sys.executable, "-m", "inferlb.cli", "up", "--simulate", "--autoscale", f"1..{args.max_workers}",
            "--data-dir", str(data_dir), "--worker-args", f"--sim-fixed-ms {args.sim_fixed_ms} --sim-per-token-us 0",
            "--scale-up-cooldown", str(args.scale_up_cooldown),
            "--scale-down-cooldown", str(args.scale_down_cooldown), "--downscale-window", str(args.downscale_window)]
    for flag, port in ports.items():
        argv += [f"--{flag}", str(port)]
    return Component(name="inferlb-up", argv=argv, ready_url=f"http://127.0.0.1:{ports['envoy-admin-port']}/ready",
                     log_path=data_dir / "inferlb-up.log", ready_timeout_s=STACK_READY_TIMEOUT_S)


def schedule(phases: list[Phase], rates: list[float], seed: int) -> np.ndarray:
    """Open-loop Poisson send times over the phases, each at its own rate."""
    rng = np.random.default_rng(seed)
    times: list[float] = []
    for phase, rate in zip(phases, rates):
        t = phase.start_s
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= phase.end_s:
                break
            times.append(t)
    return np.asarray(times)


async def sample_pool(client: httpx.AsyncClient, admin: str, started: float, samples: list[Sample],
                      stop: asyncio.Event) -> None:
    """The pool's routable workers and the signal, every :data:`SAMPLE_EVERY_S`, until ``stop``."""
    while not stop.is_set():
        try:
            endpoints = (await client.get(f"{admin}/v1/endpoints")).json()["endpoints"]
            desired = desired_replicas((await client.get(f"{admin}/metrics")).text, "default")
            samples.append(Sample(time.monotonic() - started, sum(e["routable"] for e in endpoints), desired))
        except httpx.TransportError as exc:
            progress(f"  sampling failed: {exc!r}")
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except TimeoutError:
            pass


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """One load step through a fresh ``inferlb up --autoscale``: the report of its requests and its pool."""
    capacity = 1000.0 / args.sim_fixed_ms
    phases = [Phase("low", 0.0, args.low_s, args.low),
              Phase("high", args.low_s, args.low_s + args.high_s, args.high),
              Phase("after", args.low_s + args.high_s, args.low_s + args.high_s + args.after_s, args.low)]
    rates = [p.load * capacity for p in phases]
    sends = schedule(phases, rates, args.seed)
    body = embeddings_body(12)
    names = ("listener-port", "envoy-admin-port", "xds-port", "admin-port", "ext-proc-port", "ext-proc-metrics-port")
    ports = {name: free_port() for name in names}
    # The workers' ports, added ones too, below the kernel's ephemeral range: a port the scaler finds free
    # must not be taken meanwhile as the source port of one of the load's connections.
    base = scaler_free_port(WORKER_PORTS_FROM, ports.values())
    data_dir = Path(tempfile.mkdtemp(prefix="inferlb-autoscale-"))  # kept when a request failed: its logs
    spec = up_component(args, data_dir, {**ports, "base-port": base})
    admin = f"http://127.0.0.1:{ports['admin-port']}"
    url = f"http://127.0.0.1:{ports['listener-port']}/v1/embeddings"
    progress(f"inferlb up --autoscale 1..{args.max_workers} (simulated workers, {capacity:g} req/s each); "
             f"load {args.low:.0%} -> {args.high:.0%} -> {args.low:.0%}; {len(sends)} requests")
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with ProcessGroup(report=progress, stop_timeout_s=60.0) as group, \
            httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False) as client:
        try:
            await group.start([spec])
            await _wait_serving(client, url, body, group)
        except (ComponentDied, RuntimeError) as exc:
            raise RuntimeError(f"{exc}; the stack's logs: {(data_dir / 'inferlb-up.log').read_text()[-2000:]}")
        progress("stack up; load starts")
        requests, samples = await _drive(client, url, body, sends, admin, group, args.after_s)
        progress("load done; stopping the stack")
    report = summarise(phases, sorted(requests, key=lambda r: r.sent_s), samples, args.slo_ms / 1000, rates, 1)
    if report["failed"]:
        progress(f"requests failed: the stack's data dir and logs are kept in {data_dir}")
    else:
        shutil.rmtree(data_dir, ignore_errors=True)
    return _document(args, capacity, report)


async def _drive(client: httpx.AsyncClient, url: str, body: bytes, sends: np.ndarray, admin: str,
                 group: ProcessGroup, after_s: float) -> tuple[list[Request], list[Sample]]:
    """Send each request at its time (open loop) while sampling the pool, with a progress line every 10 s;
    then sample on until the pool is back at one worker, for ``after_s`` at most."""
    requests: list[Request] = []
    samples: list[Sample] = []
    stop = asyncio.Event()
    started = time.monotonic()
    sampler = asyncio.create_task(sample_pool(client, admin, started, samples, stop))

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, started + at - time.monotonic()))
        t0 = time.monotonic()
        try:
            outcome = str((await client.post(url, content=body,
                                             headers=HEADERS)).status_code)
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        requests.append(Request(at, time.monotonic() - t0, outcome == "200", outcome))

    async def report_progress() -> None:
        while not stop.is_set():
            await asyncio.sleep(10.0)
            last = samples[-1] if samples else None
            progress(f"  t={time.monotonic() - started:5.0f}s  sent {len(requests)}  failed "
                     f"{sum(not r.ok for r in requests)}  workers {last and last.workers}  "
                     f"desired {last and last.desired}")

    reporter = asyncio.create_task(report_progress())
    try:
        await asyncio.gather(*(one(float(at)) for at in sends))
        # the pool may still be shrinking: sample until it is back at MIN, within the after phase's length
        deadline = time.monotonic() + after_s
        while time.monotonic() < deadline and (not samples or samples[-1].workers > 1):
            await asyncio.sleep(SAMPLE_EVERY_S)
        group.check_alive()
    finally:
        stop.set()
        reporter.cancel()
        await asyncio.gather(sampler, reporter, return_exceptions=True)
    return requests, samples


def _document(args: argparse.Namespace, capacity: float, report: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: the command, the settings of the run and its report."""
    return {"benchmark": "autoscale", "date": time.strftime("%Y-%m-%d"),
            "command": "inferlb bench autoscale " + " ".join(sys.argv[3:]) if len(sys.argv) > 3 else
            "inferlb bench autoscale",
            "settings": {"min_workers": 1, "max_workers": args.max_workers, "worker_capacity_rps": capacity,
                         "slo_s": args.slo_ms / 1000, "scale_up_cooldown_s": args.scale_up_cooldown,
                         "scale_down_cooldown_s": args.scale_down_cooldown,
                         "downscale_window_s": args.downscale_window, "seed": args.seed,
                         "workers": "simulated (--sim-fixed-ms, 1 slot)"},
            **report}


async def _wait_serving(client: httpx.AsyncClient, url: str, body: bytes, group: ProcessGroup) -> None:
    """Until a request through Envoy is answered 200 (the stack routes), or the deadline."""
    deadline = time.monotonic() + STACK_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        group.check_alive()
        try:
            if (await client.post(url, content=body, headers=HEADERS)).status_code \
                    == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"nothing answered {url} within {STACK_READY_TIMEOUT_S:g} s")


def main(args: argparse.Namespace) -> int:
    if not 1 < args.max_workers <= 16 or not 0 < args.low < args.high or args.sim_fixed_ms <= 0 \
            or min(args.low_s, args.high_s, args.after_s) <= 0:
        print("inferlb bench autoscale: need 2 <= --max-workers <= 16, 0 < --low < --high, --sim-fixed-ms > 0 "
              "and positive phase lengths", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run(args))
    except RuntimeError as exc:
        print(f"inferlb bench autoscale: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; every process stopped", file=sys.stderr)
        return 130
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["failed"] == 0 else 1
