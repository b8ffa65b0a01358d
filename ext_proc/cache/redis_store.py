"""The gateway cache's shared level in Redis (the quotas' server): an answer stored by one ext_proc replica
is a hit at every other.

Why bounded here rather than by Redis's ``maxmemory``: the server is shared with the quotas, whose keys must
never be evicted for cached vectors. So each entry expires after the TTL, and a byte budget is kept by the
store script itself: ``<prefix>bytes`` (the total), ``<prefix>sizes`` (a hash of entry sizes),
``<prefix>index`` (a sorted set by time stored, for the TTL) and ``<prefix>lru`` (a sorted set by last use,
on a logical clock, ``<prefix>clock``: uses within one millisecond still have an order).
One put is one script, one round trip: it forgets entries past their TTL, stores the new one, and drops the
least recently used while over the budget (counted as evictions). A lookup is one script too: the GET, and
on a hit the entry's last use, so the popular answers (the Zipf head) stay while one-off ones go. Keys are
the request key in hex (``cache/key.py``).

Redis unreachable, failing or slower than the timeout: a lookup is a miss and a store is skipped, never a
failed request; for a short back-off after a failure Redis is not tried (a dead Redis must not cost every
request a connect attempt).
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .memory_store import CachedResponse

log = logging.getLogger(__name__)

KEY_PREFIX = "inferlb:cache:"
DEFAULT_BACKOFF_S = 0.5

# KEYS: the entry, the index (by time stored), the sizes (hash), the byte total, the LRU (by last use), the
# LRU's clock. ARGV: value, TTL ms, budget bytes. Returns {bytes held, entries evicted for room}.
STORE_LUA = """
local t = redis.call('TIME')  -- Redis's clock, one for every replica (ms)
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, budget = tonumber(ARGV[2]), tonumber(ARGV[3])
local function forget(k)
  local size = redis.call('HGET', KEYS[3], k)
  redis.call('ZREM', KEYS[2], k)
  redis.call('ZREM', KEYS[5], k)
  redis.call('HDEL', KEYS[3], k)
  redis.call('DEL', k)
  if size then redis.call('DECRBY', KEYS[4], size) end
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do forget(k) end
forget(KEYS[1])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, KEYS[1])
redis.call('ZADD', KEYS[5], redis.call('INCR', KEYS[6]), KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], #ARGV[1])
local total = redis.call('INCRBY', KEYS[4], #ARGV[1])
local evicted = 0
while total > budget do
  local coldest = redis.call('ZRANGE', KEYS[5], 0, 0)[1]
  if not coldest then break end
  forget(coldest)
  total = tonumber(redis.call('GET', KEYS[4])) or 0
  if coldest ~= KEYS[1] then evicted = evicted + 1 end
end
return {total, evicted}
"""

# KEYS: the entry, the LRU, its clock. Returns the value (nil: a miss); a hit becomes the most recently used.
LOOKUP_LUA = """
local value = redis.call('GET', KEYS[1])
if value then redis.call('ZADD', KEYS[2], 'XX', redis.call('INCR', KEYS[3]), KEYS[1]) end
return value
"""


def encode(response: CachedResponse) -> bytes:
    """version, content-type and body, split by newlines (header values never hold one)."""
    return b"\n".join((response.version.encode(), response.content_type.encode(), response.body))


def decode(value: bytes) -> CachedResponse | None:
    parts = value.split(b"\n", 2)
    if len(parts) != 3:
        return None
    return CachedResponse(parts[2], parts[1].decode("latin-1"), parts[0].decode("latin-1"))


class RedisResponseCache:
    """The shared level: lookups and stores in Redis, each bounded by the timeout."""

    def __init__(self, client: aioredis.Redis, *, ttl_s: float, max_bytes: int, timeout_s: float,
                 prefix: str = KEY_PREFIX, backoff_s: float = DEFAULT_BACKOFF_S) -> None:
        self._client = client
        self._ttl_ms = max(1, round(ttl_s * 1000))
        self.max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._prefix = prefix
        self._lru = [f"{prefix}lru", f"{prefix}clock"]
        self._meta = [f"{prefix}index", f"{prefix}sizes", f"{prefix}bytes", *self._lru]
        self._store = client.register_script(STORE_LUA)
        self._lookup = client.register_script(LOOKUP_LUA)
        self._backoff_s = backoff_s
        self._down_until = 0.0  # time.monotonic() before which Redis is not tried
        self._failing = False
        self.errors = 0

    @classmethod
    def from_url(cls, url: str, *, timeout_s: float, **kwargs) -> RedisResponseCache:
        """On a ``redis://``, ``rediss://`` or ``unix://`` URL; connects at the first call."""
        client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                         retry=Retry(NoBackoff(), 0), health_check_interval=0)
        return cls(client, timeout_s=timeout_s, **kwargs)

    async def get(self, key: bytes) -> CachedResponse | None:
        """The stored answer; None when there is none, or Redis did not answer in time."""
        value = await self._call("get", self._lookup(keys=[self._prefix + key.hex(), *self._lru]))
        return decode(value) if value else None

    async def put(self, key: bytes, response: CachedResponse) -> tuple[int, int] | None:
        """Store; (bytes the level holds, entries evicted for room), or None when Redis did not answer."""
        value = encode(response)
        if len(value) > self.max_bytes:
            return None
        reply = await self._call("put", self._store(keys=[self._prefix + key.hex(), *self._meta],
                                                    args=[value, self._ttl_ms, self.max_bytes]))
        return (int(reply[0]), int(reply[1])) if reply is not None else None

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _call(self, operation: str, call):  # type: ignore[no-untyped-def]
        if time.monotonic() < self._down_until:
            call.close()  # the coroutine is never awaited: close it (no "never awaited" warning)
            self.errors += 1
            return None
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await call
        except (RedisError, OSError, TimeoutError) as exc:
            self.errors += 1
            self._down_until = time.monotonic() + self._backoff_s
            if not self._failing:
                self._failing = True
                log.warning("gateway cache: Redis %s failed (%s: %s); the shared level is skipped until it "
                            "answers", operation, type(exc).__name__, exc)
            return None
        if self._failing:
            self._failing = False
            log.info("gateway cache: Redis answers again")
        return reply
