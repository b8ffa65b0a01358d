"""The Redis of the Redis faults: a throwaway redis-server that can be killed and started again on its port.

ext_proc keeps its quota counters and the shared level of its gateway cache there; killing it (``kill -9``)
is "Redis down", starting it again on the same port is Redis back (empty: no persistence, as after a
crash without a snapshot). Always stopped on the way out of ``async with``.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..processes import free_port
from ..quota.quota_bench import redis_argv, wait_for_ping


@dataclass
class RedisProcess:
    """redis-server on 127.0.0.1:``port``; ``kill`` and ``start`` again keep the port."""

    directory: Path
    port: int = 0
    process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.port = self.port or free_port()
        self.process = await asyncio.create_subprocess_exec(
            *redis_argv(self.port, str(self.directory)), stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL)
        try:
            await wait_for_ping(self.port, self.process)
        except BaseException:
            await self.kill()
            raise

    async def kill(self) -> None:
        """``kill -9``: no goodbye to its clients."""
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
        self.process = None


class ThrowawayRedis:
    """``async with ThrowawayRedis() as redis``: started in a fresh directory; killed and removed after."""

    def __init__(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="inferlb-faults-redis-")
        self.redis = RedisProcess(Path(self._directory.name))

    async def __aenter__(self) -> RedisProcess:
        try:
            await self.redis.start()
        except BaseException:
            self._directory.cleanup()
            raise
        return self.redis

    async def __aexit__(self, *_: object) -> None:
        try:
            await self.redis.kill()
        finally:
            self._directory.cleanup()
