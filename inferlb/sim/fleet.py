"""The simulated workers: k slots and a queue each, and the counters their /metrics would show.

A worker serves a request as one job of ``Fleet.service_s`` seconds at the
speed it has when the job *starts* (the emulated worker's rule), on the first
free of its ``slots``; the rest wait in arrival order, or, when the trace
carries classes, in the workers' own class order with aging (the
simulated worker's ``JobQueue``, ``workers/queue_order.py``).
Nothing else is modelled: no batching across requests, no network, no
rejections by the worker.

The counters are the ones the control plane derives telemetry from
(``control_plane/telemetry/parse.py``'s ``Sample``) and the ones the ORCA header
carries (``cpu_utilization`` and ``rps_fractional`` sampled every
``LOAD_SAMPLE_PERIOD_S`` like ``workers/metrics.py``'s ``LoadSampler``, and
the in-flight count), so the real policies read what they read live.
"""

from __future__ import annotations

from collections import deque

from inferlb.bench.load.scenario import Fleet
from workers.queue_order import JobQueue, QueueOrder

LOAD_SAMPLE_PERIOD_S = 0.5  # workers/service.py samples its CPU and request rate this often


class SimWorker:
    """One worker's queue, slots and cumulative counters (mutable: the engine's hot state)."""

    __slots__ = (
        "_last_busy",
        "_last_completed",
        "_last_sample_at",
        "busy_done_s",
        "completed",
        "cpu_utilization",
        "duration_sum",
        "index",
        "inflight",
        "inputs_total",
        "queue",
        "queue_wait_count",
        "queue_wait_sum",
        "rps",
        "running",
        "running_started_sum",
        "slots",
        "speed",
        "tokens_total",
    )

    def __init__(self, index: int, speed: float, slots: int) -> None:
        self.index = index
        self.speed = speed
        self.slots = slots
        self.running = 0  # jobs on a slot
        self.queue: deque[int] | JobQueue[int] = deque()  # request indices waiting (SimFleet sets the kind)
        self.inflight = 0  # running + queued: the worker's ``inflight_requests`` gauge and ORCA figure
        self.busy_done_s = 0.0  # service seconds of finished jobs
        self.running_started_sum = 0.0  # sum of the start times of running jobs (busy time in O(1))
        self.completed = 0
        self.tokens_total = 0
        self.inputs_total = 0
        self.duration_sum = 0.0  # arrival at the worker to completion
        self.queue_wait_sum = 0.0
        self.queue_wait_count = 0
        # The LoadSampler's last figures (what the ORCA header and the cpu gauge report).
        self.cpu_utilization = 0.0
        self.rps = 0.0
        self._last_busy = 0.0
        self._last_completed = 0
        self._last_sample_at = 0.0

    def busy_s(self, now: float) -> float:
        """Slot-seconds spent serving up to ``now``, running jobs included."""
        return self.busy_done_s + self.running * now - self.running_started_sum

    def sample_load(self, now: float) -> None:
        """The worker's periodic load sample: busy fraction of its slots and completions/s since the last."""
        elapsed = now - self._last_sample_at
        if elapsed <= 0:
            return
        busy = self.busy_s(now)
        self.cpu_utilization = min(1.0, max(0.0, (busy - self._last_busy) / (elapsed * self.slots)))
        self.rps = (self.completed - self._last_completed) / elapsed
        self._last_busy, self._last_completed, self._last_sample_at = busy, self.completed, now


class SimFleet:
    """Every worker plus the scenario's cost curve."""

    def __init__(self, fleet: Fleet, inputs_per_request: int = 1, queue_order: QueueOrder | None = None) -> None:
        """``queue_order``: the workers' queues are ``JobQueue`` s in that order (the trace carries classes);
        None: FIFO."""
        self.spec = fleet
        self.workers = [SimWorker(i, w.speed, w.slots) for i, w in enumerate(fleet.workers)]
        if queue_order is not None:
            for w in self.workers:
                w.queue = JobQueue(queue_order)
        self.inputs_per_request = inputs_per_request
        # service_s = (fixed + per_token * tokens) * scale / speed, with the constants folded once
        self._fixed = fleet.fixed_s * fleet.cost_scale
        self._per_token = fleet.per_token_s * fleet.cost_scale

    def __len__(self) -> int:
        return len(self.workers)

    def work_s(self, tokens: int) -> float:
        """The job's seconds at speed 1; ``service_s`` divides it by the speed (the oracles do too, for the
        same floats)."""
        return self._fixed + self._per_token * tokens * self.inputs_per_request

    def service_s(self, worker: SimWorker, tokens: int) -> float:
        """The job's seconds at the worker's current speed (equal to ``Fleet.service_s``)."""
        return self.work_s(tokens) / worker.speed

    def cost_coefficients(self, worker: SimWorker) -> tuple[float, float]:
        """The worker's own cost fit as its ``batch_cost_seconds`` gauge reports it: (per_token, fixed)."""
        return self._per_token / worker.speed, self._fixed / worker.speed

    def sample_load(self, now: float) -> None:
        for w in self.workers:
            w.sample_load(now)
