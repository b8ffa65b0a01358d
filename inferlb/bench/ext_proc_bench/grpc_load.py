"""Phase 3: ext_proc alone, driven by a gRPC client that plays Envoy's three messages per request.

The server is pinned to one core and the client to the other, so decisions per
server CPU-second is what one core sustains. The trivial servicer is measured
the same way in the same run: the framework's floor to compare against.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ..stack.dataplanes import ext_proc_component
from ..processes import ProcessGroup, free_port
from .cpu import CpuMeter, pinned
from .stack import Log, Stack, decisions, trivial_servicer, trivial_uds
from .workload import PATH

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
Messages = Sequence[tuple[bytes, bytes, bytes]]
# A ProcessingResponse whose first field is override_message_timeout (10, length-delimited) carries only that:
# every answer proper has a lower-numbered field, and protobuf writes fields in number order.
EXTENSION_TAG = bytes([10 << 3 | 2])
STREAM_TIMEOUT_S = 10.0  # a stream the server never finishes counts as an error instead of hanging the run


def header_map(pairs: Sequence[tuple[str, str]]) -> Any:
    """An Envoy HeaderMap of (name, value) pairs, values as ``raw_value`` (as Envoy sends them)."""
    from envoy.config.core.v3 import base_pb2

    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


async def envoy_messages(client: httpx.AsyncClient, bodies: Sequence[bytes], worker_url: str,
                         authority: str) -> tuple[list[tuple[bytes, bytes, bytes]], httpx.Response]:
    """Per body, the three serialized ProcessingRequests Envoy sends: request headers, the buffered body,
    and the response headers that a real (simulated) worker answered for that very body. Also the
    worker's first answer (for the fake worker)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    out = []
    answers = []
    for i, body in enumerate(bodies):
        answer = await client.post(worker_url + PATH, content=body, headers={"content-type": "application/json"})
        answer.raise_for_status()
        answers.append(answer)
        request_headers = [(":authority", authority), (":path", PATH), (":method", "POST"), (":scheme", "http"),
                           ("content-type", "application/json"), ("content-length", str(len(body))),
                           ("user-agent", "bench_ext_proc"), ("x-forwarded-proto", "http"),
                           ("x-request-id", f"00000000-0000-4000-8000-{i:012d}")]
        response_headers = [(":status", str(answer.status_code))] + [
            (k.lower(), v) for k, v in answer.headers.items() if k.lower() not in ("connection",)]
        response_headers.append(("x-envoy-upstream-service-time", "1"))
        out.append((
            pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=header_map(request_headers)))
            .SerializeToString(),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString(),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map(response_headers)))
            .SerializeToString(),
        ))
    return out, answers[0]


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


async def grpc_drive(target: str, messages: Messages, streams: int, seconds: float,
                     body_only: bool = False) -> dict[str, Any]:
    """``streams`` concurrent loops, each one ext_proc stream per request after the other, for ``seconds``."""
    import grpc

    counts: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", 8 << 20)]) as channel:
        process = channel.stream_stream(PROCESS_METHOD, request_serializer=None, response_deserializer=None)
        await asyncio.wait_for(channel.channel_ready(), 10)
        deadline = time.perf_counter() + seconds

        async def one_loop(k: int) -> None:
            i = k
            perf = time.perf_counter
            while perf() < deadline:
                headers, body, response = messages[i % len(messages)]
                i += streams
                started = perf()
                call = process(timeout=STREAM_TIMEOUT_S)
                try:
                    if not body_only:
                        await call.write(headers)
                        await call.read()
                    await call.write(body)
                    while (await call.read())[:1] == EXTENSION_TAG:  # a wait in the fair queue: as Envoy does,
                        pass  # take the longer timeout and read on for the answer
                    if not body_only:
                        await call.write(response)
                        await call.read()
                    await call.done_writing()
                    code = await call.code()
                except grpc.aio.AioRpcError as exc:
                    counts[f"error_{exc.code().name}"] += 1
                    continue
                if code != grpc.StatusCode.OK:
                    counts[f"error_{code.name}"] += 1
                    continue
                latencies.append(perf() - started)
                counts["ok"] += 1

        started = time.perf_counter()
        await asyncio.gather(*(one_loop(k) for k in range(streams)))
        wall = time.perf_counter() - started
    lat = np.array(latencies) * 1000
    return {"streams_ok": counts.pop("ok", 0), "errors": dict(counts), "wall_s": wall,
            "stream_p50_ms": _pct(lat, 50), "stream_p99_ms": _pct(lat, 99)}


