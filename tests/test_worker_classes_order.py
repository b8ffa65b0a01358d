"""The workers' one queue order (``workers/queue_order.py``) and the schedulers that use it: the simulated
worker's slots serve the best class first with aging (before: FIFO whatever the class), and the real
batcher's scheduling options (las, round_robin, fifo) order requests of one class.

No sleeps and no timing: the simulated slot is held inside its first job by a gate, and the batcher's
engine is the gated recorder of tests/test_batcher.py.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import pytest

from inferlb_runtime.request_class import Priority
from inferlb_runtime.request_class import aged_rank as rank
from workers.config import WorkerConfig, load_config
from workers.queue_order import JobQueue, QueueOrder, Scheduling
from workers.simulated import Simulation, SlotScheduler

from .test_batcher import GatedEngine, _entered, make, open_gate, run, tokens
from .test_sim_slots_queue_depth import Recorder

C, S, X = int(Priority.CRITICAL), int(Priority.STANDARD), int(Priority.SHEDDABLE)


# --- the rule -------------------------------------------------------------------------------------------


def test_rank_climbs_one_class_per_aging_interval_and_stops_at_critical() -> None:
    assert rank(X, waiting_since=10.0, now=10.0, aging_s=2.0) == X
    assert rank(X, waiting_since=10.0, now=11.9, aging_s=2.0) == X
    assert rank(X, waiting_since=10.0, now=12.0, aging_s=2.0) == S
    assert rank(X, waiting_since=10.0, now=100.0, aging_s=2.0) == C


@dataclass
class Req:
    name: str
    priority: int
    waiting_since: float
    attained: float
    seq: int


def served(order: QueueOrder, waiting: list[Req], now: float) -> list[str]:
    """Names in the order ``order.first`` picks them (each leaves once picked)."""
    left, out = list(waiting), []
    while left:
        chosen = order.first(left, now)
        left.remove(chosen)
        out.append(chosen.name)
    return out


@pytest.mark.parametrize("scheduling, expected", [
    (Scheduling.LAS, ["small", "fresh", "big"]),  # least attained first
    (Scheduling.ROUND_ROBIN, ["big", "small", "fresh"]),  # longest since its last batch first
    (Scheduling.FIFO, ["big", "small", "fresh"]),  # arrival order
])
def test_within_a_class_the_scheduling_option_decides(scheduling: Scheduling, expected: list[str]) -> None:
    waiting = [Req("big", S, 1.0, 5000, 1), Req("small", S, 2.0, 10, 2), Req("fresh", S, 3.0, 20, 3)]
    order = QueueOrder(scheduling, aging_s=100.0)
    assert served(order, waiting, now=4.0) == expected
    # a better class goes first, whatever it attained
    assert served(order, [*waiting, Req("vip", C, 3.5, 10**9, 9)], now=4.0)[0] == "vip"


def test_a_request_that_waited_past_the_aging_interval_does_not_overtake_its_own_class() -> None:
    """Before, aging lifted requests: a large request that had waited 2 s for its next batch ranked
    critical and went before a one-sentence request of its class that had just arrived (the hogs
    benchmark's p99 of 669 ms under las)."""
    order = QueueOrder(Scheduling.LAS, aging_s=2.0)
    waiting = [Req("hog", S, 0.0, 5000, 1), Req("sentence", S, 2.9, 0, 2)]
    assert served(order, waiting, now=3.0) == ["sentence", "hog"]


def test_a_class_climbs_with_its_longest_waiting_request() -> None:
    order = QueueOrder(Scheduling.LAS, aging_s=2.0)
    waiting = [Req("standard", S, 1.0, 0, 5), Req("old-sheddable", X, 0.0, 100, 1), Req("new-sheddable", X, 1.0, 0, 6)]
    # at 1.9 s the sheddable class is still last
    assert served(order, waiting, now=1.9)[0] == "standard"
    # at 4 s it ranks critical like standard (aged once) and its longest-waiting request came first: its
    # least-served request goes first
    assert served(order, waiting, now=4.0) == ["new-sheddable", "old-sheddable", "standard"]
    with pytest.raises(ValueError):
        order.first([], now=0.0)


def test_a_bad_aging_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="aging_s"):
        QueueOrder(aging_s=0)


def test_the_job_queue_serves_the_best_class_first_then_arrival_with_aging() -> None:
    q: JobQueue[str] = JobQueue(QueueOrder(aging_s=2.0))
    for job, priority in (("x0", X), ("s1", S), ("c2", C), ("s3", S), ("c4", C)):
        q.push(job, priority, now=0.0)
    assert len(q) == 5
    assert [q.take(0.1) for _ in range(5)] == ["c2", "c4", "s1", "s3", "x0"]
    q.push("old-sheddable", X, now=0.0)
    q.push("standard", S, now=1.0)
    q.push("critical", C, now=1.0)
    assert q.take(1.9) == "critical"
    assert q.take(2.0) == "old-sheddable"  # ranks as standard at 2 s and arrived first
    assert q.take(2.0) == "standard"
    with pytest.raises(IndexError):
        q.take(3.0)
    with pytest.raises(ValueError, match="priority"):
        q.push("bad", 3, now=0.0)
    q.push("a", S, now=0.0)
    q.push("b", X, now=0.0)
    assert sorted(q.drain()) == ["a", "b"] and len(q) == 0


