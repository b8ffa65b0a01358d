"""API keys and quotas on ext_proc's per-request path, through its real gRPC server in process.

The key table is given to the view source as the control plane would push it; the quota store is the
in-process one. What is checked is what Envoy receives on each phase: an immediate 401/429/503 in OpenAI's
shape, or the pick with the key removed and the class the key allows, then the x-ratelimit-* headers on
the response. The same path through real Envoy: tests/test_tenants_envoy.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.callers import ANONYMOUS, identify
from ext_proc.model import EndpointView
from ext_proc.server import ServiceSettings
from ext_proc.xds.tenants import KeyTable
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import static_view
from inferlb_runtime.api_keys import KeyEntry, Quota, hash_key
from inferlb_runtime.request_class import Priority

from .stack import prometheus_samples, sample
from .test_ext_proc_service import (PICK, exchange, request_body, request_headers, response_headers, serving,
                                    set_headers, until)

pytestmark = pytest.mark.servers

A = EndpointView("127.0.0.1:8201", "127.0.0.1", 8201)
KEY, BATCH_KEY = "ilb-test-key-acme", "ilb-test-key-batch"
TABLE = KeyTable.of("v1", [
    KeyEntry(hash_key(KEY), "key_acme", "acme", Priority.STANDARD, 1.0, Quota(requests_per_minute=2)),
    KeyEntry(hash_key(BATCH_KEY), "key_batch", "batch", Priority.SHEDDABLE),
])
REQUIRED = ServiceSettings(require_api_keys=True)
BODY = {"input": "a sentence"}


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def error_of(response: pb.ProcessingResponse) -> tuple[int, dict, dict[str, str]]:
    assert response.WhichOneof("response") == "immediate_response", response
    immediate = response.immediate_response
    return immediate.status.code, json.loads(immediate.body)["error"], set_headers(immediate.headers)


def test_identify_follows_the_rules_of_callers_py() -> None:
    assert identify(None, TABLE, False) is ANONYMOUS
    assert identify("Bearer ilb-unknown", TABLE, False) is ANONYMOUS  # not required: an SDK's dummy key is fine
    assert identify("Basic abc", TABLE, True).code == "invalid_api_key"  # type: ignore[union-attr]
    assert identify(f"Bearer {KEY}", None, True).status == 503  # type: ignore[union-attr]
    caller = identify(f"bearer  {BATCH_KEY} ", TABLE, True)
    assert caller.tenant == "batch"  # type: ignore[union-attr]
    assert caller.priority_for(Priority.CRITICAL) is Priority.SHEDDABLE  # type: ignore[union-attr]
    assert caller.priority_for(None) is Priority.SHEDDABLE  # type: ignore[union-attr]
    assert ANONYMOUS.priority_for(Priority.CRITICAL) is Priority.CRITICAL


@pytest.mark.parametrize("headers,code,status", [
    ({}, "invalid_api_key", 401),
    (bearer("ilb-unknown"), "invalid_api_key", 401),
    ({"authorization": "Basic dXNlcjpwYXNz"}, "invalid_api_key", 401),
], ids=["missing", "unknown", "not-bearer"])
def test_without_a_live_key_the_answer_is_401_before_any_body(counter: TokenCounter, headers: dict, code: str,
                                                             status: int) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=REQUIRED) as h:
            h.source.set_key_table(TABLE)
            call = h.stub.Process()
            got, error, _ = error_of(await exchange(call, request_headers(headers)))
            assert (got, error["code"], error["type"]) == (status, code, "invalid_request_error")
            assert "API key" in error["message"]
            call.cancel()
            samples = prometheus_samples(h.servicer.metrics.render().decode())
            assert sample(samples, "inferlb_ext_proc_auth_failures_total",
                          reason="missing_key" if not headers else "invalid_key") == 1

    asyncio.run(scenario())


def test_no_key_table_yet_is_503_not_401(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=REQUIRED) as h:
            call = h.stub.Process()
            status, error, headers = error_of(await exchange(call, request_headers(bearer(KEY))))
            assert (status, error["code"], headers["retry-after"]) == (503, "api_keys_unavailable", "1")
            call.cancel()

    asyncio.run(scenario())


def test_a_known_key_is_removed_and_its_class_is_the_best_the_request_gets(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=REQUIRED) as h:
            h.source.set_key_table(TABLE)
            call = h.stub.Process()
            first = await exchange(call, request_headers({**bearer(BATCH_KEY),
                                                          "x-gateway-inference-objective": "critical"}))
            mutation = first.request_headers.response.header_mutation
            assert list(mutation.remove_headers) == ["authorization"]  # the worker never sees the key
            assert set_headers(mutation)["x-gateway-inference-objective"] == "sheddable"
            second = await exchange(call, request_body(BODY))
            assert set_headers(second.request_body.response.header_mutation)[PICK].startswith(A.id)
            call.cancel()

            # A GET is decided at its headers: the same mutation rides on the pick.
            call = h.stub.Process()
            answer = await exchange(call, request_headers(bearer(BATCH_KEY), method="GET", end_of_stream=True))
            mutation = answer.request_headers.response.header_mutation
            assert list(mutation.remove_headers) == ["authorization"]
            assert set_headers(mutation)["x-gateway-inference-objective"] == "sheddable"
            assert set_headers(mutation)[PICK].startswith(A.id)
            call.cancel()

    asyncio.run(scenario())


def test_keys_not_required_an_unknown_key_is_anonymous_and_still_not_forwarded(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A])) as h:
            h.source.set_key_table(TABLE)
            call = h.stub.Process()
            first = await exchange(call, request_headers(bearer("sk-anything")))
            assert list(first.request_headers.response.header_mutation.remove_headers) == ["authorization"]
            second = await exchange(call, request_body(BODY))
            assert second.WhichOneof("response") == "request_body"
            last = await exchange(call, response_headers({":status": "200"}))
            assert not any(k.startswith("x-ratelimit") for k in set_headers(last.response_headers.response
                                                                               .header_mutation))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            samples = prometheus_samples(h.servicer.metrics.render().decode())
            assert sample(samples, "inferlb_ext_proc_tenant_requests_total", tenant="anonymous",
                          outcome="served") == 1

    asyncio.run(scenario())


def test_over_the_quota_is_429_with_openais_headers_and_nothing_routed(counter: TokenCounter) -> None:
    async def one(h, expect_pick: bool) -> pb.ProcessingResponse:  # type: ignore[no-untyped-def]
        call = h.stub.Process()
        await exchange(call, request_headers(bearer(KEY)))
        answer = await exchange(call, request_body(BODY))
        if expect_pick:
            last = await exchange(call, response_headers({":status": "200"}))
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            return last
        call.cancel()
        return answer

    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=REQUIRED) as h:
            h.source.set_key_table(TABLE)
            first = set_headers((await one(h, True)).response_headers.response.header_mutation)
            assert (first["x-ratelimit-limit-requests"], first["x-ratelimit-remaining-requests"]) == ("2", "1")
            assert first["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in first  # the key has no token limit
            await one(h, True)
            status, error, headers = error_of(await one(h, False))
            assert (status, error["code"], error["type"]) == (429, "rate_limit_exceeded", "requests")
            assert "requests per min (RPM): Limit 2, Used 2" in error["message"]
            assert headers["x-ratelimit-remaining-requests"] == "0"
            assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) >= 1
            assert len(h.servicer.router.outstanding) == 0  # nothing was routed
            usage = lambda outcome: sample(prometheus_samples(h.servicer.metrics.render().decode()),  # noqa: E731
                                           "inferlb_ext_proc_tenant_requests_total", tenant="acme", outcome=outcome)
            await until(lambda: usage("rate_limited") == 1, 5, "the refused stream to end")
            assert usage("served") == 2
            samples = prometheus_samples(h.servicer.metrics.render().decode())
            assert sample(samples, "inferlb_ext_proc_admit_replies_total", code="rate_limit_exceeded") == 1

    asyncio.run(scenario())


# --- fair admission ----------------------------------------------------------------------------------

FAIR = ServiceSettings(fair_queue_depth=1)  # one endpoint: a second request in flight waits its turn
HEAVY, LIGHT = "ilb-test-key-heavy", "ilb-test-key-light"
FAIR_TABLE = KeyTable.of("v1", [KeyEntry(hash_key(HEAVY), "key_heavy", "heavy"),
                                KeyEntry(hash_key(LIGHT), "key_light", "light")])


def test_a_saturated_fleet_admits_in_weighted_fair_order_not_arrival_order(counter: TokenCounter) -> None:
    """heavy's first request holds the one endpoint; heavy queues two more, then light one. Each finish lets
    one in: heavy's older one first (equal tags, earlier arrival), then light's before heavy's second
    (its tenant's finish tag is smaller): fair order, where arrival order would serve light last. Envoy is
    told to wait longer for the answer of a queued request (override_message_timeout) before it waits."""
    async def start(h, key: str) -> grpc.aio.StreamStreamCall:  # type: ignore[no-untyped-def]
        call = h.stub.Process()
        await exchange(call, request_headers(bearer(key)))
        await call.write(request_body(BODY))
        return call

    async def picked(call: grpc.aio.StreamStreamCall) -> None:
        answer = await call.read()
        assert answer.WhichOneof("response") == "request_body", answer

    async def finish(call: grpc.aio.StreamStreamCall) -> None:
        await exchange(call, response_headers({":status": "200"}))
        await call.done_writing()

    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=FAIR) as h:
            h.source.set_key_table(FAIR_TABLE)
            outstanding = h.servicer.router.outstanding  # keyed by stream: 1, 2, ... in the order started
            first = await start(h, HEAVY)
            await picked(first)
            waiting = [await start(h, HEAVY), await start(h, HEAVY), await start(h, LIGHT)]  # streams 2, 3, 4
            for call in waiting:
                extend = await call.read()
                assert extend.WhichOneof("response") is None and extend.override_message_timeout.seconds > 1
            await until(lambda: h.servicer.gate.waiting == 3, 5, "three requests to queue")
            current, served = first, []
            for _ in waiting:
                await finish(current)
                await until(lambda: any(k in outstanding for k in (2, 3, 4) if k not in served), 5,
                            "the next request to be admitted")
                key = next(k for k in (2, 3, 4) if k not in served and k in outstanding)
                served.append(key)
                current = waiting[key - 2]
                await picked(current)
            assert served == [2, 4, 3]  # heavy, light, heavy: arrival order would be 2, 3, 4
            await finish(current)
            samples = prometheus_samples(h.servicer.metrics.render().decode())
            assert sample(samples, "inferlb_ext_proc_fair_queue_wait_seconds_count", how="admitted") == 3

    asyncio.run(scenario())


def test_a_shed_request_of_a_key_with_limits_carries_the_rate_limit_headers_too(counter: TokenCounter) -> None:
    """Every answer to a key with limits has OpenAI's x-ratelimit-* headers, a 429 overloaded included."""
    busy = dataclasses.replace(A, telemetry={"inflight": 1000.0})  # seconds of predicted work: over any SLO
    table = KeyTable.of("v1", [KeyEntry(hash_key(KEY), "key_acme", "acme", Priority.SHEDDABLE, 1.0,
                                        Quota(requests_per_minute=5))])

    async def scenario() -> None:
        async with serving(counter, static_view([busy]), settings=REQUIRED) as h:
            h.source.set_key_table(table)
            call = h.stub.Process()
            await exchange(call, request_headers(bearer(KEY)))
            status, error, headers = error_of(await exchange(call, request_body(BODY)))
            assert (status, error["code"]) == (429, "overloaded")
            assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("5", "4")
            call.cancel()

    asyncio.run(scenario())
