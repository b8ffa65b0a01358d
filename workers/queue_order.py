"""The order in which a worker serves what waits in its queue: one rule for every scheduler.

The real worker's ``MicroBatcher``, the simulated worker's ``SlotScheduler``
and the fleet simulator (``inferlb sim``) all rank waiting work with this
module, so a class, an aging step or a tie-break means the same everywhere.
It is pure: the caller passes the clock (``now``, any monotonic seconds), and
it imports nothing but the standard library, so a simulator on a virtual
clock can use it as it is.

The rule:
1. The class: critical (0), standard (1), sheddable (2), strictly, except
   that a class climbs one rank per ``aging_s`` its longest-waiting request
   has waited (since it arrived, or since its last batch), never past
   critical: no class starves. Ties go to the class whose longest-waiting
   request arrived first.
2. Within the chosen class, the scheduling option (``Scheduling``):
   - ``las`` (least attained service, the default): the request that has had
     the least computed for it so far; a request of 2,048 inputs gets one
     batch, then a one-sentence request that arrived meanwhile gets the next.
   - ``round_robin``: the request that has waited longest since its last
     batch; new requests join the end of the round.
   - ``fifo``: arrival order, the whole of one request before the next (the
     old oldest-input-first batcher; the baseline).
   Arrival order (``seq``) breaks every tie.

Aging ranks classes, not requests: were a request to climb on its own, a
large request that had waited ``aging_s`` for its next batch would outrank
a one-sentence request of its own class that had just arrived, and least
attained service would be lost exactly when a worker is busiest.

A request served whole in one go (a simulated job) has attained nothing and
waits since it arrived, so for it all three options are class, then arrival.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import Generic, Iterable, Protocol, TypeVar

from inferlb_runtime.request_class import AGING_S, aged_rank

CLASSES = 3  # critical, standard, sheddable (inferlb_runtime.request_class.Priority)

T = TypeVar("T")


class Scheduling(str, Enum):
    """How a worker orders requests of the same rank (see the module docstring)."""

    LAS = "las"
    ROUND_ROBIN = "round_robin"
    FIFO = "fifo"


SCHEDULINGS = tuple(s.value for s in Scheduling)  # the names a configuration or a flag may give


class Waiting(Protocol):
    """What ``QueueOrder.first`` reads of a waiting request."""

    @property
    def priority(self) -> int: ...  # 0 best

    @property
    def waiting_since(self) -> float: ...  # arrival, or when its last batch was taken

    @property
    def attained(self) -> float: ...  # work computed for it so far (any unit, e.g. padded tokens)

    @property
    def seq(self) -> int: ...  # arrival number


W = TypeVar("W", bound=Waiting)


@dataclass(frozen=True, slots=True)
class QueueOrder:
    """The ordering rule with its parameters."""

    scheduling: Scheduling = Scheduling.LAS
    aging_s: float = AGING_S

    def __post_init__(self) -> None:
        if not self.aging_s > 0:
            raise ValueError(f"aging_s must be > 0, got {self.aging_s}")

    def class_key(self, *, priority: int, oldest_since: float, oldest_seq: int, now: float) -> tuple[int, int]:
        """Sorts the classes that have waiting work, smallest first: the class's rank with aging (from its
        longest-waiting request's ``oldest_since``), then that request's arrival number."""
        return aged_rank(priority, oldest_since, now, self.aging_s), oldest_seq

    def within_key(self, *, waiting_since: float, attained: float, seq: int) -> tuple[float, ...]:
        """Sorts the waiting requests of one class, smallest first."""
        if self.scheduling is Scheduling.LAS:
            return (attained, seq)
        if self.scheduling is Scheduling.ROUND_ROBIN:
            return (waiting_since, seq)
        return (seq,)

    def first(self, waiting: Iterable[W], now: float) -> W:
        """The request to serve next (``ValueError`` when none waits); one pass over ``waiting``."""
        best: dict[int, W] = {}  # class -> its first request
        oldest: dict[int, W] = {}  # class -> its longest-waiting request
        for request in waiting:
            p = request.priority
            if p not in best or self._within(request) < self._within(best[p]):
                best[p] = request
            if p not in oldest or (request.waiting_since, request.seq) < (oldest[p].waiting_since, oldest[p].seq):
                oldest[p] = request
        if not best:
            raise ValueError("first() of no waiting requests")
        chosen = min(oldest, key=lambda p: self.class_key(priority=p, oldest_since=oldest[p].waiting_since,
                                                          oldest_seq=oldest[p].seq, now=now))
        return best[chosen]

    def _within(self, request: Waiting) -> tuple[float, ...]:
        return self.within_key(waiting_since=request.waiting_since, attained=request.attained, seq=request.seq)


class JobQueue(Generic[T]):
    """Waiting jobs that are each served whole, once (a simulated worker's requests), in ``QueueOrder``.

    One deque per class: within a class the oldest job has waited longest, so
    it has the best rank and the smallest arrival number, and the next job is
    the best of the (at most three) heads under ``order.class_key``. Not
    thread-safe: the caller holds its own lock.
    """

    __slots__ = ("_classes", "_order", "_seq", "_size")

    def __init__(self, order: QueueOrder | None = None) -> None:
        self._order = order or QueueOrder()
        self._classes: tuple[deque[tuple[float, int, T]], ...] = tuple(deque() for _ in range(CLASSES))
        self._seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, job: T, priority: int, now: float) -> None:
        """Queue ``job`` of class ``priority`` (0..2), arriving at ``now``."""
        if not 0 <= priority < CLASSES:
            raise ValueError(f"priority must be 0..{CLASSES - 1}, got {priority}")
        self._seq += 1
        self._classes[priority].append((now, self._seq, job))
        self._size += 1

    def take(self, now: float) -> T:
        """The job to serve next, removed from the queue (``IndexError`` when the queue is empty)."""
        best_key: tuple[int, int] | None = None
        best: deque[tuple[float, int, T]] | None = None
        for priority, waiting in enumerate(self._classes):
            if waiting:  # the head is the class's longest-waiting job and its first in every option
                since, seq, _ = waiting[0]
                key = self._order.class_key(priority=priority, oldest_since=since, oldest_seq=seq, now=now)
                if best_key is None or key < best_key:
                    best_key, best = key, waiting
        if best is None:
            raise IndexError("take() from an empty JobQueue")
        self._size -= 1
        return best.popleft()[2]

    def drain(self) -> list[T]:
        """Every waiting job, removed (on shutdown)."""
        jobs = [job for waiting in self._classes for _, _, job in waiting]
        for waiting in self._classes:
            waiting.clear()
        self._size = 0
        return jobs
