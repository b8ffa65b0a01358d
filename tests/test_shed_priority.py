"""The ``shed`` plugin's priority-aware prediction: a sheddable request's time on workers that serve by class
is its queued work stretched by the higher classes' offered load, ``(B + c) / (1 - rho)``.

On a manual clock (no sleeps, no timing): the offered-work rate alone, the plugin fed decisions, the real
Router (the registry hands the plugin its clock; the chain tells it each decision), and the simulator,
which runs the same chain code on its simulated clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re

import numpy as np
import pytest

from ext_proc.model import Candidate, Decision, EndpointView, Reply, RequestView
from ext_proc.pick.offered_work import OfferedWork
from ext_proc.pick.policies import Shed
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from ext_proc.server import ServiceSettings
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import static_view
from inferlb.sim.runner import SimOptions, shedding_params, simulate
from inferlb_runtime.pick_chain import ShedParams, chain_spec
from inferlb_runtime.plugins import BadPolicyParams
from inferlb_runtime.request_class import Priority

from .test_ext_proc_service import exchange, request_body, request_headers, serving
from .test_sim_classes_shedding import X, overloaded

A, B = (EndpointView(f"127.0.0.1:{p}", "127.0.0.1", p) for p in (8301, 8302))


class ManualClock:
    """A monotonic clock the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(priority: Priority, tokens: int = 8) -> RequestView:
    return RequestView(tokens=tokens, estimated=False, model=None, inputs=1, priority=priority)


def candidate(e: EndpointView, outstanding_s: float, cost_s: float = 0.01) -> Candidate:
    return Candidate(e, cost_s, outstanding_s, 0, 0)


def route(shed: Shed, clock: ManualClock, endpoint: EndpointView, priority: Priority, seconds: float,
          every_s: float, count: int) -> None:
    """``count`` decisions of ``seconds`` of work to ``endpoint``, one every ``every_s`` of the clock."""
    for _ in range(count):
        clock.now += every_s
        shed.decided(request(priority), Decision((endpoint.id,), seconds, "least_completion_time"))


# --- the rate ------------------------------------------------------------------------------------------


def test_offered_work_is_an_exponentially_weighted_rate_per_endpoint() -> None:
    clock = ManualClock()
    work = OfferedWork(window_s=1.0, clock=clock)
    assert work.rate(A.id) == 0.0
    work.add(A.id, 0.5)
    assert work.rate(A.id) == pytest.approx(0.5)
    clock.now = 1.0
    assert work.rate(A.id) == pytest.approx(0.5 / math.e)  # one window later
    for _ in range(2000):  # 0.9 s of work per second, for 20 windows
        clock.now += 0.01
        work.add(A.id, 0.009)
    assert work.rate(A.id) == pytest.approx(0.9, rel=0.01)
    assert work.rate(B.id) == 0.0
    work.keep([B.id])  # A left the view
    assert work.rate(A.id) == 0.0
    with pytest.raises(ValueError, match="window_s"):
        OfferedWork(window_s=0.0, clock=clock)


# --- the plugin ------------------------------------------------------------------------------------------


def test_a_sheddable_request_is_shed_when_the_higher_classes_would_keep_it_past_the_slo() -> None:
    clock = ManualClock()
    shed = Shed(ShedParams(slo_ms=500), clock=clock)
    fifo = Shed(ShedParams(slo_ms=500, queue_model="fifo"), clock=clock)
    route(shed, clock, A, Priority.STANDARD, 0.008, 0.01, 1000)  # standard work keeps A 80% busy
    waiting = [candidate(A, 0.1)]  # 110 ms of work there: within the SLO were it served in arrival order
    assert fifo.admit(request(Priority.SHEDDABLE), waiting) is None
    reply = shed.admit(request(Priority.SHEDDABLE), waiting)  # but 0.11 / (1 - 0.8) = 550 ms
    assert isinstance(reply, Reply) and (reply.status, reply.code) == (429, "overloaded")
    predicted_ms = float(re.search(r"complete in (\d+) ms", reply.message).group(1))  # type: ignore[union-attr]
    assert predicted_ms == pytest.approx(550, rel=0.03)  # the rate just after a decision is a little over 0.8
    assert "500 ms SLO" in reply.message and reply.retry_after_s == 1
    # B has no higher-class work: the same request completes there in its queued 310 ms
    assert shed.admit(request(Priority.SHEDDABLE), [*waiting, candidate(B, 0.3)]) is None
    for priority in (Priority.CRITICAL, Priority.STANDARD):
        assert shed.admit(request(priority), waiting) is None  # never shed


