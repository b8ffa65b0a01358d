"""Micro-batching: grouping by length, budgets, order, failures and the cost model.

The engine is a recording function gated by an event, so batch composition is
deterministic without any sleep.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import pytest

from workers.batcher import BatchCostModel, DeadlineExceeded, MicroBatcher, Priority, QueueFull


class Observer:
    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []
        self.waits: list[float] = []
        self.depths: list[int] = []
        self.cancelled = 0
        self.missed = 0

    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None:
        self.batches.append({"size": size, "tokens": tokens, "padded": padded_tokens})

    def queue_wait(self, seconds: float, priority: Priority) -> None:
        self.waits.append(seconds)

    def queue_depth(self, items: int) -> None:
        self.depths.append(items)

    def inputs_cancelled(self, items: int) -> None:
        self.cancelled += items

    def deadline_missed(self) -> None:
        self.missed += 1


class GatedEngine:
    """Embeds a token array as [len, first id]; each batch waits for ``release``."""

    def __init__(self, fail_on_length: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Semaphore(0)
        self.entered = threading.Semaphore(0)
        self.fail_on_length = fail_on_length

    def __call__(self, batch: list[Sequence[int]]) -> np.ndarray:
        self.entered.release()
        self.gate.acquire()
        self.batches.append([len(t) for t in batch])
        if self.fail_on_length is not None and any(len(t) == self.fail_on_length for t in batch):
            raise RuntimeError("engine failure")
        return np.array([[len(t), t[0]] for t in batch], dtype=np.float32)


def make(engine: GatedEngine, **kw) -> tuple[MicroBatcher, Observer, ThreadPoolExecutor]:  # type: ignore[no-untyped-def]
    observer = Observer()
    executor = ThreadPoolExecutor(1)
    kw.setdefault("max_wait_s", 0.0)
    return MicroBatcher(run_batch=engine, executor=executor, observer=observer, **kw), observer, executor


def tokens(length: int, first: int) -> list[int]:
    return [first] + [1] * (length - 1)


async def _entered(engine: GatedEngine) -> None:
    """Wait until the engine thread is inside a batch (so later inputs must queue)."""
    assert await asyncio.to_thread(engine.entered.acquire, timeout=10), "no batch started"


def open_gate(engine: GatedEngine) -> None:
    """Let every further batch run without waiting."""
    engine.gate.release(1000)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_one_request_split_across_batches_comes_back_in_order() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, observer, executor = make(engine, max_batch_size=3)
        batcher.start()
        inputs = [tokens(n, i) for i, n in enumerate([5, 9, 5, 30, 9, 5, 30, 12, 5, 7])]
        open_gate(engine)
        result = await batcher.embed(inputs)
        assert [int(r[1]) for r in result.vectors] == list(range(10))
        assert [int(r[0]) for r in result.vectors] == [len(t) for t in inputs]
        assert len(engine.batches) >= 4 and all(len(b) <= 3 for b in engine.batches)
        assert result.queue_s >= 0 and result.compute_s >= 0
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_queued_inputs_group_by_length_within_the_token_budget() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, observer, executor = make(engine, max_batch_tokens=1024, max_batch_size=64)
        batcher.start()
        first = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)  # the engine is now busy; everything below queues
        lengths = [8, 200, 10, 190, 9, 256, 12, 200, 8, 11]
        requests = [asyncio.ensure_future(batcher.embed([tokens(n, i)])) for i, n in enumerate(lengths)]
        await asyncio.sleep(0)
        open_gate(engine)
        await first
        await asyncio.gather(*requests)
        for i, r in enumerate(requests):
            assert int(r.result().vectors[0][1]) == i
        batches = engine.batches[1:]
        # The oldest queued input (8 tokens) anchors the next batch: all the short ones go together.
        assert sorted(batches[0]) == [8, 8, 9, 10, 11, 12]
        for batch in batches:
            assert max(batch) * len(batch) <= 1024
            assert sum(batch) >= 0.75 * max(batch) * len(batch)
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_a_failed_batch_fails_its_requests_and_the_batcher_goes_on() -> None:
    async def main() -> None:
        engine = GatedEngine(fail_on_length=7)
        batcher, _, executor = make(engine)
        batcher.start()
        bad = asyncio.ensure_future(batcher.embed([tokens(7, 1)]))
        await _entered(engine)
        engine.gate.release()
        with pytest.raises(RuntimeError, match="engine failure"):
            await bad
        good = asyncio.ensure_future(batcher.embed([tokens(3, 2)]))
        await _entered(engine)
        engine.gate.release()
        assert int((await good).vectors[0][1]) == 2
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_cancelled_requests_are_dropped_from_the_queue() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, observer, executor = make(engine)
        batcher.start()
        busy = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)
        gone = asyncio.ensure_future(batcher.embed([tokens(50, 1)]))
        kept = asyncio.ensure_future(batcher.embed([tokens(6, 2)]))
        await asyncio.sleep(0)
        gone.cancel()
        engine.gate.release()
        await busy
        await _entered(engine)
        engine.gate.release()
        assert int((await kept).vectors[0][1]) == 2
        assert engine.batches == [[4], [6]]
        assert observer.cancelled == 1 and batcher.queued == 0
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_a_full_queue_sheds_load() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, _, executor = make(engine, max_queue_items=3)
        batcher.start()
        busy = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)
        queued = asyncio.ensure_future(batcher.embed([tokens(4, 1)] * 3))
        await asyncio.sleep(0)
        with pytest.raises(QueueFull):
            await batcher.embed([tokens(4, 2)])
        engine.gate.release()
        await busy
        await _entered(engine)
        engine.gate.release()
        assert len((await queued).vectors) == 3
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_a_short_request_waits_for_one_batch_of_a_large_one_not_all_of_it() -> None:
    """Before: each batch was built around the oldest queued input, so all 20 inputs of the large request
    (ten batches here) ran before the short one that arrived during its first batch."""
    async def main() -> None:
        engine = GatedEngine()
        batcher, _, executor = make(engine, max_batch_tokens=200, max_batch_size=64)
        batcher.start()
        large = asyncio.ensure_future(batcher.embed([tokens(100, i) for i in range(20)]))
        await _entered(engine)  # the large request's first batch runs
        short = asyncio.ensure_future(batcher.embed([tokens(5, 99)]))
        await asyncio.sleep(0)
        engine.gate.release()
        await _entered(engine)  # the next batch
        assert engine.batches == [[100, 100]]
        engine.gate.release()
        assert int((await short).vectors[0][1]) == 99
        assert engine.batches == [[100, 100], [5]]
        open_gate(engine)
        assert [int(r[1]) for r in (await large).vectors] == list(range(20))
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_two_large_requests_take_turns() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, _, executor = make(engine, max_batch_tokens=200, max_batch_size=64)
        batcher.start()
        busy = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)
        a = asyncio.ensure_future(batcher.embed([tokens(100, 1)] * 6))
        b = asyncio.ensure_future(batcher.embed([tokens(90, 2)] * 6))
        await asyncio.sleep(0)
        open_gate(engine)
        await asyncio.gather(busy, a, b)
        # Two inputs per batch (200 tokens): b starts long before a's last batch (before: a ran first, whole).
        batches = engine.batches[1:]
        first_b = min(i for i, batch in enumerate(batches) if 90 in batch)
        last_a = max(i for i, batch in enumerate(batches) if 100 in batch)
        assert first_b == 1 and last_a >= 4, batches
        await batcher.stop()
        executor.shutdown()

    run(main())


@pytest.mark.parametrize("aging_s, expected", [(3600.0, [[4], [7], [8], [9]]), (1e-9, [[4], [9], [8], [7]])])
def test_classes_go_in_priority_order_and_waiting_ages_a_request_up(aging_s: float, expected: list) -> None:
    """critical before standard before sheddable; with (absurdly) quick aging every waiting request reaches
    the top class and arrival order decides: nothing starves."""
    async def main() -> None:
        engine = GatedEngine()
        batcher, _, executor = make(engine, max_batch_size=1, aging_s=aging_s)
        batcher.start()
        busy = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)
        waiting = [asyncio.ensure_future(batcher.embed([tokens(n, n)], priority=p))
                   for n, p in ((9, Priority.SHEDDABLE), (8, Priority.STANDARD), (7, Priority.CRITICAL))]
        await asyncio.sleep(0)
        open_gate(engine)
        await asyncio.gather(busy, *waiting)
        assert engine.batches == expected
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_a_request_whose_deadline_passes_in_the_queue_never_runs() -> None:
    async def main() -> None:
        engine = GatedEngine()
        batcher, observer, executor = make(engine)
        batcher.start()
        with pytest.raises(DeadlineExceeded, match="had passed when it arrived"):
            await batcher.embed([tokens(5, 1)], deadline=time.perf_counter())
        busy = asyncio.ensure_future(batcher.embed([tokens(4, 0)]))
        await _entered(engine)
        deadline = time.perf_counter() + 0.001
        late = asyncio.ensure_future(batcher.embed([tokens(6, 2)], deadline=deadline))
        kept = asyncio.ensure_future(batcher.embed([tokens(7, 3)]))
        while time.perf_counter() <= deadline:  # the condition itself: the deadline has passed
            await asyncio.sleep(0.001)
        open_gate(engine)
        with pytest.raises(DeadlineExceeded, match="while its inputs waited"):
            await late
        await asyncio.gather(busy, kept)
        assert engine.batches == [[4], [7]]
        assert observer.missed == 2 and batcher.queued == 0
        await batcher.stop()
        executor.shutdown()

    run(main())


def test_cost_model_recovers_per_token_and_fixed_cost() -> None:
    model = BatchCostModel()
    for tokens_ in [16, 64, 256, 1024, 32, 512, 128]:
        model.observe(tokens_, 0.002 + 0.00005 * tokens_)
    a, b = model.coefficients()
    assert a == pytest.approx(0.00005, rel=1e-3)
    assert b == pytest.approx(0.002, rel=1e-3)


def test_window_follows_fixed_cost_and_idle_workers_do_not_wait() -> None:
    engine = GatedEngine()
    batcher, _, executor = make(engine, max_wait_s=0.003)
    assert batcher.window() == 0.0  # nothing observed yet: never wait
    for tokens_ in [16, 64, 256, 1024]:
        batcher.cost.observe(tokens_, 0.001 + 0.00005 * tokens_)
    assert batcher.window() == pytest.approx(0.001, rel=1e-3)
    for tokens_ in [16, 64, 256, 1024]:
        batcher.cost.observe(tokens_, 0.010 + 0.00005 * tokens_)
    assert batcher.window() == 0.003  # capped
    executor.shutdown()
