#!/usr/bin/env python
"""xDS control-plane benchmark: how long a weight change takes to reach every
connected xDS client, and what it costs the control plane.

For each configuration (mode x endpoints x clients) a fresh control-plane
process runs the production path in-process: ``SnapshotCache`` +
``serve_xds`` on a free 127.0.0.1 port, and the real ``Controller`` (its
``publish``: ``build_snapshot`` in ``asyncio.to_thread``, then
``set_default_snapshot`` on the loop; once the Envoys ACK it, ext_proc's
snapshot with the rich EDS, which no client here subscribes to; the
debouncer is not started, so the debounce delay, 0.1 s by default in
production, is not in the figures). Every client is in the Envoys' node
group: they get the lean EDS (address, health, weight).
Clients connect like Envoy (CDS and LDS wildcard, EDS for the workers
cluster, RDS by name) and ACK every response:

  * N-1 lightweight ADS clients (tests/xds_client.py), all in ONE separate
    client-fleet process, one gRPC connection each;
  * 1 real Envoy 1.40 (the project's bootstrap, a free admin port; the
    listener port in DataPlaneSettings is free too). ``--no-envoy``: N
    lightweight clients instead.

Measurement (server side, one clock, no cross-process timing): a weight
change is applied to the controller's state off the clock, then the clock
starts and ``Controller.publish()`` runs. The server's XdsMetrics hook
``on_ack`` (called synchronously when a stream records an ACK) checks
``cache.clients()`` once at least N EDS ACKs arrived; the round converges
the moment every client's acked EDS version equals the new snapshot's EDS
version. Reported per round:

  conv     weight change -> last ACK processed (build + push + ACKs)
  push     set_default_snapshot -> last ACK
  build    publish() start -> set_default_snapshot (the Envoys' snapshot,
           in the worker thread)
  EDS B    bytes of one EDS response as a lightweight client received it
           (the protobuf message; gRPC/HTTP2 framing excluded); x N = total
  CPU      control-plane process CPU seconds (all threads; process_time,
           ns resolution) from the change to convergence, and that as % of
           the wall time (100% = one core)
  RSS      control-plane process RSS after the round (max over rounds)

"change=all" changes every endpoint's weight (a policy recompute);
"change=one" changes a single endpoint's weight (Delta, --single-clients
clients). The ClusterLoadAssignment is ONE resource that holds every
endpoint, so Delta resends the whole CLA in both cases: compare the bytes.

Endpoints carry scraped telemetry by default (as in production; it rides in
ext_proc's EDS metadata only, which the Envoys' snapshot does not carry;
--no-telemetry drops it). Per round, the JSON also has ``publish_ms``: until
publish() returned (the wait for the Envoys' ACKs and ext_proc's snapshot
included). Endpoint addresses are
127.77.x.y:1 (loopback, nothing listens): the Envoy's health checks fail
fast and touch nobody; their interval is --envoy-health-check-interval
(default 60 s, so that Envoy does not health-check 10,000 hosts a second
on the same cores as the control plane).

Targets: 10,000 endpoints x 50 clients converge in <= 1 s; a single-weight
change with Delta at 10 clients in <= 50 ms.

Usage:
  python scripts/bench_xds.py                      # the full matrix (minutes)
  python scripts/bench_xds.py --endpoints 100 --clients 2 --rounds 2 --modes delta --single-clients 2
  python scripts/bench_xds.py --json bench_xds.json --no-envoy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from control_plane.config import ControlPlaneConfig  # noqa: E402
from control_plane.controller import Controller  # noqa: E402
from control_plane.model import DataPlaneSettings, Endpoint, FleetState, Telemetry  # noqa: E402
from control_plane.type_urls import CLUSTER, ENDPOINT, LISTENER, PUSH_ORDER, ROUTE, SHORT_NAMES  # noqa: E402
from control_plane.xds import Snapshot, SnapshotCache, serve_xds, stop_xds  # noqa: E402
from control_plane.xds.clients import NoopMetrics  # noqa: E402
from inferlb.bootstrap import render_bootstrap  # noqa: E402

CONV_TARGET_MS = 1000.0  # 10,000 endpoints x 50 clients
SINGLE_TARGET_MS = 50.0  # one weight, Delta, 10 clients
NODE_CLUSTER = "inferlb"
ENVOY_NODE = "bench-envoy"


# -- the configuration one control-plane process runs -------------------------------------------


@dataclass(frozen=True)
class Spec:
    mode: str  # sotw | delta
    change: str  # all | one
    endpoints: int
    clients: int  # xDS clients in all, the Envoy included
    envoy: bool
    rounds: int
    warmup: int
    telemetry: bool
    health_check_interval_s: float
    round_timeout_s: float
    sync_timeout_s: float
    envoy_path: str

    @property
    def fakes(self) -> int:
        return self.clients - (1 if self.envoy else 0)

    @property
    def label(self) -> str:
        who = f"{self.clients} ({'1 envoy' if self.envoy else 'no envoy'})"
        return f"{self.mode:5} change={self.change:3} endpoints={self.endpoints:<6} clients={who}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weight_of(index: int, round_no: int, change: str) -> int:
    """Round 0 is the initial state; every later round changes every weight ("all") or one ("one")."""
    if change == "one":
        return 100 + round_no if index == 0 else 1 + (index * 31) % 1000
    return 1 + (index * 31 + round_no * 17) % 1000  # differs from the previous round for every index


def make_endpoints(n: int, telemetry: bool) -> tuple[Endpoint, ...]:
    out = []
    for i in range(n):
        t = None
        if telemetry:
            f = (i % 97) / 97
            t = Telemetry(observed_at=1000.0, cpu_utilization=0.3 + 0.5 * f, latency_mean_s=0.012 + 0.01 * f,
                          latency_p50_s=0.010 + 0.01 * f, latency_p99_s=0.041 + 0.03 * f,
                          latency_per_token_s=0.00021 + 0.0001 * f, queue_wait_mean_s=0.0013 * f,
                          queue_depth=3.0 * f, inflight=1.0 + 4.0 * f, rps=12.5 + 10 * f, tokens_per_s=1500.0 + 900 * f,
                          error_rate=0.001 * f, batch_cost_per_token_s=0.00009 + 0.00001 * f,
                          batch_cost_fixed_s=0.0021 + 0.001 * f)
        out.append(Endpoint(address=f"127.77.{i // 250}.{i % 250 + 1}", port=1, source="static",
                            computed_weight=weight_of(i, 0, "all"), telemetry=t))
    return tuple(out)


def reweigh(state: FleetState, round_no: int, change: str) -> FleetState:
    if change == "one":
        endpoints = list(state.endpoints)
        endpoints[0] = replace(endpoints[0], computed_weight=weight_of(0, round_no, "one"))
        return replace(state, endpoints=tuple(endpoints))
    return replace(state, endpoints=tuple(replace(e, computed_weight=weight_of(i, round_no, "all"))
                                          for i, e in enumerate(state.endpoints)))


# -- server-side hooks ----------------------------------------------------------------------------


class BenchCache(SnapshotCache):
    """The production cache; ``on_set`` sees each snapshot just before it becomes current."""

    on_set: Callable[[Snapshot], None] | None = None

    def set_default_snapshot(self, snapshot: Snapshot) -> None:
        if self.on_set is not None:
            self.on_set(snapshot)
        super().set_default_snapshot(snapshot)


class Watcher(NoopMetrics):
    """The server's XdsMetrics hook (the hooks it does not need are NoopMetrics'): stamps the moment every client has ACKed a target EDS version."""

    def __init__(self, cache: SnapshotCache, expected: int) -> None:
        self.cache = cache
        self.expected = expected
        self.changed = asyncio.Event()  # any connect / disconnect / ACK / NACK
        self.done = asyncio.Event()
        self.target: str | None = None
        self.eds_acks = 0
        self.done_at: float | None = None
        self.done_cpu = 0.0
        self.pushes: Counter[str] = Counter()
        self.nacks: Counter[str] = Counter()
        self.disconnects = 0

    def arm(self, version: str) -> None:
        self.target, self.eds_acks, self.done_at = version, 0, None
        self.pushes.clear()
        self.done.clear()

    def converged(self, version: str) -> bool:
        clients = self.cache.clients()
        return len(clients) >= self.expected and all(
            (t := c.types.get(ENDPOINT)) is not None and t.acked_version == version for c in clients)

    def synced(self, snapshot: Snapshot) -> bool:
        clients = self.cache.clients()
        return len(clients) >= self.expected and all(
            (t := c.types.get(u)) is not None and t.acked_version == snapshot.version(u)
            for c in clients for u in PUSH_ORDER)

    # XdsMetrics
    def on_connect(self, mode: str) -> None:
        self.changed.set()

    def on_disconnect(self, mode: str) -> None:
        self.disconnects += 1
        self.changed.set()

    def on_push(self, type_url: str, seconds: float) -> None:
        self.pushes[SHORT_NAMES.get(type_url, type_url)] += 1

    def on_ack(self, type_url: str) -> None:
        self.changed.set()
        if self.target is not None and type_url == ENDPOINT:
            self.eds_acks += 1
            if self.eds_acks >= self.expected and self.converged(self.target):
                self.done_at = time.monotonic()
                self.done_cpu = time.process_time()
                self.target = None
                self.done.set()

    def on_nack(self, type_url: str) -> None:
        self.nacks[SHORT_NAMES.get(type_url, type_url)] += 1
        self.changed.set()


# -- the control-plane process (one configuration) ----------------------------------------------


class Children:
    """The client fleet and the Envoy of one configuration; always stopped by ``stop``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.fleet: asyncio.subprocess.Process | None = None
        self.envoy: asyncio.subprocess.Process | None = None
        self.envoy_log = workdir / "envoy.log"
        self.lines: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._reader: asyncio.Task[None] | None = None

    async def start_fleet(self, spec: Spec, target: str, route_name: str) -> None:
        fleet_spec = {"target": target, "mode": spec.mode, "clients": spec.fakes, "route": route_name,
                      "deadline_s": spec.sync_timeout_s + (spec.rounds + spec.warmup) * spec.round_timeout_s + 60}
        self.fleet = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(__file__).resolve()), "--_fleet", json.dumps(fleet_spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=str(ROOT))
        self._reader = asyncio.create_task(self._read_fleet())

    async def _read_fleet(self) -> None:
        assert self.fleet is not None and self.fleet.stdout is not None
        async for raw in self.fleet.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if "error" in line:
                self.errors.append(f"client fleet: {line['error']}")
            else:
                self.lines.append(line)

    async def start_envoy(self, spec: Spec, xds_port: int) -> None:
        config = self.workdir / "envoy.yaml"
        config.write_text(render_bootstrap(node_id=ENVOY_NODE, node_cluster=NODE_CLUSTER, xds_port=xds_port,
                                           admin_port=free_port(), delta=spec.mode == "delta"))
        with open(self.envoy_log, "wb") as log:
            self.envoy = await asyncio.create_subprocess_exec(
                spec.envoy_path, "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                "--log-level", "warning", stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def problem(self) -> str | None:
        """Why waiting further is pointless (a child died or reported an error), else None."""
        if self.errors:
            return self.errors[0]
        if self.fleet is not None and self.fleet.returncode is not None:
            return f"client fleet exited with {self.fleet.returncode}"
        if self.envoy is not None and self.envoy.returncode is not None:
            return f"envoy exited with {self.envoy.returncode}: {self.envoy_tail()}"
        return None

    def envoy_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.envoy_log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def cpu_seconds(self) -> dict[str, float]:
        out = {}
        for name, proc in (("fleet", self.fleet), ("envoy", self.envoy)):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(psutil.Error):
                    t = psutil.Process(proc.pid).cpu_times()
                    out[name] = t.user + t.system
        return out

    async def stop(self) -> None:
        async def end(proc: asyncio.subprocess.Process | None, graceful: Callable[[], None]) -> None:
            if proc is None or proc.returncode is not None:
                return
            with contextlib.suppress(ProcessLookupError, OSError):
                graceful()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()

        def close_stdin() -> None:  # the fleet exits on EOF
            assert self.fleet is not None and self.fleet.stdin is not None
            self.fleet.stdin.close()

        await asyncio.gather(end(self.envoy, lambda: self.envoy.terminate()),  # type: ignore[union-attr]
                             end(self.fleet, close_stdin))
        if self._reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._reader, 10)


