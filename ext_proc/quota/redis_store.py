"""The quota store in Redis: counters shared by every ext_proc replica.

One check is one Lua script, so one round trip (``EVALSHA``; the script is
loaded again by itself after a Redis restart). Redis runs a script
atomically, so concurrent checks from any number of replicas serialise and a
window never admits more than its quota. The script is
:mod:`ext_proc.quota.algorithm` written again in Lua, with the same integer
arithmetic, and tests drive both with the same sequences. It reads the time
from Redis (``TIME``), so the replicas need no clock agreement.

Keys: ``inferlb:quota:{<tenant>}:tokens:<window>`` and ``...:requests:<window>``
(the counts of one 60 s window, expiring two windows after it ends),
``...:in_flight`` and ``...:leases`` (a sorted set of lease ids by expiry,
expiring with the last lease), so an idle tenant leaves nothing behind. The
braces are a Redis Cluster hash tag: one tenant's keys share a slot, as a
script's keys must.

Why not the ``limits`` library (read at 5.8.0): its rate limiter hits one
limit per call (one script, one round trip each) and reads a window's
figures with another call, so tokens and requests per minute would take four
round trips, and a request refused by its requests per minute would already
have spent its tokens (no atomic check of several limits); it has no tokens
in flight either.

Redis unreachable, failing or slower than the timeout (50 ms by default):
the configured failure mode decides (``open``: admit, ``closed``: refuse),
the outcome says ``store_failed`` and the observer counts it. For a short
back-off after a failure the store does not even try (a dead Redis must not
cost every request a connect attempt); redis-py reconnects at the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, TimeoutError as RedisTimeout

from inferlb_runtime.api_keys import Quota

from . import ADMITTED, FailureMode, Lease, NoQuotaObserver, QuotaObserver, QuotaOutcome, decision_result
from .algorithm import IN_FLIGHT_RETRY_MS, WINDOW_MS, Decision, to_outcome

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 0.05
DEFAULT_BACKOFF_S = 0.5
KEY_PREFIX = "inferlb:quota:"

# KEYS: tokens base, requests base, in-flight counter, leases (sorted set).
# ARGV: tokens/min, requests/min, max in flight (0: none), tokens, lease TTL ms, lease id, now ms ("": TIME).
# Returns {admitted, exceeded, too_large, retry_ms, window, tokens remaining, tokens reset ms,
#          requests remaining, requests reset ms}: quota_algorithm.Decision, field by field.
ACQUIRE_LUA = f"""
local W = {WINDOW_MS}
local tpm, rpm, mif = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, ttl = tonumber(ARGV[4]), tonumber(ARGV[5])
local now
if ARGV[7] ~= '' then
  now = tonumber(ARGV[7])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local window = math.floor(now / W)
local elapsed = now - window * W

local function counts(base)
  return tonumber(redis.call('GET', base .. ':' .. window)) or 0,
         tonumber(redis.call('GET', base .. ':' .. (window - 1))) or 0
end
local function retry(cur, prev, limit, c)
  local load = prev * (W - elapsed) + cur * W
  if load + c * W <= limit * W then return -1 end
  if cur + c <= limit then
    return W - math.floor((limit - c - cur) * W / prev) - elapsed
  end
  return 2 * W - elapsed - math.floor((limit - c) * W / cur)
end
local function figures(cur, prev, limit)
  local load = prev * (W - elapsed) + cur * W
  local remaining = math.max(0, math.floor((limit * W - load) / W))
  if cur > 0 then return remaining, 2 * W - elapsed end
  if prev > 0 then return remaining, W - elapsed end
  return remaining, 0
end

local tcur, tprev, rcur, rprev, inflight = 0, 0, 0, 0, 0
if tpm > 0 then tcur, tprev = counts(KEYS[1]) end
if rpm > 0 then rcur, rprev = counts(KEYS[2]) end
if mif > 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
  if #expired > 0 then
    local freed = 0
    for _, member in ipairs(expired) do freed = freed + tonumber(string.match(member, ':(%d+)$')) end
    redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
    redis.call('DECRBY', KEYS[3], freed)
  end
  inflight = math.max(0, tonumber(redis.call('GET', KEYS[3])) or 0)
