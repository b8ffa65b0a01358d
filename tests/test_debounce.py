"""The debouncer coalesces a burst into one flush and never holds a change past max_delay."""

from __future__ import annotations

import asyncio

from control_plane.debounce import Debouncer


def test_a_burst_flushes_once_after_it_ends() -> None:
    async def main() -> int:
        flushed = asyncio.Event()
        count = 0

        async def flush() -> None:
            nonlocal count
            count += 1
            flushed.set()

        debouncer = Debouncer(flush, delay=0.05, max_delay=10)
        debouncer.start()
        for _ in range(20):
            debouncer.mark()
        await asyncio.wait_for(flushed.wait(), 10)
        await debouncer.stop()
        return count

    assert asyncio.run(main()) == 1


def test_a_steady_stream_still_flushes_by_the_cap() -> None:
    async def main() -> int:
        flushed = asyncio.Event()

        async def flush() -> None:
            flushed.set()

        debouncer = Debouncer(flush, delay=0.05, max_delay=0.3)
        debouncer.start()
        marks = 0
        # Keep marking faster than `delay`: only the cap can end the wait.
        while not flushed.is_set():
            debouncer.mark()
            marks += 1
            await asyncio.sleep(0.01)
            assert marks < 10_000, "never flushed"
        await debouncer.stop()
        return marks

    assert asyncio.run(main()) > 1


def test_deadline_is_the_earlier_of_trailing_delay_and_cap() -> None:
    async def noop() -> None:
        return None

    async def main() -> None:
        debouncer = Debouncer(noop, delay=0.1, max_delay=1.0)
        assert debouncer.deadline() is None
        debouncer.mark()
        first = debouncer.deadline()
        assert first is not None
        debouncer._first = (debouncer._first or 0) - 0.95  # the burst began 0.95 s ago
        assert debouncer.deadline() < first  # type: ignore[operator]

    asyncio.run(main())
