"""ext_proc's service in process: the real gRPC server and a real grpc.aio client stream, no Envoy.

The servicer runs with the real token counter, cost model, outstanding ledger
and picker; only its endpoint view is injected (a ``StaticViewSource``), so
each test states the fleet it needs. The xDS client is tested against the
control plane's real ADS server, in this process (tests may import
``control_plane``; the ext_proc package never does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import signal
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable, Mapping, TypeVar

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError

from control_plane.controller import build_ext_proc_snapshot, build_snapshot
from control_plane.model import Endpoint, FleetState, Health, PickPolicySpec as CpPickPolicySpec, Telemetry
from control_plane.type_urls import ENDPOINT
from control_plane.xds import Snapshot, SnapshotCache, TypeStatus, make_epoch, serve_xds, stop_xds
from control_plane.xds.snapshot import Encoded
from inferlb_runtime.plugins import PolicyAllowlist
from ext_proc.config import load_config
from ext_proc.metrics import ExtProcMetrics
from ext_proc.model import EndpointView
from ext_proc.server import ExtProcServicer, ServiceSettings
from ext_proc.fronts.serving import GrpcFront, HealthReporter, serve_grpc
from ext_proc.wire import COUNTED_RESPONSE_HEADER, ENDPOINT_RESPONSE_HEADER
from ext_proc.tokens import TokenCounter
from ext_proc.xds.client import (
    FleetView,
    PickPolicySpec,
    StaticViewSource,
    XdsClient,
    XdsClientSettings,
    static_view,
)

from .conftest import ROOT, free_port
from .stack import http, launch, wait_for

pytestmark = pytest.mark.servers

T = TypeVar("T")
PICK = "x-gateway-destination-endpoint"
EXT_PROC_GROUP = "inferlb-ext-proc"
A, B, C = (EndpointView(f"127.0.0.1:{p}", "127.0.0.1", p) for p in (8101, 8102, 8103))


@pytest.fixture(scope="module")
def counter() -> TokenCounter:
    return TokenCounter.from_package()


@pytest.fixture(params=[pytest.param("native", marks=pytest.mark.native), "grpcio"])
def grpc_front(request: pytest.FixtureRequest) -> GrpcFront:
    """Each gRPC test runs on both fronts: the same servicer, the same assertions."""
    return request.param


# --- harness -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Harness:
    servicer: ExtProcServicer
    source: StaticViewSource
    channel: grpc.aio.Channel
    health: HealthReporter

    @property
    def stub(self) -> pb_grpc.ExternalProcessorStub:
        return pb_grpc.ExternalProcessorStub(self.channel)


@asynccontextmanager
async def serving(counter: TokenCounter, view: FleetView | None = None,
                  default_policy: PickPolicySpec = PickPolicySpec("least_completion_time"),
                  settings: ServiceSettings = ServiceSettings(),
                  allow: PolicyAllowlist = PolicyAllowlist(), front: GrpcFront = "auto") -> AsyncIterator[Harness]:
    """The real gRPC server (ExternalProcessor + health) on a free port, on ``front``, and a channel to it."""
    source = StaticViewSource(view)
    servicer = ExtProcServicer.create(settings, source, ExtProcMetrics(), counter, default_policy, allow)
    health = HealthReporter(source)
    target = f"127.0.0.1:{free_port()}"
    server = await serve_grpc(servicer, health, [target], 8 * 1024 * 1024, front=front)
    channel = grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", 8 * 1024 * 1024)])
    try:
        yield Harness(servicer, source, channel, health)
    finally:
        await channel.close()
        await server.stop(None)


def headers_message(headers: Mapping[str, str], end_of_stream: bool = False) -> pb.HttpHeaders:
    """As Envoy 1.40 sends them: values in ``raw_value``."""
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]), end_of_stream=end_of_stream)


def request_headers(extra: Mapping[str, str] | None = None, method: str = "POST",
                    end_of_stream: bool = False) -> pb.ProcessingRequest:
    headers = {":method": method, ":path": "/v1/embeddings", ":authority": "inferlb",
               "content-type": "application/json", **(extra or {})}
    return pb.ProcessingRequest(request_headers=headers_message(headers, end_of_stream))


def request_body(body: bytes | dict) -> pb.ProcessingRequest:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def response_headers(headers: Mapping[str, str]) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_headers=headers_message(headers))


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {o.header.key: (o.header.raw_value.decode() or o.header.value) for o in mutation.set_headers}


def pick_metadata(response: pb.ProcessingResponse) -> str:
    return response.dynamic_metadata.fields["envoy.lb"].struct_value.fields[PICK].string_value


async def exchange(call: grpc.aio.StreamStreamCall, message: pb.ProcessingRequest) -> pb.ProcessingResponse:
    await call.write(message)
    response = await call.read()
    assert response is not grpc.aio.EOF
    return response


async def until(predicate: Callable[[], T], timeout: float, what: str) -> T:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


# --- the ExternalProcessor --------------------------------------------------------------------------


def test_a_body_gets_a_pick_header_metadata_and_its_token_count(counter: TokenCounter, reference: dict,
        grpc_front: GrpcFront) -> None:
    items = reference["items"][:3]
    expected_tokens = sum(int(item["tokens_with_special"]) for item in items)

    async def scenario() -> None:
        async with serving(counter, static_view([A, B, C]), front=grpc_front) as h:
            call = h.stub.Process()
            first = await exchange(call, request_headers())
            assert first.WhichOneof("response") == "request_headers"
            assert not first.request_headers.response.header_mutation.set_headers  # nothing decided yet
            second = await exchange(call, request_body({"model": "all-MiniLM-L6-v2",
                                                        "input": [item["text"] for item in items]}))
            assert second.WhichOneof("response") == "request_body"
            headers = set_headers(second.request_body.response.header_mutation)
            picks = headers[PICK].split(",")
            assert picks[0] in {A.id, B.id, C.id} and len(picks) == len(set(picks)) == 3  # primary + 2 fallbacks
            assert pick_metadata(second) == headers[PICK]
            assert int(headers["x-inferlb-tokens"]) == expected_tokens  # the tokenizer's own count
            assert float(headers["x-inferlb-predicted-ms"]) > 0
            assert h.servicer.router.outstanding.of(picks[0]).requests == 1
            assert h.servicer.router.outstanding.of(picks[0]).tokens == expected_tokens
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
            await until(lambda: len(h.servicer.router.outstanding) == 0, 5, "the stream's end to release its work")

    asyncio.run(scenario())


def test_a_request_without_a_body_is_picked_at_its_headers(counter: TokenCounter, grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), front=grpc_front) as h:
            call = h.stub.Process()
            response = await exchange(call, request_headers(method="GET", end_of_stream=True))
            assert response.WhichOneof("response") == "request_headers"
            picked = set_headers(response.request_headers.response.header_mutation)[PICK]
            assert picked.split(",")[0] in {A.id, B.id}
            assert pick_metadata(response) == picked
            call.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("fleet", [
    [],
    [dataclasses.replace(A, healthy=False), dataclasses.replace(B, draining=True)],
], ids=["no-endpoints", "unhealthy-and-draining"])
def test_no_routable_endpoint_is_an_immediate_503_in_openai_shape(counter: TokenCounter,
                                                                  fleet: list[EndpointView],
        grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view(fleet), front=grpc_front) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            response = await exchange(call, request_body({"input": "hello"}))
            assert response.WhichOneof("response") == "immediate_response"
            immediate = response.immediate_response
            assert immediate.status.code == 503
            assert set_headers(immediate.headers)["content-type"] == "application/json"
            error = json.loads(immediate.body)["error"]
            assert error["code"] == "no_endpoint_ready" and "No inference endpoint is ready" in error["message"]
            assert len(h.servicer.router.outstanding) == 0
            call.cancel()

    asyncio.run(scenario())


def test_a_stream_cancelled_before_the_response_releases_its_outstanding_work(counter: TokenCounter,
        grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), front=grpc_front) as h:
            calls = []
            for _ in range(3):
                call = h.stub.Process()
                await exchange(call, request_headers())
                await exchange(call, request_body({"input": "a request whose client goes away"}))
                calls.append(call)
            assert h.servicer.router.outstanding.total().requests == 3
            for call in calls:  # what Envoy does when the client disconnects or the upstream resets
                call.cancel()
            await until(lambda: h.servicer.router.outstanding.total().requests == 0, 5, "cancelled streams to release")
            assert h.servicer.router.outstanding.leaked == 0
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_released_total", {"how": "early"}) == 3

    asyncio.run(scenario())


def test_response_headers_feed_the_cost_model_and_release_the_work(counter: TokenCounter,
        grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A]), front=grpc_front) as h:
            cost = h.servicer.router.cost
            call = h.stub.Process()
            await exchange(call, request_headers())
            decided = await exchange(call, request_body({"input": "learn from me"}))
            tokens = int(set_headers(decided.request_body.response.header_mutation)["x-inferlb-tokens"])
            assert len(h.servicer.router.outstanding) == 1
            answered = await exchange(call, response_headers({
                ":status": "200", "x-inferlb-tokens": str(tokens),
                "server-timing": "queue;dur=0.5, compute;dur=7.25, total;dur=8.0",
                "endpoint-load-metrics": "TEXT cpu_utilization=0.5, named_metrics.queue=0, named_metrics.inflight=1",
            }))
            assert cost.observed(A.id) == 1 and cost.observations == 1
            assert len(h.servicer.router.outstanding) == 0
            shown = set_headers(answered.response_headers.response.header_mutation)
            assert shown[ENDPOINT_RESPONSE_HEADER] == A.id and shown[COUNTED_RESPONSE_HEADER] == str(tokens)

            # An error response teaches nothing (its timing is not the request's cost), but still releases.
            call = h.stub.Process()
            await exchange(call, request_headers())
            await exchange(call, request_body({"input": "fails"}))
            await exchange(call, response_headers({":status": "503", "server-timing": "total;dur=0.1"}))
            assert cost.observed(A.id) == 1 and len(h.servicer.router.outstanding) == 0

    asyncio.run(scenario())


def test_a_stream_ended_at_its_response_headers_closes_grpcs_receiver(counter: TokenCounter,
        grpc_front: GrpcFront) -> None:
    """The servicer ends the stream after the response headers, before Envoy's half-close. grpc's request
    receiver is an async generator: left open, the collector would hand each one to the loop's finalizer
    hook (a wake-up from outside and a task per stream). The servicer closes it itself."""
    finalized: list[object] = []

    async def scenario() -> None:
        hooks = sys.get_asyncgen_hooks()

        def finalizer(agen: object) -> None:
            finalized.append(agen)
            hooks.finalizer(agen)  # type: ignore[misc]

        sys.set_asyncgen_hooks(firstiter=hooks.firstiter, finalizer=finalizer)
        try:
            async with serving(counter, static_view([A]), front=grpc_front) as h:
                for _ in range(5):
                    call = h.stub.Process()
                    await exchange(call, request_headers())
                    await exchange(call, request_body({"input": "close me"}))
                    await exchange(call, response_headers({":status": "200"}))
                    assert await call.read() is grpc.aio.EOF  # the server ended it
                    assert await call.code() == grpc.StatusCode.OK
                assert h.servicer.active_streams == 0
                gc.collect()
        finally:
            sys.set_asyncgen_hooks(*hooks)
        assert [type(a).__name__ for a in finalized] == []

    asyncio.run(scenario())


def test_the_host_envoy_reports_as_upstream_is_the_one_that_learns(counter: TokenCounter,
        grpc_front: GrpcFront) -> None:
    """With ``response_attributes: [upstream.address]`` Envoy says which host answered (a retry may
    have moved the request to a fallback): that host's fit learns, and the client is told so."""
    async def scenario() -> None:
        async with serving(counter, static_view([A, B], PickPolicySpec("round_robin")), front=grpc_front) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            decided = await exchange(call, request_body({"input": "retried elsewhere"}))
            primary, fallback = set_headers(decided.request_body.response.header_mutation)[PICK].split(",")
            message = response_headers({":status": "200", "server-timing": "compute;dur=3.0, total;dur=4.0"})
            attributes = struct_pb2.Struct()
            attributes.fields["upstream.address"].string_value = fallback
            message.attributes["envoy.filters.http.ext_proc"].CopyFrom(attributes)
            answered = await exchange(call, message)
            assert set_headers(answered.response_headers.response.header_mutation)[ENDPOINT_RESPONSE_HEADER] == fallback
            assert (h.servicer.router.cost.observed(fallback), h.servicer.router.cost.observed(primary)) == (1, 0)
            assert len(h.servicer.router.outstanding) == 0

    asyncio.run(scenario())


