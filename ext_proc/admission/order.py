"""The order in which requests waiting at admission are let through: priority bands, then fair shares.

When the fleet is saturated, ext_proc holds requests before routing them
(``admission/gate.py``, the asyncio gate) and releases them as capacity frees,
in this order. It is pure: the caller passes the clock (``now``, any
monotonic seconds, and each entry's arrival time), and it imports nothing
but the standard library, so a simulation on a virtual clock can use it as
it is.

The rule:

1. **The band**: critical (0), standard (1), sheddable (2)
   (``inferlb_runtime.request_class.Priority``), strictly, except that a
   band climbs one rank per ``aging_s`` its longest-waiting entry has
   waited, never past critical; ties go to the band whose longest-waiting
   entry arrived first. This is the workers' rule (``workers/queue_order.py``)
   so a class means the same at admission and in a worker's queue. The
   Gateway API Inference Extension's flow control serves bands strictly;
   aging is kept here because a band of critical load that saturates the
   fleet would otherwise hold every standard request until its maximum wait
   and turn it into a 429. ``aging_s=None`` serves the bands strictly.
2. **The tenant**, within the band: weighted fair queuing by virtual finish
   time, self-clocked (SCFQ, Golestani 1994). Each tenant with waiting work
   is a flow; only its head carries a tag, ``finish = start + cost / weight``,
   where ``start`` is the finish tag of the tenant's previous request
   released while it stayed backlogged, or the band's virtual time (the
   finish tag of the last entry released) when the tenant was idle. The
   head with the smallest finish tag goes first; the head that arrived
   first breaks a tie. So two backlogged tenants are served costs in the
   ratio of their weights, to within one request's cost of each; a tenant
   that was idle banks no credit (it starts at the current virtual time);
   and a tenant with 1,000 requests queued delays a newcomer by at most its
   weight's worth of requests per round, because only its head competes.
3. **Within a tenant**: first in, first out; or, with ``size_rate`` (tokens per second), the least work
   first with aging: an entry's key is ``arrived + cost / size_rate`` and the smallest key goes first.
   The key does not move with the clock, yet it ages: a request of cost ``c`` is overtaken only by
   requests that arrive less than ``c / size_rate`` seconds after it, so a large one is never starved,
   and a one-sentence request does not wait behind every batch its own client queued before it (every
   caller without a key is one client per address, but one address may send both). With one flow per
   tenant, this is the order of the tenant's own requests only: the order between tenants stays the
   weighted fair one above.

Tags are given lazily, to heads only (the entry its flow would send next): a request that leaves from the middle
(its client left, its wait ran out) leaves no hole in its tenant's tags,
and a head that leaves hands its start tag to the next one. A tenant with
nothing queued keeps no state: its last finish tag can never exceed the
virtual time once it is released, so nothing is lost.

The unit of ``cost`` is the caller's: every entry of one queue must use the
same one (tokens, or predicted service seconds). ``weight`` is any positive
number; a tenant's weight is read from each entry, so a changed weight
applies from its next request.

Bounded: at most ``max_queued`` entries in all and ``max_per_tenant`` per
tenant (all bands); ``push`` refuses beyond them. When the whole queue is
full, ``make_room`` evicts the newest entry of the tenant holding the most
(longest queue drop), so a tenant below the others can still queue: a
tenant within its quota cannot fill the shared queue and crowd the rest out.

Not thread-safe: one asyncio loop (or one simulation) owns an instance.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from inferlb_runtime.request_class import AGING_S, aged_rank

from ..model import SIZE_BOUNDS, size_bucket

BANDS = 3  # critical, standard, sheddable
_COMPACT_SLACK = 64  # a heap is rebuilt when its stale items outnumber its live ones by more than this

T = TypeVar("T")


class Refusal(str, Enum):
    """Why an entry is not (or no longer) queued; the values are metric labels."""

    TENANT_FULL = "tenant_full"  # its tenant already has max_per_tenant queued
    QUEUE_FULL = "queue_full"  # max_queued are queued in all
    DISPLACED = "displaced"  # evicted by make_room: its tenant held the most of a full queue


@dataclass(eq=False, slots=True)
class Entry(Generic[T]):
    """One waiting request. Identity is the object (two equal requests are two entries)."""

    tenant: str
    weight: float  # the tenant's share: > 0
    priority: int  # 0 critical, 1 standard, 2 sheddable
    cost: float  # > 0, in the queue's unit
    arrived: float  # the caller's clock
    max_wait_s: float  # > 0 (math.inf: no limit)
    payload: T  # what the caller needs back (the gate's future)
    seq: int = 0  # arrival number, set by push
    finish: float = 0.0  # the virtual finish tag, set when it becomes its tenant's head
    queued: bool = False
    key: float = 0.0  # its order within its tenant's flow (smallest first), set by push
    label: str = ""  # what metrics call its tenant (a flow may be one client of a tenant); "": the tenant

    @property
    def deadline(self) -> float:
        return self.arrived + self.max_wait_s


class _Flow:
    """One tenant's waiting entries in one band, a heap by (key, seq); ``start`` is its head's virtual start
    tag, ``work`` the cost it holds."""

    __slots__ = ("entries", "start", "work")

    def __init__(self, start: float) -> None:
        self.entries: list[tuple[float, int, Entry]] = []
        self.start = start
        self.work = 0.0

    @property
    def head(self) -> Entry:
        return self.entries[0][2]

    def push(self, entry: Entry) -> bool:
        """Add ``entry``; True when it is the new head."""
        heapq.heappush(self.entries, (entry.key, entry.seq, entry))
        self.work += entry.cost
        return self.entries[0][2] is entry

    def pop(self) -> Entry:
        entry = heapq.heappop(self.entries)[2]
        self.work -= entry.cost
        return entry

    def remove(self, entry: Entry) -> None:
        """O(its flow): an entry leaving from the middle (its client left, its wait ran out)."""
        index = next(i for i, item in enumerate(self.entries) if item[2] is entry)
        last = self.entries.pop()
        if index < len(self.entries):
            self.entries[index] = last
            heapq.heapify(self.entries)
        self.work -= entry.cost

    def ahead(self, key: float) -> float:
        """The work of its entries that go before a new one of ``key``."""
        return sum(item[2].cost for item in self.entries if item[0] <= key)

    def newest(self) -> Entry:
        return max(self.entries, key=lambda item: item[1])[2]


class _Band:
    """One priority band: its tenants' flows, their heads by finish tag, and its entries by arrival."""

    __slots__ = ("flows", "heads", "arrivals", "vtime", "work")

    def __init__(self) -> None:
        self.work = 0.0  # the cost of every entry queued in it
        self.flows: dict[str, _Flow] = {}
        # (finish tag, head's seq, flow); an item whose seq is no longer its flow's head is stale
        self.heads: list[tuple[float, int, _Flow]] = []
        self.arrivals: OrderedDict[Entry, None] = OrderedDict()  # the first is the longest-waiting
        self.vtime = 0.0


