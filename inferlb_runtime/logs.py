"""One JSON object per log line on stderr, for every logger of a service (uvicorn's included), and the
request a line was written for.

Why a context variable: a line logged anywhere while a request is handled (a policy, the batcher, a store)
must carry that request's ``x-request-id`` without every call passing it on. A service binds the request
once, where it starts handling it (ext_proc per stream, the HTTP services in a middleware); asyncio copies
the binding into tasks and threads started from there, and the handler's filter stamps ``request_id`` (and
``trace_id`` while tracing is on) on the line. Lines outside a request carry neither.
"""

from __future__ import annotations

import logging
import logging.config
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Iterable, Protocol

UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access")
MAX_REQUEST_ID_CHARS = 128  # a client may send any x-request-id: a log line keeps this much of it


class RequestIdentity(Protocol):
    """What a log line learns about the request it was written for (read only when a line is written)."""

    @property
    def request_id(self) -> str | None: ...

    @property
    def trace_id(self) -> str | None: ...


@dataclass(frozen=True)
class RequestIds:
    """A request's identity, known when it is bound (the HTTP services)."""

    request_id: str | None
    trace_id: str | None = None


_REQUEST: ContextVar[RequestIdentity | None] = ContextVar("inferlb_request", default=None)


def bind_request(identity: RequestIdentity) -> Token[RequestIdentity | None]:
    """Lines logged from here on in this context (and tasks it starts) are this request's."""
    return _REQUEST.set(identity)


def unbind_request(token: Token[RequestIdentity | None]) -> None:
    _REQUEST.reset(token)


def bound_request() -> RequestIdentity | None:
    return _REQUEST.get()


class RequestContextFilter(logging.Filter):
    """Stamps ``request_id`` and ``trace_id`` of the bound request on each record (on the handler: a record
    propagated from any logger passes it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        identity = _REQUEST.get()
        if identity is not None:
            request_id = identity.request_id
            if request_id:
                record.request_id = request_id[:MAX_REQUEST_ID_CHARS]
            trace_id = identity.trace_id
            if trace_id:
                record.trace_id = trace_id
        return True


def configure_json_logging(component: str, level: str, quiet: Iterable[str] = ("httpx",)) -> None:
    """``component`` is stamped on every line; loggers in ``quiet`` log warnings only."""
    logging.config.dictConfig({
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "{asctime}{levelname}{name}{message}",
            "style": "{",
            "rename_fields": {"asctime": "ts", "levelname": "level", "name": "logger", "message": "msg"},
            "static_fields": {"component": component},
        }},
        "filters": {"request": {"()": RequestContextFilter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr",
                                "filters": ["request"]}},
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            **{name: {"handlers": [], "propagate": True} for name in UVICORN_LOGGERS},
            **{name: {"level": "WARNING"} for name in quiet},
        },
    })
