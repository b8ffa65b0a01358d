"""inferlb bench quota: what a tenant's key lookup and quota check cost ext_proc per request.

Issue 14's target: the key lookup and the quota check take at most 100 µs of
ext_proc's CPU per request in process, plus one Redis round trip when the
counters are shared. In process: CPU time (time.process_time) over N calls of
the API key table's lookup (SHA-256 of the bearer key, a dict lookup), the
in-process store's acquire and release, and the two together. With Redis,
per request (key lookup, acquire, release; one at a time): ext_proc's CPU,
the wall time (p50, p99) and Redis's own CPU, for a key with per-minute
limits only (one round trip: a served request's release has nothing to give
back) and for one with tokens in flight too (a second round trip frees them).
Redis is a throwaway redis-server on loopback unless --redis-url names one
(written to under inferlb:quota:{bench-*}).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from inferlb_runtime.api_keys import KeyEntry, Quota, hash_key, new_key

DESCRIPTION = __doc__.split("\n\n", 1)[1] if __doc__ else ""
TARGET_US = 100.0
# A tenant that never runs into its limits (the cost of an admitted request is the one that matters),
# with all three limits, so every part of the check runs.
QUOTA = Quota(tokens_per_minute=10**12, requests_per_minute=10**12, max_tokens_in_flight=10**12)
PER_MINUTE = Quota(tokens_per_minute=10**12, requests_per_minute=10**12)
TOKENS = 128


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=100_000, help="calls per in-process measurement (100000)")
    parser.add_argument("--redis-calls", type=int, default=5_000, help="calls per Redis measurement (5000)")
    parser.add_argument("--keys", type=int, default=1_000, help="keys in the lookup table, in 100 tenants (1000)")
    parser.add_argument("--redis-url", help="measure against this Redis (default: start a throwaway redis-server)")
    parser.add_argument("--no-redis", action="store_true", help="in process only")
    parser.add_argument("--json", type=Path, help="also write the results here")


@dataclass(frozen=True)
class Row:
    what: str
    cpu_us: float  # ext_proc's CPU per call
    wall_p50_us: float | None = None
    wall_p99_us: float | None = None
    server_cpu_us: float | None = None  # Redis's CPU per call


def main(args: argparse.Namespace) -> int:
    if args.calls < 1 or args.redis_calls < 1 or args.keys < 1:
        raise SystemExit("inferlb bench quota: --calls, --redis-calls and --keys must be > 0")
    if not args.no_redis and not args.redis_url and shutil.which("redis-server") is None:
        raise SystemExit("inferlb bench quota: redis-server not found (apt-get install redis-server), "
                         "or pass --redis-url or --no-redis")
    rows = asyncio.run(_measure(args))
    print(render(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


async def _measure(args: argparse.Namespace) -> list[Row]:
    from ext_proc.quota.memory_store import MemoryQuotaStore
    from ext_proc.xds.tenants import KeyTable

    keys = [new_key() for _ in range(args.keys)]
    table = KeyTable.of("bench", (KeyEntry(hash_key(k), f"key-{i}", f"bench-{i % 100}", quota=QUOTA)
                                  for i, k in enumerate(keys)))
    memory = MemoryQuotaStore()
    n = args.calls

    async def lookup(i: int) -> None:
        table.lookup(keys[i % len(keys)])

    async def check(i: int) -> None:
        outcome = await memory.acquire(f"bench-{i % 100}", QUOTA, TOKENS)
        await memory.release(outcome.lease, served=True)

    async def both(i: int) -> None:
        entry = table.lookup(keys[i % len(keys)])
        outcome = await memory.acquire(entry.tenant, entry.quota, TOKENS)
        await memory.release(outcome.lease, served=True)

    rows = [Row("key lookup (sha256 + dict)", await _cpu_per_call(lookup, n)),
            Row("quota acquire + release, in process", await _cpu_per_call(check, n)),
            Row("key lookup + quota, in process", await _cpu_per_call(both, n))]
    if not args.no_redis:
        async with throwaway_redis(args.redis_url) as url:
            rows += await _measure_redis(url, table, keys, args.redis_calls)
    return rows


async def _cpu_per_call(call: Callable[[int], Awaitable[None]], n: int) -> float:
    for i in range(min(n, 1_000)):  # warm up (caches, the store's tenants)
        await call(i)
    start = time.process_time()
    for i in range(n):
        await call(i)
    return (time.process_time() - start) / n * 1e6


async def _measure_redis(url: str, table, keys: list[str], n: int) -> list[Row]:
    """Per request: acquire + release, one at a time, for a key without and with tokens in flight."""
    from ext_proc.quota.redis_store import RedisQuotaStore

    store = RedisQuotaStore.from_url(url, timeout_s=5.0)  # a bench measures: it does not fail open
    rows = []
    try:
        # Without tokens in flight a served request's release has nothing to give back: one round trip.
        for what, quota in (("key lookup + quota, Redis: per-minute limits (1 round trip)", PER_MINUTE),
                            ("key lookup + quota, Redis: with tokens in flight (2 round trips)", QUOTA)):
            async def request(i: int, quota: Quota = quota) -> None:
                entry = table.lookup(keys[i % len(keys)])
                outcome = await store.acquire(entry.tenant, quota, TOKENS)
                if not outcome.admitted or outcome.store_failed:
                    raise SystemExit(f"inferlb bench quota: Redis refused or failed: {outcome}")
                await store.release(outcome.lease, served=True)

            for i in range(min(n, 1_000)):
                await request(i)
            walls = []
            server_before = await _redis_cpu_s(store)
            cpu_before = time.process_time()
            for i in range(n):
                start = time.perf_counter()
                await request(i)
                walls.append(time.perf_counter() - start)
            cpu = (time.process_time() - cpu_before) / n * 1e6
            server_cpu = (await _redis_cpu_s(store) - server_before) / n * 1e6
            walls.sort()
            rows.append(Row(what, cpu, statistics.median(walls) * 1e6,
                            walls[min(n - 1, int(n * 0.99))] * 1e6, server_cpu))
    finally:
        await store.aclose()
    return rows


async def _redis_cpu_s(store) -> float:
    info = await store._client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@contextlib.asynccontextmanager
async def throwaway_redis(url: str | None) -> AsyncIterator[str]:
    """``url``, or a throwaway redis-server on loopback (no persistence), stopped on the way out."""
    if url:
        yield url
        return
    from ..processes import free_port

    port = free_port()
    with tempfile.TemporaryDirectory(prefix="inferlb-bench-redis-") as directory:
        process = await asyncio.create_subprocess_exec(*redis_argv(port, directory),
                                                       stdout=asyncio.subprocess.DEVNULL,
                                                       stderr=asyncio.subprocess.DEVNULL)
        try:
            await wait_for_ping(port, process)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            if process.returncode is None:
                process.terminate()
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


def redis_argv(port: int, directory: str) -> list[str]:
    """A throwaway redis-server on loopback: no persistence, no password (``inferlb bench faults`` too)."""
    return ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--dir", directory, "--save", "",
            "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"]


async def wait_for_ping(port: int, process: asyncio.subprocess.Process, timeout_s: float = 30.0) -> None:
    import redis.asyncio as aioredis

    deadline = time.monotonic() + timeout_s
    client = aioredis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1)
    try:
        while True:
            if process.returncode is not None:
                raise SystemExit(f"inferlb bench: the throwaway redis-server exited with {process.returncode}")
            with contextlib.suppress(OSError, aioredis.RedisError):
                if await client.ping():
                    return
            if time.monotonic() > deadline:
                raise SystemExit(f"inferlb bench: the throwaway redis-server did not answer PING in {timeout_s:g}s")
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


def render(rows: list[Row]) -> str:
    """The table, and the verdict on the in-process target."""
    def cell(value: float | None) -> str:
        return "" if value is None else f"{value:.1f}"

    lines = ["| measurement | ext_proc CPU µs/call | wall p50 µs | wall p99 µs | Redis CPU µs/call |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {r.what} | {cell(r.cpu_us)} | {cell(r.wall_p50_us)} | {cell(r.wall_p99_us)} | "
              f"{cell(r.server_cpu_us)} |" for r in rows]
    in_process = next(r for r in rows if r.what == "key lookup + quota, in process")
    verdict = "met" if in_process.cpu_us <= TARGET_US else "MISSED"
    lines.append(f"\nkey lookup + quota check in process: {in_process.cpu_us:.1f} µs of CPU per request "
                 f"(target <= {TARGET_US:g} µs: {verdict})")
    return "\n".join(lines)
