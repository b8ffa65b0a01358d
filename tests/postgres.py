"""A real, throwaway PostgreSQL server for tests (Debian's ``postgresql`` package).

One server per test session (``postgres_server``): ``initdb`` into a fresh
temporary directory owned by the ``postgres`` OS user (the server refuses to
run as root, and the tests do), ``postgres`` on 127.0.0.1 and a free port with
``fsync=off``, trust authentication for loopback. Each test gets its own
database (``postgres_url``), so tests never see each other's rows. The server
is stopped (fast shutdown, then SIGKILL) and its directory removed when the
session ends, even after a failure; its log is shown if it fails to start.

Without the server binaries the tests that need it are skipped with how to
install them, and fail under ``make test``, which installs them (``APT_PACKAGES``;
``need`` and ``missing`` in tests/conftest.py). Finding the
binaries, ``initdb`` and the server's command line are the product's
(``inferlb.bench.reliability.faults_postgres``, the PostgreSQL fault's server).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from inferlb.bench.reliability.faults_postgres import ServerMissing, init_cluster, server_argv, server_binaries, server_url

from .conftest import free_port, missing, need
from .stack import Proc, launch, wait_for


@dataclass
class PostgresServer:
    proc: Proc
    port: int
    bin_dir: Path

    def url(self, database: str = "postgres") -> str:
        return server_url(self.port, database)

    def admin(self) -> psycopg.Connection:
        """A superuser connection to the ``postgres`` database (autocommit)."""
        return psycopg.connect(self.url(), autocommit=True, connect_timeout=5)

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"inferlb_{uuid.uuid4().hex[:12]}"
        with self.admin() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def accepts_connections(self) -> bool:
        try:
            with self.admin() as conn:
                return conn.execute("SELECT 1").fetchone() == (1,)
        except psycopg.OperationalError:
            return False

    def terminate_backends(self, application_name_like: str) -> int:
        """Kill the server processes serving matching clients (their connections drop); how many."""
        with self.admin() as conn:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name LIKE %s AND pid <> pg_backend_pid()",
                                (application_name_like,)).fetchall()
        return len(rows)


def _stop(proc: Proc) -> None:
    """Fast shutdown (SIGINT: disconnect clients, stop), SIGKILL if it hangs; always reaped."""
    if proc.alive():
        proc.process.send_signal(signal.SIGINT)
        try:
            proc.process.wait(20)
        except subprocess.TimeoutExpired:
            proc.process.kill()
    proc.process.wait(10)


@pytest.fixture(scope="session")
def postgres_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PostgresServer]:
    need("postgres")
    bin_dir = server_binaries()
    assert bin_dir is not None
    log_dir = tmp_path_factory.mktemp("postgres-logs")
    # Not under pytest's tmp dir: that one is root-only (0700), and the server runs as postgres.
    base = Path(tempfile.mkdtemp(prefix="inferlb-pg-"))
    try:
        try:
            data, sockets = init_cluster(base, bin_dir)
        except ServerMissing as exc:
            missing(str(exc))
        port = free_port()
        proc = launch("postgres", server_argv(bin_dir, data, sockets, port), log_dir)
        try:
            server = PostgresServer(proc, port, bin_dir)
            wait_for(server.accepts_connections, 60, "PostgreSQL to accept connections", [proc])
            yield server
        except BaseException:
            print(f"\n----- postgres ({proc.log_path}), last lines -----\n{proc.tail()}")
            raise
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A fresh database on the session's server, for one test."""
    return postgres_server.create_database()