def test_a_client_sent_pick_header_is_stripped(counter: TokenCounter, grpc_front: GrpcFront) -> None:
    forged = {PICK: "10.9.9.9:1", "x-inferlb-tokens": "1"}

    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), front=grpc_front) as h:
            call = h.stub.Process()
            first = await exchange(call, request_headers(forged))
            assert set(first.request_headers.response.header_mutation.remove_headers) == set(forged)
            second = await exchange(call, request_body({"input": "hello"}))
            assert "10.9.9.9" not in set_headers(second.request_body.response.header_mutation)[PICK]
            call.cancel()
        async with serving(counter, None, front=grpc_front) as h:  # no view yet: no pick, the forged one still goes
            call = h.stub.Process()
            first = await exchange(call, request_headers(forged, method="GET", end_of_stream=True))
            mutation = first.request_headers.response.header_mutation
            assert PICK in mutation.remove_headers and PICK not in set_headers(mutation)
            assert not first.HasField("dynamic_metadata")
            call.cancel()

    asyncio.run(scenario())


def test_a_body_too_big_for_the_loop_is_counted_off_it(counter: TokenCounter, grpc_front: GrpcFront) -> None:
    """Bodies up to Envoy's 4 MiB buffer limit arrive as one gRPC message, and are counted exactly; over
    128 KiB, Envoy is told to wait longer before the count starts."""
    big = "the quick brown fox jumps over the lazy dog " * 70_000  # ~3 MiB, capped at 256 tokens
    texts = [big, "short one"]
    expected = 256 + counter.count_text("short one")

    async def scenario() -> None:
        async with serving(counter, static_view([A]), front=grpc_front) as h:
            call = h.stub.Process()
            await exchange(call, request_headers())
            # First Envoy is told to wait longer (override_message_timeout): no race of the count with its timeout
            extend = await exchange(call, request_body({"input": texts}))
            assert extend.WhichOneof("response") is None and extend.override_message_timeout.seconds > 1
            response = await call.read()
            assert int(set_headers(response.request_body.response.header_mutation)["x-inferlb-tokens"]) == expected
            call.cancel()

    asyncio.run(scenario())


