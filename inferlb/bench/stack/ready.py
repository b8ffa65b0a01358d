"""A readiness port for bench children that speak no HTTP (a gRPC servicer, an xDS client fleet).

``ProcessGroup`` waits for a component's ``ready_url`` to answer 2xx; a child
that is not an HTTP server opens this once it is really ready (listening,
connected, subscribed) and answers every request on it with 200.
"""

from __future__ import annotations

import asyncio

READY_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(READY_ANSWER)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve_ready(port: int) -> asyncio.Server:
    """Answer 200 on 127.0.0.1:``port`` until the returned server is closed."""
    return await asyncio.start_server(_answer, "127.0.0.1", port)
