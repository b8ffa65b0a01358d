"""The gateway cache through ext_proc's real gRPC service (no Envoy): a miss asks Envoy for the response body
(mode_override) and stores it; the same question then gets an ImmediateResponse with the stored answer, after the
quota check; no-cache, no-store, a non-200, a foreign version and a rollout's other version are never mixed up."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
import pytest

from ext_proc.model import EndpointView
from ext_proc.server import ServiceSettings
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import static_view
from inferlb_runtime.model_routing import MODEL_HEADER

from .test_ext_proc_service import (
    counter,  # noqa: F401  (the module's token counter fixture)
    exchange,
    request_body,
    request_headers,
    response_headers,
    serving,
    set_headers,
)
from .test_ext_proc_tenants import BATCH_KEY, KEY, TABLE, bearer

pytestmark = pytest.mark.servers

INT8, FP32 = "all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32"
FAMILY = "all-MiniLM-L6-v2"
A = EndpointView("127.0.0.1:8101", "127.0.0.1", 8101, models=(INT8, FP32), model_aliases=(FAMILY,))
CACHED = ServiceSettings(cache_max_bytes=1 << 20)
ANSWER = json.dumps({"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.25, -0.5]}],
                     "model": INT8, "usage": {"prompt_tokens": 3, "total_tokens": 3}}).encode()
BUFFERED_PARTIAL = processing_mode_pb2.ProcessingMode.BUFFERED_PARTIAL


async def ask(h: Any, body: dict, headers: dict | None = None) -> tuple[Any, pb.ProcessingResponse]:
    call = h.stub.Process()
    await exchange(call, request_headers(headers))
    return call, await exchange(call, request_body(body))


async def served(call: Any, version: str = INT8, status: str = "200", body: bytes = ANSWER) -> pb.ProcessingResponse:
    """The worker's answer going back through the stream; the response-headers answer."""
    answer = await exchange(call, response_headers({":status": status, MODEL_HEADER: version,
                                                    "content-type": "application/json",
                                                    "content-length": str(len(body))}))
    if answer.mode_override.response_body_mode == BUFFERED_PARTIAL:
        last = await exchange(call, pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True)))
        assert last.WhichOneof("response") == "response_body"
    return answer


def cache_samples(h: Any) -> dict[tuple[str, str], float]:
    return {(s.labels["level"], s.labels.get("result", "")): s.value
            for family in text_string_to_metric_families(h.servicer.metrics.render().decode())
            for s in family.samples if s.name == "inferlb_ext_proc_cache_requests_total"}


def version_answers(h: Any) -> dict[tuple[str, str], float]:
    return {(s.labels["model"], s.labels["code_class"]): s.value
            for family in text_string_to_metric_families(h.servicer.metrics.render().decode())
            for s in family.samples if s.name == "inferlb_ext_proc_model_requests_total"}


def test_a_miss_is_stored_from_the_response_body_and_the_same_question_is_answered_from_it(
        counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=CACHED) as h:
            call, first = await ask(h, {"model": INT8, "input": ["hello", "world"]})
            assert first.WhichOneof("response") == "request_body"  # routed
            answer = await served(call)
            assert set_headers(answer.response_headers.response.header_mutation)["x-inferlb-cache"] == "miss"
            assert answer.mode_override.response_body_mode == BUFFERED_PARTIAL  # asked for this one body
            assert len(h.servicer.stage("cache").cache) == 1

            # The same question, spelt otherwise: answered by ext_proc, routed nowhere.
            call, hit = await ask(h, {"input": [ "hello", "world"], "model": INT8})
            assert hit.WhichOneof("response") == "immediate_response"
            reply = hit.immediate_response
            assert reply.status.code == 200 and reply.body == ANSWER and reply.details == "inferlb_cache_hit"
            headers = set_headers(reply.headers)
            assert headers["x-inferlb-cache"] == "hit" and headers[MODEL_HEADER] == INT8
            assert headers["content-type"] == "application/json"
            assert len(h.servicer.router.outstanding) == 0
            assert cache_samples(h)[("memory", "hit")] == 1 and cache_samples(h)[("memory", "miss")] == 1
            # the hit is a 200 of that version in the per-version counts, as the worker's answer was
            assert version_answers(h)[(INT8, "2xx")] == 2

            # A stored answer needs no body: the response-headers answer of a hit never comes (Envoy
            # answered); a request answered again from the worker (no-cache) is not asked for twice.
            call, bypass = await ask(h, {"model": INT8, "input": ["hello", "world"]}, {"cache-control": "no-cache"})
            assert bypass.WhichOneof("response") == "request_body"
            assert (await served(call)).mode_override.response_body_mode == BUFFERED_PARTIAL  # refreshed
            assert cache_samples(h)[("memory", "bypass")] == 1

    asyncio.run(scenario())