def test_the_pick_policy_follows_eds_and_a_bad_spec_keeps_the_current_one(counter: TokenCounter,
        grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), front=grpc_front) as h:
            assert h.servicer.router.policy == "least_completion_time"
            h.source.set(static_view([A, B], PickPolicySpec("round_robin", {"fallbacks": 1.0})))
            assert h.servicer.router.policy == "round_robin"
            h.source.set(static_view([A, B], PickPolicySpec("no_such_policy")))
            assert h.servicer.router.policy == "round_robin"
            h.source.set(static_view([A, B], PickPolicySpec("least_outstanding", {"d": "many"})))
            h.source.set(static_view([A, B], PickPolicySpec("least_outstanding", {"d": "many"})))  # repeated
            assert h.servicer.router.policy == "round_robin"
            registry = h.servicer.metrics.registry
            assert registry.get_sample_value("inferlb_ext_proc_policy_switches_total", {"result": "rejected"}) == 2
            # And the switched policy decides: round robin with one fallback alternates primaries.
            primaries = []
            for _ in range(4):
                call = h.stub.Process()
                await exchange(call, request_headers())
                response = await exchange(call, request_body({"input": "x"}))
                picks = set_headers(response.request_body.response.header_mutation)[PICK].split(",")
                assert len(picks) == 2
                primaries.append(picks[0])
                call.cancel()
            assert set(primaries) == {A.id, B.id} and primaries[0] != primaries[1]

    asyncio.run(scenario())


