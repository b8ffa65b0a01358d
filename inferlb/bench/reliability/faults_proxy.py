"""A delaying TCP proxy for ``inferlb bench faults``: latency injected in front of one worker (or Redis).

Each byte a client sends is forwarded ``delay_s`` after it arrived (a link's latency, like ``tc netem
delay``, not a throughput cap: chunks are timestamped on arrival and released in order at their own time).
Answers flow back at once. ``delay_s`` may change while connections are open; 0 forwards at once.
It runs in the harness's event loop, so it needs no privileges and no extra process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
CHUNK = 65536


@dataclass
class DelayProxy:
    """Listens on 127.0.0.1:``port`` (0: any free one) and forwards to ``upstream_host``:``upstream_port``."""

    upstream_host: str
    upstream_port: int
    delay_s: float = 0.0
    port: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "DelayProxy":
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and cut every open connection (both ends)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> "DelayProxy":
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            upstream_r, upstream_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._delayed(client_r, upstream_w))
                tasks.create_task(self._pump(upstream_r, client_w))
        except* (OSError, asyncio.IncompleteReadError):
            pass  # either end went away: close both, as a real link failing would
        except* Exception:  # a proxy bug must show in the log, not vanish with the task
            log.exception("delay proxy to %s:%s failed", self.upstream_host, self.upstream_port)
        finally:
            self._tasks.discard(task)
            for writer in (client_w, upstream_w):
                if writer is not None:
                    writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    async def _delayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Forward each chunk ``delay_s`` after it arrived; reading goes on meanwhile (latency, not a cap)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await reader.read(CHUNK):
                    queue.put_nowait((loop.time() + self.delay_s, data))
            finally:  # EOF, or the client gone: either way the end of what it sent
                queue.put_nowait((loop.time() + self.delay_s, b""))

        reading = asyncio.create_task(read())
        try:
            while True:
                due, data = await queue.get()
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)  # the injected latency itself, not a synchronisation
                if not data:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        finally:
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, asyncio.IncompleteReadError):
                await reading
