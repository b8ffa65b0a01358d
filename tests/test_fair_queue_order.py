"""The admission queue's order (``ext_proc/admission/order.py``): priority bands with aging, then weighted fair
queuing across tenants by virtual finish time, FIFO within a tenant; removal, expiry and the caps.

Pure: the clock is an argument, so nothing here sleeps or times anything.
"""

from __future__ import annotations

import math
import random

import pytest

from ext_proc.admission.order import Entry, FairOrder, Refusal
from inferlb_runtime.request_class import Priority

C, S, X = int(Priority.CRITICAL), int(Priority.STANDARD), int(Priority.SHEDDABLE)


def entry(tenant: str, *, weight: float = 1.0, priority: int = S, cost: float = 1.0, arrived: float = 0.0,
          max_wait_s: float = math.inf, name: str = "") -> Entry[str]:
    return Entry(tenant, weight, priority, cost, arrived, max_wait_s, name or tenant)


def drain(order: FairOrder[str], now: float = 0.0) -> list[Entry[str]]:
    out = []
    while (e := order.pop(now)) is not None:
        out.append(e)
    return out


# --- weighted fair shares ---------------------------------------------------------------------------------


def test_weights_1_to_3_backlogged_are_served_costs_1_to_3() -> None:
    order: FairOrder[str] = FairOrder()
    for _ in range(400):
        order.push(entry("a", weight=1))
        order.push(entry("b", weight=3))
    served = {"a": 0.0, "b": 0.0}
    for _ in range(400):  # both stay backlogged throughout: each has 400 queued
        e = order.pop(0.0)
        assert e is not None
        served[e.tenant] += e.cost
        assert abs(served["a"] / 1 - served["b"] / 3) <= 1.0  # within one request's cost, at every prefix
    assert served == {"a": 100.0, "b": 300.0}


def test_weighted_shares_hold_with_mixed_costs_to_within_one_request_each() -> None:
    rng = random.Random(14)
    order: FairOrder[str] = FairOrder()
    weights = {"a": 1.0, "b": 3.0}
    for _ in range(600):
        for tenant, weight in weights.items():
            order.push(entry(tenant, weight=weight, cost=float(rng.randint(1, 512))))
    served = {"a": 0.0, "b": 0.0}
    for _ in range(600):
        e = order.pop(0.0)
        assert e is not None
        served[e.tenant] += e.cost
        # self-clocked fair queuing's bound: normalised service differs by at most one request of each
        assert abs(served["a"] / 1 - served["b"] / 3) <= 512 / 1 + 512 / 3
    assert 0.2 < served["a"] / (served["a"] + served["b"]) < 0.3


def test_a_burst_of_1000_delays_a_light_tenant_by_at_most_one_request_per_round() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(1000):
        order.push(entry("heavy", name=f"h{i}"))
    delays = []
    for _ in range(50):  # the light tenant sends one request at a time while the burst drains
        order.push(entry("light"))
        ahead = 0
        while (e := order.pop(0.0)) is not None and e.tenant == "heavy":
            ahead += 1
        assert e is not None and e.tenant == "light"
        delays.append(ahead)
    assert max(delays) <= 1
    assert order.queued("heavy") >= 900  # the burst is still there: fairness, not luck


def test_a_heavier_burst_delays_a_light_tenant_by_at_most_its_weight_ratio() -> None:
    order: FairOrder[str] = FairOrder()
    for _ in range(1000):
        order.push(entry("heavy", weight=3))
    aheads = []
    for _ in range(20):
        order.push(entry("light", weight=1))
        ahead = 0
        while (e := order.pop(0.0)) is not None and e.tenant == "heavy":
            ahead += 1
        aheads.append(ahead)
    # three per round (its weight's worth), one more in a round where rounding puts a tag a hair either side
    assert max(aheads) <= 4 and sum(aheads) <= 3 * 20 + 1


def test_an_idle_tenant_banks_no_credit() -> None:
    order: FairOrder[str] = FairOrder()
    order.push(entry("b"))
    for _ in range(200):
        order.push(entry("a"))
    first = [order.pop(0.0) for _ in range(101)]  # b once, then a alone for 100: b idle meanwhile
    assert sum(e is not None and e.tenant == "b" for e in first) == 1
    for _ in range(50):
        order.push(entry("b"))
    nxt = [e.tenant for e in (order.pop(0.0) for _ in range(40)) if e is not None]
    # b starts at the current virtual time: it alternates with a instead of taking 50 in a row
    assert nxt == ["a", "b"] * 20  # equal tags: a's head arrived first


def test_fifo_within_a_tenant() -> None:
    order: FairOrder[str] = FairOrder()
    for i in range(10):
        order.push(entry("a", cost=float(10 - i), name=f"a{i}"))
    assert [e.payload for e in drain(order)] == [f"a{i}" for i in range(10)]


# --- priority bands -------------------------------------------------------------------------------------