def test_grpc_health_is_serving_once_the_first_view_arrives(counter: TokenCounter, grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, None, front=grpc_front) as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            h.source.set(static_view([A]))

            async def serving_now() -> bool:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            deadline = asyncio.get_running_loop().time() + 5
            while not await serving_now():
                assert asyncio.get_running_loop().time() < deadline, "health never became SERVING"
                await asyncio.sleep(0.01)

    asyncio.run(scenario())


def test_grpc_health_watch_liveness_and_unknown_services_behave_alike_on_both_fronts(
        counter: TokenCounter, grpc_front: GrpcFront) -> None:
    """grpc.health.v1 as the EPP's probes use it: Watch streams each change, ``liveness`` is SERVING from the
    start, an unknown service is NOT_FOUND to Check and SERVICE_UNKNOWN to Watch; stopping turns all NOT_SERVING."""
    status = health_pb2.HealthCheckResponse

    async def scenario() -> None:
        async with serving(counter, None, front=grpc_front) as h:
            health = health_pb2_grpc.HealthStub(h.channel)
            assert (await health.Check(health_pb2.HealthCheckRequest(service="liveness"))).status == status.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
            watch = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            assert (await watch.read()).status == status.NOT_SERVING
            h.source.set(static_view([A]))
            assert (await asyncio.wait_for(watch.read(), 10)).status == status.SERVING
            unknown_watch = health.Watch(health_pb2.HealthCheckRequest(service="nope"))
            assert (await unknown_watch.read()).status == status.SERVICE_UNKNOWN
            unknown_watch.cancel()
            method = h.channel.unary_unary("/envoy.service.ext_proc.v3.ExternalProcessor/Nope", None, None)
            with pytest.raises(grpc.aio.AioRpcError) as unimplemented:
                await method(b"")
            assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await h.health.stop()
            assert (await asyncio.wait_for(watch.read(), 10)).status == status.NOT_SERVING
            watch.cancel()

    asyncio.run(scenario())


