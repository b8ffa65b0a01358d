"""Phase 4: where ext_proc's time goes, under the gRPC load of phase 3.

``perf record`` of the running (unprofiled) ext_proc gives CPU by shared object
(interpreter, grpc core, kernel, tokenizers...) without cProfile's distortion;
then a second ext_proc under cProfile (``python -m cProfile -m ext_proc``) says
where its main thread's time goes, by category and by function.
"""

from __future__ import annotations

import asyncio
import collections
import os
import pstats
import shutil
import sys
from typing import Any

from ...supervisor import Component
from ..stack.dataplanes import EXT_PROC_CACHE_ENV
from ..stack.fleet import child_env
from ..processes import ProcessGroup, free_port
from .grpc_load import Messages, measure_direct
from .stack import Log, Stack

ROOT = os.getcwd()

CATEGORIES = (  # (label, substrings of "file:function"), first match wins
    ("idle (waiting in epoll)", ("'poll' of 'select.epoll' objects",)),
    ("grpc aio callbacks (Cython: untraced, shows as Context.run)", ("'run' of '_contextvars.Context' objects",)),
    ("start-up (imports, tokenizer load)", ("builtins.compile", "builtins.exec", "marshal.loads", "<frozen",
                                           "'from_file' of 'tokenizers", "_imp.")),
    ("token counting (tokenizers)", ("tokenizers", "ext_proc/tokens.py")),
    ("body JSON (orjson)", ("orjson",)),
    ("ext_proc: pick chain + cost model", ("ext_proc/pick/router.py", "ext_proc/pick/chain.py", "ext_proc/pick/costing.py",
                                           "ext_proc/pick/policies.py", "ext_proc/pick/guard.py", "ext_proc/pick/cost.py",
                                           "ext_proc/pick/outstanding.py", "ext_proc/model.py")),
    ("ext_proc: servicer (incl. untraced grpc calls)", ("ext_proc/server.py", "ext_proc/wire.py")),
    ("metrics (prometheus_client)", ("prometheus_client", "ext_proc/metrics.py")),
    ("protobuf (build/parse messages)", ("google/protobuf", "google._upb", "protobuf")),
    ("grpc (python layer)", ("grpc",)),
    # On uvloop (ext_proc's default) the loop, its epoll waits and the grpc aio callbacks it runs are C
    # code that cProfile cannot see: all of it is the own time of asyncio.run / uvloop.run.
    ("uvloop + grpc aio callbacks (untraced C, incl. idle waits)", ("runners.py:run",)),
    ("asyncio event loop", ("asyncio", "uvloop", "selectors.py", "events.py", "_weakrefset.py", "inspect.py")),
)

PERF_DSOS = (  # (label, substrings of the DSO name), first match wins
    ("Python interpreter (ext_proc, asyncio, grpc's Python code)", ("libpython",)),
    ("grpc core + Cython (cygrpc)", ("cygrpc",)),
    ("gRPC C++ + abseil (the native front)", ("libgrpc", "libgpr", "libabsl", "_native_front")),
    ("tokenizers (Rust)", ("tokenizers",)),
    ("protobuf (upb)", ("_message",)),
    ("orjson", ("orjson",)),
    ("kernel (syscalls, loopback TCP, scheduling)", ("[kernel",)),
    # not a bare "libc": it is in libcrypto's name too
    ("libc / libstdc++ / malloc / the loader", ("libc.so", "libc-", "libstdc++", "libgcc_s", "libm.so", "ld-linux")),
)


def dso_group(dso: str) -> str:
    """The ``PERF_DSOS`` label of a shared object's name as ``perf report`` prints it; "other" for none."""
    return next((label for label, needles in PERF_DSOS if any(n in dso for n in needles)), "other")


def categorise(key: tuple[str, int, str]) -> str:
    text = f"{key[0]}:{key[2]}"
    for label, needles in CATEGORIES:
        if any(n in text for n in needles):
            return label
    return "other (builtins called from all of the above)"