end

local too_large, exceeded, wait = 0, 0, -1
if tpm > 0 and cost > tpm then
  too_large = 1
elseif mif > 0 and cost > mif then
  too_large = 3
else
  local r = -1
  if tpm > 0 then r = retry(tcur, tprev, tpm, cost) end
  if r > wait then exceeded, wait = 1, r end
  r = -1
  if rpm > 0 then r = retry(rcur, rprev, rpm, 1) end
  if r > wait then exceeded, wait = 2, r end
  r = -1
  if mif > 0 and inflight + cost > mif then r = {IN_FLIGHT_RETRY_MS} end
  if r > wait then exceeded, wait = 3, r end
end
local admitted = 0
if too_large == 0 and exceeded == 0 then
  admitted = 1
  local keep = 3 * W - elapsed
  if tpm > 0 then
    local key = KEYS[1] .. ':' .. window
    tcur = redis.call('INCRBY', key, cost)
    redis.call('PEXPIRE', key, keep)
  end
  if rpm > 0 then
    local key = KEYS[2] .. ':' .. window
    rcur = redis.call('INCR', key)
    redis.call('PEXPIRE', key, keep)
  end
  if mif > 0 then
    redis.call('ZADD', KEYS[4], now + ttl, ARGV[6] .. ':' .. cost)
    local left = redis.call('INCRBY', KEYS[3], cost)
    if left < cost then redis.call('SET', KEYS[3], cost) end
    redis.call('PEXPIRE', KEYS[3], ttl + W)
    redis.call('PEXPIRE', KEYS[4], ttl + W)
  end
end
local trem, treset, rrem, rreset = 0, 0, 0, 0
if tpm > 0 then trem, treset = figures(tcur, tprev, tpm) end
if rpm > 0 then rrem, rreset = figures(rcur, rprev, rpm) end
if exceeded == 0 then wait = -1 end
return {{admitted, too_large + exceeded, math.min(too_large, 1), wait, window, trem, treset, rrem, rreset}}
"""

# KEYS: as ACQUIRE_LUA's. ARGV: lease member ("": none), its tokens, refund window ("": none),
# tokens to refund, requests to refund.
RELEASE_LUA = """
if ARGV[1] ~= '' and redis.call('ZREM', KEYS[4], ARGV[1]) == 1 then
  if redis.call('DECRBY', KEYS[3], ARGV[2]) < 0 then redis.call('SET', KEYS[3], 0, 'KEEPTTL') end
end
local function refund(key, amount)
  local v = tonumber(redis.call('GET', key))
  if v then redis.call('SET', key, math.max(0, v - amount), 'KEEPTTL') end
end
if ARGV[3] ~= '' then
  if tonumber(ARGV[4]) > 0 then refund(KEYS[1] .. ':' .. ARGV[3], tonumber(ARGV[4])) end
  if tonumber(ARGV[5]) > 0 then refund(KEYS[2] .. ':' .. ARGV[3], tonumber(ARGV[5])) end
end
return 1
"""


def tenant_keys(tenant: str) -> list[str]:
    """The script's KEYS for ``tenant`` (the tenant name is TENANT_PATTERN-checked: no braces, no colons)."""
    base = f"{KEY_PREFIX}{{{tenant}}}:"
    return [base + "tokens", base + "requests", base + "in_flight", base + "leases"]


