"""The Endpoint Picker Protocol in process (issue 18): FULL_DUPLEX_STREAMED, the subset hint, the served
endpoint, the health services. The real gRPC server and a real client stream; only the view is injected
(the harness of ``test_ext_proc_service``). Through Envoy: ``test_epp_gateway_envoy``."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ext_proc.server import ServiceSettings
from ext_proc.tokens import TokenCounter
from ext_proc.wire import ENDPOINT_RESPONSE_HEADER, STREAMED_CHUNK_BYTES, Subset, subset_hint
from ext_proc.xds.client import static_view

from .test_ext_proc_service import (
    PICK,
    A,
    B,
    C,
    exchange,
    headers_message,
    pick_metadata,
    request_headers,
    serving,
    set_headers,
)

pytestmark = pytest.mark.servers

MODE = processing_mode_pb2.ProcessingMode
DUPLEX = pb.ProtocolConfiguration(request_body_mode=MODE.FULL_DUPLEX_STREAMED,
                                  response_body_mode=MODE.FULL_DUPLEX_STREAMED)


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


def duplex_headers(subset: struct_pb2.Value | None = None) -> pb.ProcessingRequest:
    """The first message of a FULL_DUPLEX_STREAMED stream, as Envoy sends it (with protocol_config)."""
    message = request_headers()
    message.protocol_config.CopyFrom(DUPLEX)
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"].CopyFrom(subset)
    return message


def chunk(data: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def strings(*values: str) -> struct_pb2.Value:
    value = struct_pb2.Value()
    value.list_value.values.extend(struct_pb2.Value(string_value=v) for v in values)
    return value


async def read(call: grpc.aio.StreamStreamCall) -> pb.ProcessingResponse:
    response = await call.read()
    assert response is not grpc.aio.EOF
    return response


def echoed(responses: list[pb.ProcessingResponse]) -> bytes:
    return b"".join(r.request_body.response.body_mutation.streamed_response.body for r in responses)


# --- FULL_DUPLEX_STREAMED ------------------------------------------------------------------------------


def test_full_duplex_request_is_held_until_the_body_then_picked_and_echoed(counter: TokenCounter) -> None:
    body = json.dumps({"input": "the endpoint picker protocol " * 10}).encode()

    async def scenario() -> None:
        async with serving(counter, static_view([A, B])) as h:
            call = h.stub.Process()
            await call.write(duplex_headers())
            await call.write(chunk(body[:20], False))  # nothing is answered until the decision
            await call.write(chunk(body[20:], True))
            decision = await read(call)
            assert decision.WhichOneof("response") == "request_headers"  # the headers' answer carries the pick
            picks = set_headers(decision.request_headers.response.header_mutation)[PICK]
            assert picks.split(",")[0] in (A.id, B.id)
            assert pick_metadata(decision) == picks  # the header and the metadata never differ
            echo = await read(call)
            streamed = echo.request_body.response.body_mutation.streamed_response
            assert streamed.body == body and streamed.end_of_stream
            assert len(h.servicer.router.outstanding) == 1
            # The response: headers answered, each body chunk passed through, learnt and released at the end.
            answer = await exchange(call, pb.ProcessingRequest(response_headers=headers_message(
                {":status": "200", "server-timing": "compute;dur=4.0"})))
            assert set_headers(answer.response_headers.response.header_mutation)[ENDPOINT_RESPONSE_HEADER] \
                == picks.split(",")[0]
            assert len(h.servicer.router.outstanding) == 1  # still streaming
            first = await exchange(call, pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"data":')))
            assert first.response_body.response.body_mutation.streamed_response.body == b'{"data":'
            last = await exchange(call, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"[]}",
                                                                                      end_of_stream=True)))
            passed = last.response_body.response.body_mutation.streamed_response
            assert passed.body == b"[]}" and passed.end_of_stream
            assert await call.read() is grpc.aio.EOF  # nothing else comes: the stream ends
            assert len(h.servicer.router.outstanding) == 0
            assert h.servicer.router.cost.observations == 1

    asyncio.run(scenario())


def test_full_duplex_large_body_is_echoed_in_chunks_and_trailers_end_it(counter: TokenCounter) -> None:
    body = json.dumps({"input": ["x " * 80_000]}).encode()
    assert len(body) > 2 * STREAMED_CHUNK_BYTES

    async def scenario() -> None:
        async with serving(counter, static_view([A])) as h:
            call = h.stub.Process()
            await call.write(duplex_headers())
            await call.write(chunk(body, False))  # no end_of_stream: the trailers end the body
            await call.write(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
            decision = await read(call)
            assert set_headers(decision.request_headers.response.header_mutation)[PICK] == A.id
            answers = [await read(call) for _ in range(-(-len(body) // STREAMED_CHUNK_BYTES))]
            assert echoed(answers) == body
            assert not any(a.request_body.response.body_mutation.streamed_response.end_of_stream for a in answers)
            assert (await read(call)).WhichOneof("response") == "request_trailers"
            call.cancel()

    asyncio.run(scenario())


def test_full_duplex_body_over_the_cap_is_413(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A]), settings=ServiceSettings(max_body_bytes=2048)) as h:
            call = h.stub.Process()
            await call.write(duplex_headers())
            await call.write(chunk(b"x" * 1500, False))
            await call.write(chunk(b"x" * 1500, False))
            refused = await read(call)
            assert refused.immediate_response.status.code == 413

    asyncio.run(scenario())


def test_full_duplex_get_is_decided_on_its_headers(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A])) as h:
            call = h.stub.Process()
            message = request_headers(method="GET", end_of_stream=True)
            message.protocol_config.CopyFrom(DUPLEX)
            decision = await exchange(call, message)
            assert set_headers(decision.request_headers.response.header_mutation)[PICK] == A.id
            call.cancel()

    asyncio.run(scenario())


# --- the subset hint ---------------------------------------------------------------------------------


def test_subset_hint_restricts_the_candidates(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B, C])) as h:
            for subset in (strings(B.id), struct_pb2.Value(string_value=f" {B.id} ,10.9.9.9:1")):
                for _ in range(3):
                    call = h.stub.Process()
                    await call.write(duplex_headers(subset))
                    await call.write(chunk(b'{"input": "subset"}', True))
                    decision = await read(call)
                    assert set_headers(decision.request_headers.response.header_mutation)[PICK] == B.id
                    call.cancel()

    asyncio.run(scenario())


def test_subset_hint_with_nothing_eligible_is_503(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B])) as h:
            for subset in (strings("10.0.0.9:8000"), strings(), struct_pb2.Value(number_value=3)):
                call = h.stub.Process()
                await call.write(duplex_headers(subset))
                await call.write(chunk(b'{"input": "none of them"}', True))
                refused = await read(call)
                assert refused.immediate_response.status.code == 503
                assert json.loads(refused.immediate_response.body)["error"]["code"] == "no_endpoint_in_subset"
            assert len(h.servicer.router.outstanding) == 0

    asyncio.run(scenario())


def test_subset_entries_ip_port_bracketed_ipv6_and_bare_ip() -> None:
    metadata = base_pb2.Metadata()
    metadata.filter_metadata["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"].CopyFrom(
        strings("10.0.0.1:8000,[2001:db8::1]:9000", "10.0.0.2", "not-an-address"))
    subset = subset_hint(metadata)
    assert subset == Subset(frozenset({"10.0.0.1:8000", "2001:db8::1:9000"}), frozenset({"10.0.0.2"}))
    assert subset.allows("10.0.0.1:8000") and not subset.allows("10.0.0.1:8001")
    assert subset.allows("10.0.0.2:1234") and subset.allows("2001:db8::1:9000")
    assert subset_hint(base_pb2.Metadata()) is None  # not set: the whole pool


# --- the served endpoint -------------------------------------------------------------------------------


def test_learning_follows_the_endpoint_the_data_plane_reports_as_served(counter: TokenCounter) -> None:
    """BUFFERED too: the served report is the data plane's, whatever the body mode."""
    async def scenario() -> None:
        async with serving(counter, static_view([A, B])) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            decision = await exchange(call, pb.ProcessingRequest(request_body=pb.HttpBody(
                body=b'{"input": "walked"}', end_of_stream=True)))
            primary = set_headers(decision.request_body.response.header_mutation)[PICK].split(",")[0]
            other = B if primary == A.id else A
            message = pb.ProcessingRequest(response_headers=headers_message(
                {":status": "200", "server-timing": "compute;dur=3.0"}))
            message.metadata_context.filter_metadata["envoy.lb"].fields[
                "x-gateway-destination-endpoint-served"].string_value = other.id
            answer = await exchange(call, message)
            assert set_headers(answer.response_headers.response.header_mutation)[ENDPOINT_RESPONSE_HEADER] == other.id
            assert h.servicer.metrics.counts["served"]["fallback"] == 1
            cost = h.servicer.router.cost
            assert cost.observed(other.id) == 1 and cost.observed(primary) == 0  # learnt for the one that served

    asyncio.run(scenario())


# --- health ------------------------------------------------------------------------------------------


def test_health_services_liveness_readiness_and_ext_proc(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, None) as h:
            health = health_pb2_grpc.HealthStub(h.channel)

            async def status(service: str) -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

            assert await status("liveness") == health_pb2.HealthCheckResponse.SERVING  # alive without a view
            for service in ("readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await status(service) == health_pb2.HealthCheckResponse.NOT_SERVING
            h.source.set(static_view([A]))
            deadline = asyncio.get_running_loop().time() + 5
            while await status("readiness") != health_pb2.HealthCheckResponse.SERVING:
                assert asyncio.get_running_loop().time() < deadline, "readiness never became SERVING"
                await asyncio.sleep(0.01)
            assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == \
                health_pb2.HealthCheckResponse.SERVING

    asyncio.run(scenario())