# --- the xDS client against the control plane's ADS server -------------------------------------------


class AdsServer:
    """The control plane's ADS server and snapshot cache, on this loop; the test sets snapshots."""

    def __init__(self, port: int | None = None) -> None:
        self.cache = SnapshotCache()
        self.port = port or free_port()
        self.epoch = make_epoch()
        self._server = None

    async def __aenter__(self) -> "AdsServer":
        self._server = await serve_xds(self.cache, f"127.0.0.1:{self.port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop_xds(self._server, self.cache, grace=0.5)

    def publish(self, state: FleetState) -> Snapshot:
        """The Envoys' snapshot and ext_proc's (the rich EDS), as the controller builds them."""
        envoys = build_snapshot(state, self.epoch)
        self.cache.set_default_snapshot(envoys)
        rich = build_ext_proc_snapshot(state, envoys)
        self.cache.set_snapshot(EXT_PROC_GROUP, rich)
        return rich

    def publish_eds_bytes(self, data: bytes) -> Snapshot:
        snapshot = Snapshot.from_resources({ENDPOINT: {"workers": Encoded(ENDPOINT, "workers", data)}}, self.epoch)
        self.cache.set_snapshot(EXT_PROC_GROUP, snapshot)
        return snapshot

    def eds_status(self, node_id: str) -> TypeStatus | None:
        client = next((c for c in self.cache.clients() if c.node_id == node_id), None)
        return client.types.get(ENDPOINT) if client is not None else None


def fleet_state(pick: CpPickPolicySpec = CpPickPolicySpec()) -> FleetState:
    telemetry = Telemetry(observed_at=1.0, cpu_utilization=0.5, queue_depth=3, inflight=2,
                          batch_cost_per_token_s=0.0002, batch_cost_fixed_s=0.0015)
    return FleetState(endpoints=(
        Endpoint("127.0.0.1", 8101, health=Health.HEALTHY, computed_weight=300, telemetry=telemetry),
        Endpoint("127.0.0.1", 8102, draining=True),
        Endpoint("127.0.0.1", 8103, health=Health.UNHEALTHY),
        Endpoint("127.0.0.1", 8104),  # not scraped yet: UNKNOWN, routable
    ), pick_policy=pick)


MODES = pytest.mark.parametrize("delta", [True, False], ids=["delta", "sotw"])


@MODES
def test_the_xds_client_gets_the_rich_eds_view_and_acks(delta: bool) -> None:
    node = f"ext-proc-{'delta' if delta else 'sotw'}"

    async def scenario() -> None:
        async with AdsServer() as ads:
            first = ads.publish(fleet_state(CpPickPolicySpec("round_robin", {"fallbacks": 1})))
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id=node, delta=delta)) as xds:
                view = await xds.wait_ready(10)
                by_id = view.by_id
                assert set(by_id) == {"127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103", "127.0.0.1:8104"}
                a = by_id["127.0.0.1:8101"]
                assert (a.weight, a.healthy, a.draining) == (300, True, False)
                assert a.telemetry["queue_depth"] == 3 and a.telemetry["batch_cost_per_token_s"] == 0.0002
                assert "weight" not in a.telemetry and "id" not in a.telemetry
                assert by_id["127.0.0.1:8102"].draining and not by_id["127.0.0.1:8102"].routable
                assert not by_id["127.0.0.1:8103"].healthy
                assert {e.id for e in view.routable} == {"127.0.0.1:8101", "127.0.0.1:8104"}
                assert view.pick_policy == PickPolicySpec("round_robin", {"fallbacks": 1.0})
                await until(lambda: (s := ads.eds_status(node)) is not None
                            and s.acked_version == first.version(ENDPOINT), 10, "the ACK")
                assert xds.connected

                # An update replaces the view as a whole.
                second = ads.publish(dataclasses.replace(fleet_state(), endpoints=fleet_state().endpoints[:1]))
                await until(lambda: xds.view is not None and len(xds.view.endpoints) == 1, 10, "the update")
                await until(lambda: ads.eds_status(node).acked_version == second.version(ENDPOINT), 10,
                            "the second ACK")

    asyncio.run(scenario())


