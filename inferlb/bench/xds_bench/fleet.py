"""The client-fleet process: N lightweight ADS clients, one gRPC connection each, as N Envoys would have.

``python -m inferlb.bench.xds_bench.fleet SPEC_JSON READY_PORT``: every client
subscribes like Envoy (CDS and LDS wildcard, EDS following the clusters, RDS by
name) and ACKs every response; then READY_PORT answers 200. One JSON line per
response goes to stdout (the configuration reads them from the fleet's log).
SIGTERM or SIGINT ends it; a stream that ends early, or the deadline passing,
is written as an ``{"error": ...}`` line and exits 1.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from typing import Any, Callable

from ..stack.ready import serve_ready
from .spec import NODE_CLUSTER


async def fleet_main(spec: dict[str, Any], ready_port: int) -> int:
    import grpc

    from control_plane.type_urls import CLUSTER, LISTENER, ROUTE, SHORT_NAMES

    from .ads_client import CHANNEL_OPTIONS, DeltaClient, Received, SotwClient

    out = sys.stdout

    def observer(index: int) -> Callable[[Received], None]:
        def observe(received: Received) -> None:
            message = received.message
            out.write(json.dumps({"c": index, "type": SHORT_NAMES.get(received.type_url, "?"),
                                  "v": received.version, "b": message.ByteSize(), "n": len(message.resources),
                                  "t": time.monotonic()}) + "\n")
            out.flush()
        return observe

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    client_type = SotwClient if spec["mode"] == "sotw" else DeltaClient
    channels, clients = [], []
    # A channel (and TCP connection) per client, as separate Envoys would have.
    options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    code = 0
    ready = None
    try:
        for i in range(spec["clients"]):
            channel = grpc.aio.insecure_channel(spec["target"], options=options)
            channels.append(channel)
            client = client_type(channel, f"bench-client-{i}", NODE_CLUSTER, follow_clusters=True, decode=False,
                                 history=False, observe=observer(i))
            clients.append(client)
            await client.start()
            await client.subscribe(CLUSTER)  # EDS follows the clusters, as Envoy does
            await client.subscribe(LISTENER)
            await client.subscribe(ROUTE, [spec["route"]])
        ready = await serve_ready(ready_port)
        stopped = asyncio.create_task(stop.wait())
        ended = [asyncio.create_task(c.wait_for(lambda: False, timeout=spec["deadline_s"])) for c in clients]
        done, _ = await asyncio.wait([stopped, *ended], timeout=spec["deadline_s"],
                                     return_when=asyncio.FIRST_COMPLETED)
        if stopped not in done:
            code = 1
            for task in done:
                out.write(json.dumps({"error": f"a client stream ended: {task.exception()!r}"}) + "\n")
            if not done:
                out.write(json.dumps({"error": "client fleet deadline passed"}) + "\n")
            out.flush()
        for task in [stopped, *ended]:
            task.cancel()
        await asyncio.gather(stopped, *ended, return_exceptions=True)
    finally:
        if ready is not None:
            ready.close()
        await asyncio.gather(*(c.disconnect() for c in clients), return_exceptions=True)
        await asyncio.gather(*(ch.close() for ch in channels), return_exceptions=True)
    return code


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m inferlb.bench.xds_bench.fleet SPEC_JSON READY_PORT", file=sys.stderr)
        return 2
    return asyncio.run(fleet_main(json.loads(argv[0]), int(argv[1])))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