class RedisQuotaStore:
    """Counters in Redis, one script per check; the failure mode decides when Redis does not answer."""

    def __init__(self, client: aioredis.Redis, *, failure_mode: FailureMode = "open",
                 timeout_s: float = DEFAULT_TIMEOUT_S, lease_ttl_s: float = 300.0,
                 observer: QuotaObserver | None = None, backoff_s: float = DEFAULT_BACKOFF_S,
                 clock_ms: Callable[[], int] | None = None) -> None:
        """``clock_ms``: tests only (the scripts take the time from Redis without it)."""
        self._client = client
        self._failure_mode: FailureMode = failure_mode
        self._timeout_s = timeout_s
        self._lease_ttl_ms = round(lease_ttl_s * 1000)
        self._observer = observer or NoQuotaObserver()
        self._backoff_s = backoff_s
        self._clock_ms = clock_ms
        self._acquire_script = client.register_script(ACQUIRE_LUA)
        self._release_script = client.register_script(RELEASE_LUA)
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._failing = False

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs) -> RedisQuotaStore:
        """A store on a ``redis://``, ``rediss://`` or ``unix://`` URL; connects at the first check."""
        client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),  # no retries inside redis-py: the timeout bounds the whole check
            health_check_interval=0)
        return cls(client, timeout_s=timeout_s, **kwargs)

    async def acquire(self, tenant: str, quota: Quota, tokens: int) -> QuotaOutcome:
        if quota.unlimited:
            self._observer.quota_decision("admitted")
            return ADMITTED
        lease_id = secrets.token_hex(8)
        args = (quota.tokens_per_minute or 0, quota.requests_per_minute or 0, quota.max_tokens_in_flight or 0,
                tokens, self._lease_ttl_ms, lease_id, self._now_arg())
        reply = await self._call("acquire", self._acquire_script, tenant_keys(tenant), args)
        if reply is None:
            outcome = QuotaOutcome(admitted=self._failure_mode == "open", store_failed=True,
                                   retry_after_s=None if self._failure_mode == "open" else self._backoff_s)
        else:
            outcome = to_outcome(Decision.of_reply(reply), quota, tenant, tokens, lease_id)
        self._observer.quota_decision(decision_result(outcome, self._failure_mode))
        return outcome

    async def release(self, lease: Lease, served: bool) -> None:
        if not lease.releases(served):
            return
        refund = lease.refunds(served)
        args = (f"{lease.id}:{lease.tokens}" if lease.in_flight else "", lease.tokens,
                lease.window if refund else "", lease.tokens if refund and lease.per_minute_tokens else 0,
                1 if refund and lease.per_minute_request else 0)
        await self._call("release", self._release_script, tenant_keys(lease.tenant), args)

    async def aclose(self) -> None:
        await self._client.aclose()

    def _now_arg(self) -> int | str:
        return self._clock_ms() if self._clock_ms is not None else ""

    async def _call(self, operation: str, script, keys: list[str], args: tuple) -> list[int] | None:
        """The script's reply, or None when Redis failed, was too slow, or is in its back-off."""
        if time.monotonic() < self._down_until:
            self._observer.quota_store_error(operation, "backoff")
            return None
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await script(keys=keys, args=args)
        except (RedisError, OSError, TimeoutError) as exc:
            # redis-py's own TimeoutError is a RedisError: the socket timeout, same as ours
            self._observer.quota_store_error(operation, "timeout" if isinstance(exc, (TimeoutError, RedisTimeout))
                                             else "error")
            self._down_until = time.monotonic() + self._backoff_s
            # The idle pooled connections are to the Redis that failed: after a restart each would fail
            # once more (and set another back-off, refusing everything when failing closed). Fresh ones then.
            with contextlib.suppress(RedisError, OSError):
                await self._client.connection_pool.disconnect(inuse_connections=False)
            if not self._failing:
                self._failing = True
                log.warning("quota store: Redis %s failed (%s: %s); failing %s until it answers",
                            operation, type(exc).__name__, exc, self._failure_mode)
            return None
        self._observer.quota_store_latency(time.perf_counter() - start)
        if self._failing:
            self._failing = False
            log.info("quota store: Redis answers again")
        return reply