def test_the_higher_classes_utilisation_of_a_multi_slot_worker_is_over_its_slots() -> None:
    """1.6 s of standard work per second is 80% of a 2-slot worker (telemetry ``slots``), not 160%: a
    sheddable request there is predicted at (B + c) / (1 - 0.8), not refused as if it would never run."""
    clock = ManualClock()
    shed = Shed(ShedParams(slo_ms=600), clock=clock)
    two_slots = EndpointView(A.id, A.address, A.port, telemetry={"slots": 2.0})
    route(shed, clock, two_slots, Priority.STANDARD, 0.016, 0.01, 1000)
    assert shed.admit(request(Priority.SHEDDABLE), [candidate(two_slots, 0.1)]) is None  # 0.11 / 0.2 = 550 ms
    reply = shed.admit(request(Priority.SHEDDABLE), [candidate(A, 0.1)])  # the same work on one slot
    assert isinstance(reply, Reply) and "critical and standard requests keep every candidate busy" in reply.message


def test_sheddable_work_does_not_count_and_the_rate_fades_when_the_load_stops() -> None:
    clock = ManualClock()
    shed = Shed(ShedParams(slo_ms=500), clock=clock)
    route(shed, clock, A, Priority.SHEDDABLE, 0.008, 0.01, 1000)  # its own class does not overtake it
    assert shed.admit(request(Priority.SHEDDABLE), [candidate(A, 0.1)]) is None
    route(shed, clock, A, Priority.CRITICAL, 0.02, 0.01, 1000)  # twice what A can do
    reply = shed.admit(request(Priority.SHEDDABLE), [candidate(A, 0.0)])
    assert isinstance(reply, Reply) and "keep every candidate busy" in reply.message
    assert reply.retry_after_s == 1  # the rate's window: by then a stopped load has faded
    clock.now += 10.0
    assert shed.admit(request(Priority.SHEDDABLE), [candidate(A, 0.1)]) is None


def test_the_queue_model_is_a_checked_parameter_of_the_shed_plugin() -> None:
    spec = chain_spec("least_completion_time",
                      {"slo_ms": 0, "admit": [{"plugin": "shed", "params": {"queue_model": "fifo", "slo_ms": 500}}]})
    assert [(r.plugin, r.params["queue_model"]) for r in spec.admit] == [("shed", "fifo")]
    assert ShedParams().queue_model == "priority"
    with pytest.raises(BadPolicyParams, match="queue_model"):
        chain_spec("least_completion_time", {"admit": [{"plugin": "shed", "params": {"queue_model": "lifo"}}]})
    with pytest.raises(BadPolicyParams, match="rate_window_s"):
        chain_spec("least_completion_time", {"admit": [{"plugin": "shed", "params": {"rate_window_s": 0}}]})


# --- through the real Router ------------------------------------------------------------------------------


def test_the_router_tells_the_shed_plugin_each_decision_on_the_registrys_clock() -> None:
    clock = ManualClock()
    router = Router(PluginRegistry(clock=clock), "least_completion_time", {"slo_ms": 500}, clock=clock)
    fifo = Router(PluginRegistry(clock=clock), "least_completion_time",
                  {"slo_ms": 0, "admit": [{"plugin": "shed", "params": {"slo_ms": 500, "queue_model": "fifo"}}]},
                  clock=clock)
    fleet = (A, B)
    for key in range(100):  # a burst of standard requests (~0.1 s of work each), each over as soon as it is routed
        for r in (router, fifo):
            decision = r.decide(key, request(Priority.STANDARD, tokens=400), fleet)
            assert isinstance(decision, Decision)
            r.release(key)
    # nothing is queued now, but the higher classes' work arrives faster than either endpoint drains it
    assert router.outstanding.total().requests == 0
    assert isinstance(router.decide(1000, request(Priority.SHEDDABLE), fleet), Reply)
    assert isinstance(fifo.decide(1000, request(Priority.SHEDDABLE), fleet), Decision)
    clock.now += 30.0  # the burst is long past
    assert isinstance(router.decide(1001, request(Priority.SHEDDABLE), fleet), Decision)