async def wait_for_condition(condition: Callable[[], bool], event: asyncio.Event, timeout: float,
                             problem: Callable[[], str | None], what: str) -> None:
    """Re-check ``condition`` whenever ``event`` fires (and at least every second, for ``problem``)."""
    deadline = time.monotonic() + timeout
    while True:
        event.clear()
        if condition():
            return
        if (why := problem()) is not None:
            raise RuntimeError(f"{what}: {why}")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), min(remaining, 1.0))


async def run_configuration(spec: Spec) -> dict[str, Any]:
    proc = psutil.Process()
    result: dict[str, Any] = {"spec": {k: v for k, v in asdict(spec).items() if k != "envoy_path"},
                              "rounds": [], "ok": False, "error": None}
    settings = DataPlaneSettings(listener_port=free_port(), health_check_interval_s=spec.health_check_interval_s)
    state = FleetState(endpoints=make_endpoints(spec.endpoints, spec.telemetry), settings=settings)
    cache = BenchCache()
    watcher = Watcher(cache, spec.clients)
    set_at: list[float] = []

    def on_set(snapshot: Snapshot) -> None:
        set_at.append(time.monotonic())
        watcher.arm(snapshot.version(ENDPOINT))

    controller = Controller(ControlPlaneConfig(), cache, None, state)
    await controller.publish()  # the initial snapshot, before anyone connects (as production does)
    assert controller.snapshot is not None
    result["cla_bytes"] = len(controller.snapshot.resources(ENDPOINT)[settings.workers_cluster].any.value)
    result["rss_mb_idle"] = proc.memory_info().rss / 2**20
    xds_port = free_port()
    server = await serve_xds(cache, f"127.0.0.1:{xds_port}", watcher)  # type: ignore[arg-type]
    workdir = Path(tempfile.mkdtemp(prefix="bench_xds_"))
    children = Children(workdir)
    versions: list[str] = [controller.snapshot.version(ENDPOINT)]
    try:
        started = time.monotonic()
        if spec.fakes:
            await children.start_fleet(spec, f"127.0.0.1:{xds_port}", settings.route_name)
        if spec.envoy:
            await children.start_envoy(spec, xds_port)
        snapshot = controller.snapshot
        await wait_for_condition(lambda: watcher.synced(snapshot), watcher.changed, spec.sync_timeout_s,
                                 children.problem, f"{spec.clients} clients to sync")
        result["sync_s"] = time.monotonic() - started
        result["rss_mb_synced"] = proc.memory_info().rss / 2**20
        cache.on_set = on_set
        for round_no in range(1, spec.warmup + spec.rounds + 1):
            controller.update(lambda s, r=round_no: reweigh(s, r, spec.change))  # off the clock
            set_at.clear()
            cpu0, others0 = time.process_time(), children.cpu_seconds()
            t0 = time.monotonic()
            await controller.publish()
            published = time.monotonic()
            version = controller.snapshot.version(ENDPOINT)
            if not set_at or version in versions:
                raise RuntimeError("publish() set no new EDS version (no weight changed?)")
            versions.append(version)
            await wait_for_condition(lambda: watcher.done_at is not None, watcher.done, spec.round_timeout_s,
                                     children.problem, f"round {round_no}: every client to ACK EDS {version}")
            others1 = children.cpu_seconds()
            assert watcher.done_at is not None
            wall = watcher.done_at - t0
            cpu = watcher.done_cpu - cpu0
            sample = {
                "round": round_no, "warmup": round_no <= spec.warmup, "version": version,
                "conv_ms": wall * 1000, "push_ms": (watcher.done_at - set_at[0]) * 1000,
                "build_ms": (set_at[0] - t0) * 1000, "publish_ms": (published - t0) * 1000, "cpu_s": cpu, "cpu_pct": 100 * cpu / wall if wall > 0 else 0.0,
                "rss_mb": proc.memory_info().rss / 2**20, "pushes": dict(watcher.pushes), "t0": t0,
                **{f"{k}_cpu_s": others1[k] - others0[k] for k in others1 if k in others0},
            }
            result["rounds"].append(sample)
        result["ok"] = True
    except Exception as exc:  # reported in the table; the next configuration still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        cache.on_set = None
        await children.stop()
        await stop_xds(server, cache, grace=1.0)
        shutil.rmtree(workdir, ignore_errors=True)
    result["nacks"] = dict(watcher.nacks)
    # Bytes and receive times as the lightweight clients saw them (their lines are all in by now).
    for sample in result["rounds"]:
        eds = [line for line in children.lines if line["type"] == "eds" and line["v"] == sample["version"]]
        if eds:
            sample["eds_push_bytes"] = statistics.median(line["b"] for line in eds)
            sample["eds_resources"] = max(line["n"] for line in eds)
            sample["client_recv_max_ms"] = (max(line["t"] for line in eds) - sample["t0"]) * 1000
        others = Counter(line["type"] for line in children.lines
                         if line["type"] != "eds" and line["t"] >= sample["t0"]
                         and (sample["round"] == len(result["rounds"])
                              or line["t"] < result["rounds"][sample["round"]]["t0"]))
        if others:
            sample["other_responses"] = dict(others)
    result["summary"] = summarise(spec, result)
    return result


