"""The debouncer coalesces a burst into one flush and never holds a change past max_delay."""

from __future__ import annotations

import asyncio
import logging

import pytest

from control_plane.debounce import Debouncer
from inferlb_runtime.backoff import Backoff


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


class Failures:
    """A FailureObserver that counts by task."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def task_failed(self, task: str) -> None:
        self.counts[task] = self.counts.get(task, 0) + 1


def test_a_failing_flush_is_logged_counted_and_retried_until_it_succeeds(caplog: pytest.LogCaptureFixture) -> None:
    """Before supervision one exception ended the debouncer's task: nothing was published again."""
    async def main() -> tuple[list[bool], Failures]:
        failures = Failures()
        flushed = asyncio.Event()
        seen_failing: list[bool] = []
        calls = 0
        debouncer: Debouncer

        async def flush() -> None:
            nonlocal calls
            calls += 1
            seen_failing.append(debouncer.publishing.failing)
            if calls <= 3:
                raise RuntimeError(f"publish failure {calls}")
            flushed.set()

        debouncer = Debouncer(flush, delay=0.01, max_delay=0.1, observer=failures,
                              backoff=Backoff(initial_s=0.01, max_s=0.02))
        debouncer.start()
        debouncer.mark()
        await asyncio.wait_for(flushed.wait(), 10)
        assert not debouncer.publishing.failing and debouncer.publishing.last_error is None
        # and it keeps working: a later change is flushed too
        flushed.clear()
        debouncer.mark()
        await asyncio.wait_for(flushed.wait(), 10)
        await debouncer.stop()
        return seen_failing, failures

    with caplog.at_level(logging.ERROR, logger="inferlb.control_plane"):
        seen_failing, failures = asyncio.run(main())
    assert seen_failing == [False, True, True, True, False]
    assert failures.counts == {"publisher": 3}
    errors = [r for r in caplog.records if r.getMessage() == "background task failed; retrying"]
    assert len(errors) == 3 and all(r.exc_info and r.exc_info[0] is RuntimeError for r in errors)
    assert [r.consecutive_failures for r in errors] == [1, 2, 3]  # type: ignore[attr-defined]


def test_while_failing_the_health_says_why() -> None:
    async def main() -> tuple[bool, str | None, int]:
        failed = asyncio.Event()

        async def flush() -> None:
            failed.set()
            raise ValueError("cannot build the snapshot")

        debouncer = Debouncer(flush, delay=0.01, max_delay=0.1, backoff=Backoff(initial_s=10, max_s=10))
        debouncer.start()
        debouncer.mark()
        await asyncio.wait_for(failed.wait(), 10)
        health = debouncer.publishing
        result = health.failing, health.last_error, health.consecutive_failures
        await debouncer.stop()  # cancels the backoff wait: stopping never waits for a retry
        return result

    assert asyncio.run(main()) == (True, "ValueError: cannot build the snapshot", 1)
