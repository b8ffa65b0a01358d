"""The asyncio admission gate (``ext_proc/admission/gate.py``): the fast path, waiting and release in fair order,
cancellation, maximum waits, caps, the recheck task and the observer.

No sleeps and no timing: the clock is a variable, room is a counter the test sets, the recheck task's
sleep is a latch the test opens, and the loop is only ever yielded to a bounded number of times.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from ext_proc.admission.gate import CANCELLED, FairGate, GateSettings, Outcome
from inferlb_runtime.request_class import Priority

C, S, X = int(Priority.CRITICAL), int(Priority.STANDARD), int(Priority.SHEDDABLE)


class Room:
    """The fleet's room as the caller sees it: ``free`` slots, minus the admissions granted but not yet counted."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.fail = False

    def __call__(self, pending: int) -> bool:
        if self.fail:
            raise RuntimeError("telemetry broke")
        return self.free - pending > 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Latch:
    """The recheck task's sleep: it returns when the test opens it."""

    def __init__(self) -> None:
        self.sleeping = 0
        self._event = asyncio.Event()

    async def __call__(self, seconds: float) -> None:
        self.sleeping += 1
        try:
            await self._event.wait()
        finally:
            self.sleeping -= 1
        self._event = asyncio.Event()

    def open(self) -> None:
        self._event.set()


class Recorder:
    def __init__(self) -> None:
        self.depths: list[tuple[str, int]] = []
        self.lefts: list[tuple[str, int, str, float]] = []
        self.rejections: list[tuple[str, int, str]] = []
        self.failures: list[str] = []

    def depth(self, tenant: str, queued: int) -> None:
        self.depths.append((tenant, queued))

    def left(self, tenant: str, priority: int, how: str, waited_s: float) -> None:
        self.lefts.append((tenant, priority, how, waited_s))

    def rejected(self, tenant: str, priority: int, reason: str) -> None:
        self.rejections.append((tenant, priority, reason))

    def task_failed(self, task: str) -> None:
        self.failures.append(task)