def test_bands_are_served_best_first_without_aging() -> None:
    order: FairOrder[str] = FairOrder(aging_s=None)
    order.push(entry("a", priority=X, name="x"))
    order.push(entry("a", priority=S, name="s"))
    order.push(entry("b", priority=C, name="c"))
    assert [e.payload for e in drain(order, now=1e6)] == ["c", "s", "x"]  # strict: no aging at any age


def test_a_waiting_band_climbs_one_class_per_aging_interval() -> None:
    order: FairOrder[str] = FairOrder(aging_s=2.0)
    order.push(entry("a", priority=X, arrived=0.0, name="old-sheddable"))
    order.push(entry("b", priority=C, arrived=3.0, name="critical"))
    order.push(entry("c", priority=S, arrived=3.5, name="standard"))
    # at 3.9 the sheddable band has waited 3.9 s: one class up (standard); critical still goes first
    assert order.pop(3.9).payload == "critical"  # type: ignore[union-attr]
    order.push(entry("b", priority=C, arrived=4.0, name="critical-2"))
    # at 4.0 it has waited 4 s: two classes up, critical's rank, and it arrived first
    assert order.pop(4.0).payload == "old-sheddable"  # type: ignore[union-attr]
    assert [e.payload for e in drain(order, now=4.0)] == ["critical-2", "standard"]


def test_fair_shares_hold_within_each_band() -> None:
    order: FairOrder[str] = FairOrder(aging_s=None)
    for _ in range(100):
        order.push(entry("a", weight=1, priority=X))
        order.push(entry("b", weight=1, priority=X))
        order.push(entry("a", weight=1, priority=C))
    tenants = [e.tenant for e in drain(order)]
    assert tenants[:100] == ["a"] * 100  # the critical band first, all a's
    assert tenants[100:].count("a") == tenants[100:].count("b") == 100
    assert abs(tenants[100:200].count("a") - 50) <= 1


# --- removal, expiry ------------------------------------------------------------------------------------


def test_removing_a_head_hands_its_start_tag_to_the_next() -> None:
    order: FairOrder[str] = FairOrder()
    a1, a2 = entry("a", cost=100, name="a1"), entry("a", cost=1, name="a2")
    order.push(a1)
    order.push(a2)
    order.push(entry("b", cost=10, name="b1"))
    assert order.remove(a1) and not order.remove(a1)
    # a2's tag is 0 + 1, not 100 + 1: the request that left was never served, so it costs a nothing
    assert [e.payload for e in drain(order)] == ["a2", "b1"]
    assert len(order) == 0 and order.queued("a") == 0


def test_removing_from_the_middle_keeps_fifo_and_counts() -> None:
    order: FairOrder[str] = FairOrder()
    es = [entry("a", name=f"a{i}") for i in range(5)]
    for e in es:
        order.push(e)
    assert order.remove(es[2])
    assert order.queued("a") == 4 and len(order) == 4
    assert [e.payload for e in drain(order)] == ["a0", "a1", "a3", "a4"]


def test_expire_removes_what_waited_past_its_maximum_wait() -> None:
    order: FairOrder[str] = FairOrder()
    order.push(entry("a", arrived=0.0, max_wait_s=5.0, name="a-5"))
    order.push(entry("b", arrived=1.0, max_wait_s=1.0, name="b-2"))
    order.push(entry("c", arrived=0.0, name="c-forever"))
    assert order.expire(1.9) == []
    assert [e.payload for e in order.expire(2.0)] == ["b-2"]
    assert [e.payload for e in order.expire(100.0)] == ["a-5"]
    assert [e.payload for e in drain(order)] == ["c-forever"]


def test_expire_skips_entries_that_already_left() -> None:
    order: FairOrder[str] = FairOrder()
    gone = entry("a", max_wait_s=1.0)
    order.push(gone)
    assert order.pop(0.0) is gone
    assert order.expire(10.0) == []


def test_heaps_stay_bounded_when_heads_keep_leaving() -> None:
    order: FairOrder[str] = FairOrder(max_per_tenant=20_000, max_queued=20_000)
    keep = [entry(f"t{i}") for i in range(3)]
    for e in keep:
        order.push(e)
    for _ in range(10_000):  # a client that queues and leaves over and over
        e = entry("churn", max_wait_s=1e9)
        order.push(e)
        order.remove(e)
    band = order._bands[S]
    assert len(band.heads) <= 2 * len(band.flows) + 64 + 1
    assert len(order._deadlines) <= 2 * len(order) + 64 + 1
    assert {e.tenant for e in drain(order)} == {"t0", "t1", "t2"}


# --- bounds ---------------------------------------------------------------------------------------------


