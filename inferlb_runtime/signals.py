"""How a service learns it must stop: SIGINT and SIGTERM set an asyncio event instead of ending the process
abruptly, so the service drains in-flight work and stops its parts in order."""

from __future__ import annotations

import asyncio
import signal


def stop_on_signals() -> asyncio.Event:
    """An event SIGINT and SIGTERM set (the running loop's handlers replace the default)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
