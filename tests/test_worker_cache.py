"""The worker cache's parts without a network: LRU by bytes, the Cache-Control policy, the config, and
coalescing in front of a real ``MicroBatcher`` whose engine is gated (so what is in flight is known without
any sleep): a follower whose leader's client leaves computes the input itself."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator

import numpy as np
import pytest

from workers.batcher import Embedded, Priority
from workers.cached_embedding import CachedEmbedder
from workers.config import WorkerConfig, load_config
from workers.model_batchers import ModelBatchers
from workers.input_cache import ID_BYTES, CacheKey, InputCache
from inferlb_runtime.cache_control import CacheDirectives, parse_cache_control
from workers.request_options import parse_request_options

from .test_batcher import GatedEngine, Observer
from .test_ext_proc_service import until

DIM = 4
ENTRY = DIM * 4 + 2 * ID_BYTES  # a float32 vector of DIM and a key of two token ids


class Recorder:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.evicted = 0
        self.results = {"hit": 0, "miss": 0, "coalesced": 0}

    def cache_bytes(self, size: int) -> None:
        self.sizes.append(size)

    def cache_evicted(self, entries: int) -> None:
        self.evicted += entries

    def cache_results(self, *, hits: int, misses: int, coalesced: int) -> None:
        for name, count in (("hit", hits), ("miss", misses), ("coalesced", coalesced)):
            self.results[name] += count


def vec(value: float) -> np.ndarray:
    return np.full(DIM, value, dtype=np.float32)


def test_lru_evicts_the_least_recently_used_to_stay_within_its_bytes() -> None:
    recorder = Recorder()
    cache = InputCache(3 * ENTRY, observer=recorder)
    a, b, c, d = (CacheKey.of("m", [i, i]) for i in range(4))
    for key, value in ((a, 1.0), (b, 2.0), (c, 3.0)):
        cache.put(key, vec(value))
    assert cache.size_bytes == 3 * ENTRY and recorder.evicted == 0
    assert cache.get(a) is not None  # a is now the most recently used: b goes first
    cache.put(d, vec(4.0))
    assert cache.get(b) is None
    assert [cache.get(k)[0] for k in (a, c, d)] == [1.0, 3.0, 4.0]  # type: ignore[index]
    assert recorder.evicted == 1 and cache.size_bytes == 3 * ENTRY and recorder.sizes[-1] == 3 * ENTRY


def test_a_stored_vector_is_a_read_only_copy_with_the_same_bits() -> None:
    cache = InputCache(10 * ENTRY)
    batch = np.array([[0.1, 0.2, 0.3, 0.4], [1, 2, 3, 4]], dtype=np.float32)
    key = CacheKey.of("m", [1, 2])
    cache.put(key, batch[0])
    batch[0, 0] = 9.0  # the batch's buffer may be reused; the entry must not change with it
    stored = cache.get(key)
    assert stored is not None and stored.dtype == np.float32 and not stored.flags.writeable
    assert stored.tobytes() == np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32).tobytes()
    assert stored.base is None or stored.base is not batch


def test_an_entry_larger_than_the_cache_and_a_zero_cache_store_nothing() -> None:
    small = InputCache(ENTRY - 1)
    small.put(CacheKey.of("m", [1, 2]), vec(1.0))
    assert len(small) == 0 and small.size_bytes == 0
    off = InputCache(0)
    off.put(CacheKey.of("m", [1, 2]), vec(1.0))
    assert not off.enabled and len(off) == 0


def test_versions_never_share_an_entry() -> None:
    cache = InputCache(10 * ENTRY)
    cache.put(CacheKey.of("all-MiniLM-L6-v2-int8", [1, 2]), vec(1.0))
    assert cache.get(CacheKey.of("all-MiniLM-L6-v2-fp32", [1, 2])) is None


@pytest.mark.parametrize("header, policy", [
    (None, (True, True)),
    ("no-cache", (False, True)),
    ("No-Cache, max-age=0", (False, True)),
    ("no-store", (False, False)),
    ("max-age=60, no-store", (False, False)),
    ("max-age=60", (True, True)),
])
def test_cache_control_directives(header: str | None, policy: tuple[bool, bool]) -> None:
    directives = parse_cache_control(header)
    assert (directives.lookup, directives.store) == policy
    headers = {"cache-control": header} if header is not None else {}
    assert parse_request_options(headers, 0.0).cache == directives


def test_cache_max_bytes_from_toml_env_and_flag(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert WorkerConfig().cache_max_bytes == 32 * 1024 * 1024
    toml = tmp_path / "w.toml"
    toml.write_text("[worker]\ncache_max_bytes = 1000\n")
    assert load_config(toml, environ={}).cache_max_bytes == 1000
    assert load_config(toml, environ={"INFERLB_WORKER_CACHE_MAX_BYTES": "0"}).cache_max_bytes == 0
    assert load_config(toml, {"cache_max_bytes": 5}, environ={"INFERLB_WORKER_CACHE_MAX_BYTES": "0"}
                       ).cache_max_bytes == 5
    with pytest.raises(ValueError, match="cache_max_bytes must be >= 0"):
        WorkerConfig(cache_max_bytes=-1)


def test_a_follower_whose_leader_leaves_computes_the_input_itself() -> None:
    """The leader's client goes away while its input computes: the follower must not fail with it."""

    async def main() -> None:
        engine = GatedEngine()
        async with gated_embedder(engine) as (embedder, recorder):
            blocker = await busy(embedder, engine)
            leader = asyncio.ensure_future(embedder.embed([[7, 7]], model="m"))
            await until(lambda: embedder.inflight_keys == 2, 10, "two inputs in flight")
            follower = asyncio.ensure_future(embedder.embed([[7, 7]], model="m"))
            await until(lambda: recorder.results["coalesced"] == 1, 10, "one coalesced input")
            leader.cancel()
            engine.gate.release()  # the blocker ends; the follower's own [7, 7] is queued and computed
            await blocker
            await asyncio.get_running_loop().run_in_executor(None, engine.entered.acquire)
            engine.gate.release()
            row = (await follower).vectors[0]
            assert row.tolist() == [2.0, 7.0]  # GatedEngine's [length, first id]
            assert leader.cancelled()
            assert embedder.inflight_keys == 0
            assert recorder.results == {"hit": 0, "miss": 3, "coalesced": 1}  # the retry counts again

    asyncio.run(main())


