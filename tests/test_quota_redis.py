"""The Redis quota store on a real redis-server (tests/redis_server.py): the same decisions as the
in-process store, atomic across two replicas' clients, one round trip per check, keys that clean up after
themselves, and the failure modes when Redis stops or hangs (and the recovery when it is back)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import pydantic
import pytest
import redis.asyncio as aioredis

from ext_proc.config import ExtProcConfig
from ext_proc.quota import QuotaOutcome
from ext_proc.quota.algorithm import WINDOW_MS
from ext_proc.quota.memory_store import MemoryQuotaStore
from ext_proc.quota.redis_store import RedisQuotaStore
from ext_proc.quota.stores import open_quota_store
from inferlb_runtime.api_keys import Quota

if TYPE_CHECKING:
    from .redis_server import RedisServer

pytest_plugins = ("tests.redis_server",)  # the redis_server, redis_url and own_redis fixtures

T = TypeVar("T")
GENEROUS_S = 10.0  # a timeout that only a dead or stopped Redis reaches (2 shared cores: no tight ones)


class Recorder:
    """The observer: what the store reported."""

    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.reasons: Counter[str] = Counter()
        self.round_trips = 0

    def quota_decision(self, result: str) -> None:
        self.decisions[result] += 1

    def quota_store_error(self, operation: str, reason: str) -> None:
        self.errors[operation] += 1
        self.reasons[reason] += 1

    def quota_store_latency(self, seconds: float) -> None:
        assert seconds >= 0
        self.round_trips += 1


def redis_store(url: str, **kwargs) -> RedisQuotaStore:
    kwargs.setdefault("timeout_s", GENEROUS_S)
    return RedisQuotaStore.from_url(url, **kwargs)


async def eventually(check: Callable[[], Awaitable[T | None]], timeout: float, what: str) -> T:
    """Poll ``check`` until it returns something truthy, against a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def comparable(outcome: QuotaOutcome) -> tuple:
    lease = outcome.lease
    return (outcome.admitted, outcome.exceeded, outcome.too_large, outcome.retry_after_s, outcome.tokens,
            outcome.requests, outcome.store_failed,
            None if lease is None else (lease.tenant, lease.window, lease.tokens, lease.per_minute_tokens,
                                        lease.per_minute_request, lease.in_flight))


# --- the same decisions ----------------------------------------------------------------------------