@MODES
def test_the_xds_client_nacks_what_it_cannot_use_and_keeps_its_view(delta: bool) -> None:
    node = f"ext-proc-nack-{'delta' if delta else 'sotw'}"

    async def scenario() -> None:
        async with AdsServer() as ads:
            good = ads.publish(fleet_state())
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id=node, delta=delta)) as xds:
                kept = await xds.wait_ready(10)
                await until(lambda: ads.eds_status(node).acked_version == good.version(ENDPOINT), 10, "the ACK")

                garbage = ads.publish_eds_bytes(b"\x12\xff\xff\xff\x0fnot a ClusterLoadAssignment")
                status = await until(lambda: (s := ads.eds_status(node)).nack_count == 1 and s, 10, "a NACK")
                assert status.last_nack is not None and status.last_nack.version == garbage.version(ENDPOINT)
                assert "does not parse" in status.last_nack.message
                assert status.acked_version == good.version(ENDPOINT)
                assert xds.view is kept and xds.rejected == 1

                # Parses, but names a host override_host could never match.
                hostname = ads.publish(dataclasses.replace(fleet_state(), endpoints=(Endpoint("worker-1", 8101),)))
                status = await until(lambda: (s := ads.eds_status(node)).nack_count == 2 and s, 10, "a second NACK")
                assert status.last_nack.version == hostname.version(ENDPOINT)
                assert "not an IP address" in status.last_nack.message
                assert xds.view is kept

                fixed = ads.publish(fleet_state())
                await until(lambda: ads.eds_status(node).acked_version == fixed.version(ENDPOINT), 10,
                            "the fixed snapshot's ACK")

    asyncio.run(scenario())