def test_an_input_joins_only_a_computation_of_its_own_class_or_a_better_one() -> None:
    """A critical input must not wait in a sheddable request's place; it leads the later arrivals."""

    async def main() -> None:
        engine = GatedEngine()
        async with gated_embedder(engine) as (embedder, recorder):
            blocker = await busy(embedder, engine)
            sheddable = asyncio.ensure_future(embedder.embed([[7, 7]], model="m", priority=Priority.SHEDDABLE))
            await until(lambda: recorder.results["miss"] == 2, 10, "two misses")
            critical = asyncio.ensure_future(embedder.embed([[7, 7]], model="m", priority=Priority.CRITICAL))
            await until(lambda: recorder.results["miss"] == 3, 10,
                        "three misses")  # computed, not joined to the sheddable one
            standard = asyncio.ensure_future(embedder.embed([[7, 7]], model="m", priority=Priority.STANDARD))
            await until(lambda: recorder.results["coalesced"] == 1, 10,
                        "one coalesced input")  # joined the critical one
            for _ in range(3):
                engine.gate.release()
            results = await asyncio.gather(blocker, sheddable, critical, standard)
            assert [r.vectors.tolist() for r in results[1:]] == [[[2.0, 7.0]]] * 3
            assert recorder.results == {"hit": 0, "miss": 3, "coalesced": 1}
            assert embedder.inflight_keys == 0

    asyncio.run(main())


