"""ASGI middleware: each HTTP request's ``x-request-id`` on its log lines, and its server span when tracing.

Why pure ASGI rather than Starlette's BaseHTTPMiddleware: it is on the workers' inference path, and a
middleware that only reads headers and wraps ``send`` costs a header scan, not another task and a body copy.
The span is made current (OpenTelemetry's context), so the handler adds what only it knows (tokens, the
batch) to ``trace.get_current_span()``.
"""

from __future__ import annotations

import uuid
from typing import Any, Awaitable, Callable, Collection, MutableMapping

from opentelemetry import trace

from .logs import RequestIds, bind_request, unbind_request
from .tracing import REQUEST_ID_HEADER, TRACEPARENT_HEADER, Tracing, trace_id_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REQUEST_ID = REQUEST_ID_HEADER.encode()
_TRACE_HEADERS = {TRACEPARENT_HEADER.encode(), b"tracestate"}


class RequestContextMiddleware:
    """Binds the request id for the request's log lines; with ``tracing``, a SERVER span per request to one
    of ``traced_paths`` (probes and /metrics are polled all the time: spans for them would bury the rest),
    a child of the caller's ``traceparent``.

    ``generate_id``: a request without ``x-request-id`` gets a fresh one (a service no proxy stands in front
    of, the admin API); ``echo_id``: the response carries it, so a caller can quote it.
    """

    def __init__(self, app: ASGIApp, *, generate_id: bool = False, echo_id: bool = False,
                 tracing: Tracing | None = None, traced_paths: Collection[str] = ()) -> None:
        self.app = app
        self.generate_id = generate_id
        self.echo_id = echo_id
        self.tracing = tracing
        self.traced_paths = frozenset(traced_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id: str | None = None
        for name, value in scope["headers"]:
            if name == _REQUEST_ID:
                request_id = value.decode("latin-1")
                break
        if request_id is None and self.generate_id:
            request_id = str(uuid.uuid4())
        if self.echo_id and request_id is not None:
            send = _echoing(send, request_id.encode("latin-1"))
        tracing = self.tracing
        if tracing is None or scope["path"] not in self.traced_paths:
            token = bind_request(RequestIds(request_id))
            try:
                await self.app(scope, receive, send)
            finally:
                unbind_request(token)
            return
        await self._traced(tracing, scope, receive, send, request_id)

    async def _traced(self, tracing: Tracing, scope: Scope, receive: Receive, send: Send,
                      request_id: str | None) -> None:
        carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
                   if name in _TRACE_HEADERS}
        method, path = scope["method"], scope["path"]
        span = tracing.tracer.start_span(f"{method} {path}", context=tracing.extract(carrier),
                                         kind=trace.SpanKind.SERVER,
                                         attributes={"http.request.method": method, "url.path": path})
        if request_id is not None:
            span.set_attribute("inferlb.request_id", request_id)

        async def recording_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(trace.StatusCode.ERROR)
            await send(message)

        token = bind_request(RequestIds(request_id, trace_id_of(span)))
        try:
            with trace.use_span(span, end_on_exit=True):
                await self.app(scope, receive, recording_status)
        finally:
            unbind_request(token)


def _echoing(send: Send, request_id: bytes) -> Send:
    async def with_request_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != _REQUEST_ID]
            message["headers"] = [*headers, (_REQUEST_ID, request_id)]
        await send(message)

    return with_request_id
