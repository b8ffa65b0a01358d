"""Admission when the fleet is saturated: requests wait here, before routing, and leave in fair order.

``FairGate.admit`` is called per request, after its tokens are counted and
before the router picks an endpoint. While the queue is empty and the
caller's ``has_room`` says the fleet can take one more, it returns
``ADMITTED`` at once: one call, no future, no loop (thousands a second pass
so). Otherwise the request waits in ``fair_order.FairOrder`` (priority
bands with aging, then weighted fair queuing across tenants, FIFO within a
tenant) and is released as capacity frees:

- ``notify()`` (the caller calls it when a request finishes) releases
  waiting entries in order while ``has_room`` holds;
- because room can also appear without a finish (telemetry shows a worker
  freed, an endpoint joined), a recheck task polls every ``recheck_s``
  while anything waits, and ends when the queue is empty. It runs its step
  under ``inferlb_runtime.supervision.Supervised``: a failure is logged,
  counted and retried, never silent. ``poll()`` is that step, public so a
  test can drive it on an injected clock.

``has_room(pending)`` gets the number of admissions granted whose callers
have not resumed yet: a released waiter runs on a later loop turn, so the
caller's own bookkeeping (its router's outstanding requests) has not
counted it. The caller must therefore count an admitted request before its
next ``await`` (route it right after ``admit`` returns). ``has_room`` is
called often (per request on the fast path): keep it O(1), and it should
not raise (an exception reaches whoever called admit or notify; the waiter
whose admit raised leaves the queue).

The cost is the caller's choice, one unit per gate; ext_proc passes the
request's exact token count. Tokens are known before routing (the
predicted service seconds are per endpoint, and no endpoint is picked
yet), they are the unit of the tenants' quotas, so a weight and a quota
speak of the same thing, and they do not move with a learnt cost model a
client could skew. A worker's time is about ``a + b * tokens``; a caller
that wants the fixed part charged passes ``tokens + a / b``.

Outcomes: ``ADMITTED``; ``TIMED_OUT`` (waited its maximum wait),
``QUEUE_FULL`` / ``TENANT_FULL`` (refused at the door) and ``DISPLACED``
(evicted from a full queue because its tenant held the most). The caller
turns the others into a 429 or lets a critical request through anyway; the
gate does not decide. A waiter whose stream is cancelled leaves the queue
(``CancelledError`` removes its entry); if it was already granted, the
grant is handed to the next waiter.

The GIE flow control's shape, kept: a flow is (tenant, priority); bands are
served best first; a rejection before queuing is told apart from an
eviction after it; the saturation check is the caller's. Not kept: its
per-shard actor goroutine (one asyncio loop already serialises us) and its
byte-sized capacity (entries are bounded by count; the body size is capped
upstream).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from inferlb_runtime.request_class import AGING_S
from inferlb_runtime.supervision import FailureObserver, Supervised

from .order import Entry, FairOrder, Refusal

log = logging.getLogger("inferlb.ext_proc.fair_queue")

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[object]]


class Outcome(str, Enum):
    """How ``admit`` ended; the values are metric labels."""

    ADMITTED = "admitted"
    TIMED_OUT = "timed_out"
    QUEUE_FULL = Refusal.QUEUE_FULL.value
    TENANT_FULL = Refusal.TENANT_FULL.value
    DISPLACED = Refusal.DISPLACED.value


CANCELLED = "cancelled"  # the ``left`` label of a waiter whose client went away (not an Outcome: it raises)


class GateObserver(Protocol):
    """What the gate reports (``ext_proc/metrics.py`` implements it); every call is on the event loop.

    Fast-path admissions are not reported: they never queued (count them with the requests)."""

    def depth(self, tenant: str, queued: int) -> None:
        """``tenant`` now has ``queued`` entries waiting (0: it has none)."""

    def left(self, tenant: str, priority: int, how: str, waited_s: float) -> None:
        """A queued entry left after ``waited_s``: ``how`` is ``admitted``, ``timed_out``, ``displaced``
        or ``cancelled``."""

    def rejected(self, tenant: str, priority: int, reason: str) -> None:
        """An entry was refused at push: ``reason`` is ``queue_full`` or ``tenant_full``."""


class NoObserver:
    """The default observer: reports nowhere."""

    def depth(self, tenant: str, queued: int) -> None:
        pass

    def left(self, tenant: str, priority: int, how: str, waited_s: float) -> None:
        pass

    def rejected(self, tenant: str, priority: int, reason: str) -> None:
        pass


@dataclass(frozen=True)
class GateSettings:
    """The gate's bounds (configuration: ``[ext_proc]``, when the caller wires it)."""

    max_wait_s: float = 5.0  # the default maximum wait; admit() may pass a shorter one (a request's budget)
    max_queued: int = 10_000
    max_queued_per_tenant: int = 1_000
    aging_s: float | None = AGING_S  # None: strict priority bands
    recheck_s: float = 0.05  # how often has_room is polled, and waits expired, while anything waits
    # Within a tenant: None, first in first out; else the least work first, aged at this many tokens a second
    # (fair_order.py): a request of n tokens is overtaken only by those arriving within n / size_rate s of it.
    size_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s}")
        if not self.recheck_s > 0:
            raise ValueError(f"recheck_s must be > 0, got {self.recheck_s}")


