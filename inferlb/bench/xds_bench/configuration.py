"""One configuration, in its own process: the control plane's production path and the measured rounds.

``python -m inferlb.bench.xds_bench.configuration SPEC_JSON RESULT_PATH`` runs
``SnapshotCache`` + ``serve_xds`` on a free 127.0.0.1 port and the real
``Controller`` (its ``publish``), starts the client fleet and the Envoy, waits
until every client is in sync, then changes weights round after round and
writes every figure to RESULT_PATH as JSON. A fresh process per configuration
keeps RSS and CPU clean.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import psutil

from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.model import DataPlaneSettings, FleetState
from control_plane.type_urls import ENDPOINT
from control_plane.xds import Snapshot, serve_xds, stop_xds

from ..processes import ProcessGroup, free_port
from .children import Children
from .hooks import BenchCache, Watcher
from .spec import CONV_TARGET_MS, SINGLE_TARGET_MS, Spec, make_endpoints, reweigh


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
    group = ProcessGroup(stop_timeout_s=10.0)
    children = Children(workdir, group)
    versions: list[str] = [controller.snapshot.version(ENDPOINT)]
    try:
        started = time.monotonic()
        await children.start(spec, xds_port, settings.route_name)
        snapshot = controller.snapshot
        await wait_for_condition(lambda: watcher.synced(snapshot), watcher.changed, spec.sync_timeout_s,
                                 children.problem, f"{spec.clients} clients to sync")
        result["sync_s"] = time.monotonic() - started
        result["rss_mb_synced"] = proc.memory_info().rss / 2**20
        cache.on_set = on_set
        for round_no in range(1, spec.warmup + spec.rounds + 1):
            result["rounds"].append(await _round(round_no, spec, controller, watcher, children, set_at, versions,
                                                 proc))
        result["ok"] = True
    except Exception as exc:  # reported in the table; the next configuration still runs
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        cache.on_set = None
        await group.stop()
        await stop_xds(server, cache, grace=1.0)
        lines = children.lines()  # the fleet has stopped: its lines are all in
        shutil.rmtree(workdir, ignore_errors=True)
    result["nacks"] = dict(watcher.nacks)
    _client_figures(result["rounds"], lines)
    result["summary"] = summarise(spec, result)
    return result


async def _round(round_no: int, spec: Spec, controller: Controller, watcher: Watcher, children: Children,
                 set_at: list[float], versions: list[str], proc: psutil.Process) -> dict[str, Any]:
    """One measured weight change: update the state (off the clock), publish, wait until every client ACKed
    the new EDS version; its times (from the publish), CPU and memory."""
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
    return sample


def _client_figures(rounds: list[dict[str, Any]], lines: list[dict[str, Any]]) -> None:
    """Add to each round the bytes and receive times as the lightweight clients saw them, and their other
    responses during it."""
    for sample in rounds:
        eds = [line for line in lines if line["type"] == "eds" and line["v"] == sample["version"]]
        if eds:
            sample["eds_push_bytes"] = statistics.median(line["b"] for line in eds)
            sample["eds_resources"] = max(line["n"] for line in eds)
            sample["client_recv_max_ms"] = (max(line["t"] for line in eds) - sample["t0"]) * 1000
        others = Counter(line["type"] for line in lines
                         if line["type"] != "eds" and line["t"] >= sample["t0"]
                         and (sample["round"] == len(rounds)
                              or line["t"] < rounds[sample["round"]]["t0"]))
        if others:
            sample["other_responses"] = dict(others)


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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m inferlb.bench.xds_bench.configuration SPEC_JSON RESULT_PATH", file=sys.stderr)
        return 2
    try:
        return asyncio.run(server_main(Spec(**json.loads(argv[0])), Path(argv[1])))
    except asyncio.CancelledError:
        return 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
