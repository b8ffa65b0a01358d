"""ext_proc's costing of multi-slot workers (telemetry ``slots``), without servers.

A worker that runs ``k`` jobs at once is costed by the wait for its first free slot, so that 3 requests
on a 4-slot worker are no queue, and a single-slot worker (or one that does not say) is costed as before.
"""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from ext_proc.pick.cost import CostModel
from ext_proc.pick.costing import Costing, slot_wait_s
from ext_proc.model import Candidate, Decision, EndpointView, RequestView
from ext_proc.pick.outstanding import Outstanding
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router


def endpoint(port: int, **telemetry: float) -> EndpointView:
    return EndpointView(id=f"127.0.0.1:{port}", address="127.0.0.1", port=port, telemetry=telemetry)


REQUEST = RequestView(tokens=32, estimated=False, model=None, inputs=1)
FAST = {"batch_cost_fixed_s": 0.0, "batch_cost_per_token_s": 0.00025}  # 8 ms for 32 tokens
SLOW = {"batch_cost_fixed_s": 0.0, "batch_cost_per_token_s": 0.001}  # 32 ms: a quarter of the speed


@pytest.mark.parametrize(("work_s", "requests", "slots", "wait_s"), [
    (0.3, 3, 1, 0.3),  # one slot: all the work there is ahead
    (0.3, 3, 0.5, 0.3),  # nonsense below one slot: read as one
    (0.3, 3, 4, 0.0),  # a slot is free
    (0.0, 0, 4, 0.0),
    (0.4, 4, 4, 0.4 / 16),  # all busy: one request's work, done four at a time
    (0.8, 8, 4, 0.8 * 5 / 32),  # five must finish (four running, one queued ahead) before a slot frees
    (0.2, 2, 2, 0.2 / 4),
])
def test_slot_wait_is_the_work_before_the_first_free_slot(work_s: float, requests: float, slots: float,
                                                          wait_s: float) -> None:
    assert slot_wait_s(work_s, requests, slots) == pytest.approx(wait_s)


def costed(telemetry_a: Mapping[str, float], ours_on_a: int) -> Candidate:
    """The candidate for endpoint a, with ``ours_on_a`` of our 8 ms requests in flight there."""
    outstanding = Outstanding()
    costing = Costing(CostModel(), outstanding)
    a = endpoint(8101, **telemetry_a)
    for i in range(ours_on_a):
        outstanding.begin(i, a.id, 32, 0.008)
    costing.new_view([a], [a])
    (candidate,) = costing.candidates(REQUEST, [a])
    return candidate


def test_our_own_work_on_a_multi_slot_worker_is_spread_over_its_slots() -> None:
    assert costed({**FAST}, 3).outstanding_s == pytest.approx(0.024)  # no slots reported: one, as before
    assert costed({**FAST, "slots": 1}, 3).outstanding_s == pytest.approx(0.024)
    assert costed({**FAST, "slots": 4}, 3).outstanding_s == 0.0  # the fourth slot is free
    assert costed({**FAST, "slots": 4}, 6).outstanding_s == pytest.approx(0.048 * 3 / 24)
    free = costed({**FAST, "slots": 4}, 3)
    assert free.predicted_completion_s == pytest.approx(free.predicted_cost_s)


def test_reported_foreign_work_counts_towards_the_slots_too() -> None:
    # the worker reports 6 in flight, 2 of them ours: 4 foreign, costed at the mean request size (32 tokens)
    candidate = costed({**FAST, "slots": 4, "inflight": 6}, 2)
    assert candidate.outstanding_s == pytest.approx(6 * 0.008 * 3 / (6 * 4))
    assert costed({**FAST, "inflight": 6}, 2).outstanding_s == pytest.approx(6 * 0.008)


def test_the_default_chain_prefers_a_busy_fast_multi_slot_worker_over_an_idle_slow_one() -> None:
    """The multi-slot scenario's mistake: 4 requests on a fast 4-slot worker looked like a 32 ms queue, so an
    idle quarter-speed single-slot worker (32 ms) won; with the slots known, the wait there is 2 ms."""
    router = Router(PluginRegistry(), "least_completion_time", {"seed": 1, "d": 2})
    multi, single = endpoint(8101, **FAST, slots=4), endpoint(8102, **SLOW)
    for i in range(4):
        router.outstanding.begin(-1 - i, multi.id, 32, 0.008)
    decision = router.decide(1, REQUEST, (multi, single))
    assert type(decision) is Decision and decision.primary == multi.id
    assert decision.completion_s == pytest.approx(0.032 / 16 + 0.008)

    unaware = Router(PluginRegistry(), "least_completion_time", {"seed": 1, "d": 2})
    blind = endpoint(8101, **FAST)  # the same worker, its slots not reported
    for i in range(4):
        unaware.outstanding.begin(-1 - i, blind.id, 32, 0.008)
    decision = unaware.decide(1, REQUEST, (blind, single))
    assert type(decision) is Decision and decision.primary == single.id