class _TenantCounts:
    """Queued entries per tenant, and a tenant holding the most, each in O(1)."""

    __slots__ = ("count", "_holding", "most")

    def __init__(self) -> None:
        self.count: dict[str, int] = {}
        self._holding: dict[int, dict[str, None]] = {}  # n -> the tenants with n queued (ordered)
        self.most = 0

    def add(self, tenant: str) -> None:
        n = self.count.get(tenant, 0)
        if n:
            self._unhold(tenant, n)
        n += 1
        self.count[tenant] = n
        self._holding.setdefault(n, {})[tenant] = None
        if n > self.most:
            self.most = n

    def sub(self, tenant: str) -> None:
        n = self.count[tenant]
        self._unhold(tenant, n)
        n -= 1
        if n:
            self.count[tenant] = n
            self._holding.setdefault(n, {})[tenant] = None
        else:
            del self.count[tenant]
        while self.most and self.most not in self._holding:  # at most one step: the tenant is at n - 1
            self.most -= 1

    def largest(self) -> str | None:
        return next(iter(self._holding[self.most])) if self.most else None

    def _unhold(self, tenant: str, n: int) -> None:
        holding = self._holding[n]
        del holding[tenant]
        if not holding:
            del self._holding[n]


class FairOrder(Generic[T]):
    """The admission queue's order (see the module docstring). ``aging_s=None``: strict bands."""

    __slots__ = ("max_queued", "max_per_tenant", "aging_s", "size_rate", "_bands", "_counts", "_deadlines", "_seq",
                 "_size", "_by_size")

    def __init__(self, max_queued: int = 10_000, max_per_tenant: int = 1_000,
                 aging_s: float | None = AGING_S, size_rate: float | None = None) -> None:
        if max_queued < 1 or max_per_tenant < 1:
            raise ValueError(f"max_queued and max_per_tenant must be >= 1, got {max_queued}, {max_per_tenant}")
        if aging_s is not None and not aging_s > 0:
            raise ValueError(f"aging_s must be > 0 or None, got {aging_s}")
        if size_rate is not None and not (math.isfinite(size_rate) and size_rate > 0):
            raise ValueError(f"size_rate must be a positive number or None, got {size_rate}")
        self.size_rate = size_rate  # None: first in, first out within a tenant
        self.max_queued = max_queued
        self.max_per_tenant = max_per_tenant
        self.aging_s = aging_s
        self._bands = tuple(_Band() for _ in range(BANDS))
        self._counts = _TenantCounts()
        self._deadlines: list[tuple[float, int, Entry[T]]] = []  # (deadline, seq, entry); left ones are stale
        self._seq = 0
        self._size = 0
        self._by_size = [0] * (len(SIZE_BOUNDS) + 1)  # entries queued by size bucket (model.SIZE_BOUNDS)

    def __len__(self) -> int:
        return self._size

    def queued(self, tenant: str) -> int:
        """How many entries ``tenant`` has queued (all bands)."""
        return self._counts.count.get(tenant, 0)

    def push(self, entry: Entry[T]) -> Refusal | None:
        """Queue ``entry``; None when queued, else why not (it is then left unqueued).

        ``ValueError`` for a weight, cost, priority or maximum wait that means nothing: those come from
        the caller's configuration and code, never from a client, so they are a bug to surface."""
        if entry.queued:
            raise ValueError("push() of an entry that is already queued")
        _check(entry)
        if self._counts.count.get(entry.tenant, 0) >= self.max_per_tenant:
            return Refusal.TENANT_FULL
        if self._size >= self.max_queued:
            return Refusal.QUEUE_FULL
        self._seq += 1
        entry.seq = self._seq
        entry.queued = True
        entry.key = self.key(entry.cost, entry.arrived)
        band = self._bands[entry.priority]
        flow = band.flows.get(entry.tenant)
        if flow is None:  # idle until now: no credit banked, it starts at the band's virtual time
            flow = band.flows[entry.tenant] = _Flow(band.vtime)
        if flow.push(entry):  # its flow's new head (it overtook the one tagged before: that tag is stale)
            self._tag_head(band, flow)
        band.work += entry.cost
        self._by_size[size_bucket(entry.cost)] += 1
        band.arrivals[entry] = None
        self._counts.add(entry.tenant)
        self._size += 1
        heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry))
        return None

    def peek(self, now: float) -> Entry[T] | None:
        """The entry :meth:`pop` would return, left queued."""
        band = self._next_band(now)
        return self._top(band)[2].head if band is not None else None

    def pop(self, now: float) -> Entry[T] | None:
        """The next entry to let through, removed; None when nothing waits."""
        band = self._next_band(now)
        if band is None:
            return None
        self._top(band)  # the live head on top
        finish, _, flow = heapq.heappop(band.heads)
        entry = flow.pop()
        band.vtime = finish
        if flow.entries:
            flow.start = finish  # still backlogged: its next request starts where this one finished
            self._tag_head(band, flow)
        else:
            del band.flows[entry.tenant]
        self._forget(band, entry)
        return entry

    def remove(self, entry: Entry[T]) -> bool:
        """Take ``entry`` out (its client left); False when it was not queued. O(its tenant's queue)."""
        if not entry.queued:
            return False
        band = self._bands[entry.priority]
        flow = band.flows[entry.tenant]
        was_head = flow.head is entry
        flow.remove(entry)
        if not flow.entries:
            del band.flows[entry.tenant]
        elif was_head:  # the next one inherits the start tag: the one that left was never served
            self._tag_head(band, flow)
        self._forget(band, entry)
        return True

    def expire(self, now: float) -> list[Entry[T]]:
        """Every queued entry whose maximum wait has run out by ``now``, removed, oldest deadline first."""
        expired: list[Entry[T]] = []
        while self._deadlines and self._deadlines[0][0] <= now:  # remove() may compact: read it anew
            entry = heapq.heappop(self._deadlines)[2]
            if self.remove(entry):
                expired.append(entry)
        return expired

    def make_room(self, tenant: str) -> Entry[T] | None:
        """When the queue is full: evict and return the newest entry (of its worst band) of the tenant
        holding the most entries, if it holds more than ``tenant`` would after one more push; else None."""
        largest = self._counts.largest()
        if largest is None or self._counts.count[largest] <= self.queued(tenant) + 1:
            return None
        for band in reversed(self._bands):
            flow = band.flows.get(largest)
            if flow is not None:
                victim = flow.newest()
                self.remove(victim)
                return victim
        raise AssertionError(f"tenant {largest!r} is counted but has no flow")  # pragma: no cover

    def waiting_no_larger(self, cost: float) -> bool:
        """Whether an entry of a size (bucket) no larger than ``cost`` waits."""
        return any(self._by_size[: size_bucket(cost) + 1])

    def key(self, cost: float, arrived: float) -> float:
        """An entry's order within its flow: its arrival, plus its cost's worth of aging (size_rate)."""
        return arrived if self.size_rate is None else arrived + cost / self.size_rate

    def work_ahead(self, tenant: str, weight: float, priority: int, cost: float, arrived: float) -> float:
        """The queued work (in the cost's unit) that would go before a new entry of this tenant, class, cost
        and arrival: every better band's, the entries of its own flow with a smaller key, and from each other
        flow of its band the share weighted fair queuing gives it meanwhile (its weight's worth of the work
        ahead of the new one, at most what it holds). An estimate (aging moves bands; new arrivals come),
        O(the flows of its band and its own flow's entries); for the caller to refuse at once a request
        that cannot get its turn in time."""
        ahead = sum(band.work for band in self._bands[:priority])
        band = self._bands[priority]
        own = band.flows.get(tenant)
        mine = own.ahead(self.key(cost, arrived)) if own is not None else 0.0
        turns = (mine + cost) / weight
        for name, flow in band.flows.items():
            if name != tenant:
                ahead += min(flow.work, turns * flow.head.weight)
        return ahead + mine

    # -- internals ---------------------------------------------------------------------------------------

    def _next_band(self, now: float) -> _Band | None:
        best: _Band | None = None
        best_key: tuple[int, int] = (BANDS, 0)
        for priority, band in enumerate(self._bands):
            if band.arrivals:
                oldest = next(iter(band.arrivals))
                rank = priority if self.aging_s is None else aged_rank(priority, oldest.arrived, now, self.aging_s)
                key = (rank, oldest.seq)
                if best is None or key < best_key:
                    best, best_key = band, key
        return best

    @staticmethod
    def _top(band: _Band) -> tuple[float, int, _Flow]:
        """The band's next head, dropping stale items first (a head that left, or was overtaken and
        re-tagged)."""
        heads = band.heads
        while True:
            finish, seq, flow = heads[0]
            if flow.entries and flow.head.seq == seq:
                return heads[0]
            heapq.heappop(heads)

    def _tag_head(self, band: _Band, flow: _Flow) -> None:
        head = flow.head
        head.finish = flow.start + head.cost / head.weight
        heapq.heappush(band.heads, (head.finish, head.seq, flow))
        if len(band.heads) > 2 * len(band.flows) + _COMPACT_SLACK:  # many heads left: drop the stale items
            band.heads = [(f.head.finish, f.head.seq, f) for f in band.flows.values()]
            heapq.heapify(band.heads)

    def _forget(self, band: _Band, entry: Entry[T]) -> None:
        """The bookkeeping shared by every way out of the queue."""
        entry.queued = False
        band.work -= entry.cost
        self._by_size[size_bucket(entry.cost)] -= 1
        del band.arrivals[entry]
        self._counts.sub(entry.tenant)
        self._size -= 1
        if len(self._deadlines) > 2 * self._size + _COMPACT_SLACK:  # entries that left before their deadline
            self._deadlines = [item for item in self._deadlines if item[2].queued]
            heapq.heapify(self._deadlines)


def _check(entry: Entry) -> None:
    if not (math.isfinite(entry.weight) and entry.weight > 0):
        raise ValueError(f"weight must be a positive number, got {entry.weight!r}")
    if not (math.isfinite(entry.cost) and entry.cost > 0):
        raise ValueError(f"cost must be a positive number, got {entry.cost!r}")
    if not 0 <= entry.priority < BANDS:
        raise ValueError(f"priority must be 0..{BANDS - 1}, got {entry.priority!r}")
    if not entry.max_wait_s > 0:  # also rejects NaN; math.inf is no limit
        raise ValueError(f"max_wait_s must be > 0, got {entry.max_wait_s!r}")