def test_a_removed_assignment_is_an_empty_view_not_a_stale_one() -> None:
    """Delta: the control plane no longer has the ``workers`` assignment. ext_proc then answers 503
    (no endpoint) rather than routing on endpoints that may be gone."""
    async def scenario() -> None:
        async with AdsServer() as ads:
            ads.publish(fleet_state())
            async with XdsClient(XdsClientSettings(target=f"127.0.0.1:{ads.port}", node_id="ext-proc-rm")) as xds:
                await xds.wait_ready(10)
                ads.cache.set_snapshot(EXT_PROC_GROUP, Snapshot.from_resources({ENDPOINT: {}}, ads.epoch))
                view = await until(lambda: xds.view is not None and not xds.view.endpoints and xds.view, 10,
                                   "the removal")
                assert view.routable == () and view.pick_policy == PickPolicySpec("least_completion_time")

    asyncio.run(scenario())


def test_the_xds_client_keeps_its_view_while_disconnected_and_reconnects() -> None:
    async def scenario() -> None:
        port = free_port()
        settings = XdsClientSettings(target=f"127.0.0.1:{port}", node_id="ext-proc-reconnect",
                                     backoff_initial_s=0.05, backoff_max_s=0.2)
        async with XdsClient(settings) as xds:
            async with AdsServer(port) as ads:
                ads.publish(fleet_state())
                view = await xds.wait_ready(10)
            await until(lambda: not xds.connected, 10, "the client to notice the server is gone")
            assert xds.view is view  # still routing on the last view
            async with AdsServer(port) as ads:  # a restarted control plane: a new epoch, new versions
                snapshot = ads.publish(dataclasses.replace(fleet_state(), endpoints=fleet_state().endpoints[:2]))
                await until(lambda: xds.connected and xds.view is not None and len(xds.view.endpoints) == 2, 15,
                            "the client to reconnect and take the new view")
                await until(lambda: ads.eds_status("ext-proc-reconnect").acked_version == snapshot.version(ENDPOINT),
                            10, "the ACK to the new server")

    asyncio.run(scenario())


# --- the command line ---------------------------------------------------------------------------------


def test_settings_merge_file_environment_and_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "inferlb.toml"
    path.write_text("[ext_proc]\nport = 9102\nxds_mode = 'sotw'\npick_policy = 'round_robin'\n")
    monkeypatch.setenv("INFERLB_EXT_PROC_PORT", "9202")
    monkeypatch.setenv("INFERLB_EXT_PROC_METRICS_PORT", "9290")
    config = load_config(path, {"metrics_port": 9390, "node_id": None})
    assert (config.port, config.xds_mode, config.pick_policy) == (9202, "sotw", "round_robin")  # env beats file
    assert config.metrics_port == 9390  # flag beats env
    assert config.node_id.startswith("ext-proc-")  # a default unique per process
    with pytest.raises(ValidationError, match="grpc_max_message_bytes"):
        load_config(overrides={"max_body_bytes": 16 * 1024 * 1024})
    with pytest.raises(ValidationError, match="bogus"):
        load_config(overrides={"bogus": 1})