def test_an_input_joins_only_a_computation_whose_deadline_is_no_later_than_its_own() -> None:
    """The input a follower waits for must start, if ever, before the follower's own deadline."""

    async def main() -> None:
        engine = GatedEngine()
        async with gated_embedder(engine) as (embedder, recorder):
            blocker = await busy(embedder, engine)
            far = time.perf_counter() + 3600
            late = asyncio.ensure_future(embedder.embed([[7, 7]], model="m", deadline=far + 60))
            await until(lambda: recorder.results["miss"] == 2, 10, "two misses")
            sooner = asyncio.ensure_future(embedder.embed([[7, 7]], model="m", deadline=far))
            await until(lambda: recorder.results["miss"] == 3, 10,
                        "three misses")  # computed, not joined to the one with the later deadline
            for follower in (far + 30, far + 60, None):  # joined: no sooner than the leader's (none: no deadline)
                asyncio.ensure_future(embedder.embed([[7, 7]], model="m", deadline=follower))
            await until(lambda: recorder.results["coalesced"] == 3, 10, "three coalesced inputs")
            none = asyncio.ensure_future(embedder.embed([[8, 8]], model="m"))  # a leader without a deadline
            await until(lambda: recorder.results["miss"] == 4, 10, "four misses")
            bounded = asyncio.ensure_future(embedder.embed([[8, 8]], model="m", deadline=far))
            await until(lambda: recorder.results["miss"] == 5, 10, "five misses")  # not joined to "none"
            for _ in range(5):
                engine.gate.release()
            results = await asyncio.gather(blocker, late, sooner, none, bounded)
            assert [r.vectors.tolist() for r in results[1:]] == [[[2.0, 7.0]]] * 2 + [[[2.0, 8.0]]] * 2
            assert recorder.results == {"hit": 0, "miss": 5, "coalesced": 3}

    asyncio.run(main())


def test_duplicates_in_one_request_are_computed_once_and_the_answer_is_cached() -> None:
    async def main() -> None:
        engine = GatedEngine()
        for _ in range(10):
            engine.gate.release()
        async with gated_embedder(engine) as (embedder, recorder):
            first = await embedder.embed([[5, 1], [6, 1, 1], [5, 1]], model="m")
            assert sum(len(batch) for batch in engine.batches) == 2
            assert recorder.results == {"hit": 0, "miss": 2, "coalesced": 1}
            again = await embedder.embed([[6, 1, 1], [5, 1]], model="m", policy=CacheDirectives())
            assert recorder.results == {"hit": 2, "miss": 2, "coalesced": 1}
            assert again.vectors.tobytes() == first.vectors[[1, 0]].tobytes()
            fresh = await embedder.embed([[5, 1]], model="m", policy=CacheDirectives(no_cache=True))
            assert recorder.results["miss"] == 3 and fresh.vectors.tolist() == [[2.0, 5.0]]

    asyncio.run(main())


@asynccontextmanager
async def gated_embedder(engine: GatedEngine) -> AsyncIterator[tuple[CachedEmbedder, Recorder]]:
    """A cache in front of a real ``ModelBatchers`` (one model, "m") whose engine is ``engine``."""
    with ThreadPoolExecutor(1) as pool:
        batcher = ModelBatchers(["m"], lambda model, batch: engine(batch), executor=pool, observer=Observer(),
                                max_wait_s=0)
        batcher.start()
        recorder = Recorder()
        try:
            yield CachedEmbedder(batcher, InputCache(100 * ENTRY), recorder), recorder
        finally:
            await batcher.stop()


async def busy(embedder: CachedEmbedder, engine: GatedEngine) -> asyncio.Future[Embedded]:
    """A request of one long input, returned once its batch holds the engine (until ``engine.gate``)."""
    blocker = asyncio.ensure_future(embedder.embed([[9] * 50], model="m"))
    await asyncio.get_running_loop().run_in_executor(None, engine.entered.acquire)
    return blocker