async def measure_direct(name: str, target: str, pid: int, client: httpx.AsyncClient, metrics_url: str | None,
                         messages: Messages, streams: int, seconds: float, log: Log,
                         body_only: bool = False) -> dict[str, Any]:
    with pinned(pid) as how:
        d0 = await decisions(client, metrics_url) if metrics_url else 0.0
        meter = CpuMeter({"server": [pid], "client": [os.getpid()]})
        figures = await grpc_drive(target, messages, streams, seconds, body_only)
        cores = meter.stop()
        made = (await decisions(client, metrics_url) - d0) if metrics_url else None
    wall = figures["wall_s"]
    per_s = (made if made is not None else figures["streams_ok"]) / wall
    entry = {**figures, "pinning": how, "messages_per_stream": 1 if body_only else 3, "streams": streams,
             "decisions": made, "per_s": per_s, "cores": cores,
             "per_cpu_s": per_s / cores["server"] if cores["server"] > 0 else None}
    what = "decisions" if made is not None else "streams"
    log(f"[saturation/grpc] {name:<34}: {per_s:7.0f} {what}/s, server CPU {cores['server']:.2f} cores -> "
        f"{entry['per_cpu_s'] or 0:7.0f} per CPU-second; client CPU {cores['client']:.2f}, others {cores['others']:.2f}; "
        f"stream p50 {figures['stream_p50_ms'] or 0:.2f} ms; errors {figures['errors'] or 0}")
    return entry


TRANSPORTS = ("tcp", "uds")


@dataclass(frozen=True)
class Server:
    """One gRPC server the direct phase measures: key in the results, label, where, and its decision counter."""

    key: str
    label: str
    pid: int
    port: int
    uds: Path
    metrics_url: str | None  # ext_proc's /metrics (decisions); None: count streams
    seconds: float

    def target(self, transport: str) -> str:
        return f"unix:{self.uds}" if transport == "uds" else f"127.0.0.1:{self.port}"


async def _servers(args: Any, st: Stack, group: ProcessGroup) -> list[Server]:
    """The stack's ext_proc; when it runs on the native front, the same ext_proc on grpcio's (a second
    replica on the same control plane: the front the native one replaced); the trivial servicer on grpcio
    (the floor of earlier runs) and on the native front."""
    servers = [Server("ext_proc", "ext_proc, 3 messages/request", st.pid("ext_proc"), st.ext_proc_port,
                      st.ext_proc_uds, st.ext_proc_metrics_url, args.grpc_seconds)]
    if st.ext_proc_front == "native":
        port, metrics_port = free_port(), free_port()
        uds = st.log_dir / "ext_proc_grpcio.sock"
        component = ext_proc_component("ext_proc-grpcio", port=port, metrics_port=metrics_port,
                                       xds_port=st.xds_port, logs=st.log_dir,
                                       data_dir=st.log_dir / "ext_proc-grpcio-data", uds=uds, grpc_front="grpcio",
                                       node_id="bench-ext-proc-grpcio")
        await group.start([component])
        servers.append(Server("ext_proc_grpcio", "ext_proc on grpcio's front", group.pid(component.name), port, uds,
                              f"http://127.0.0.1:{metrics_port}", args.grpc_seconds))
    if args.floor_seconds > 0:
        for front in ("grpcio", "native") if st.ext_proc_front == "native" else ("grpcio",):
            component, port = trivial_servicer(st.log_dir, front)
            await group.start([component])
            key, label = ("trivial", "trivial servicer") if front == "grpcio" else (
                "trivial_native", "trivial servicer, native front")
            servers.append(Server(key, label, group.pid(component.name), port, trivial_uds(st.log_dir, front),
                                  None, args.floor_seconds))
    return servers


async def direct_phase(args: Any, st: Stack, messages: Messages, log: Log) -> dict[str, Any]:
    """Each server of ``_servers`` over loopback TCP and over its Unix socket, in turn, so that a
    neighbour's load falls on all. ``ext_proc`` and ``trivial``: the stack's own transport."""
    out: dict[str, Any] = {}
    async with ProcessGroup() as group:
        servers = await _servers(args, st, group)
        for transport in TRANSPORTS:
            for server in servers:
                target = server.target(transport)
                await grpc_drive(target, messages, args.grpc_streams, 1.0)  # warm the client's code paths
                out[f"{server.key}_{transport}"] = await measure_direct(
                    f"{server.label}, {transport.upper()}", target, server.pid, st.client, server.metrics_url,
                    messages, args.grpc_streams, server.seconds, log)
    out["ext_proc"] = out[f"ext_proc_{st.transport}"]
    if f"trivial_{st.transport}" in out:
        out["trivial"] = out[f"trivial_{st.transport}"]
    return out
