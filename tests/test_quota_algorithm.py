"""The quota algorithm (ext_proc/quota/algorithm.py) on an injected clock, the in-process store, and the
rate-limit headers (ext_proc/quota/__init__.py)."""

from __future__ import annotations

import asyncio
import heapq
import random
from collections import Counter

import pytest

from ext_proc.quota import algorithm as A
from ext_proc.quota import (
    ADMITTED,
    QuotaOutcome,
    Window,
    duration,
    rate_limit_headers,
)
from ext_proc.quota.memory_store import MemoryQuotaStore
from inferlb_runtime.api_keys import Quota

W = A.WINDOW_MS
TTL = 300_000


class Tenant:
    """One tenant's state driven through the pure functions, with outcomes as the stores give them."""

    def __init__(self, quota: Quota, ttl_ms: int = TTL) -> None:
        self.quota, self.ttl_ms = quota, ttl_ms
        self.state = A.TenantState()
        self.serial = 0

    def acquire(self, tokens: int, now_ms: int) -> QuotaOutcome:
        self.serial += 1
        self.state, decision = A.acquire(self.state, self.quota, tokens, now_ms, self.ttl_ms, str(self.serial))
        return A.to_outcome(decision, self.quota, "acme", tokens, str(self.serial))

    def release(self, outcome: QuotaOutcome, served: bool, now_ms: int) -> None:
        assert outcome.lease is not None
        self.state = A.release(self.state, outcome.lease, served, now_ms)


# --- the sliding window ----------------------------------------------------------------------------


def test_the_window_boundary_weighs_the_previous_minute() -> None:
    t = Tenant(Quota(tokens_per_minute=100))
    assert t.acquire(100, 0).admitted
    last = t.acquire(1, W - 1)
    assert not last.admitted and last.exceeded == "tokens_per_minute"
    # A fixed window would refill at the boundary (a double burst); the previous minute still weighs 100%.
    at_boundary = t.acquire(50, W)
    assert not at_boundary.admitted
    assert at_boundary.retry_after_s == 30.0  # half of the previous minute has slid out by then
    assert not t.acquire(50, W + 30_000 - 1).admitted
    assert t.acquire(50, W + 30_000).admitted
    assert not t.acquire(1, W + 30_000).admitted


def test_two_minutes_on_everything_is_forgotten() -> None:
    t = Tenant(Quota(tokens_per_minute=100, requests_per_minute=2))
    assert t.acquire(100, 10).admitted
    assert t.acquire(100, 2 * W).admitted


def test_the_retry_time_is_exact() -> None:
    """For random histories, a refused request passes at exactly retry_after and not 1 ms before."""
    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        quota = Quota(tokens_per_minute=rng.randint(50, 500), requests_per_minute=rng.randint(2, 20))
        t = Tenant(quota)
        now = rng.randint(0, 3 * W)
        for _ in range(rng.randint(1, 30)):
            now += rng.randint(0, 8_000)
            t.acquire(rng.randint(1, 60), now)
        cost = rng.randint(1, 60)
        probe = Tenant(quota)
        probe.state = t.state
        refused = probe.acquire(cost, now)
        if refused.admitted or refused.too_large:
            continue
        retry_ms = round(refused.retry_after_s * 1000)
        assert retry_ms > 0
        early, on_time = Tenant(quota), Tenant(quota)
        early.state = on_time.state = t.state
        assert not early.acquire(cost, now + retry_ms - 1).admitted
        assert on_time.acquire(cost, now + retry_ms).admitted
        checked += 1
    assert checked > 50


