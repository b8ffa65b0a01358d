"""Routing by model through ext_proc's real gRPC service (no Envoy): the x-inferlb-model header, ext_proc's own
404 and GET /v1/models, the per-version metrics, and the rich EDS the control plane's real ADS server builds
from a fleet whose workers say what they serve (issue 15).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.model import Endpoint, FleetState, Health
from ext_proc.model import EndpointView
from ext_proc.server import ServiceSettings
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import XdsClient, XdsClientSettings, static_view
from inferlb_runtime.model_routing import MODEL_HEADER, Rollout

from .test_ext_proc_service import (
    PICK,
    AdsServer,
    counter,  # noqa: F401  (the module's token counter fixture)
    exchange,
    request_body,
    request_headers,
    response_headers,
    serving,
    set_headers,
    until,
)

pytestmark = pytest.mark.servers

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
FAMILY, ST = "all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2"
A = EndpointView("127.0.0.1:8101", "127.0.0.1", 8101, models=(INT8,), model_aliases=(FAMILY, ST))
B = EndpointView("127.0.0.1:8102", "127.0.0.1", 8102, models=(FP32,), model_aliases=(FAMILY, ST))
CANARY = Rollout(FAMILY, ((INT8, 90.0), (FP32, 10.0)))


def removed(response: object, phase: str) -> list[str]:
    return list(getattr(response, phase).response.header_mutation.remove_headers)


def metric_samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_chosen_version_reaches_the_worker_in_its_header_and_a_clients_own_is_removed(
        counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A, B], rollouts=[CANARY])) as h:
            call = h.stub.Process()
            first = await exchange(call, request_headers({MODEL_HEADER: INT8}))
            assert MODEL_HEADER in removed(first, "request_headers")  # only ext_proc chooses the version
            second = await exchange(call, request_body({"model": FP32, "input": "hello"}))
            headers = set_headers(second.request_body.response.header_mutation)
            assert headers[MODEL_HEADER] == FP32 and headers[PICK] == B.id
            answer = await exchange(call, response_headers({":status": "200", MODEL_HEADER: FP32,
                                                            "server-timing": "compute;dur=5"}))
            assert answer.WhichOneof("response") == "response_headers"

            # A bare alias (no rollout for it): no version chosen, the worker picks its first with the alias.
            call = h.stub.Process()
            await exchange(call, request_headers())
            body = await exchange(call, request_body({"model": ST, "input": "hello"}))
            headers = set_headers(body.request_body.response.header_mutation)
            assert MODEL_HEADER not in headers and headers[PICK].split(",")[0] in {A.id, B.id}
            call.cancel()

            samples = metric_samples(h.servicer.metrics.render().decode())
            assert samples[("inferlb_ext_proc_model_requests_total",
                            frozenset({("model", FP32), ("code_class", "2xx")}))] == 1
            assert samples[("inferlb_ext_proc_model_response_seconds_count", frozenset({("model", FP32)}))] == 1
            assert samples[("inferlb_ext_proc_model_decisions_total", frozenset({("model", FP32)}))] == 1
            assert samples[("inferlb_ext_proc_model_decisions_total", frozenset({("model", "other")}))] == 1
            # The version that served taught its own cost fit.
            assert h.servicer.router.cost.observed(B.id, FP32) == 1

    asyncio.run(scenario())


def test_an_unknown_model_is_answered_404_by_ext_proc(counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A, B], rollouts=[CANARY])) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            answer = await exchange(call, request_body({"model": "text-embedding-3-small", "input": "hello"}))
            assert answer.WhichOneof("response") == "immediate_response"
            reply = answer.immediate_response
            assert reply.status.code == 404 and reply.details == "inferlb_model_not_found"
            error = json.loads(reply.body)["error"]
            assert (error["code"], error["type"], error["param"]) == (
                "model_not_found", "invalid_request_error", "model")
            assert "'text-embedding-3-small'" in error["message"] and FP32 in error["message"]
            assert len(h.servicer.router.outstanding) == 0  # nothing went anywhere
            samples = metric_samples(h.servicer.metrics.render().decode())
            assert samples[("inferlb_ext_proc_model_requests_total",
                            frozenset({("model", "other"), ("code_class", "4xx")}))] == 1
            assert samples[("inferlb_ext_proc_admit_replies_total", frozenset({("code", "model_not_found")}))] == 1

    asyncio.run(scenario())


def test_an_unknown_model_is_404_even_when_nothing_is_routable_or_the_fleet_is_saturated(
        counter: TokenCounter) -> None:  # noqa: F811
    """Its answer does not depend on the fleet's state: no 503 while every worker is down, and no wait in the
    fair queue (nor an extended Envoy timeout) while the fleet is saturated."""
    down = dataclasses.replace(A, healthy=False)

    async def scenario() -> None:
        async with serving(counter, static_view([down])) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            answer = await exchange(call, request_body({"model": "no-such-model", "input": "hello"}))
            assert answer.immediate_response.status.code == 404
            call = h.stub.Process()  # a known model with nothing routable: still the fleet's 503
            await exchange(call, request_headers())
            answer = await exchange(call, request_body({"model": INT8, "input": "hello"}))
            assert answer.immediate_response.status.code == 503
        async with serving(counter, static_view([A]), settings=ServiceSettings(fair_queue_depth=1)) as h:
            holder = h.stub.Process()
            await exchange(holder, request_headers())
            held = await exchange(holder, request_body({"model": INT8, "input": "hello"}))
            assert held.WhichOneof("response") == "request_body"  # routed: the one endpoint is now full
            assert not h.servicer.gate.passes_now()
            call = h.stub.Process()
            await exchange(call, request_headers())
            answer = await exchange(call, request_body({"model": "no-such-model", "input": "hello"}))
            assert answer.WhichOneof("response") == "immediate_response"  # not override_message_timeout
            assert answer.immediate_response.status.code == 404 and h.servicer.gate.waiting == 0
            holder.cancel()

    asyncio.run(scenario())


def test_get_v1_models_is_answered_by_ext_proc_from_the_catalogue(counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A, B], rollouts=[CANARY])) as h:
            def get(path: str) -> object:
                return request_headers({":path": path}, method="GET", end_of_stream=True)

            call = h.stub.Process()
            answer = (await exchange(call, get("/v1/models?limit=5"))).immediate_response
            assert answer.status.code == 200
            listed = json.loads(answer.body)
            assert listed["object"] == "list"
            by_id = {m["id"]: m for m in listed["data"]}
            assert set(by_id) == {INT8, FP32, FAMILY, ST}
            assert by_id[FAMILY]["inferlb"]["rollout"]["versions"] == {INT8: 90.0, FP32: 10.0}

            call = h.stub.Process()
            one = (await exchange(call, get("/v1/models/sentence-transformers%2Fall-MiniLM-L6-v2"))).immediate_response
            assert one.status.code == 200 and json.loads(one.body)["id"] == ST
            call = h.stub.Process()
            missing = (await exchange(call, get("/v1/models/nope"))).immediate_response
            assert missing.status.code == 404 and json.loads(missing.body)["error"]["code"] == "model_not_found"

        # Workers that do not say what they serve: the request goes to one of them, as before.
        async with serving(counter, static_view([EndpointView(A.id, A.address, A.port)])) as h:
            call = h.stub.Process()
            answer = await exchange(call, get("/v1/models"))
            assert answer.WhichOneof("response") == "request_headers"
            assert set_headers(answer.request_headers.response.header_mutation)[PICK] == A.id
            call.cancel()

    asyncio.run(scenario())


def test_the_xds_client_reads_what_the_control_planes_rich_eds_says_each_worker_serves() -> None:
    state = FleetState(endpoints=(
        Endpoint("127.0.0.1", 8101, health=Health.HEALTHY, models=(INT8,), model_aliases=(FAMILY, ST)),
        Endpoint("127.0.0.1", 8102, health=Health.HEALTHY, models=(FP32,), model_aliases=(FAMILY,), pool="gpu-less"),
    ), rollouts=(CANARY,))

    async def scenario() -> None:
        async with AdsServer() as ads:
            ads.publish(state)
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id="ext-proc-models")) as xds:
                view = await xds.wait_ready(10)
                a, b = (view.by_id[f"127.0.0.1:{p}"] for p in (8101, 8102))
                assert (a.models, a.model_aliases, a.pool) == ((INT8,), (FAMILY, ST), "default")
                assert (b.models, b.model_aliases, b.pool) == ((FP32,), (FAMILY,), "gpu-less")
                assert view.rollouts == {FAMILY: CANARY} and view.rollouts_error is None
                assert view.catalogue.serving[FAMILY] == {a.id, b.id}
                ads.publish(FleetState(endpoints=state.endpoints))  # the rollout deleted
                await until(lambda: xds.view is not None and not xds.view.rollouts, 10, "the rollout to go")

    asyncio.run(scenario())