def summarise(spec: Spec, result: dict[str, Any]) -> dict[str, Any]:
    rounds = [r for r in result["rounds"] if not r["warmup"]]
    if not rounds:
        return {}
    conv = [r["conv_ms"] for r in rounds]
    push_bytes = [r["eds_push_bytes"] for r in rounds if "eds_push_bytes" in r]
    summary: dict[str, Any] = {
        "conv_ms_median": statistics.median(conv), "conv_ms_max": max(conv),
        "push_ms_median": statistics.median(r["push_ms"] for r in rounds),
        "build_ms_median": statistics.median(r["build_ms"] for r in rounds),
        "cpu_s_median": statistics.median(r["cpu_s"] for r in rounds),
        "cpu_pct_median": statistics.median(r["cpu_pct"] for r in rounds),
        "rss_mb_max": max(r["rss_mb"] for r in rounds),
        "eds_push_bytes": statistics.median(push_bytes) if push_bytes else None,
        "eds_bytes_source": "client" if push_bytes else "cla",
    }
    per_push = summary["eds_push_bytes"] or result.get("cla_bytes", 0)
    summary["eds_bytes_per_change"] = per_push * spec.clients
    target = None
    if spec.change == "all" and spec.endpoints >= 10_000 and spec.clients >= 50:
        target = CONV_TARGET_MS
    elif spec.change == "one" and spec.mode == "delta":
        target = SINGLE_TARGET_MS
    if target is not None:
        summary["target_ms"] = target
        summary["target_met"] = max(conv) <= target
    return summary