def test_caps_refuse_at_push() -> None:
    order: FairOrder[str] = FairOrder(max_queued=5, max_per_tenant=3)
    assert [order.push(entry("a")) for _ in range(4)] == [None, None, None, Refusal.TENANT_FULL]
    assert [order.push(entry("b")) for _ in range(3)] == [None, None, Refusal.QUEUE_FULL]
    assert len(order) == 5 and order.queued("a") == 3 and order.queued("b") == 2


def test_make_room_evicts_the_newest_of_the_tenant_holding_the_most() -> None:
    order: FairOrder[str] = FairOrder(max_queued=4, max_per_tenant=4)
    hog = [entry("hog", priority=p, name=f"hog{i}") for i, p in enumerate([C, X, X])]
    for e in hog:
        order.push(e)
    order.push(entry("light"))
    newcomer = entry("light", name="light2")
    assert order.push(newcomer) is Refusal.QUEUE_FULL
    victim = order.make_room("light")
    assert victim is hog[2] and not victim.queued  # its newest, of its worst band
    assert order.push(newcomer) is None
    # now hog holds 2 and light 2: evicting would only swap who is short, so nothing is evicted
    assert order.push(entry("light")) is Refusal.QUEUE_FULL
    assert order.make_room("light") is None
    assert order.make_room("hog") is None


@pytest.mark.parametrize("field,value", [("weight", 0.0), ("weight", math.nan), ("cost", 0.0),
                                         ("cost", math.inf), ("priority", 3), ("max_wait_s", 0.0)])
def test_nonsense_entries_are_a_clear_error(field: str, value: float) -> None:
    e = entry("a")
    setattr(e, field, value)
    with pytest.raises(ValueError, match=field):
        FairOrder().push(e)


def test_nonsense_settings_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="aging_s"):
        FairOrder(aging_s=0.0)
    with pytest.raises(ValueError, match="max_queued"):
        FairOrder(max_queued=0)


# --- within a tenant: the least work first, aged (size_rate) ---------------------------------------------


def test_within_a_tenant_a_short_request_overtakes_the_large_ones_queued_before_it() -> None:
    order: FairOrder[str] = FairOrder(size_rate=1000.0)  # 8,192 tokens: overtaken for 8.2 s after it came
    for i in range(3):
        order.push(entry("anonymous", cost=8192, arrived=i * 0.1, name=f"batch{i}"))
    order.push(entry("anonymous", cost=6, arrived=0.5, name="sentence"))
    assert [e.payload for e in drain(order, now=0.5)] == ["sentence", "batch0", "batch1", "batch2"]


def test_an_aged_large_request_is_served_before_a_short_one_that_came_much_later() -> None:
    order: FairOrder[str] = FairOrder(size_rate=1000.0)
    order.push(entry("anonymous", cost=2000, arrived=0.0, name="batch"))  # its key: 0 + 2 s
    order.push(entry("anonymous", cost=6, arrived=2.5, name="late sentence"))  # 2.5 s later: too late to pass it
    order.push(entry("anonymous", cost=6, arrived=1.0, name="early sentence"))
    assert [e.payload for e in drain(order, now=3.0)] == ["early sentence", "batch", "late sentence"]


def test_without_a_size_rate_a_tenant_is_served_first_in_first_out() -> None:
    order: FairOrder[str] = FairOrder()
    order.push(entry("t", cost=8192, arrived=0.0, name="batch"))
    order.push(entry("t", cost=6, arrived=0.1, name="sentence"))
    assert [e.payload for e in drain(order)] == ["batch", "sentence"]


def test_a_short_head_is_fair_between_tenants_too() -> None:
    """The overtaking stays within the tenant: another tenant's turn comes by the weighted fair tags."""
    order: FairOrder[str] = FairOrder(size_rate=1000.0)
    order.push(entry("a", cost=100, arrived=0.0, name="a1"))
    order.push(entry("b", cost=100, arrived=0.0, name="b1"))
    order.push(entry("a", cost=1, arrived=0.05, name="a-short"))  # a's new head: tagged from a's start
    served = [e.payload for e in drain(order, now=0.2)]
    assert served.index("a-short") < served.index("a1") and served[0] in ("a-short", "b1")


def test_work_ahead_counts_better_bands_its_own_smaller_entries_and_the_others_fair_share() -> None:
    order: FairOrder[str] = FairOrder(size_rate=1000.0, aging_s=None)
    order.push(entry("crit", priority=0, cost=500, arrived=0.0))
    order.push(entry("me", cost=10, arrived=0.0))
    order.push(entry("me", cost=5000, arrived=0.0))  # larger than the new one: goes after it
    order.push(entry("other", cost=10_000, arrived=0.0))
    ahead = order.work_ahead("me", 1.0, 1, 20, arrived=0.0)
    # 500 of the better band; 10 of its own (5000 goes after it); the other tenant's share meanwhile: (10 + 20)
    assert ahead == 500 + 10 + 30
    assert order.work_ahead("newcomer", 1.0, 2, 20, arrived=0.0) == 500 + 10 + 5000 + 10_000
