"""Each request stage alone, on a typed RequestContext: no gRPC, no Envoy, no servers.

The end-to-end behaviour of the whole pipeline is asserted through the real gRPC stream in
tests/test_ext_proc_service.py and through Envoy in tests/test_ext_proc_envoy.py; here each stage's own
contract: what it reads from the context, what it leaves on it, and when it answers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.admission.rules import AdmissionRules
from ext_proc.callers import Caller
from ext_proc.context import Answer, RequestContext, Wait
from ext_proc.admission.gate import GateSettings
from ext_proc.metrics import ExtProcMetrics
from ext_proc.model import EndpointView, Reply, RequestView
from ext_proc.pipeline import Collaborators, build_stages, check_operator_stages
from ext_proc.quota.memory_store import MemoryQuotaStore
from ext_proc.pick.registry import PluginRegistry
from ext_proc.replies import Replies
from ext_proc.pick.router import Router
from ext_proc.server import ServiceSettings
from ext_proc.stage import Stages
from ext_proc.stages.admission import Admission
from ext_proc.stages.caller import IdentifyCaller
from ext_proc.stages.count import CountTokens
from ext_proc.stages.decide import Decide
from ext_proc.stages.learn import Learn
from ext_proc.stages.models import ListModels
from ext_proc.stages.operator import OperatorStage, OperatorStageSpec
from ext_proc.stages.quota import Quota
from ext_proc.stages.route import CheckRoute
from ext_proc.stages.usage import Usage
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import PickPolicySpec, StaticViewSource, static_view
from inferlb_runtime.api_keys import Quota as TenantQuota
from inferlb_runtime.plugins import PolicyAllowlist, PolicyNotFound
from inferlb_runtime.request_class import Priority


A, B = (EndpointView(f"127.0.0.1:{p}", "127.0.0.1", p) for p in (8101, 8102))
PICK = "x-gateway-destination-endpoint"
HERE = PolicyAllowlist(("tests.test_ext_proc_stages",))


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


def context(headers: dict[str, str] | None = None, body: Any = None, end_of_stream: bool = False) -> RequestContext:
    """A stream's context as the runner leaves it for the stages: the headers message (and its bytes), the
    body once whole."""
    all_headers = {":method": "POST", ":path": "/v1/embeddings", "content-type": "application/json",
                   **(headers or {})}
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in all_headers.items()]),
        end_of_stream=end_of_stream)
    ctx = RequestContext(1)
    ctx.opening = pb.ProcessingRequest(request_headers=message)
    ctx.headers_raw = pb.ProcessingRequest(request_headers=message).SerializeToString()
    ctx.headers_phase = end_of_stream
    caller = IdentifyCaller(PICK, False, StaticViewSource(), ExtProcMetrics())
    assert caller.on_request_headers(ctx) is None
    if body is not None:
        ctx.payload = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ctx


def router() -> Router:
    return Router(PluginRegistry(), "least_completion_time")


def resolve(verdict: Any) -> Answer | None:
    """A stage's verdict, with a Wait awaited as the runner would."""
    if type(verdict) is Wait:
        return asyncio.run(verdict.work)  # type: ignore[arg-type]
    return verdict


def answer_json(answer: Answer) -> tuple[int, dict[str, Any]]:
    response = pb.ProcessingResponse.FromString(answer.message).immediate_response
    return response.status.code, json.loads(response.body)


# --- caller ------------------------------------------------------------------------------------------------


def test_the_caller_stage_strips_client_pick_headers_and_keeps_the_rest() -> None:
    ctx = context({PICK: "10.0.0.1:80", "x-other": "kept"})
    assert PICK not in ctx.headers and ctx.headers["x-other"] == "kept"
    assert PICK.encode() in ctx.mutation  # the removal goes to Envoy with the headers' answer
    assert ctx.priority is Priority.STANDARD and ctx.caller.tenant == "anonymous"


def test_the_caller_stage_answers_a_bad_class_header_with_400() -> None:
    metrics = ExtProcMetrics()
    ctx = RequestContext(1)
    message = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key="x-gateway-inference-objective", raw_value=b"urgent!")]))
    ctx.opening, ctx.headers_raw = pb.ProcessingRequest(request_headers=message), None
    answer = IdentifyCaller(PICK, False, StaticViewSource(), metrics).on_request_headers(ctx)
    assert answer is not None and answer.final
    status, body = answer_json(answer)
    assert status == 400 and body["error"]["code"] == "invalid_header"


