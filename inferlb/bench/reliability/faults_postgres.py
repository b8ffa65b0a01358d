"""The PostgreSQL of the PostgreSQL fault: a throwaway server that can be shut down at once and started again.

Debian's server binaries (``/usr/lib/postgresql/<version>/bin``), ``initdb`` into a fresh directory and
``postgres`` on 127.0.0.1 and a free port, trust authentication for loopback and no durability settings
(``fsync=off``): a server that exists for one run. Run as root (as here and in CI) it runs as the
``postgres`` OS user, since PostgreSQL refuses to run as root. The control-plane replicas share it
(``INFERLB_STORE``).

"Down" is an immediate shutdown (SIGQUIT to the postmaster, what ``pg_ctl stop -m immediate`` sends): every
backend quits at once, clients' connections drop, nothing is checkpointed. Started again on the same data
directory and port, the server runs crash recovery and keeps every committed row. Always stopped on the way
out of ``async with``. ``tests/postgres.py`` starts its session server with the same helpers.
"""

from __future__ import annotations

import asyncio
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import psycopg

from ..processes import free_port

OS_USER = "postgres"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class ServerMissing(RuntimeError):
    """No PostgreSQL server here (binaries or OS user): the message says what to install."""


def server_binaries() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` with ``initdb`` and ``postgres``, or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"),
                        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    for postgres in reversed(candidates):
        bin_dir = Path(postgres).parent
        if (bin_dir / "initdb").exists():
            return bin_dir
    return None


def as_server_user(argv: list[str]) -> list[str]:
    """``argv`` as the postgres OS user when we are root (``setpriv`` execs: signals reach the server)."""
    if os.geteuid() != 0:
        return argv
    return ["setpriv", f"--reuid={OS_USER}", f"--regid={OS_USER}", "--init-groups", "--", *argv]


def init_cluster(base: Path, bin_dir: Path) -> tuple[Path, Path]:
    """``initdb`` into ``base/data`` (``base/sockets`` for the Unix sockets); both paths. RuntimeError with
    initdb's output if it fails, ServerMissing without the server's OS user. ``base`` must not be under a root-only directory (the server user reads it)."""
    data, sockets = base / "data", base / "sockets"
    data.mkdir()
    sockets.mkdir()
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam(OS_USER)
        except KeyError:
            raise ServerMissing(f"no {OS_USER!r} OS user: apt-get install postgresql creates it") from None
        for path in (base, data, sockets):
            os.chown(path, user.pw_uid, user.pw_gid)
    initdb = subprocess.run(
        as_server_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                        "--encoding=UTF8", "--no-sync", "--no-instructions"]),
        capture_output=True, text=True, cwd=base, timeout=120, check=False)
    if initdb.returncode != 0:
        raise RuntimeError(f"initdb failed:\n{initdb.stdout}\n{initdb.stderr}")
    return data, sockets


def server_argv(bin_dir: Path, data: Path, sockets: Path, port: int) -> list[str]:
    """The server on 127.0.0.1:``port``, throwaway settings (no fsync), warnings and worse logged."""
    return as_server_user([
        str(bin_dir / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port), "-k", str(sockets),
        "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
        "-c", "max_connections=200", "-c", "log_min_messages=warning"])


def server_url(port: int, database: str = "postgres") -> str:
    return f"postgresql://postgres@127.0.0.1:{port}/{database}"


class PostgresProcess:
    """The server on an initialised data directory; ``shutdown_immediately`` and ``start`` keep the port."""

    def __init__(self, bin_dir: Path, data: Path, sockets: Path, log_path: Path) -> None:
        self.bin_dir, self.data, self.sockets, self.log_path = bin_dir, data, sockets, log_path
        self.port = 0
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return server_url(self.port)

    async def start(self) -> None:
        """Start it and wait until it accepts connections (crash recovery included)."""
        self.port = self.port or free_port()
        with open(self.log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                *server_argv(self.bin_dir, self.data, self.sockets, self.port), stdout=log,
                stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL)
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop(signal.SIGKILL)
            raise

    async def _wait_ready(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_TIMEOUT_S
        while loop.time() < deadline:
            if self.process is None or self.process.returncode is not None:
                raise RuntimeError(f"postgres exited while starting; see {self.log_path}")
            try:
                async with await psycopg.AsyncConnection.connect(self.url, connect_timeout=2) as conn:
                    await conn.execute("SELECT 1")
                    return
            except psycopg.OperationalError:
                await asyncio.sleep(0.1)
        raise TimeoutError(f"postgres did not accept connections within {READY_TIMEOUT_S:g} s; see {self.log_path}")

    async def shutdown_immediately(self) -> None:
        """Down: SIGQUIT (immediate shutdown), every backend quits and drops its client; reaped."""
        await self.stop(signal.SIGQUIT)

    async def stop(self, sig: int = signal.SIGINT) -> None:
        """``sig`` (default SIGINT: fast shutdown), SIGKILL if it is still running after the timeout."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.returncode is None:
            process.send_signal(sig)
            try:
                await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                process.kill()
        await process.wait()


class ThrowawayPostgres:
    """``async with ThrowawayPostgres(log_dir) as postgres``: initialised and started in a fresh directory;
    stopped and removed after. ServerMissing when there is no server to run."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._base: Path | None = None
        self.postgres: PostgresProcess | None = None

    async def __aenter__(self) -> PostgresProcess:
        bin_dir = server_binaries()
        if bin_dir is None:
            raise ServerMissing("PostgreSQL server binaries not found under /usr/lib/postgresql/*/bin: "
                                "apt-get install postgresql")
        self._base = Path(tempfile.mkdtemp(prefix="inferlb-faults-pg-"))
        try:
            data, sockets = await asyncio.to_thread(init_cluster, self._base, bin_dir)
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self.postgres = PostgresProcess(bin_dir, data, sockets, self._log_dir / "postgres.log")
            await self.postgres.start()
        except BaseException:
            await self.__aexit__()
            raise
        return self.postgres

    async def __aexit__(self, *_: object) -> None:
        try:
            if self.postgres is not None:
                await self.postgres.stop()
        finally:
            if self._base is not None:
                shutil.rmtree(self._base, ignore_errors=True)
