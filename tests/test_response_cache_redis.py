"""The gateway cache's shared level on a real redis-server (tests/redis_server.py): an answer stored through one
ext_proc servicer is a hit at another (its own in-process level empty), the byte budget drops the least recently used entries,
entries expire with the TTL, and a Redis that does not answer is a miss, never a failed request."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pydantic
import pytest

from ext_proc.config import ExtProcConfig
from ext_proc.cache.memory_store import CachedResponse
from ext_proc.cache.redis_store import RedisResponseCache
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import static_view

from .test_ext_proc_service import counter, serving  # noqa: F401  (the module's token counter fixture)
from .test_response_cache_service import A, ANSWER, CACHED, INT8, ask, cache_samples, served

if TYPE_CHECKING:
    from .redis_server import RedisServer

pytest_plugins = ("tests.redis_server",)  # the redis_server, redis_url and own_redis fixtures


def shared(url: str, **kwargs: float) -> RedisResponseCache:
    options = {"ttl_s": 60.0, "max_bytes": 1 << 20, "timeout_s": 1.0} | kwargs
    return RedisResponseCache.from_url(url, **options)  # type: ignore[arg-type]


def test_an_answer_stored_by_one_replica_is_a_hit_at_another(counter: TokenCounter,  # noqa: F811
                                                           redis_url: str) -> None:
    async def scenario() -> None:
        first, second = shared(redis_url), shared(redis_url)
        try:
            async with serving(counter, static_view([A]), settings=CACHED) as one:
                one.servicer.stage("cache").shared = first
                call, _ = await ask(one, {"model": INT8, "input": "shared"})
                await served(call)
                await asyncio.gather(*one.servicer.stage("cache").shared_stores)  # the store runs off the stream
            async with serving(counter, static_view([A]), settings=CACHED) as other:
                other.servicer.stage("cache").shared = second
                _, hit = await ask(other, {"model": INT8, "input": "shared"})
                assert hit.immediate_response.status.code == 200 and hit.immediate_response.body == ANSWER
                samples = cache_samples(other)
                assert samples[("memory", "miss")] == 1 and samples[("redis", "hit")] == 1
                _, again = await ask(other, {"model": INT8, "input": "shared"})  # now in its own level
                assert again.immediate_response.body == ANSWER and cache_samples(other)[("memory", "hit")] == 1
        finally:
            await first.aclose()
            await second.aclose()

    asyncio.run(scenario())


def test_the_byte_budget_drops_the_least_recently_used_and_entries_expire(redis_url: str,
                                                                         redis_server: "RedisServer") -> None:
    async def scenario() -> None:
        answer = CachedResponse(b"x" * 1000, "application/json", INT8)
        cache = shared(redis_url, max_bytes=3500)
        try:
            for key in (b"a", b"b", b"c"):
                assert (await cache.put(key, answer)) == ((1000 + 2 + len(INT8) + 16) * (ord(key) - 96), 0)
            assert await cache.get(b"a") == answer  # a hit: "a" is now the most recently used, "b" the least
            held, evicted = await cache.put(b"d", answer)  # type: ignore[misc]
            assert evicted == 1 and held <= 3500
            assert await cache.get(b"b") is None
            assert await cache.get(b"a") == answer and await cache.get(b"d") == answer
            held, evicted = await cache.put(b"e", answer)  # type: ignore[misc]
            assert evicted == 1 and await cache.get(b"c") is None and await cache.get(b"a") == answer
            await cache.put(b"a", answer)  # a store again replaces, never counts twice
            assert int(redis_server.command("ZCARD", "inferlb:cache:lru")[1:]) == 3  # a, d, e
        finally:
            await cache.aclose()
        short = shared(redis_url, ttl_s=30)
        try:
            await short.put(b"e", answer)
            ttl = int(redis_server.command("PTTL", "inferlb:cache:" + b"e".hex())[1:])  # RESP ":49\r\n"
            assert 0 < ttl <= 30_000  # Redis expires it with the TTL; a later put forgets its size
        finally:
            await short.aclose()

    asyncio.run(scenario())


def test_redis_not_answering_is_a_miss(own_redis: "RedisServer") -> None:
    async def scenario() -> None:
        url = own_redis.url
        own_redis.stop()
        cache = shared(url, timeout_s=0.2)
        try:
            assert await cache.get(b"k") is None
            assert await cache.put(b"k", CachedResponse(b"{}", "application/json", INT8)) is None
            assert cache.errors == 2  # the second not even tried (the back-off)
        finally:
            await cache.aclose()

    asyncio.run(scenario())


def test_the_cache_store_must_be_memory_or_a_redis_url() -> None:
    assert ExtProcConfig(cache_store="redis://127.0.0.1:6379/0").cache_store.startswith("redis://")
    with pytest.raises(pydantic.ValidationError, match="cache_store"):
        ExtProcConfig(cache_store="http://example")
