"""What fair admission does on a saturated fleet: a simulation on a virtual clock with ``fair_order.FairOrder``.

Two tenants at weights 1 and 3, one offering five times the other's load, on a fleet that can serve less
than they offer together. The admission rule is the gate's (``fair_queue.FairGate``): start at once while
nothing waits and a slot is free, else queue; each finish releases the next in order; a wait past
``max_wait_s`` is refused (a 429). Against plain FIFO (every request in one flow), fair queuing gives each
tenant what it asks up to its weighted share, and the rest to whoever wants more (work-conserving).

Pure and seeded: the same shares on every run, no sleeps, no wall clock.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

from ext_proc.admission.order import Entry, FairOrder

SLOTS = 4  # requests in service at once
TOKENS_PER_S = 5_000.0  # per slot: the fleet serves 20,000 tokens/s
CAPACITY = SLOTS * TOKENS_PER_S


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float
    offered: float  # tokens per second, as a fraction of the fleet's capacity


def simulate(tenants: list[Tenant], *, fair: bool = True, horizon_s: float = 300.0, warmup_s: float = 20.0,
             max_wait_s: float = 2.0, seed: int = 14) -> dict[str, float]:
    """The share of the fleet's capacity each tenant was served after ``warmup_s`` (Poisson arrivals, request
    sizes uniform in 16..512 tokens, service time proportional to tokens). ``fair=False``: one FIFO flow."""
    rng = random.Random(seed)
    mean_cost = (16 + 512) / 2
    events: list[tuple[float, int, str, object]] = []  # (time, tie, kind, what)
    tie = 0
    for t in tenants:
        rate = t.offered * CAPACITY / mean_cost  # requests per second
        now = rng.expovariate(rate)
        while now < horizon_s:
            tie += 1
            events.append((now, tie, "arrive", t))
            now += rng.expovariate(rate)
    heapq.heapify(events)
    order: FairOrder[str] = FairOrder(max_queued=100_000, max_per_tenant=100_000, aging_s=None)
    free = SLOTS
    served = {t.name: 0.0 for t in tenants}

    def start(entry: Entry[str], now: float) -> None:
        nonlocal free, tie
        free -= 1
        tie += 1
        heapq.heappush(events, (now + entry.cost / TOKENS_PER_S, tie, "finish", entry))

    while events:
        now, _, kind, what = heapq.heappop(events)
        if now >= horizon_s:
            break
        order.expire(now)
        if kind == "finish":
            entry = what
            assert isinstance(entry, Entry)
            free += 1
            if now >= warmup_s:
                served[entry.payload] += entry.cost
        else:
            t = what
            assert isinstance(t, Tenant)
            cost = float(rng.randint(16, 512))
            entry = Entry(t.name if fair else "all", t.weight, 1, cost, now, max_wait_s, t.name)
            if not order and free:
                start(entry, now)
                continue
            order.push(entry)
        while free and (nxt := order.pop(now)) is not None:
            start(nxt, now)
    window = (horizon_s - warmup_s) * CAPACITY
    return {name: tokens / window for name, tokens in served.items()}


W1_OFFERS_5X = [Tenant("w1", 1.0, 2.0), Tenant("w3", 3.0, 0.4)]  # weight 1 offers 5x the weight-3 tenant's load
W3_OFFERS_5X = [Tenant("w1", 1.0, 0.4), Tenant("w3", 3.0, 2.0)]  # weight 3 offers 5x the weight-1 tenant's load


def test_a_tenant_within_its_share_gets_all_it_asks_though_the_other_offers_5x() -> None:
    fifo = simulate(W1_OFFERS_5X, fair=False)
    fair = simulate(W1_OFFERS_5X)
    # FIFO hands out capacity by offered load: w3 gets about 1/6 of the fleet, less than it asks
    assert fifo["w3"] < 0.25
    # fair: w3 asks 0.4 of the fleet, under its 3/4 share, and gets it; w1 takes the rest, none is idle
    assert math.isclose(fair["w3"], 0.4, abs_tol=0.03)
    assert math.isclose(fair["w1"], 0.6, abs_tol=0.03)


def test_when_both_want_more_than_their_share_they_get_1_to_3() -> None:
    fifo = simulate(W3_OFFERS_5X, fair=False)
    fair = simulate(W3_OFFERS_5X)
    assert fifo["w1"] < 0.2  # by offered load, about 1/6
    assert math.isclose(fair["w1"], 0.25, abs_tol=0.03)  # its weighted share, though w3 offers 5x
    assert math.isclose(fair["w3"], 0.75, abs_tol=0.03)