def test_what_is_never_stored_and_what_never_matches(counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=CACHED) as h:
            cases = [
                ({"model": INT8, "input": "no-store"}, {"cache-control": "no-store"}, INT8, "200"),
                ({"model": INT8, "input": "an error"}, None, INT8, "400"),
                ({"model": INT8, "input": "another version"}, None, FP32, "200"),  # not what the key names
            ]
            for body, headers, version, status in cases:
                call, routed = await ask(h, body, headers)
                assert routed.WhichOneof("response") == "request_body"
                answer = await served(call, version, status)
                assert not answer.HasField("mode_override")  # the body is not asked for
                assert set_headers(answer.response_headers.response.header_mutation)["x-inferlb-cache"] == "miss"
            assert len(h.servicer.stage("cache").cache) == 0

            # Another version of the same input misses; a version leaving the catalogue takes its answers.
            call, _ = await ask(h, {"model": FP32, "input": "x"})
            await served(call, FP32)
            call, other = await ask(h, {"model": INT8, "input": "x"})
            assert other.WhichOneof("response") == "request_body"
            await served(call, INT8)
            assert len(h.servicer.stage("cache").cache) == 2
            h.source.set(static_view([EndpointView(A.id, A.address, A.port, models=(INT8,))]))
            assert len(h.servicer.stage("cache").cache) == 1

    asyncio.run(scenario())


def test_a_hit_counts_against_the_quota_and_tenants_can_be_isolated(counter: TokenCounter) -> None:  # noqa: F811
    """acme may make 2 requests a minute: a miss and a hit use them both, and the third is refused though its
    answer is stored. With cache_per_tenant, batch's same question is its own miss."""
    async def scenario() -> None:
        settings = ServiceSettings(cache_max_bytes=1 << 20, cache_per_tenant=True)
        async with serving(counter, static_view([A]), settings=settings) as h:
            h.source.set_key_table(TABLE)
            body = {"model": INT8, "input": "per tenant"}
            call, _ = await ask(h, body, bearer(KEY))
            await served(call)
            _, hit = await ask(h, body, bearer(KEY))
            assert hit.immediate_response.status.code == 200
            assert set_headers(hit.immediate_response.headers)["x-ratelimit-remaining-requests"] == "0"
            call, refused = await ask(h, body, bearer(KEY))
            assert refused.immediate_response.status.code == 429
            call.cancel()
            _, other = await ask(h, body, bearer(BATCH_KEY))
            assert other.WhichOneof("response") == "request_body"  # batch does not see acme's answers
            samples = {(s.labels["tenant"], s.labels["outcome"]): s.value
                       for family in text_string_to_metric_families(h.servicer.metrics.render().decode())
                       for s in family.samples if s.name == "inferlb_ext_proc_tenant_requests_total"}
            assert samples[("acme", "served")] == 2  # the miss and the hit

    asyncio.run(scenario())


def test_the_cache_off_still_says_miss(counter: TokenCounter) -> None:  # noqa: F811
    async def scenario() -> None:
        async with serving(counter, static_view([A])) as h:  # cache_max_bytes 0: off
            assert "cache" not in h.servicer.stages.names
            call, _ = await ask(h, {"model": INT8, "input": "x"})
            answer = await served(call)
            assert set_headers(answer.response_headers.response.header_mutation)["x-inferlb-cache"] == "miss"
            assert not answer.HasField("mode_override")

    asyncio.run(scenario())