@pytest.mark.slow  # python -m ext_proc, a real process
def test_the_command_line_serves_probes_without_a_control_plane_and_stops_on_sigterm(tmp_path: Path) -> None:
    help_out = subprocess.run([sys.executable, "-m", "ext_proc", "--help"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    assert help_out.returncode == 0 and "least_completion_time" in help_out.stdout
    bad = subprocess.run([sys.executable, "-m", "ext_proc", "--pick-policy", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "nope" in bad.stderr

    metrics_port, xds_port = free_port(), free_port()  # nothing listens on the xDS port
    proc = launch("ext-proc-cli", [sys.executable, "-m", "ext_proc", "--port", str(free_port()),
                                   "--metrics-port", str(metrics_port), "--xds-port", str(xds_port)], tmp_path)
    try:
        base = f"http://127.0.0.1:{metrics_port}"
        def healthy() -> bool:
            with http() as client:
                return client.get(f"{base}/healthz").status_code == 200

        wait_for(healthy, 30, "/healthz", [proc])
        with http() as client:
            ready = client.get(f"{base}/readyz")
            assert ready.status_code == 503 and "no EDS" in ready.json()["reason"]
            metrics = client.get(f"{base}/metrics").text
        assert "inferlb_ext_proc_xds_connected 0.0" in metrics and "inferlb_ext_proc_ready 0.0" in metrics
        proc.process.send_signal(signal.SIGTERM)
        assert proc.process.wait(15) == 0
        assert '"msg": "stopped"' in proc.log()
    finally:
        proc.stop()


def test_each_replica_learns_its_index_from_the_controllers_list_of_connected_ext_procs() -> None:
    """The controller lists the connected ext_proc node ids in the rich EDS; each client finds itself."""
    from control_plane.config import ControlPlaneConfig
    from control_plane.controller import Controller

    async def scenario() -> None:
        async with AdsServer() as ads:
            controller = Controller(ControlPlaneConfig(), ads.cache, None, fleet_state())
            await controller.publish()
            target = f"127.0.0.1:{ads.port}"
            async with XdsClient(XdsClientSettings(target=target, node_id="ext-proc-b")) as b, \
                    XdsClient(XdsClientSettings(target=target, node_id="ext-proc-a")) as a:
                await b.wait_ready(10)
                await a.wait_ready(10)
                assert b.view.partition == a.view.partition == (0, 1)  # published before they connected
                await until(lambda: controller.ext_proc_replicas() == ("ext-proc-a", "ext-proc-b"), 10, "both")
                await controller.publish()
                await until(lambda: a.view.partition == (0, 2) and b.view.partition == (1, 2), 10, "the list")
            await until(lambda: controller.ext_proc_replicas() == (), 10, "both gone")
            await controller.publish()
            assert controller.published_replicas == ()

    asyncio.run(scenario())


def test_the_servicer_hands_the_views_partition_to_its_picker(counter: TokenCounter, grpc_front: GrpcFront) -> None:
    async def scenario() -> None:
        async with serving(counter, static_view([A, B]), front=grpc_front) as h:
            assert h.servicer.router.partition.partition == (0, 1)
            h.source.set(dataclasses.replace(static_view([A, B]), partition=(2, 3)))
            assert h.servicer.router.partition.partition == (2, 3)
            h.source.set(static_view([A, B]))  # the list no longer names us: the whole fleet again
            assert h.servicer.router.partition.partition == (0, 1)

    asyncio.run(scenario())


def test_a_malformed_replica_list_is_nacked() -> None:
    from envoy.config.endpoint.v3 import endpoint_pb2

    from ext_proc.xds.client import InvalidResource, parse_load_assignment

    cla = endpoint_pb2.ClusterLoadAssignment(cluster_name="workers")
    locality = cla.endpoints.add()
    locality.metadata.filter_metadata["inferlb"].update({"ext_proc_replicas": [1, 2]})
    with pytest.raises(InvalidResource, match="ext_proc_replicas"):
        parse_load_assignment(cla.SerializeToString(), "workers", "1", "ext-proc-a")
    locality.metadata.filter_metadata["inferlb"].update({"ext_proc_replicas": ["x", "ext-proc-a"]})
    view = parse_load_assignment(cla.SerializeToString(), "workers", "1", "ext-proc-a")
    assert view.partition == (1, 2)
    assert parse_load_assignment(cla.SerializeToString(), "workers", "1", "not-listed").partition == (0, 1)
