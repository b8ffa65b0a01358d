"""uvicorn embedded in a service's own asyncio loop."""

from __future__ import annotations

import contextlib
from typing import Iterator

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """uvicorn inside our loop: the process's signal handling stays the service's own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