def test_the_caller_stage_refuses_a_request_without_a_key_when_keys_are_required() -> None:
    ctx = RequestContext(1)
    ctx.opening = pb.ProcessingRequest(request_headers=pb.HttpHeaders())
    answer = IdentifyCaller(PICK, True, StaticViewSource(), ExtProcMetrics()).on_request_headers(ctx)
    assert answer is not None and ctx.outcome == "unauthenticated"
    assert answer_json(answer)[0] in (401, 503)  # 503 while no key table has arrived


def test_the_route_stage_answers_a_post_to_a_path_the_fleet_does_not_serve_before_its_model() -> None:
    stage = CheckRoute(("/v1/embeddings",), ExtProcMetrics())
    chat = context({":path": "/v1/chat/completions"})
    answer = stage.on_request_headers(chat)
    assert answer is not None and answer.final
    status, body = answer_json(answer)
    assert status == 404 and body["error"]["code"] == "not_found"
    assert stage.on_request_headers(context()) is None  # /v1/embeddings
    assert stage.on_request_headers(context({":path": "/v1/embeddings?x=1"})) is None
    assert stage.on_request_headers(context({":method": "GET", ":path": "/metrics"}, end_of_stream=True)) is None


# --- count, quota, usage ---------------------------------------------------------------------------------


def test_the_count_stage_leaves_the_counted_request(counter: TokenCounter) -> None:
    ctx = context(body={"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat.", "Hello"]})
    assert CountTokens(counter).on_request(ctx) is None
    assert ctx.request is not None and ctx.request.inputs == 2 and ctx.tokens == ctx.request.tokens > 2
    assert ctx.started > 0


def test_the_count_stage_counts_a_large_body_off_the_loop_and_asks_for_the_extension_at_once(
        counter: TokenCounter) -> None:
    ctx = context(body={"input": ["word"] * 40_000})
    verdict = CountTokens(counter).on_request(ctx)
    assert type(verdict) is Wait and verdict.extend_after == 0.0
    assert resolve(verdict) is None and ctx.request is not None and ctx.request.inputs == 40_000


def test_the_quota_stage_passes_a_caller_without_quota_and_refuses_one_over_it() -> None:
    metrics = ExtProcMetrics()
    stage = Quota(MemoryQuotaStore(), metrics)
    ctx = context()
    ctx.tokens = 5
    assert stage.on_request(ctx) is None and ctx.quota is None
    limited = Caller("acme", "key_1", Priority.STANDARD, Priority.CRITICAL, 1.0, TenantQuota(tokens_per_minute=10))

    async def twice() -> tuple[Answer | None, Answer | None, RequestContext]:
        first, second = context(), context()
        first.caller = second.caller = limited
        first.tokens = second.tokens = 8
        return await stage.on_request(first).work, await stage.on_request(second).work, second  # type: ignore

    first, second, refused = asyncio.run(twice())
    assert first is None and second is not None and refused.outcome == "rate_limited"
    status, body = answer_json(second)
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"


def test_the_usage_stage_counts_the_tenants_outcome_once_the_stream_ends() -> None:
    metrics = ExtProcMetrics()
    ctx = context()
    ctx.outcome, ctx.tokens = "served", 7
    Usage(metrics).on_end(ctx)
    assert metrics.tenant_counts[("anonymous", "served")] == [1, 7]


# --- models, decide, learn ----------------------------------------------------------------------------------


def test_the_models_stage_answers_only_a_get_of_the_model_list() -> None:
    served = EndpointView("127.0.0.1:8101", "127.0.0.1", 8101, models=("all-MiniLM-L6-v2-int8",),
                          model_aliases=("all-MiniLM-L6-v2",))
    source = StaticViewSource(static_view([served]))
    stage = ListModels(source, ExtProcMetrics())
    get = context({":method": "GET", ":path": "/v1/models"}, end_of_stream=True)
    answer = stage.on_request(get)
    assert answer is not None and answer.final and get.outcome == "served"
    listing = json.loads(pb.ProcessingResponse.FromString(answer.message).immediate_response.body)
    assert "all-MiniLM-L6-v2" in {m["id"] for m in listing["data"]}
    assert stage.on_request(context(body={"input": "x"})) is None  # a body came: not a listing


def test_the_decide_stage_forwards_with_a_pick_and_counts_it_outstanding(counter: TokenCounter) -> None:
    source = StaticViewSource(static_view([A, B]))
    r = router()
    metrics = ExtProcMetrics()
    stage = Decide(PICK, "envoy.lb", PickPolicySpec("least_completion_time"), source, r, metrics,
                   Replies(metrics, source))
    stage.on_view(source.view)  # type: ignore[arg-type]
    ctx = context(body={"input": "The cat sits on the mat."})
    CountTokens(counter).on_request(ctx)
    answer = stage.on_request(ctx)
    assert not answer.final and ctx.forwarded and ctx.pick in {A.id, B.id}
    picked = pb.ProcessingResponse.FromString(answer.message)
    assert {o.header.key for o in picked.request_body.response.header_mutation.set_headers} >= {PICK}
    assert r.outstanding.snapshot()[ctx.pick].requests == 1