# --- the simulated worker's slots ---------------------------------------------------------------------


class GatedSimulation(Simulation):
    """A simulation whose first job holds its slot until ``release`` (read when the job starts)."""

    def __init__(self) -> None:
        super().__init__(fixed_s=0.0, per_token_s=0.0)
        self.entered = threading.Event()
        self.release = threading.Event()

    def batch_seconds(self, padded_tokens: int) -> float:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the first job"
        return 0.0


def served_order(priorities: list[Priority], order: QueueOrder | None = None) -> list[int]:
    """Indices of ``priorities`` in the order one slot serves them, queued together behind a held job."""
    async def scenario() -> list[int]:
        simulation = GatedSimulation()
        slots = SlotScheduler(simulation, slots=1, observer=Recorder(), order=order)
        slots.start()
        done: list[int] = []
        try:
            busy = asyncio.create_task(slots.embed([[1]]))
            assert await asyncio.to_thread(simulation.entered.wait, 10), "the first job never started"

            async def one(i: int, priority: Priority) -> None:
                await slots.embed([[i + 2]], priority=priority)
                done.append(i)

            tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(priorities)]
            while slots.queued != len(priorities):
                await asyncio.sleep(0)
            simulation.release.set()
            await asyncio.gather(busy, *tasks)
            return done
        finally:
            simulation.release.set()
            await slots.stop()

    return asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_simulated_slot_serves_critical_before_standard_before_sheddable() -> None:
    """Before: the slots served a FIFO, so the sheddable request queued first ran first."""
    order = served_order([Priority.SHEDDABLE, Priority.STANDARD, Priority.CRITICAL, Priority.STANDARD,
                          Priority.CRITICAL])
    assert order == [2, 4, 1, 3, 0]


def test_a_simulated_slot_ages_waiting_requests_up() -> None:
    """With (absurdly) quick aging every waiting job ranks critical at once and arrival order decides."""
    assert served_order([Priority.SHEDDABLE, Priority.STANDARD, Priority.CRITICAL],
                        QueueOrder(aging_s=1e-9)) == [0, 1, 2]


# --- the real batcher's scheduling options ------------------------------------------------------------


def batches_for(scheduling: Scheduling) -> list[list[int]]:
    """Batches of 2 inputs: a large request (8 x 100 tokens), then a short one (5) and another large one
    (6 x 90) queued during its first batch."""
    async def main() -> list[list[int]]:
        engine = GatedEngine()
        batcher, _, executor = make(engine, max_batch_tokens=200, max_batch_size=64, scheduling=scheduling)
        batcher.start()
        try:
            a = asyncio.ensure_future(batcher.embed([tokens(100, 1)] * 8))
            await _entered(engine)
            short = asyncio.ensure_future(batcher.embed([tokens(5, 2)]))
            b = asyncio.ensure_future(batcher.embed([tokens(90, 3)] * 6))
            await asyncio.sleep(0)
            open_gate(engine)
            await asyncio.gather(a, short, b)
            return engine.batches
        finally:
            await batcher.stop()
            executor.shutdown()

    return run(main())


def test_fifo_serves_whole_requests_in_arrival_order() -> None:
    """The baseline, the batcher before fair scheduling: the short request waits for all of the first."""
    assert batches_for(Scheduling.FIFO) == [[100, 100]] * 4 + [[5]] + [[90, 90]] * 3


def test_las_serves_the_least_served_request_next() -> None:
    batches = batches_for(Scheduling.LAS)
    assert batches[:2] == [[100, 100], [5]]
    # then the large ones alternate by attained service: b, having had nothing, goes before a's second batch
    assert batches[2] == [90, 90]


def test_round_robin_gives_each_request_one_batch_in_turn() -> None:
    """The large request rejoined the round when its first batch was taken, before the other two arrived."""
    batches = batches_for(Scheduling.ROUND_ROBIN)
    assert batches[:6] == [[100, 100], [100, 100], [5], [90, 90], [100, 100], [90, 90]]


# --- configuration --------------------------------------------------------------------------------------


def test_scheduling_is_configurable_and_a_bad_one_is_refused_by_name() -> None:
    assert WorkerConfig().scheduling == "las"
    assert load_config(environ={"INFERLB_WORKER_SCHEDULING": "fifo"}).scheduling == "fifo"
    with pytest.raises(ValueError, match="scheduling must be one of las, round_robin, fifo, got 'lifo'"):
        WorkerConfig(scheduling="lifo")
    with pytest.raises(ValueError, match="aging_s must be > 0"):
        WorkerConfig(aging_s=0)