async def server_main(spec: Spec, result_path: Path) -> int:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    result = await run_configuration(spec)
    result_path.write_text(json.dumps(result))
    return 0


# -- the client fleet process ----------------------------------------------------------------------


async def fleet_main(spec: dict[str, Any]) -> int:
    import grpc

    from tests.xds_client import CHANNEL_OPTIONS, DeltaClient, Received, SotwClient

    out = sys.stdout

    def observer(index: int) -> Callable[[Received], None]:
        def observe(received: Received) -> None:
            message = received.message
            out.write(json.dumps({"c": index, "type": SHORT_NAMES.get(received.type_url, "?"),
                                  "v": received.version, "b": message.ByteSize(), "n": len(message.resources),
                                  "t": time.monotonic()}) + "\n")
            out.flush()
        return observe

    loop = asyncio.get_running_loop()
    stdin = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    client_type = SotwClient if spec["mode"] == "sotw" else DeltaClient
    channels, clients = [], []
    # A channel (and TCP connection) per client, as separate Envoys would have.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    code = 0
    try:
        for i in range(spec["clients"]):
            channel = grpc.aio.insecure_channel(spec["target"], options=options)
            channels.append(channel)
            client = client_type(channel, f"bench-client-{i}", NODE_CLUSTER, follow_clusters=True, decode=False,
                                 history=False, observe=observer(i))
            clients.append(client)
            await client.start()
            await client.subscribe(CLUSTER)  # EDS follows the clusters, as Envoy does
            await client.subscribe(LISTENER)
            await client.subscribe(ROUTE, [spec["route"]])
        eof = asyncio.create_task(stdin.read())
        ended = [asyncio.create_task(c.wait_for(lambda: False, timeout=spec["deadline_s"])) for c in clients]
        done, _ = await asyncio.wait([eof, *ended], timeout=spec["deadline_s"], return_when=asyncio.FIRST_COMPLETED)
        if eof not in done:
            for task in done:
                code = 1
                out.write(json.dumps({"error": f"a client stream ended: {task.exception()!r}"}) + "\n")
            if not done:
                code = 1
                out.write(json.dumps({"error": "client fleet deadline passed"}) + "\n")
            out.flush()
        for task in [eof, *ended]:
            task.cancel()
        await asyncio.gather(eof, *ended, return_exceptions=True)
    finally:
        await asyncio.gather(*(c.disconnect() for c in clients), return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
    return code


# -- the orchestrator ------------------------------------------------------------------------------


def run_isolated(spec: Spec) -> dict[str, Any]:
    """One configuration in a fresh process (clean RSS and CPU), in its own process group."""
    timeout = spec.sync_timeout_s + (spec.rounds + spec.warmup) * spec.round_timeout_s + 120
    with tempfile.TemporaryDirectory(prefix="bench_xds_") as tmp:
        result_path = Path(tmp) / "result.json"
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--_server",
                                 json.dumps(asdict(spec)), str(result_path)], cwd=str(ROOT), start_new_session=True)
        try:
            proc.wait(timeout)
        except BaseException as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)  # the configuration's process group: server, fleet, Envoy
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


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def progress_line(spec: Spec, result: dict[str, Any]) -> str:
    s = result.get("summary") or {}
    if not s:
        return f"{spec.label}: FAILED {result.get('error')}"
    line = (f"{spec.label}: conv median {s['conv_ms_median']:.1f} ms max {s['conv_ms_max']:.1f} ms | "
            f"push {s['push_ms_median']:.1f} ms | build {s['build_ms_median']:.1f} ms | "
            f"EDS {fmt_bytes(s['eds_push_bytes'] or result.get('cla_bytes'))}/push | "
            f"cpu {s['cpu_s_median']:.3f} s/change ({s['cpu_pct_median']:.0f}%) | RSS {s['rss_mb_max']:.0f} MB")
    if "target_ms" in s:
        line += f" | target <= {s['target_ms']:.0f} ms: {'MET' if s['target_met'] else 'MISSED'}"
    if result.get("error"):
        line += f" | ERROR {result['error']}"
    return line


