"""ext_proc's native gRPC front: gRPC C++ streams (``ext_proc._native_front``) served by asyncio handlers.

The extension runs HTTP/2 on a thread of its own and hands the loop each stream's events in batches
(``ext_proc/native/front.cc`` says how). Here every stream becomes one task running its method's handler:
an async generator that reads the stream's messages and yields its answers, which is how grpcio's aio server
runs ``ExtProcServicer.process``, so the servicer is the same on both fronts. Why it exists: on grpcio's aio
server, the framework costs about as much CPU per decision as ext_proc's own work (docs/benchmarks.md,
section 3); this front takes most of that away.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

OK = 0
UNKNOWN = 2
NOT_FOUND = 5
UNIMPLEMENTED = 12

Metadata = Sequence[tuple[str, bytes]]


def load_front() -> ModuleType | None:
    """The compiled front, or None when it was not built (no gRPC C++ at install time; see setup.py)."""
    try:
        from .. import _native_front  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _native_front


class StreamAbort(Exception):
    """Raised by a handler to end its stream with a gRPC status other than OK."""

    def __init__(self, code: int, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class Messages:
    """One stream's incoming messages (serialised), as an async iterator that ends at the client's half-close."""

    __slots__ = ("_items", "_waiter", "_closed")

    def __init__(self) -> None:
        self._items: collections.deque[bytes] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def put(self, message: bytes) -> None:
        self._items.append(message)
        self._wake()

    def close(self) -> None:
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> Messages:
        return self

    async def __anext__(self) -> bytes:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


@dataclass(frozen=True)
class Invocation:
    """What a handler may know of its call beyond the messages: the client's metadata (when asked for)."""

    metadata: Metadata = ()

    def invocation_metadata(self) -> Metadata:
        return self.metadata


Handler = Callable[[Messages, Invocation], AsyncIterator[bytes]]


@dataclass
class _Open:
    messages: Messages
    task: asyncio.Task[None]


class NativeServer:
    """Serves ``handlers`` (full method name -> handler) on every target (``host:port``, ``unix:/path``).

    Unknown methods end UNIMPLEMENTED. A handler's StreamAbort ends its stream with that status; any other
    exception is logged and ends it UNKNOWN. A stream the client cancels or resets cancels its task."""

    front = "native"

    def __init__(self, front: ModuleType, handlers: Mapping[str, Handler], targets: Sequence[str],
                 max_message_bytes: int, reuse_port: bool = False, with_metadata: bool = False) -> None:
        self._kinds = front
        self._handlers = dict(handlers)
        self._front: Any = front.Front(list(targets), max_message_bytes, reuse_port, with_metadata)
        self._open: dict[int, _Open] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled by a CLOSED event, their handlers not yet out
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._front.fileno(), self._on_events)
        self._stopped = False

    @property
    def open_streams(self) -> int:
        return len(self._open)

    def _on_events(self) -> None:
        kinds = self._kinds
        for event in self._front.drain():
            sid, kind = event[0], event[1]
            if kind == kinds.MESSAGE:
                stream = self._open.get(sid)
                if stream is not None:
                    stream.messages.put(event[2])
            elif kind == kinds.OPENED:
                self._opened(sid, event[3], event[2])
            elif kind == kinds.HALF_CLOSED:
                stream = self._open.get(sid)
                if stream is not None:
                    stream.messages.close()
            elif kind == kinds.CLOSED:  # finished, or cancelled by the client: either way its task is done
                stream = self._open.pop(sid, None)
                if stream is not None and not stream.task.done():
                    stream.task.cancel()
                    self._ending.add(stream.task)
                    stream.task.add_done_callback(self._ending.discard)

    def _opened(self, sid: int, method: str, metadata: Metadata | None) -> None:
        handler = self._handlers.get(method)
        if handler is None:
            self._front.finish(sid, UNIMPLEMENTED, f"unknown method {method}")
            return
        messages = Messages()
        task = self._loop.create_task(self._serve(sid, handler, messages, Invocation(metadata or ())))
        self._open[sid] = _Open(messages, task)

    async def _serve(self, sid: int, handler: Handler, messages: Messages, invocation: Invocation) -> None:
        write = self._front.write
        try:
            async for answer in handler(messages, invocation):
                write(sid, answer)
        except StreamAbort as abort:
            self._front.finish(sid, abort.code, abort.details)
        except Exception as exc:  # noqa: BLE001 - the stream ends with a status; the server goes on
            log.exception("gRPC stream failed")
            self._front.finish(sid, UNKNOWN, f"{type(exc).__name__}: {exc}")
        else:
            self._front.finish(sid, OK)
        finally:
            self._open.pop(sid, None)

    async def stop(self, grace: float | None) -> None:
        """Refuse new streams, let open ones finish for up to ``grace`` seconds, then cancel them; returns once
        every handler has ended, those the front closed itself (a CLOSED event, even one that came while it
        stopped) included."""
        if self._stopped:
            return
        self._stopped = True
        await asyncio.to_thread(self._front.stop, grace or 0.0)  # the loop keeps serving meanwhile
        self._on_events()  # the last events: the streams it cancelled
        self._loop.remove_reader(self._front.fileno())
        tasks = [stream.task for stream in self._open.values()]
        self._open.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._ending, return_exceptions=True)
