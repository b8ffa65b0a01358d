"""The simulated worker's queue-depth gauge follows jobs that leave the queue because their client left.

Before: only a served job reported the depth, and it reported the depth at the moment it was taken, so
when the last jobs to leave were cancelled ones (skipped by their slot), the gauge kept saying they were
queued (CI: test_stragglers_become_timeouts_and_the_run_stays_bounded waited 10 s for a drain that had
happened)."""

from __future__ import annotations

import asyncio

from workers.simulated import Simulation, SlotScheduler


class Recorder:
    """A BatchObserver that keeps the depths it is told and the cancelled inputs."""

    def __init__(self) -> None:
        self.depths: list[int] = []
        self.cancelled = 0

    def batch_done(self, *, size: int, tokens: int, padded_tokens: int, seconds: float) -> None: ...

    def queue_wait(self, seconds: float, priority: object) -> None: ...

    def queue_depth(self, items: int) -> None:
        self.depths.append(items)

    def inputs_cancelled(self, items: int) -> None:
        self.cancelled += items

    def deadline_missed(self) -> None: ...


def test_cancelled_queued_jobs_bring_the_gauge_back_to_zero() -> None:
    async def scenario() -> Recorder:
        recorder = Recorder()
        slots = SlotScheduler(Simulation(fixed_s=0.2, per_token_s=0.0), slots=1, observer=recorder)
        slots.start()
        try:
            running = asyncio.create_task(slots.embed([[1, 2]]))
            waiting = [asyncio.create_task(slots.embed([[3]])) for _ in range(3)]
            while slots.queued != 3:  # the first job is in the slot, three wait behind it
                await asyncio.sleep(0.005)
            for task in waiting:
                task.cancel()
            await running
            await asyncio.gather(*waiting, return_exceptions=True)
            deadline = asyncio.get_running_loop().time() + 10
            # the slot skips the three cancelled jobs; the gauge must come back to 0 (it stayed at 3 before)
            while not (recorder.cancelled == 3 and recorder.depths and recorder.depths[-1] == 0):
                assert asyncio.get_running_loop().time() < deadline, (recorder.cancelled, recorder.depths)
                await asyncio.sleep(0.005)
            return recorder
        finally:
            await slots.stop()

    recorder = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert recorder.cancelled == 3 and recorder.depths[-1] == 0