def table(results: list[dict[str, Any]]) -> str:
    header = ("mode", "change", "endpoints", "clients", "conv med ms", "conv max ms", "push med ms", "build ms",
              "EDS B/push", "EDS B/change", "CPU s/chg", "CPU %", "RSS MB", "target")
    rows = [header]
    for r in results:
        spec, s = r["spec"], r.get("summary") or {}
        clients = f"{spec['clients']}{'+E' if spec['envoy'] else ''}"
        if not s:
            rows.append((spec["mode"], spec["change"], str(spec["endpoints"]), clients,
                         "FAILED", "", "", "", "", "", "", "", "", (r.get("error") or "")[:60]))
            continue
        target = "-"
        if "target_ms" in s:
            target = f"<={s['target_ms']:.0f} {'MET' if s['target_met'] else 'MISSED'}"
        rows.append((spec["mode"], spec["change"], str(spec["endpoints"]), clients,
                     f"{s['conv_ms_median']:.1f}", f"{s['conv_ms_max']:.1f}", f"{s['push_ms_median']:.1f}",
                     f"{s['build_ms_median']:.1f}", fmt_bytes(s["eds_push_bytes"] or r.get("cla_bytes")),
                     fmt_bytes(s["eds_bytes_per_change"]), f"{s['cpu_s_median']:.3f}",
                     f"{s['cpu_pct_median']:.0f}", f"{s['rss_mb_max']:.0f}", target))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i >= 2 and i < len(header) - 1 else cell.ljust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python scripts/bench_xds.py",
        description=__doc__.split("\n\n")[0] + "\n\n" + "\n\n".join(__doc__.split("\n\n")[1:-1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Each configuration runs in its own control-plane process; every process and server listens on "
               "127.0.0.1 only, is bounded by --sync-timeout/--round-timeout, and is stopped at the end.",
    )
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
    p.add_argument("--json", type=Path, metavar="FILE", help="write every round and the summary here")
    p.add_argument("--_server", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--_fleet", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args._fleet:
        return asyncio.run(fleet_main(json.loads(args._fleet)))
    if args._server:
        spec = Spec(**json.loads(args._server[0]))
        try:
            return asyncio.run(server_main(spec, Path(args._server[1])))
        except asyncio.CancelledError:
            return 1

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
    print(f"bench_xds: {len(specs)} configurations, {args.warmup} warm-up + {args.rounds} rounds each; "
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


if __name__ == "__main__":
    raise SystemExit(main())
