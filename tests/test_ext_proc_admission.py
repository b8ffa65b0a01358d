"""Issue 13 in ext_proc: sheddable requests shed when the fleet is over the SLO, deadlines steer picks.

The chain is tested on its own (no network) and through the real gRPC server in process (the harness of
``test_ext_proc_service.py``: real token counter, cost model and router; only the fleet is injected). Load
is stated, not timed: an endpoint's EDS telemetry says how many requests it has in flight, which ext_proc
costs as queued work, so "over the SLO" and "cannot make the deadline" follow from the fleet given.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from ext_proc.pick.chain import within_budget
from ext_proc.model import Candidate, Decision, EndpointView, Reply, RequestView
from ext_proc.pick.policies import Shed
from ext_proc.pick.registry import PluginRegistry
from ext_proc.pick.router import Router
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import PickPolicySpec, static_view
from inferlb_runtime.pick_chain import ShedParams, chain_spec
from inferlb_runtime.plugins import BadPolicyParams
from inferlb_runtime.request_class import Priority

from .test_ext_proc_service import exchange, pick_metadata, request_body, request_headers, serving, set_headers

A, B = (EndpointView(f"127.0.0.1:{p}", "127.0.0.1", p) for p in (8201, 8202))
BUSY = {"inflight": 1000.0}  # a thousand requests queued there: seconds of predicted work


def busy(e: EndpointView) -> EndpointView:
    return dataclasses.replace(e, telemetry=BUSY)


def request(priority: Priority = Priority.STANDARD, budget_s: float | None = None) -> RequestView:
    return RequestView(tokens=8, estimated=False, model=None, inputs=1, priority=priority, budget_s=budget_s)


def candidate(e: EndpointView, outstanding_s: float, cost_s: float = 0.01) -> Candidate:
    return Candidate(e, cost_s, outstanding_s, 0, 0)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


# --- the plugin and the budget step, alone --------------------------------------------------------------


def test_shed_answers_429_only_for_sheddable_requests_over_the_slo() -> None:
    shed = Shed(ShedParams(slo_ms=500))
    over = [candidate(A, 2.0), candidate(B, 3.4)]  # the best completes in 2.01 s, over 0.5 s
    reply = shed.admit(request(Priority.SHEDDABLE), over)
    assert isinstance(reply, Reply)
    assert (reply.status, reply.code, reply.type) == (429, "overloaded", "server_error")
    assert reply.retry_after_s == 2  # the predicted excess (1.51 s), rounded up
    assert "2010 ms" in reply.message and "500 ms" in reply.message
    for priority in (Priority.CRITICAL, Priority.STANDARD):
        assert shed.admit(request(priority), over) is None  # never shed
    assert shed.admit(request(Priority.SHEDDABLE), [candidate(A, 2.0), candidate(B, 0.1)]) is None  # B makes it
    assert shed.admit(request(Priority.SHEDDABLE), []) is None  # nothing routable: the 503 path, not a 429


def test_every_preset_sheds_by_default_and_slo_ms_0_turns_it_off() -> None:
    for name in ("least_completion_time", "round_robin", "least_outstanding", "p2c_tokens"):
        assert [r.plugin for r in chain_spec(name).admit] == ["shed"], name
        assert chain_spec(name, {"slo_ms": 250}).admit[0].params == {"slo_ms": 250}
        assert chain_spec(name, {"slo_ms": 0}).admit == ()
    with pytest.raises(BadPolicyParams, match="slo_ms"):
        chain_spec("least_completion_time", {"slo_ms": -1})


def test_the_budget_keeps_the_candidates_that_make_it_or_all_when_none_can() -> None:
    slow, fast = candidate(A, 1.0), candidate(B, 0.05)
    assert within_budget([slow, fast], 0.2) == [fast]
    assert within_budget([slow, fast], 5.0) == [slow, fast]
    assert within_budget([slow, candidate(B, 2.0)], 0.2) == [slow, candidate(B, 2.0)]


def test_round_robin_skips_the_endpoint_that_would_miss_the_deadline() -> None:
    router = Router(PluginRegistry(), "round_robin")  # its rotation offers the next 3 (1 + fallbacks)
    fleet = (busy(A), B)
    without = [router.decide(i, request(), fleet) for i in range(4)]
    assert [d.primary for d in without if isinstance(d, Decision)] == [A.id, B.id, A.id, B.id]
    with_budget = [router.decide(10 + i, request(budget_s=0.5), fleet) for i in range(4)]
    assert [d.primary for d in with_budget if isinstance(d, Decision)] == [B.id] * 4


# --- through ext_proc's gRPC server ---------------------------------------------------------------------


@pytest.mark.servers
def test_a_sheddable_request_on_an_overloaded_fleet_gets_429_and_a_critical_one_a_pick(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([busy(A), busy(B)])) as h:
            call = h.stub.Process()  # shed at its headers: it would be even if it cost nothing (no cache here)
            response = await exchange(call, request_headers({"x-gateway-inference-objective": "sheddable"}))
            assert response.WhichOneof("response") == "immediate_response"
            immediate = response.immediate_response
            assert immediate.status.code == 429
            headers = set_headers(immediate.headers)
            assert headers["content-type"] == "application/json" and int(headers["retry-after"]) >= 1
            error = json.loads(immediate.body)["error"]
            assert error["code"] == "overloaded" and error["type"] == "server_error"
            assert "sheddable" in error["message"] and "2000 ms SLO" in error["message"]
            call.cancel()
            for objective in ("critical", "standard", None):  # never shed: both endpoints are routable
                call = h.stub.Process()
                extra = {"x-gateway-inference-objective": objective} if objective else {}
                await exchange(call, request_headers(extra))
                response = await exchange(call, request_body({"input": "an interactive request"}))
                assert response.WhichOneof("response") == "request_body", objective
                assert pick_metadata(response).split(",")[0] in {A.id, B.id}
                call.cancel()
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_admit_replies_total", {"code": "overloaded"}) == 1

    asyncio.run(scenario())


@pytest.mark.servers
def test_a_sheddable_request_on_an_idle_fleet_is_served(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B])) as h:
            call = h.stub.Process()
            await exchange(call, request_headers({"x-gateway-inference-objective": "Sheddable"}))
            response = await exchange(call, request_body({"input": "a batch job"}))
            assert response.WhichOneof("response") == "request_body"
            call.cancel()
            assert h.servicer.metrics.registry.get_sample_value("inferlb_ext_proc_admit_replies_total",
                                                                {"code": "overloaded"}) == 0

    asyncio.run(scenario())


@pytest.mark.servers
def test_shedding_off_serves_sheddable_requests_however_loaded(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([busy(A), busy(B)]),
                           default_policy=PickPolicySpec("least_completion_time", {"slo_ms": 0})) as h:
            call = h.stub.Process()
            await exchange(call, request_headers({"x-gateway-inference-objective": "sheddable"}))
            response = await exchange(call, request_body({"input": "a batch job"}))
            assert response.WhichOneof("response") == "request_body"
            call.cancel()

    asyncio.run(scenario())


@pytest.mark.servers
def test_a_deadline_steers_the_pick_away_from_a_queue_it_would_miss(counter: TokenCounter) -> None:
    async def scenario() -> None:
        view = static_view([busy(A), B], PickPolicySpec("round_robin"))
        async with serving(counter, view, default_policy=PickPolicySpec("round_robin")) as h:
            picks = []
            for _ in range(4):  # round robin alone alternates A and B; the budget rules A out every time
                call = h.stub.Process()
                await exchange(call, request_headers({"x-inferlb-timeout-ms": "500"}))
                picks.append(pick_metadata(await exchange(call, request_body({"input": "hello"}))).split(",")[0])
                call.cancel()
            assert picks == [B.id] * 4
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_deadline_predictions_total", {"predicted": "met"}) == 4
            h.source.set(static_view([busy(A), busy(B)], PickPolicySpec("round_robin")))
            call = h.stub.Process()  # nobody can make it: still routed (the worker answers 504 if it must)
            await exchange(call, request_headers({"x-envoy-expected-rq-timeout-ms": "500"}))
            response = await exchange(call, request_body({"input": "hello"}))
            assert response.WhichOneof("response") == "request_body"
            call.cancel()
            assert registry.get_sample_value("inferlb_ext_proc_deadline_predictions_total",
                                             {"predicted": "missed"}) == 1

    asyncio.run(scenario())


@pytest.mark.servers
@pytest.mark.parametrize("header,value", [("x-gateway-inference-objective", "urgent"),
                                          ("x-inferlb-timeout-ms", "soon"), ("x-inferlb-timeout-ms", "-5"),
                                          ("x-envoy-expected-rq-timeout-ms", "nan")])
def test_a_bad_class_or_budget_header_is_a_400_naming_it(counter: TokenCounter, header: str, value: str) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B])) as h:
            call = h.stub.Process()
            response = await exchange(call, request_headers({header: value}))
            assert response.WhichOneof("response") == "immediate_response"
            assert response.immediate_response.status.code == 400
            error = json.loads(response.immediate_response.body)["error"]
            assert error["code"] == "invalid_header" and error["type"] == "invalid_request_error"
            assert header in error["message"] and repr(value) in error["message"]
            call.cancel()
            assert h.servicer.metrics.registry.get_sample_value("inferlb_ext_proc_parse_failures_total",
                                                                {"what": "request_headers"}) == 1
            assert h.servicer.router.outstanding.total().requests == 0

    asyncio.run(scenario())