def test_the_decide_stage_fails_open_without_a_view(counter: TokenCounter) -> None:
    source = StaticViewSource()
    metrics = ExtProcMetrics()
    stage = Decide(PICK, "envoy.lb", PickPolicySpec("least_completion_time"), source, router(), metrics,
                   Replies(metrics, source))
    ctx = context(body={"input": "x"})
    CountTokens(counter).on_request(ctx)
    answer = stage.on_request(ctx)
    assert not answer.final and ctx.forwarded and ctx.pick is None
    assert metrics.counts["fallbacks"]["no_view"] == 1


def test_the_learn_stage_releases_the_request_at_the_response_end_exactly_once(counter: TokenCounter) -> None:
    source = StaticViewSource(static_view([A, B]))
    r = router()
    metrics = ExtProcMetrics()
    replies = Replies(metrics, source)
    decide = Decide(PICK, "envoy.lb", PickPolicySpec("least_completion_time"), source, r, metrics, replies)
    learn = Learn(r, metrics, replies)
    ctx = context(body={"input": "x"})
    CountTokens(counter).on_request(ctx)
    decide.on_request(ctx)
    ctx.response, ctx.status = {":status": "200", "server-timing": "compute;dur=3.0"}, "200"
    learn.on_response_headers(ctx)
    assert ctx.served_by == ctx.pick and len(r.outstanding) == 1
    learn.on_response_end(ctx)
    assert len(r.outstanding) == 0 and metrics.counts["released"]["response"] == 1
    learn.on_end(ctx)  # the stream's end finds nothing left to release
    assert metrics.counts["released"] == {"response": 1, "early": 0, "error": 0}


# --- admission -----------------------------------------------------------------------------------------------


def test_the_admission_stage_without_a_queue_passes_everything(counter: TokenCounter) -> None:
    source = StaticViewSource(static_view([A]))
    metrics = ExtProcMetrics()
    stage = Admission(AdmissionRules(depth=0), GateSettings(), False, source, router(), metrics,
                      Replies(metrics, source))
    ctx = context(body={"input": "x"})
    CountTokens(counter).on_request(ctx)
    assert stage.gate is None and stage.on_request(ctx) is None


def test_the_admission_stage_makes_a_request_wait_when_the_fleet_is_full(counter: TokenCounter) -> None:
    source = StaticViewSource(static_view([A]))
    r = router()
    metrics = ExtProcMetrics()
    stage = Admission(AdmissionRules(depth=1, room="requests", early_refusal=False), GateSettings(max_wait_s=0.05),
                      False, source, r, metrics, Replies(metrics, source))
    stage.on_view(source.view)  # type: ignore[arg-type]
    busy = context(body={"input": "x"})
    CountTokens(counter).on_request(busy)
    r.decide(99, busy.request, source.view.endpoints)  # type: ignore[arg-type,union-attr]  # one in flight: full
    ctx = context(body={"input": "y"})
    CountTokens(counter).on_request(ctx)
    verdict = stage.on_request(ctx)
    assert type(verdict) is Wait and verdict.extend_after == 0.0  # Envoy is told before the wait
    answer = resolve(verdict)
    assert answer is not None and ctx.outcome == "shed"
    assert answer_json(answer)[1]["error"]["code"] == "overloaded"


def busy_fleet(counter: TokenCounter, rules: AdmissionRules, in_flight_tokens: int) -> tuple[Admission, Router]:
    """One endpoint with one request of ``in_flight_tokens`` in flight, behind a door of ``rules``."""
    source = StaticViewSource(static_view([A]))
    r = router()
    metrics = ExtProcMetrics()
    stage = Admission(rules, GateSettings(max_wait_s=5.0, size_rate=4000.0), False, source, r, metrics,
                      Replies(metrics, source))
    stage.on_view(source.view)  # type: ignore[arg-type]
    busy = context(body={"input": "x"})
    CountTokens(counter).on_request(busy)
    busy_request = RequestView(in_flight_tokens, False, None, 1)
    r.decide(99, busy_request, source.view.endpoints)  # type: ignore[union-attr]
    return stage, r