def test_three_times_the_quota_of_demand_admits_each_minute_within_two_percent() -> None:
    """Ten clients ask for 3x the tokens per minute for five minutes: every fixed minute is within the
    quota and, once the first has filled, at least 98% of it."""
    quota = 60_000
    t = Tenant(Quota(tokens_per_minute=quota))
    rng = random.Random(3)
    admitted: Counter[int] = Counter()
    arrivals = [(rng.randint(0, 660), c) for c in range(10)]  # (time, client), earliest first
    heapq.heapify(arrivals)
    while arrivals[0][0] < 5 * W:
        now, c = heapq.heappop(arrivals)
        tokens = rng.randint(1, 200)
        if t.acquire(tokens, now).admitted:
            admitted[now // W] += tokens
        # each client: a request every 330 ms on average, 100 tokens: 3x its tenth of the quota
        heapq.heappush(arrivals, (now + rng.randint(0, 660), c))
    for minute in range(5):
        assert admitted[minute] <= quota
        if minute:
            assert admitted[minute] >= 0.98 * quota, (minute, admitted[minute])


# --- several limits, atomically --------------------------------------------------------------------


def test_a_refusal_consumes_nothing() -> None:
    t = Tenant(Quota(tokens_per_minute=1000, requests_per_minute=1))
    first = t.acquire(10, 0)
    assert first.admitted and first.tokens == Window(1000, 990, 120.0) and first.requests.remaining == 0
    refused = t.acquire(10, 1)
    assert not refused.admitted and refused.exceeded == "requests_per_minute"
    assert refused.tokens.remaining == 990  # the tokens were not spent by the refused request
    assert refused.lease is None
    t2 = Tenant(Quota(tokens_per_minute=100, requests_per_minute=10))
    assert t2.acquire(100, 0).admitted
    by_tokens = t2.acquire(1, 1)
    assert by_tokens.exceeded == "tokens_per_minute" and by_tokens.requests.remaining == 9


def test_the_limit_to_wait_longest_for_is_named() -> None:
    t = Tenant(Quota(tokens_per_minute=100, requests_per_minute=2))
    assert t.acquire(50, 0).admitted and t.acquire(50, 0).admitted
    # At the boundary one request fits once 30 s of the previous minute have slid out; 80 tokens after 48 s.
    big = t.acquire(80, W)
    assert big.exceeded == "tokens_per_minute" and big.retry_after_s == 48.0
    small = t.acquire(10, W)  # 10 tokens would fit after 6 s: the requests are the longer wait
    assert small.exceeded == "requests_per_minute" and small.retry_after_s == 30.0


def test_an_unserved_request_is_refunded_and_a_served_one_only_frees_its_tokens_in_flight() -> None:
    t = Tenant(Quota(tokens_per_minute=100, requests_per_minute=5, max_tokens_in_flight=60))
    shed = t.acquire(60, 0)
    assert shed.admitted and not t.acquire(1, 0).admitted  # 60 in flight
    t.release(shed, served=False, now_ms=5)
    after = t.acquire(60, 10)
    assert after.admitted and after.tokens.remaining == 40 and after.requests.remaining == 4
    t.release(after, served=True, now_ms=20)
    again = t.acquire(40, 30)
    assert again.admitted and again.tokens.remaining == 0  # served: its tokens per minute stay spent
    t.release(again, served=True, now_ms=40)
    assert t.state.in_flight == 0 and not t.state.leases


def test_a_refund_goes_to_the_minute_the_request_was_counted_in() -> None:
    t = Tenant(Quota(tokens_per_minute=100))
    late = t.acquire(100, W - 10)
    t.release(late, served=False, now_ms=W + 10)  # now the previous minute: refunded there
    assert t.acquire(100, W + 20).admitted
    old = Tenant(Quota(tokens_per_minute=100))
    gone = old.acquire(50, 0)
    old.release(gone, served=False, now_ms=2 * W)  # its minute no longer counts: nothing to refund
    assert old.state.tokens == A.Minute(2)


def test_a_lease_expires_so_a_lost_release_frees_the_tokens_in_flight() -> None:
    t = Tenant(Quota(max_tokens_in_flight=100), ttl_ms=5_000)
    assert t.acquire(100, 0).admitted  # its replica dies: never released
    blocked = t.acquire(1, 4_999)
    assert not blocked.admitted and blocked.exceeded == "max_tokens_in_flight"
    assert blocked.retry_after_s == A.IN_FLIGHT_RETRY_MS / 1000
    assert t.acquire(100, 5_000).admitted


def test_a_request_over_a_limit_by_itself_is_too_large() -> None:
    t = Tenant(Quota(tokens_per_minute=100, max_tokens_in_flight=500))
    big = t.acquire(101, 0)
    assert not big.admitted and big.too_large and big.exceeded == "tokens_per_minute"
    assert big.retry_after_s is None and big.tokens.remaining == 100
    assert not any(name.startswith("retry-after") for name, _ in rate_limit_headers(big))
    t2 = Tenant(Quota(max_tokens_in_flight=50))
    assert t2.acquire(51, 0).too_large and t2.acquire(51, 0).exceeded == "max_tokens_in_flight"
    assert t2.acquire(50, 0).admitted


# --- headers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.0001, "1ms"), (0.25, "250ms"), (1, "1s"), (8.64, "8.64s"), (59.999, "59.999s"),
    (60, "1m0s"), (179.56, "2m59.56s"), (360, "6m0s"), (3600, "1h0m0s")])
