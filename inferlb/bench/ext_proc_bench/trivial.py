"""The floor: a trivial grpcio aio ExternalProcessor that parses each message and answers a constant.

``python -m inferlb.bench.ext_proc_bench.trivial PORT READY_PORT [UDS_PATH]``: gRPC on
127.0.0.1:PORT (and on the Unix socket UDS_PATH when given); once it listens, 127.0.0.1:READY_PORT answers any HTTP request
with 200 (the ``ProcessGroup``'s readiness probe speaks HTTP, not gRPC). It
runs on uvloop, ext_proc's default loop, and on grpc as ext_proc sets it
(``ext_proc.grpc_settings``), so that the floor compares like with like.
SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import asyncio
import signal
import sys

from ..ready import serve_ready

async def serve(port: int, ready_port: int, uds_path: str | None = None) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    answers = {
        "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    }
    fallback = answers["request_headers"]

    class Trivial(pb_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator, context):  # type: ignore[no-untyped-def,override]
            async for request in request_iterator:
                yield answers.get(request.WhichOneof("request"), fallback)

    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(Trivial(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    if uds_path:
        server.add_insecure_port(f"unix:{uds_path}")
    await server.start()
    ready = await serve_ready(ready_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    ready.close()
    await server.stop(1)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or not all(a.isdigit() for a in argv[:2]):
        print("usage: python -m inferlb.bench.ext_proc_bench.trivial PORT READY_PORT [UDS_PATH]", file=sys.stderr)
        return 2
    import uvloop

    from ext_proc.grpc_settings import use_grpc_defaults

    use_grpc_defaults()  # the grpc ext_proc runs on, so that the floor compares like with like
    uvloop.run(serve(int(argv[0]), int(argv[1]), argv[2] if len(argv) == 3 else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