async def until(condition: Callable[[], bool], turns: int = 1000) -> None:
    """Yield to the loop until ``condition`` holds (a bounded number of turns, no clock)."""
    for _ in range(turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``test``; a gate that never releases fails it within a generous deadline rather than hanging."""
    asyncio.run(asyncio.wait_for(test(), timeout=60))


class Harness:
    """A gate whose admitted requests take a slot (as the router counts them) and give it back on finish."""

    def __init__(self, free: int = 0, **settings: Any) -> None:
        self.room = Room(free)
        self.clock = Clock()
        self.latch = Latch()
        self.recorder = Recorder()
        self.gate = FairGate(self.room, GateSettings(**settings), observer=self.recorder,
                             failure_observer=self.recorder, clock=self.clock, sleep=self.latch)
        self.admitted: list[str] = []

    async def request(self, name: str, tenant: str, weight: float = 1.0, priority: int = S, cost: float = 1.0,
                      max_wait_s: float | None = None) -> Outcome:
        outcome = await self.gate.admit(tenant, weight, priority, cost, max_wait_s)
        if outcome is Outcome.ADMITTED:
            self.room.free -= 1  # routed: counted by the caller, before any await
            self.admitted.append(name)
        return outcome

    def spawn(self, name: str, tenant: str, **kw: Any) -> asyncio.Task[Outcome]:
        return asyncio.create_task(self.request(name, tenant, **kw))

    def finish(self, n: int = 1) -> None:
        self.room.free += n
        self.gate.notify()

    async def close(self) -> None:
        await self.gate.aclose()


# --- the fast path --------------------------------------------------------------------------------------


def test_the_fast_path_returns_without_waiting_or_touching_the_loop() -> None:
    gate = FairGate(Room(free=1))
    coro = gate.admit("a", 1.0, S, 10.0)
    # driven by hand, outside any event loop: a future, a task or a suspension would fail or not finish here
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    assert done.value.value is Outcome.ADMITTED
    assert gate.waiting == 0


def test_without_room_a_request_waits_until_notified() -> None:
    async def test() -> None:
        h = Harness(free=0)
        task = h.spawn("r1", "a")
        await until(lambda: h.gate.waiting == 1)
        h.gate.notify()  # no room yet: stays
        assert h.gate.waiting == 1 and not task.done()
        h.finish()
        assert await task is Outcome.ADMITTED
        assert h.gate.granted == 0 and h.room.free == 0
        assert h.recorder.depths == [("a", 1), ("a", 0)]
        assert [(t, how) for t, _, how, _ in h.recorder.lefts] == [("a", "admitted")]
        await h.close()

    run(test)


def test_while_others_wait_a_newcomer_queues_even_when_there_is_room() -> None:
    async def test() -> None:
        h = Harness(free=0)
        first = h.spawn("first", "a")
        await until(lambda: h.gate.waiting == 1)
        h.room.free = 1  # room appeared without a notify (telemetry): the newcomer must not jump the queue
        second = h.spawn("second", "b")
        assert await first is Outcome.ADMITTED
        assert not second.done() and h.gate.waiting == 1
        h.finish()
        assert await second is Outcome.ADMITTED
        assert h.admitted == ["first", "second"]
        await h.close()

    run(test)


def test_a_notify_releases_no_more_than_has_room_allows_counting_pending_grants() -> None:
    async def test() -> None:
        h = Harness(free=0)
        tasks = [h.spawn(f"r{i}", "a") for i in range(3)]
        await until(lambda: h.gate.waiting == 3)
        h.finish(1)  # one slot: one grant, although the waiter has not resumed when has_room is asked again
        assert h.gate.granted == 1 and h.gate.waiting == 2
        await until(lambda: len(h.admitted) == 1)
        assert h.gate.waiting == 2
        h.finish(2)
        await asyncio.gather(*tasks)
        assert h.admitted == ["r0", "r1", "r2"]
        await h.close()

    run(test)


def test_released_in_weighted_fair_order_across_tenants() -> None:
    async def test() -> None:
        h = Harness(free=0)
        tasks = [h.spawn(f"heavy{i}", "heavy", weight=1.0) for i in range(30)]
        await until(lambda: h.gate.waiting == 30)
        tasks += [h.spawn(f"vip{i}", "vip", weight=3.0) for i in range(30)]
        await until(lambda: h.gate.waiting == 60)
        for _ in range(40):
            h.finish()
            await until(lambda: h.gate.granted == 0)
        served = [name.rstrip("0123456789") for name in h.admitted]
        assert served.count("vip") == 30 and served.count("heavy") == 10  # 3:1, though heavy queued first
        h.finish(20)
        await asyncio.gather(*tasks)
        await h.close()

    run(test)


def test_critical_is_released_before_standard() -> None:
    async def test() -> None:
        h = Harness(free=0)
        tasks = [h.spawn("standard", "a", priority=S), h.spawn("sheddable", "a", priority=X)]
        await until(lambda: h.gate.waiting == 2)
        tasks.append(h.spawn("critical", "b", priority=C))
        await until(lambda: h.gate.waiting == 3)
        for _ in range(3):
            h.finish()
            await until(lambda: h.gate.granted == 0)
        assert h.admitted == ["critical", "standard", "sheddable"]
        await asyncio.gather(*tasks)
        await h.close()

    run(test)


# --- leaving the queue ----------------------------------------------------------------------------------


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def test() -> None:
        h = Harness(free=0)
        gone = h.spawn("gone", "a")
        stays = h.spawn("stays", "b")
        await until(lambda: h.gate.waiting == 2)
        h.clock.now += 1.5
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert h.gate.waiting == 1
        assert ("a", S, CANCELLED, 1.5) in h.recorder.lefts and ("a", 0) in h.recorder.depths
        h.finish()
        assert await stays is Outcome.ADMITTED and h.admitted == ["stays"]
        await h.close()

    run(test)


def test_a_waiter_cancelled_after_its_grant_hands_the_grant_on() -> None:
    async def test() -> None:
        h = Harness(free=0)
        first = h.spawn("first", "a")
        second = h.spawn("second", "a")
        await until(lambda: h.gate.waiting == 2)
        h.finish()  # granted to first, which has not resumed yet
        assert h.gate.granted == 1
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await second is Outcome.ADMITTED  # the slot first did not use went to the next in line
        assert h.admitted == ["second"] and h.gate.granted == 0
        await h.close()

    run(test)


def test_a_waiter_cancelled_but_not_yet_resumed_is_skipped_without_taking_a_grant() -> None:
    async def test() -> None:
        h = Harness(free=0)
        gone = h.spawn("gone", "a")
        stays = h.spawn("stays", "b")
        await until(lambda: h.gate.waiting == 2)
        gone.cancel()  # its handler runs on its next turn; the release below comes first
        h.finish()
        assert h.gate.granted == 1 and h.gate.waiting == 0  # gone was skipped: the one slot went to stays
        assert await stays is Outcome.ADMITTED
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert h.gate.granted == 0 and h.admitted == ["stays"]
        await h.close()

    run(test)


def test_a_waiter_whose_has_room_raises_does_not_stay_queued() -> None:
    async def test() -> None:
        h = Harness(free=0)
        waiting = h.spawn("waiting", "a")
        await until(lambda: h.gate.waiting == 1)
        h.room.fail = True
        with pytest.raises(RuntimeError, match="telemetry"):
            await h.request("unlucky", "b")
        assert h.gate.waiting == 1 and h.gate._order.queued("b") == 0
        h.room.fail = False
        h.finish()
        assert await waiting is Outcome.ADMITTED
        await h.close()

    run(test)


def test_a_wait_past_the_maximum_ends_timed_out() -> None:
    async def test() -> None:
        h = Harness(free=0, max_wait_s=5.0)
        patient = h.spawn("patient", "a")
        hurried = h.spawn("hurried", "b", max_wait_s=1.0)  # its own budget, shorter than the gate's
        greedy = h.spawn("greedy", "c", max_wait_s=60.0)  # never longer than the gate's
        await until(lambda: h.gate.waiting == 3)
        h.clock.now += 1.0
        h.gate.poll()
        assert await hurried is Outcome.TIMED_OUT
        h.clock.now += 4.0
        h.gate.poll()
        assert await patient is Outcome.TIMED_OUT and await greedy is Outcome.TIMED_OUT
        assert h.gate.waiting == 0 and h.admitted == []
        assert sorted((t, how, w) for t, _, how, w in h.recorder.lefts) == [
            ("a", "timed_out", 5.0), ("b", "timed_out", 1.0), ("c", "timed_out", 5.0)]
        await h.close()

    run(test)


def test_a_request_whose_budget_is_spent_is_not_queued() -> None:
    async def test() -> None:
        h = Harness(free=0)
        assert await h.request("late", "a", max_wait_s=0.0) is Outcome.TIMED_OUT
        assert await h.request("nan", "a", max_wait_s=float("nan")) is Outcome.TIMED_OUT
        assert h.gate.waiting == 0 and [how for _, _, how, _ in h.recorder.lefts] == ["timed_out"] * 2
        await h.close()

    run(test)


def test_caps_refuse_and_a_full_queue_displaces_the_largest_tenant() -> None:
    async def test() -> None:
        h = Harness(free=0, max_queued=4, max_queued_per_tenant=3)
        hog = [h.spawn(f"hog{i}", "hog") for i in range(3)]
        await until(lambda: h.gate.waiting == 3)
        assert await h.request("hog3", "hog") is Outcome.TENANT_FULL
        light = h.spawn("light0", "light")
        await until(lambda: h.gate.waiting == 4)
        # the queue is full: the next light request evicts hog's newest instead of being refused
        light2 = h.spawn("light1", "light")
        assert await hog[2] is Outcome.DISPLACED
        await until(lambda: h.gate.waiting == 4)
        # 2 each now: a third light request is refused, not swapped for a hog's
        assert await h.request("light2", "light") is Outcome.QUEUE_FULL
        assert h.recorder.rejections == [("hog", S, "tenant_full"), ("light", S, "queue_full")]
        assert ("hog", S, "displaced") in [(t, p, how) for t, p, how, _ in h.recorder.lefts]
        h.finish(4)
        assert [await t for t in (hog[0], hog[1], light, light2)] == [Outcome.ADMITTED] * 4
        await h.close()

    run(test)


# --- the recheck task -----------------------------------------------------------------------------------


def test_room_without_a_notify_is_found_by_the_recheck_and_the_task_ends_when_the_queue_empties() -> None:
    async def test() -> None:
        h = Harness(free=0)
        task = h.spawn("r", "a")
        await until(lambda: h.latch.sleeping == 1)
        h.room.free = 1  # room appeared, nobody called notify
        h.latch.open()
        assert await task is Outcome.ADMITTED
        recheck = h.gate._recheck
        assert recheck is not None
        await until(recheck.done)  # nothing waits: it ended instead of polling forever
        assert recheck.exception() is None
        await h.close()

    run(test)


def test_the_recheck_expires_waits_on_the_injected_clock() -> None:
    async def test() -> None:
        h = Harness(free=0, max_wait_s=2.0)
        task = h.spawn("r", "a")
        await until(lambda: h.latch.sleeping == 1)
        h.clock.now += 2.0
        h.latch.open()
        assert await task is Outcome.TIMED_OUT
        await h.close()

    run(test)


def test_a_failing_recheck_is_logged_counted_and_retried_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> None:
        h = Harness(free=0)
        task = h.spawn("r", "a")
        await until(lambda: h.latch.sleeping == 1)
        h.room.fail = True
        h.latch.open()
        await until(lambda: h.recorder.failures != [])  # the step failed: counted...
        assert "background task failed" in caplog.text  # ...and logged with its traceback
        h.room.fail = False
        h.room.free = 1
        # the supervisor retries the step after its backoff (a real, jittered ~0.1 s): wait on the outcome
        assert await asyncio.wait_for(task, timeout=30) is Outcome.ADMITTED
        assert h.recorder.failures[0] == "fair_gate_recheck"
        await h.close()

    run(test)


def test_aclose_stops_the_recheck_task() -> None:
    async def test() -> None:
        h = Harness(free=0)
        task = h.spawn("r", "a")
        await until(lambda: h.latch.sleeping == 1)
        recheck = h.gate._recheck
        await h.close()
        assert recheck is not None and recheck.cancelled()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert h.gate.waiting == 0

    run(test)


def test_nonsense_settings_and_arguments_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        GateSettings(max_wait_s=0)
    with pytest.raises(ValueError, match="recheck_s"):
        GateSettings(recheck_s=-1)

    async def test() -> None:
        gate = FairGate(Room(free=0))
        with pytest.raises(ValueError, match="weight"):
            await gate.admit("a", 0.0, S, 1.0)
        assert gate.waiting == 0

    run(test)