def test_reset_times_are_in_openais_duration_format(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_headers_of_an_admitted_and_of_a_refused_request() -> None:
    t = Tenant(Quota(tokens_per_minute=1000, requests_per_minute=10))
    admitted = dict(rate_limit_headers(t.acquire(250, 0)))
    assert admitted == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "2m0s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "750", "x-ratelimit-reset-tokens": "2m0s"}
    refused = dict(rate_limit_headers(t.acquire(800, 30_500)))
    assert refused["x-ratelimit-remaining-tokens"] == "750"
    assert refused["x-ratelimit-reset-tokens"] == "1m29.5s"
    # 800 tokens fit once 50 of the 250 have slid out: 12 s into the next minute, 41.5 s from now.
    assert refused["retry-after-ms"] == "41500" and refused["retry-after"] == "42"


def test_headers_only_for_the_limits_the_key_has() -> None:
    tokens_only = Tenant(Quota(tokens_per_minute=10)).acquire(1, 0)
    assert {n for n, _ in rate_limit_headers(tokens_only)} == {
        "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"}
    assert rate_limit_headers(ADMITTED) == []
    failed_closed = QuotaOutcome(admitted=False, store_failed=True, retry_after_s=0.5)
    assert rate_limit_headers(failed_closed) == [("retry-after", "1"), ("retry-after-ms", "500")]


# --- the in-process store --------------------------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.decisions: Counter[str] = Counter()

    def quota_decision(self, result: str) -> None:
        self.decisions[result] += 1

    def quota_store_error(self, operation: str, reason: str) -> None:
        raise AssertionError("the in-process store never fails")

    def quota_store_latency(self, seconds: float) -> None:
        raise AssertionError("the in-process store has no round trip")


def test_the_memory_store_under_interleaved_coroutines_admits_exactly_the_quota() -> None:
    asyncio.run(_interleaved())


async def _interleaved() -> None:
    now = [0]
    observer = Recorder()
    store = MemoryQuotaStore(observer=observer, clock_ms=lambda: now[0])
    quota = Quota(tokens_per_minute=1000, max_tokens_in_flight=300)

    async def client(n: int) -> int:
        served = 0
        for _ in range(20):
            outcome = await store.acquire("acme", quota, 10)
            await asyncio.sleep(0)  # let the others interleave while the request "runs"
            if outcome.admitted:
                served += 10
                await store.release(outcome.lease, served=True)
        return served

    served = await asyncio.gather(*(client(n) for n in range(20)))
    assert sum(served) == 1000
    assert observer.decisions["admitted"] == 100 and observer.decisions["limited"] == 300
    await store.aclose()


def test_the_memory_store_forgets_idle_tenants_and_passes_tenants_without_limits() -> None:
    asyncio.run(_idle_tenants())


async def _idle_tenants() -> None:
    now = [0]
    store = MemoryQuotaStore(lease_ttl_s=10, clock_ms=lambda: now[0])
    assert await store.acquire("free", Quota(), 10**9) is ADMITTED
    outcome = await store.acquire("acme", Quota(tokens_per_minute=100, max_tokens_in_flight=100), 10)
    other = await store.acquire("beta", Quota(requests_per_minute=5), 1)
    assert outcome.lease is not None and other.admitted and len(store) == 2
    now[0] = 2 * W  # acme's lease expired (10 s), both minutes passed: at the next check both go
    await store.acquire("gamma", Quota(requests_per_minute=5), 1)
    assert len(store) == 1
    await store.release(outcome.lease, served=False)  # a late release of a forgotten tenant is harmless
    assert len(store) == 1