async def perf_profile(args: Any, st: Stack, messages: Messages, log: Log) -> dict[str, Any]:
    """``perf record`` on the running (unprofiled) ext_proc under the gRPC load: CPU by shared object,
    so native time (grpc core, tokenizers, kernel) shows too, without cProfile's distortion."""
    perf = shutil.which("perf")
    if perf is None:
        return {"skipped": "perf not installed"}
    data = st.log_dir / "ext_proc.perf.data"
    pid = st.pid("ext_proc")
    seconds = max(1.0, args.profile_seconds - 1)
    recorder = await asyncio.create_subprocess_exec(
        perf, "record", "-F", "499", "-p", str(pid), "-o", str(data), "--", "sleep", f"{seconds:.0f}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        load = await measure_direct("ext_proc under perf record", st.ext_proc_target(st.transport), pid, st.client,
                                    st.ext_proc_metrics_url, messages, args.grpc_streams, args.profile_seconds, log)
        out_bytes, _ = await asyncio.wait_for(recorder.communicate(), seconds + 30)
    except BaseException:
        if recorder.returncode is None:
            recorder.kill()
            await recorder.wait()
        raise
    out_text = out_bytes.decode(errors="replace")
    if recorder.returncode != 0 or not data.exists():
        return {"skipped": f"perf record failed ({recorder.returncode}): {out_text.strip()[-300:]}"}
    reporter = await asyncio.create_subprocess_exec(perf, "report", "-i", str(data), "--sort", "dso", "--stdio",
                                                    stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.DEVNULL)
    report_text = (await asyncio.wait_for(reporter.communicate(), 120))[0].decode(errors="replace")
    by_dso: dict[str, float] = {}
    for line in report_text.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%") and not line.lstrip().startswith("#"):
            by_dso[parts[1].strip()] = float(parts[0].rstrip("%"))
    grouped: dict[str, float] = collections.defaultdict(float)
    for dso, share in by_dso.items():
        grouped[dso_group(dso)] += share
    return {"load": load, "by_dso_percent": by_dso,
            "by_group_percent": dict(sorted(grouped.items(), key=lambda kv: -kv[1]))}


async def profile_phase(args: Any, st: Stack, messages: Messages, log: Log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    log(f"[profile] perf record of ext_proc (CPU by shared object), {args.profile_seconds:.0f} s of the gRPC load")
    out["perf"] = await perf_profile(args, st, messages, log)
    port, metrics_port = free_port(), free_port()
    out_file = st.log_dir / "ext_proc.pstats"
    argv = [sys.executable, "-m", "cProfile", "-o", str(out_file), "-m", "ext_proc", "--port", str(port),
            "--metrics-port", str(metrics_port), "--xds-port", str(st.xds_port), "--node-id", "bench-ext-proc-profiled",
            "--log-level", "warning"]
    log(f"[profile] ext_proc under cProfile, {args.profile_seconds:.0f} s of the gRPC load")
    metrics_url = f"http://127.0.0.1:{metrics_port}"
    component = Component(name="ext-proc-profiled", argv=argv, ready_url=f"{metrics_url}/readyz",
                          log_path=st.log_dir / "ext-proc-profiled.log", ready_timeout_s=30.0,
                          # as the stack's: no gateway cache (the bodies repeat; hits would skip the pick)
                          env=child_env({EXT_PROC_CACHE_ENV: "0"}))
    async with ProcessGroup(stop_timeout_s=20.0) as group:  # SIGTERM: cProfile writes its file on the way out
        await group.start([component])
        load = await measure_direct("ext_proc under cProfile", f"127.0.0.1:{port}", group.pid(component.name),
                                    st.client, metrics_url, messages, args.grpc_streams, args.profile_seconds, log)
    if not out_file.exists():
        out["cprofile"] = {"error": "cProfile wrote no file", "load": load}
        return out
    raw = pstats.Stats(str(out_file)).stats  # type: ignore[attr-defined]
    by_category: dict[str, float] = collections.defaultdict(float)
    for key, (_, _, tottime, _, _) in raw.items():
        by_category[categorise(key)] += tottime
    total = sum(by_category.values())
    excluded = by_category.get("idle (waiting in epoll)", 0.0) + by_category.get("start-up (imports, tokenizer load)", 0.0)
    made = load["decisions"] or 0
    top = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)[:args.profile_top]
    out["cprofile"] = {
        "load": load,
        "profiled_s": total,
        "busy_s": total - excluded,
        "by_category_s": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "us_per_decision_by_category": {k: v / made * 1e6 for k, v in by_category.items()} if made else {},
        "top_other": [{"function": f"{k[0]}:{k[1]}({k[2]})", "own_s": v[2]} for k, v in sorted(
            ((k, v) for k, v in raw.items() if categorise(k).startswith("other")), key=lambda kv: -kv[1][2])[:15]],
        "top_own_time": [{"function": f"{k[0].replace(ROOT + '/', '')}:{k[1]}({k[2]})", "calls": v[1],
                          "own_s": v[2], "cumulative_s": v[3]} for k, v in top],
        "pstats_file": str(out_file) if args.keep_logs else "(removed; --keep-logs keeps it)",
    }
    return out