# --- through ext_proc's gRPC server: the fair queue ---------------------------------------------------


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


@pytest.mark.servers
def test_a_sheddable_request_is_shed_before_waiting_in_the_fair_queue(counter: TokenCounter) -> None:
    """One request in flight fills the fair queue's depth (1): later ones wait their turn there. A sheddable
    request the chain would shed hears its 429 at once, not after waiting behind every higher class; one the
    chain would admit waits its turn (Envoy is told to wait longer: an answer with no response set)."""
    SHEDDABLE = {"x-gateway-inference-objective": "sheddable"}

    async def scenario(endpoint: EndpointView) -> str | None:
        # the cache on: a cacheable request is not shed at its headers (a hit may answer it), so it gets here
        settings = ServiceSettings(fair_queue_depth=1, cache_max_bytes=1 << 20)
        async with serving(counter, static_view([endpoint]), settings=settings) as h:
            first = h.stub.Process()
            await exchange(first, request_headers())
            assert (await exchange(first, request_body({"input": "in flight"}))).WhichOneof("response") \
                == "request_body"
            call = h.stub.Process()
            await exchange(call, request_headers(SHEDDABLE))
            answer = await exchange(call, request_body({"input": "a batch job"}))
            which = answer.WhichOneof("response")
            if which == "immediate_response":
                assert answer.immediate_response.status.code == 429
                assert json.loads(answer.immediate_response.body)["error"]["code"] == "overloaded"
                assert h.servicer.gate.waiting == 0
            else:
                assert which is None and answer.override_message_timeout.seconds > 1
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_fair_queue_wait_seconds_count",
                                             {"how": "admitted"}) in (None, 0.0)
            call.cancel()
            first.cancel()
            return which

    busy = dataclasses.replace(A, telemetry={"inflight": 1000.0})  # seconds of queued work: over any SLO
    assert asyncio.run(scenario(busy)) == "immediate_response"
    assert asyncio.run(scenario(A)) is None  # predicted well within the SLO: it waits its turn


# --- at the request headers -------------------------------------------------------------------------------


def test_the_headers_screen_sheds_only_what_the_decision_would_shed_whatever_the_request_costs() -> None:
    """Before the body, a request is costed at the fewest tokens its size allows (none here): shed only when
    even that misses the SLO (a lower bound of its decision's prediction), and the screen teaches costing
    nothing (no size, no decision)."""
    clock = ManualClock()
    router = Router(PluginRegistry(clock=clock), "least_completion_time", {"slo_ms": 500}, clock=clock)
    headers_only = RequestView(0, True, None, 0, priority=Priority.SHEDDABLE)
    queued = (dataclasses.replace(A, telemetry={"inflight": 1000.0}),)
    assert isinstance(router.screen_unseen(headers_only, queued), Reply)
    assert isinstance(router.decide(1, request(Priority.SHEDDABLE), queued), Reply)
    idle = (A,)
    assert router.screen_unseen(headers_only, idle) is None
    # a huge request on the idle endpoint: the decision sheds it by its own cost; the headers could not know it
    assert isinstance(router.decide(2, request(Priority.SHEDDABLE, tokens=200_000), idle), Reply)
    before = [c.predicted_cost_s for c in router.costing.candidates(request(Priority.STANDARD), idle, observe=False)]
    for _ in range(100):
        router.screen_unseen(headers_only, idle)
    after = [c.predicted_cost_s for c in router.costing.candidates(request(Priority.STANDARD), idle, observe=False)]
    assert before == after
    assert router.costing.candidates(headers_only, idle, observe=False)[0].outstanding_s == 0.0
    # its content-length says it holds at least 200,000 tokens: shed at the headers even on an idle fleet
    large = dataclasses.replace(headers_only, tokens=200_000)
    assert isinstance(router.screen_unseen(large, idle), Reply)
    off = Router(PluginRegistry(clock=clock), "least_completion_time", {"slo_ms": 0}, clock=clock)
    assert off.screen_unseen(headers_only, queued) is None  # no shed plugin: nothing to screen


SHEDDABLE = {"x-gateway-inference-objective": "sheddable"}
BUSY = dataclasses.replace(A, telemetry={"inflight": 1000.0})  # seconds of queued work: over any SLO