TENANTS = {
    "acme": Quota(tokens_per_minute=400, requests_per_minute=12, max_tokens_in_flight=150),
    "beta": Quota(tokens_per_minute=250),
    "gamma": Quota(requests_per_minute=5, max_tokens_in_flight=90),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_redis_and_memory_stores_decide_alike(redis_url: str, seed: int) -> None:
    """Random sequences of checks and releases (served or not), with time jumping across windows and past
    lease expiries, on one injected clock: the Lua script and the Python function agree on every field."""

    async def scenario() -> int:
        now = [5 * WINDOW_MS + seed]
        memory = MemoryQuotaStore(lease_ttl_s=20, clock_ms=lambda: now[0])
        shared = redis_store(redis_url, lease_ttl_s=20, clock_ms=lambda: now[0])
        rng = random.Random(seed)
        held: list[tuple[QuotaOutcome, QuotaOutcome]] = []
        admitted = 0
        try:
            for step in range(400):
                # round steps and sizes that divide the limits: exact fills, boundaries and expiries happen
                now[0] += rng.choice((0, 0, 1, 999, 1_000, 5_000, 10_000, 20_000, 30_000, 60_000, 70_001))
                if held and rng.random() < 0.35:
                    m, r = held.pop(rng.randrange(len(held)))
                    served = rng.random() < 0.6
                    await memory.release(m.lease, served)
                    await shared.release(r.lease, served)
                    continue
                tenant = rng.choice(list(TENANTS))
                tokens = rng.choice((1, 7, 10, 25, 50, 90, 100, 150, 151, 250, 401))
                m = await memory.acquire(tenant, TENANTS[tenant], tokens)
                r = await shared.acquire(tenant, TENANTS[tenant], tokens)
                assert comparable(m) == comparable(r), f"step {step}: {tenant} {tokens} at {now[0]}"
                if m.admitted:
                    admitted += 1
                    if rng.random() < 0.7:  # the others are never released: their leases must expire
                        held.append((m, r))
        finally:
            await shared.aclose()
        return admitted

    admitted = asyncio.run(scenario())
    assert 40 < admitted < 350  # the sequences exercise both answers


# --- two replicas on one Redis ---------------------------------------------------------------------


def test_two_replicas_never_admit_more_than_the_quota(redis_url: str) -> None:
    """Ten clients on each of two stores (two ext_proc replicas) ask for 3x a minute's tokens at once."""
    quota = Quota(tokens_per_minute=10_000, requests_per_minute=1_000)

    async def scenario() -> list[QuotaOutcome]:
        replicas = [redis_store(redis_url), redis_store(redis_url)]

        async def client(store: RedisQuotaStore) -> list[QuotaOutcome]:
            return [await store.acquire("acme", quota, 50) for _ in range(30)]

        try:
            results = await asyncio.gather(*(client(replicas[i % 2]) for i in range(20)))
        finally:
            for store in replicas:
                await store.aclose()
        return [o for r in results for o in r]

    outcomes = asyncio.run(scenario())
    by_window: Counter[int] = Counter()
    for o in outcomes:
        if o.admitted:
            by_window[o.lease.window] += o.lease.tokens
    assert all(tokens <= 10_000 for tokens in by_window.values()), by_window
    assert sum(by_window.values()) >= 9_800  # 3x the demand: the quota is used, not left idle
    refused = [o for o in outcomes if not o.admitted]
    assert refused and all(o.exceeded == "tokens_per_minute" and o.retry_after_s > 0 for o in refused)


def test_two_replicas_share_the_tokens_in_flight(redis_url: str) -> None:
    quota = Quota(max_tokens_in_flight=500)

    async def scenario() -> tuple[int, int]:
        a, b = redis_store(redis_url), redis_store(redis_url)
        try:
            outcomes = await asyncio.gather(*(s.acquire("acme", quota, 10) for s in (a, b) * 60))
            in_flight = sum(o.lease.tokens for o in outcomes if o.admitted)
            for i, o in enumerate(outcomes):  # released by either replica
                if o.admitted:
                    await (a, b)[i % 2].release(o.lease, served=True)
            after = await b.acquire("acme", quota, 500)
            return in_flight, after.admitted
        finally:
            await a.aclose()
            await b.aclose()

    in_flight, admitted_after = asyncio.run(scenario())
    assert in_flight == 500 and admitted_after


# --- one round trip, keys that clean up ------------------------------------------------------------


def test_one_check_is_one_round_trip_and_its_keys_expire(redis_server: RedisServer, redis_url: str) -> None:
    async def scenario() -> int:
        observer = Recorder()
        store = redis_store(redis_url, observer=observer)
        quota = Quota(tokens_per_minute=1_000, requests_per_minute=100, max_tokens_in_flight=500)
        try:
            await store.acquire("acme", quota, 1)  # loads the script (once per Redis)
            sent = Counter()
            client = store._client
            execute = client.execute_command

            async def counting(*args, **kwargs):
                sent[args[0]] += 1
                return await execute(*args, **kwargs)

            client.execute_command = counting
            outcome = await store.acquire("acme", quota, 10)
            assert outcome.admitted and sent == Counter({"EVALSHA": 1})
            await store.release(outcome.lease, served=False)
            assert sent == Counter({"EVALSHA": 2})
            assert observer.round_trips == 3 and not observer.errors
        finally:
            await store.aclose()
        return 0

    asyncio.run(scenario())
    keys = redis_server.command("KEYS", "inferlb:quota:*").decode()
    names = [line for line in keys.split("\r\n") if line.startswith("inferlb:")]
    assert {n.rsplit(":", 1)[0] if n.count(":") == 4 else n for n in names} == {
        "inferlb:quota:{acme}:tokens", "inferlb:quota:{acme}:requests",
        "inferlb:quota:{acme}:in_flight", "inferlb:quota:{acme}:leases"}
    for name in names:
        ttl = int(redis_server.command("PTTL", name).decode().strip(":\r\n"))
        assert 0 < ttl <= 3 * WINDOW_MS + 300_000 + WINDOW_MS, (name, ttl)


def test_a_tenant_without_limits_never_reaches_redis() -> None:
    async def scenario() -> QuotaOutcome:
        store = redis_store("redis://127.0.0.1:1/0", failure_mode="closed")  # nothing listens there
        try:
            return await store.acquire("free", Quota(), 10)
        finally:
            await store.aclose()

    outcome = asyncio.run(scenario())
    assert outcome.admitted and not outcome.store_failed


# --- failure modes ---------------------------------------------------------------------------------


QUOTA = Quota(tokens_per_minute=1_000)


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_stopped_then_restarted(own_redis: RedisServer, mode: str) -> None:
    async def scenario() -> Recorder:
        observer = Recorder()
        store = redis_store(own_redis.url, failure_mode=mode, observer=observer, backoff_s=0.05)
        try:
            first = await store.acquire("acme", QUOTA, 10)
            assert first.admitted and not first.store_failed
            own_redis.stop()
            down = await store.acquire("acme", QUOTA, 10)
            assert down.store_failed and down.admitted == (mode == "open") and down.lease is None
            assert down.tokens is None and down.requests is None
            await store.release(first.lease, served=False)  # lost: never raises
            own_redis.start()

            async def recovered() -> QuotaOutcome | None:
                outcome = await store.acquire("acme", QUOTA, 10)
                return outcome if not outcome.store_failed else None

            back = await eventually(recovered, 30, "the store to reach the restarted Redis")
            assert back.admitted and back.tokens.remaining == 990  # a fresh Redis: no persistence
        finally:
            await store.aclose()
        return observer

    observer = asyncio.run(scenario())
    failed = "failed_open" if mode == "open" else "failed_closed"
    assert observer.decisions[failed] >= 1 and observer.decisions["admitted"] >= 2
    assert observer.errors["acquire"] >= 1 and observer.errors["release"] == 1
    assert observer.reasons["error"] >= 1  # refused: a killed Redis is an error, not a timeout


def test_a_hung_redis_times_out_into_the_failure_mode(own_redis: RedisServer) -> None:
    """SIGSTOP: the connection stays open and nothing answers; the check gives up at its timeout."""

    async def scenario() -> Recorder:
        observer = Recorder()
        store = redis_store(own_redis.url, failure_mode="closed", observer=observer, timeout_s=0.2,
                            backoff_s=0.05)
        try:
            assert (await store.acquire("acme", QUOTA, 10)).admitted
            os.kill(own_redis.proc.process.pid, signal.SIGSTOP)
            try:
                hung = await store.acquire("acme", QUOTA, 10)
                assert hung.store_failed and not hung.admitted and hung.retry_after_s is not None
            finally:
                os.kill(own_redis.proc.process.pid, signal.SIGCONT)

            async def recovered() -> QuotaOutcome | None:
                outcome = await store.acquire("acme", QUOTA, 10)
                return outcome if not outcome.store_failed else None

            back = await eventually(recovered, 30, "the store to recover from the hang")
            assert back.admitted
        finally:
            await store.aclose()
        return observer

    observer = asyncio.run(scenario())
    assert observer.decisions["failed_closed"] >= 1 and observer.errors["acquire"] >= 1
    assert observer.reasons["timeout"] >= 1  # a hung Redis is a timeout


# --- configuration ---------------------------------------------------------------------------------


def test_the_factory_opens_the_store_the_url_names(tmp_path) -> None:
    async def scenario() -> None:
        memory = open_quota_store("memory")
        assert isinstance(memory, MemoryQuotaStore)
        for url in ("redis://127.0.0.1:6379/0", "rediss://cache.example:6380", f"unix://{tmp_path}/r.sock"):
            store = open_quota_store(url, failure_mode="closed", timeout_s=0.01, lease_ttl_s=5)
            assert isinstance(store, RedisQuotaStore)
            await store.aclose()
        with pytest.raises(ValueError, match="memory' or a redis://"):
            open_quota_store("postgresql://db/x")

    asyncio.run(scenario())


@pytest.mark.parametrize(("value", "reason"), [
    ("http://cache:6379", "the scheme is 'http'"), ("redis://", "needs a host"),
    ("redis://cache:port", "not a port number"), ("unix://", "socket's path"), ("mem", "the scheme is ''")])
def test_a_bad_quota_store_is_refused_at_start_up_naming_the_field(value: str, reason: str) -> None:
    with pytest.raises(pydantic.ValidationError) as error:
        ExtProcConfig(quota_store=value)
    assert "quota_store" in str(error.value) and reason in str(error.value)


def test_quota_settings_defaults_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ExtProcConfig()
    assert (config.quota_store, config.quota_failure_mode, config.quota_store_timeout_ms,
            config.quota_lease_ttl_s) == ("memory", "open", 50, 300.0)
    monkeypatch.setenv("INFERLB_EXT_PROC_QUOTA_STORE", "redis://127.0.0.1:6379/2")
    monkeypatch.setenv("INFERLB_EXT_PROC_QUOTA_FAILURE_MODE", "closed")
    config = ExtProcConfig()
    assert config.quota_store == "redis://127.0.0.1:6379/2" and config.quota_failure_mode == "closed"
    for field, bad in (("quota_failure_mode", "ajar"), ("quota_store_timeout_ms", 0), ("quota_lease_ttl_s", 0)):
        with pytest.raises(pydantic.ValidationError, match=field):
            ExtProcConfig(**{field: bad})


def test_the_redis_client_does_not_retry_by_itself() -> None:
    """The timeout bounds the whole check: redis-py's own retries (10 by default) would multiply it."""

    async def scenario() -> None:
        store = redis_store("redis://127.0.0.1:1/0")
        client: aioredis.Redis = store._client
        try:
            assert client.get_retry()._retries == 0
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_after_a_restart_no_stale_pooled_connection_fails_a_check(own_redis: RedisServer) -> None:
    """Found by the redis_down_closed fault: the pool's idle connections to the killed Redis each failed once
    after it was back, every failure a back-off in which a closed store refused all (503s seconds later)."""
    async def scenario() -> list[QuotaOutcome]:
        store = redis_store(own_redis.url, failure_mode="closed", backoff_s=0.05)
        try:
            warm = await asyncio.gather(*(store.acquire("acme", QUOTA, 1) for _ in range(8)))  # 8 pooled
            assert all(o.admitted and not o.store_failed for o in warm)
            own_redis.stop()
            assert (await store.acquire("acme", QUOTA, 1)).store_failed
            own_redis.start()

            async def recovered() -> QuotaOutcome | None:
                outcome = await store.acquire("acme", QUOTA, 1)
                return outcome if not outcome.store_failed else None

            await eventually(recovered, 30, "the store to reach the restarted Redis")
            return list(await asyncio.gather(*(store.acquire("acme", QUOTA, 1) for _ in range(8))))
        finally:
            await store.aclose()

    after = asyncio.run(scenario())
    assert [o.store_failed for o in after] == [False] * 8, after