def test_room_in_work_lets_a_short_request_into_a_gap_a_long_one_does_not_fit(counter: TokenCounter) -> None:
    stage, r = busy_fleet(counter, AdmissionRules(depth=1, room="work", budget_s=0.5), 256)
    in_flight = r.outstanding.seconds
    assert 0 < in_flight < 0.5  # one short request's predicted seconds: under the budget
    short, long = context(body={"input": "a short one"}), context(body={"input": ["word " * 250] * 64})
    for ctx in (short, long):
        resolve(CountTokens(counter).on_request(ctx))
    assert long.tokens > 10_000
    assert stage.on_request(short) is None  # it fits the gap: admitted at once
    verdict = stage.on_request(long)
    assert type(verdict) is Wait  # 16k tokens do not fit: it waits for room
    verdict.work.close()  # type: ignore[attr-defined]


def test_a_sentence_fits_beside_a_batch_over_the_budget_and_a_second_batch_does_not(counter: TokenCounter) -> None:
    """The workers serve the least attained service first: only work no larger than a request runs before
    it there, so the door counts that work against the budget, not the batch in flight."""
    stage, r = busy_fleet(counter, AdmissionRules(depth=1, room="work", budget_s=0.05), 8192)
    assert r.outstanding.seconds > 0.05  # the batch in flight alone is over the budget
    sentence, batch = context(body={"input": "one sentence"}), context(body={"input": ["word " * 250] * 32})
    for ctx in (sentence, batch):
        resolve(CountTokens(counter).on_request(ctx))
    assert stage.on_request(sentence) is None
    verdict = stage.on_request(batch)
    assert type(verdict) is Wait
    verdict.work.close()  # type: ignore[attr-defined]


def test_a_sentence_is_not_held_behind_a_waiting_batch_that_does_not_fit(counter: TokenCounter) -> None:
    """Room in work: a batch waiting for room for itself does not hold a sentence that fits now."""
    stage, r = busy_fleet(counter, AdmissionRules(depth=1, room="work", budget_s=0.05, early_refusal=False), 8192)
    batch, sentence = context(body={"input": ["word " * 250] * 32}), context(body={"input": "one sentence"})
    for ctx in (batch, sentence):
        resolve(CountTokens(counter).on_request(ctx))

    async def scene() -> Answer | Wait | None:
        verdict = stage.on_request(batch)
        assert type(verdict) is Wait
        waiting = asyncio.ensure_future(verdict.work)
        await asyncio.sleep(0)  # let it queue (an event-loop turn, not a timed wait)
        assert stage.gate is not None and stage.gate.waiting == 1
        passed = stage.on_request(sentence)
        waiting.cancel()
        return passed

    assert asyncio.run(scene()) is None


def test_in_flight_work_is_summed_by_request_size() -> None:
    outstanding = router().outstanding
    outstanding.begin(1, A.id, 16, 0.01)
    outstanding.begin(2, A.id, 8192, 1.0)
    assert outstanding.seconds_up_to(16) == pytest.approx(0.01)
    assert outstanding.seconds_up_to(10_000) == pytest.approx(1.01)
    outstanding.finish(2)
    outstanding.finish(1)
    assert outstanding.seconds_up_to(10_000) == 0.0 and outstanding.seconds == 0.0


def test_a_request_that_cannot_get_its_turn_in_time_is_refused_at_once_with_a_retry_after(
        counter: TokenCounter) -> None:
    stage, _ = busy_fleet(counter, AdmissionRules(depth=1, room="work", budget_s=0.01), 100_000)
    ctx = context(body={"input": ["word " * 250] * 64})
    resolve(CountTokens(counter).on_request(ctx))
    answer = stage.on_request(ctx)  # 100k tokens in flight: its predicted wait is far past 5 s
    assert answer is not None and type(answer) is Answer and answer.final and ctx.outcome == "shed"
    response = pb.ProcessingResponse.FromString(answer.message).immediate_response
    assert response.status.code == 429 and json.loads(response.body)["error"]["code"] == "overloaded"
    retry_after = {h.header.key: h.header.raw_value.decode() or h.header.value
                   for h in response.headers.set_headers}["retry-after"]
    assert int(retry_after) > 5


def test_callers_without_a_key_wait_as_one_flow_per_client_address(counter: TokenCounter) -> None:
    stage, _ = busy_fleet(counter, AdmissionRules(depth=1), 256)
    flows = set()
    for address in ("127.0.0.2:40000", "127.0.0.3:40001", "127.0.0.2:40002"):
        ctx = context()
        assert ctx.opening is not None
        ctx.opening.attributes["envoy.filters.http.ext_proc"].fields["source.address"].string_value = address
        flows.add(stage._flow(ctx))
    assert flows == {"anonymous@127.0.0.2", "anonymous@127.0.0.3"}  # by address, not by connection
    keyed = context()
    keyed.caller = Caller("acme", "key_1", Priority.STANDARD, Priority.CRITICAL, 1.0, TenantQuota())
    assert stage._flow(keyed) == "acme"