@pytest.mark.servers
@pytest.mark.parametrize("cache,extra,at_headers", [
    (False, {}, True),  # nothing needs the body first: 429 before Envoy buffers it
    (True, {}, False),  # a cache hit would cost no worker: the lookup comes first, then the shed
    (True, {"cache-control": "no-store"}, True),  # the cache will not answer it: shed at the headers
    (True, {"cache-control": "no-cache"}, True),
])
def test_a_sheddable_request_is_shed_at_its_headers_unless_the_cache_could_answer_it(
        counter: TokenCounter, cache: bool, extra: dict[str, str], at_headers: bool) -> None:
    async def scenario() -> None:
        settings = ServiceSettings(cache_max_bytes=(1 << 20) if cache else 0)
        async with serving(counter, static_view([BUSY]), settings=settings) as h:
            call = h.stub.Process()
            answer = await exchange(call, request_headers({**SHEDDABLE, **extra}))
            if not at_headers:
                assert answer.WhichOneof("response") == "request_headers"
                answer = await exchange(call, request_body({"input": "a batch job"}))
            assert answer.WhichOneof("response") == "immediate_response"
            immediate = answer.immediate_response
            assert immediate.status.code == 429
            error = json.loads(immediate.body)["error"]
            assert error["code"] == "overloaded" and "sheddable" in error["message"]
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_admit_replies_total", {"code": "overloaded"}) == 1
            assert registry.get_sample_value("inferlb_ext_proc_cache_requests_total",
                                             {"level": "memory", "result": "miss"}) in \
                ((None, 0.0) if at_headers else (1.0,))
            call.cancel()
            for objective in ("critical", "standard"):  # never shed at the headers
                call = h.stub.Process()
                answer = await exchange(call, request_headers({"x-gateway-inference-objective": objective}))
                assert answer.WhichOneof("response") == "request_headers", objective
                call.cancel()

    asyncio.run(scenario())


@pytest.mark.servers
def test_on_an_idle_fleet_only_a_body_too_large_for_the_slo_is_shed_at_its_headers(counter: TokenCounter) -> None:
    """The content-length bounds the request's cost from below (HEADERS_BYTES_PER_TOKEN): 2 MB of body is at
    least 200,000 tokens, far over the SLO even on an idle worker; a small body, or none announced, goes on."""
    async def scenario() -> None:
        async with serving(counter, static_view([A])) as h:
            for length, shed in (("2000000", True), ("40", False), (None, False), ("9" * 40, False)):
                call = h.stub.Process()
                extra = {**SHEDDABLE, **({"content-length": length} if length is not None else {})}
                answer = await exchange(call, request_headers(extra))
                which = answer.WhichOneof("response")
                assert which == ("immediate_response" if shed else "request_headers"), length
                if shed:
                    assert answer.immediate_response.status.code == 429
                call.cancel()

    asyncio.run(scenario())


# --- in the simulator -------------------------------------------------------------------------------------


def test_the_simulator_builds_the_shed_plugin_with_the_queue_model_asked_for() -> None:
    assert shedding_params(500.0, None) == {"slo_ms": 500.0}
    assert shedding_params(0.0, "fifo") == {"slo_ms": 0.0}
    assert shedding_params(500.0, "fifo") == {
        "slo_ms": 0, "admit": [{"plugin": "shed", "params": {"slo_ms": 500.0, "queue_model": "fifo"}}]}


def test_at_130_percent_admitted_sheddable_requests_are_served_within_the_slo_and_goodput_rises() -> None:
    runs = {}
    for model in ("fifo", "priority"):
        result, raw = simulate(overloaded(), "inferlb_ext_proc", 1.3, options=SimOptions(shed_queue_model=model))
        served = ~raw["shed"] & (raw["classes"] == X) & ~np.isnan(raw["latency"])
        runs[model] = (result, float(np.mean(raw["latency"][served] <= result.slo_s)))
    (fifo, fifo_in_time), (priority, priority_in_time) = runs["fifo"], runs["priority"]
    # in arrival order, an admitted sheddable request waits behind every later critical and standard one
    assert priority_in_time > 2 * fifo_in_time
    assert priority.goodput_rps > fifo.goodput_rps
    assert priority.extra["classes"]["critical"]["shed"] == priority.extra["classes"]["standard"]["shed"] == 0
