"""A real, throwaway Redis server for tests (Debian's ``redis-server`` package).

One server per test session (``redis_server``), as tests/postgres.py does for
PostgreSQL: ``redis-server`` on 127.0.0.1 and a free port, in a fresh
temporary directory, with no persistence (no RDB snapshots, no AOF) and
protected mode off (it listens on loopback only, without a password). Ready
when ``PING`` answers, against a deadline. Each test gets its own database
flushed (``redis_url``). Tests that stop Redis on purpose take their own server
(``own_redis``), so they never take the shared one down under others. Every
server is stopped (SIGTERM, then SIGKILL) when its fixture ends, even after a
failure; its log is shown if it fails to start.

Without the binary the tests that need it are skipped with how to install it,
and fail under ``make test``, which installs it (``APT_PACKAGES``; ``need`` in
tests/conftest.py).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import free_port, need, which
from .stack import Proc, launch, wait_for


def ping(port: int, timeout: float = 1.0) -> bool:
    """True if a Redis on 127.0.0.1:``port`` answers PING (plain RESP over a socket: no client state)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def command(port: int, *args: str, timeout: float = 5.0) -> bytes:
    """One command's raw reply (for setup and inspection, e.g. FLUSHALL, DBSIZE)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        return sock.recv(65536)


@dataclass
class RedisServer:
    """One redis-server process; ``stop`` and ``start`` again keep its port (a restart, as clients see it)."""

    binary: str
    directory: Path
    port: int = field(default_factory=free_port)
    proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = launch("redis", [
            self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
            "--loglevel", "warning"], self.directory)
        try:
            wait_for(lambda: ping(self.port), 30, f"redis-server to answer PING on port {self.port}", [self.proc])
        except BaseException:
            print(f"\n----- redis ({self.proc.log_path}), last lines -----\n{self.proc.tail()}")
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)
            self.proc = None

    def command(self, *args: str) -> bytes:
        return command(self.port, *args)

    def flush(self) -> None:
        assert self.command("FLUSHALL").startswith(b"+OK")


def redis_binary() -> str:
    need("redis")
    found = which("redis-server")
    assert found is not None
    return found


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's server, emptied for this test."""
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, which it may stop and start again."""
    server = RedisServer(redis_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