class FairGate:
    """Weighted fair admission across tenants (see the module docstring). One asyncio loop owns it."""

    def __init__(self, has_room: Callable[[int], bool], settings: GateSettings = GateSettings(), *,
                 fits: Callable[[float, float], bool] | None = None,
                 observer: GateObserver | None = None, failure_observer: FailureObserver | None = None,
                 clock: Clock = time.monotonic, sleep: Sleep = asyncio.sleep) -> None:
        """``has_room(pending)``: room for one more request, ``pending`` admitted but not yet routed.
        ``fits(pending_cost, cost)``, when given: room for a request of ``cost`` too (room in work, not in
        requests: a short request fits in a gap a long one does not); a request passes when either says so."""
        self.settings = settings
        self._has_room = has_room
        self._fits = fits
        self._order: FairOrder[asyncio.Future[Outcome]] = FairOrder(
            settings.max_queued, settings.max_queued_per_tenant, settings.aging_s, settings.size_rate)
        self._observer: GateObserver = observer or NoObserver()
        self._clock = clock
        self._sleep = sleep
        self._supervised = Supervised("fair_gate_recheck", observer=failure_observer, logger=log)
        self._granted = 0  # released waiters that have not resumed yet
        self._granted_cost = 0.0  # their cost
        self._labels: dict[str, int] = {}  # entries queued by metric label (a tenant; its flows are clients)
        self._recheck: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """How many requests wait."""
        return len(self._order)

    @property
    def granted(self) -> int:
        """Admissions released to waiters that have not resumed yet (``has_room``'s argument)."""
        return self._granted

    def passes_now(self, cost: float = 0.0) -> bool:
        """Whether :meth:`admit` would return at once (nothing waits and there is room for ``cost``): the
        caller may have to warn its peer of a wait first (ext_proc extends Envoy's message timeout).

        Counting room in work (``fits``), a request need only wait behind requests of its size or smaller:
        a larger one waiting for room for itself does not hold a short one that fits now (the workers serve
        the least attained service first, so it would not have run first there either)."""
        if not self._order:
            return self._room(cost)
        return self._fits is not None and not self._order.waiting_no_larger(cost) and self._room(cost)

    def _room(self, cost: float) -> bool:
        fits = self._fits
        return self._has_room(self._granted) or (fits is not None and fits(self._granted_cost, cost))

    def work_ahead(self, tenant: str, weight: float, priority: int, cost: float) -> float:
        """The queued work that would go before a request of this flow, class and cost arriving now
        (``FairOrder.work_ahead``), for a caller that predicts its wait."""
        return self._order.work_ahead(tenant, weight, priority, cost, self._clock())

    async def admit(self, tenant: str, weight: float, priority: int, cost: float,
                    max_wait_s: float | None = None, label: str | None = None) -> Outcome:
        """Wait for this request's turn; ``tenant`` names its flow (a tenant, or one client of one), ``label``
        what the metrics call it (default: ``tenant``); ``cost`` in the queue's unit (tokens), ``max_wait_s``
        at most the settings' (None: theirs). ``ValueError`` for a weight, cost or priority that means
        nothing."""
        if self.passes_now(cost):  # the fast path: nothing waits, room
            return Outcome.ADMITTED
        return await self._wait(tenant, weight, priority, cost, max_wait_s, label or tenant)

    def notify(self) -> None:
        """Room may have freed (a request finished): release waiters in order while ``has_room`` holds."""
        if self._order:
            self._release(self._clock())

    def poll(self) -> None:
        """Refuse the waits that ran out, then release what ``has_room`` allows (the recheck step)."""
        now = self._clock()
        for entry in self._order.expire(now):
            self._left(entry, Outcome.TIMED_OUT, now)
        self._release(now)

    async def aclose(self) -> None:
        """Stop the recheck task (on shutdown; waiters are ended by their streams)."""
        task, self._recheck = self._recheck, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])  # never raises the task's CancelledError into us

    # -- the slow path ---------------------------------------------------------------------------------

    async def _wait(self, tenant: str, weight: float, priority: int, cost: float,
                    max_wait_s: float | None, label: str) -> Outcome:
        now = self._clock()
        limit = self.settings.max_wait_s if max_wait_s is None else min(max_wait_s, self.settings.max_wait_s)
        if not limit > 0:  # its budget is already spent (or NaN): no point queuing it
            self._observer.left(label, priority, Outcome.TIMED_OUT.value, 0.0)
            return Outcome.TIMED_OUT
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        entry = Entry(tenant, weight, priority, cost, now, limit, future, label=label)
        refusal = self._order.push(entry)
        if refusal is Refusal.QUEUE_FULL:
            victim = self._order.make_room(tenant)
            if victim is not None:
                self._left(victim, Outcome.DISPLACED, now)
                refusal = self._order.push(entry)
        if refusal is not None:
            self._observer.rejected(label, priority, refusal.value)
            return Outcome(refusal.value)
        self._counted(label, 1)
        try:
            self._release(now)  # room may be there already (only the queue was not empty): maybe this entry
            if self._order:
                self._start_recheck()
            outcome = await future
        except BaseException:  # cancelled (the client left), or has_room raised: never leave it queued
            self._abandoned(entry)
            raise
        if outcome is Outcome.ADMITTED:
            self._granted -= 1
            self._granted_cost -= entry.cost
        return outcome

    def _abandoned(self, entry: Entry[asyncio.Future[Outcome]]) -> None:
        """The waiter is gone (its stream was cancelled): leave the queue, or hand on a grant it cannot use."""
        now = self._clock()
        if self._order.remove(entry):
            self._counted(entry.label, -1)
            self._observer.left(entry.label, entry.priority, CANCELLED, now - entry.arrived)
            return
        future = entry.payload
        if future.done() and not future.cancelled() and future.result() is Outcome.ADMITTED:
            self._granted -= 1
            self._granted_cost -= entry.cost
            if self._order:
                self._release(now)

    def _release(self, now: float) -> None:
        """Let waiters through in order while the next one has room (the next in order, not a smaller one
        behind it: the order is the fairness)."""
        order = self._order
        while order:
            head = order.peek(now)
            assert head is not None  # the queue is not empty
            if not self._room(head.cost):
                return
            order.pop(now)
            if self._left(head, Outcome.ADMITTED, now):
                self._granted += 1
                self._granted_cost += head.cost

    def _left(self, entry: Entry[asyncio.Future[Outcome]], outcome: Outcome, now: float) -> bool:
        """Resolve a waiter taken out of the queue; False when its task was cancelled meanwhile (its
        handler, which has not run yet, finds the entry gone and its future cancelled: nothing to do)."""
        self._counted(entry.label, -1)
        if entry.payload.done():
            return False
        entry.payload.set_result(outcome)
        self._observer.left(entry.label, entry.priority, outcome.value, now - entry.arrived)
        return True

    def _counted(self, label: str, change: int) -> None:
        """Entries queued per metric label: a tenant's flows (its clients) add up to one series."""
        queued = self._labels.get(label, 0) + change
        if queued:
            self._labels[label] = queued
        else:
            self._labels.pop(label, None)
        self._observer.depth(label, queued)

    def _start_recheck(self) -> None:
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.get_running_loop().create_task(self._recheck_while_waiting(),
                                                                   name="fair-gate-recheck")

    async def _recheck_while_waiting(self) -> None:
        while self._order:
            await self._sleep(self.settings.recheck_s)
            await self._supervised.run(self._poll_step)

    async def _poll_step(self) -> None:
        self.poll()