# --- the pipeline and operator stages ------------------------------------------------------------------------


class RefuseLong:
    """A test stage: refuses requests over ``max_tokens``."""

    name = "refuse_long"

    def __init__(self, max_tokens: int = 3) -> None:
        self.max_tokens = max_tokens

    def on_request(self, request: RequestView) -> Reply | None:
        if request.tokens > self.max_tokens:
            return Reply(400, "too_long", "too long", type="invalid_request_error")
        return None


class Raises:
    """A test stage that always fails."""

    def on_request(self, request: RequestView) -> Reply | None:
        raise RuntimeError("broken stage")


class Hangs:
    """A test stage that never answers in time."""

    async def on_request(self, request: RequestView) -> Reply | None:
        await asyncio.sleep(3600)
        return None


class ReturnsJunk:
    def on_request(self, request: RequestView) -> object:
        return "yes"


def collaborators(counter: TokenCounter) -> Collaborators:
    return Collaborators(StaticViewSource(static_view([A, B])), counter, router(), ExtProcMetrics(),
                         MemoryQuotaStore())


def test_the_pipeline_declares_its_order_and_finds_each_hook_once(counter: TokenCounter) -> None:
    stages = build_stages(ServiceSettings(cache_max_bytes=1 << 20), collaborators(counter),
                          PickPolicySpec("least_completion_time"))
    assert stages.names == ["caller", "route", "count", "quota", "models", "cache", "admission", "decide", "learn",
                            "usage"]
    assert [h.__self__.name for h in stages.on_request] == ["count", "quota", "models", "cache", "admission",
                                                             "decide"]
    assert [h.__self__.name for h in stages.on_request_headers] == ["caller", "route", "admission"]
    assert "cache" not in build_stages(ServiceSettings(), collaborators(counter),
                                       PickPolicySpec("least_completion_time")).names  # off: not in the way


def test_an_operator_stage_runs_before_the_stage_it_names_and_can_refuse(counter: TokenCounter) -> None:
    spec = OperatorStageSpec("tests.test_ext_proc_stages:RefuseLong", {"max_tokens": 3}, before="cache")
    c = collaborators(counter)
    stages = build_stages(ServiceSettings(stages=(spec,)), c, PickPolicySpec("least_completion_time"), HERE)
    name = "operator:tests.test_ext_proc_stages:RefuseLong"
    assert stages.names.index(name) == stages.names.index("admission") - 1  # no cache: the next one
    stage = stages.by_name[name]
    short, long = context(body={"input": "hi"}), context(body={"input": "a b c d e f g h"})
    for ctx in (short, long):
        CountTokens(counter).on_request(ctx)
    assert stage.on_request(short) is None
    answer = stage.on_request(long)
    assert answer is not None and answer.final and answer_json(answer)[1]["error"]["code"] == "too_long"


@pytest.mark.parametrize("plugin", ["Raises", "Hangs", "ReturnsJunk"])
def test_a_failing_operator_stage_is_skipped_and_counted(counter: TokenCounter, plugin: str) -> None:
    metrics = ExtProcMetrics()
    source = StaticViewSource(static_view([A]))
    stage = OperatorStage(OperatorStageSpec(f"tests.test_ext_proc_stages:{plugin}", timeout_s=0.01), HERE,
                          metrics, Replies(metrics, source))
    ctx = context(body={"input": "x"})
    CountTokens(counter).on_request(ctx)
    assert resolve(stage.on_request(ctx)) is None  # the request goes on
    assert metrics.counts["stage_failures"] == {f"operator:tests.test_ext_proc_stages:{plugin}": 1}


def test_an_operator_stage_outside_the_allowlist_is_refused_at_start_up() -> None:
    spec = OperatorStageSpec("tests.test_ext_proc_stages:RefuseLong")
    with pytest.raises(PolicyNotFound, match="not under a module prefix"):
        check_operator_stages([spec], PolicyAllowlist())
    with pytest.raises(ValueError, match="before='learn' is not one of"):
        check_operator_stages([OperatorStageSpec(spec.plugin, before="learn")], HERE)
    check_operator_stages([spec], HERE)


def test_two_stages_of_one_name_are_refused() -> None:
    class Named:
        name = "x"

    with pytest.raises(ValueError, match="same name"):
        Stages([Named(), Named()])
