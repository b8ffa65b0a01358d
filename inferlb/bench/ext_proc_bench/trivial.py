"""The floor: a trivial ExternalProcessor that parses each message and answers a constant.

``python -m inferlb.bench.ext_proc_bench.trivial PORT READY_PORT [UDS_PATH] [--front grpcio|native]``: gRPC
on 127.0.0.1:PORT (and on the Unix socket UDS_PATH when given); once it listens, 127.0.0.1:READY_PORT answers
any HTTP request with 200 (the ``ProcessGroup``'s readiness probe speaks HTTP, not gRPC). It runs on uvloop,
ext_proc's default loop, and on either of ext_proc's gRPC fronts: grpcio's aio server (the default), with
grpc as ext_proc sets it (``ext_proc.fronts.grpc_settings``), or the native front (``ext_proc.fronts.native``),
so that the floor compares like with like. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

from ..stack.ready import serve_ready

def _answers() -> dict[str, Any]:
    """The constant answer to each kind of message (any other kind gets the request headers' one)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    return {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    }


async def _serve_grpcio(targets: list[str]) -> Any:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    answers = _answers()
    fallback = answers["request_headers"]

    class Trivial(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # type: ignore[no-untyped-def,override]
            async for request in request_iterator:
                yield answers.get(request.WhichOneof("request"), fallback)

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Trivial(), server)
    for target in targets:
        server.add_insecure_port(target)
    await server.start()
    return server


def _serve_native(targets: list[str]) -> Any:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from ext_proc.fronts.native import Invocation, Messages, NativeServer, load_front
    from ext_proc.wire import PROCESS_METHOD, SERVICE_NAME

    front = load_front()
    if front is None:
        raise SystemExit("the native front is not built (no gRPC C++ at install time)")
    answers = {kind: answer.SerializeToString() for kind, answer in _answers().items()}
    fallback = answers["request_headers"]
    parse = pb.ProcessingRequest.FromString

    async def process(messages: Messages, invocation: Invocation) -> AsyncIterator[bytes]:
        async for raw in messages:
            yield answers.get(parse(raw).WhichOneof("request") or "", fallback)

    return NativeServer(front, {f"/{SERVICE_NAME}/{PROCESS_METHOD}": process}, targets, 8 << 20)


async def serve(port: int, ready_port: int, uds_path: str | None = None, front: str = "grpcio") -> None:
    targets = [f"127.0.0.1:{port}"] + ([f"unix:{uds_path}"] if uds_path else [])
    server = _serve_native(targets) if front == "native" else await _serve_grpcio(targets)
    ready = await serve_ready(ready_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ready.close()
    await server.stop(1)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m inferlb.bench.ext_proc_bench.trivial",
                                description="The ext_proc bench's floor: an ExternalProcessor answering constants.")
    p.add_argument("port", type=int, help="gRPC port on 127.0.0.1")
    p.add_argument("ready_port", type=int, help="HTTP port that answers 200 once gRPC listens")
    p.add_argument("uds_path", nargs="?", help="also serve on this Unix socket")
    p.add_argument("--front", choices=["grpcio", "native"], default="grpcio", help="ext_proc's gRPC front to run on")
    args = p.parse_args(argv)
    import uvloop

    from ext_proc.fronts.grpc_settings import use_grpc_defaults

    use_grpc_defaults()  # the grpc ext_proc runs on, so that the floor compares like with like
    uvloop.run(serve(args.port, args.ready_port, args.uds_path, args.front))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
