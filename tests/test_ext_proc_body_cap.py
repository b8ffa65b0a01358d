"""ext_proc never buffers more request body than Envoy's limit: over it, an immediate 413 in OpenAI's
error shape, and the stream ends.

Through the real gRPC service (``tests/test_ext_proc_service.py``'s harness), with the body in
chunks (as a client other than Envoy's BUFFERED filter, or a STREAMED mode, sends it) and in one
message. Through real Envoy: ``tests/test_error_shape_envoy.py``.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from ext_proc.server import ServiceSettings
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import static_view

from .test_ext_proc_service import counter  # noqa: F401 - the fixture
from .test_ext_proc_service import A, B, exchange, request_body, request_headers, serving, set_headers

pytestmark = pytest.mark.servers

LIMIT = 256 * 1024
CHUNK = b"x" * (64 * 1024)


def chunk(data: bytes, end: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end))


def assert_413(response: pb.ProcessingResponse) -> None:
    assert response.WhichOneof("response") == "immediate_response", response
    immediate = response.immediate_response
    assert immediate.status.code == 413
    assert immediate.details == "inferlb_request_too_large"  # Envoy's local-reply mappers leave it alone
    assert set_headers(immediate.headers)["content-type"] == "application/json"
    assert json.loads(immediate.body) == {"error": {
        "message": f"request body is over the limit of {LIMIT} bytes", "type": "invalid_request_error",
        "param": None, "code": "request_too_large"}}


def test_a_body_in_chunks_over_the_limit_gets_413_and_the_stream_ends(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), settings=ServiceSettings(max_body_bytes=LIMIT)) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            for _ in range(LIMIT // len(CHUNK)):  # up to the limit: accepted
                assert (await exchange(call, chunk(CHUNK))).WhichOneof("response") == "request_body"
            assert_413(await exchange(call, chunk(b"y")))  # one byte over
            assert await call.read() is grpc.aio.EOF  # ext_proc closed the stream: nothing more is read
            assert await call.code() == grpc.StatusCode.OK
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_fallbacks_total", {"reason": "body_too_large"}) == 1
            assert len(h.servicer.router.outstanding) == 0 and h.servicer.active_streams == 0

    asyncio.run(scenario())


def test_one_message_over_the_limit_gets_413_and_one_at_it_a_pick(counter: TokenCounter) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), settings=ServiceSettings(max_body_bytes=LIMIT)) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            assert_413(await exchange(call, chunk(b" " * (LIMIT + 1), end=True)))

            at_limit = b'{"input": "at the limit"' + b" " * (LIMIT - 25) + b"}"
            assert len(at_limit) == LIMIT
            call = h.stub.Process()
            await exchange(call, request_headers())
            response = await exchange(call, request_body(at_limit))
            # over 128 KiB: Envoy is first told to wait longer (override_message_timeout), then the pick
            assert response.WhichOneof("response") is None and response.override_message_timeout.seconds > 1
            response = await call.read()
            assert response.WhichOneof("response") == "request_body" and response.dynamic_metadata.fields
            call.cancel()

    asyncio.run(scenario())
