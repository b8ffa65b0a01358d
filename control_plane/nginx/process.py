"""The nginx binary and its master process: ``nginx -t``, start, graceful reload, stop.

Async throughout (``asyncio`` subprocesses): ``nginx -t`` parses the whole
configuration and must not stall the xDS streams or the admin API. A reload
is confirmed, not assumed: nginx answers SIGHUP by starting new worker
processes only if the new configuration loaded, so a reload counts as done
once a worker the master did not have before appears and every old worker has
stopped accepting: the master lets old and new workers both accept for 100 ms
before it tells the old ones to quit, and a connection taken then would be
balanced by the old weights.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import time
from pathlib import Path

import psutil

from .model import NginxSettings

log = logging.getLogger("inferlb.control_plane.nginx")

PR_SET_PDEATHSIG = 1
VALIDATE_TIMEOUT_S = 30.0
POLL_S = 0.02


class NginxError(RuntimeError):
    """nginx refused or failed something; the message carries nginx's own words."""


def _die_with_parent() -> None:
    """Linux: nginx's master gets SIGTERM when the control plane dies, even by SIGKILL."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def validate(settings: NginxSettings, main_path: Path) -> str | None:
    """``nginx -t`` on ``main_path``: None when valid, else nginx's error text."""
    try:
        proc = await asyncio.create_subprocess_exec(
            settings.binary, "-t", "-q", "-p", f"{settings.config_dir}/", "-c", str(main_path),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return f"cannot run {settings.binary!r}: {exc}"
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), VALIDATE_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return f"nginx -t did not finish within {VALIDATE_TIMEOUT_S:.0f}s"
    if proc.returncode == 0:
        return None
    return out.decode(errors="replace").strip() or f"nginx -t exited with {proc.returncode}"


def _accepting(pid: int) -> bool:
    """Whether an nginx worker still takes new connections: it renames itself "... is shutting down"
    when told to quit, then only finishes what it has."""
    try:
        title = " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:  # gone (or a zombie): not accepting
        return False
    return "shutting down" not in title


class NginxProcess:
    """The nginx master: our child (``manage_process``) or one started elsewhere, found by its pid file."""

    def __init__(self, settings: NginxSettings) -> None:
        self.settings = settings
        self._child: asyncio.subprocess.Process | None = None

    @property
    def stderr_path(self) -> Path:
        return self.settings.config_dir / "nginx-stderr.log"

    def master_pid(self) -> int | None:
        if self.settings.manage_process:
            return self._child.pid if self._child is not None and self._child.returncode is None else None
        try:
            pid = int(self.settings.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if psutil.pid_exists(pid) else None

    def worker_pids(self) -> set[int]:
        pid = self.master_pid()
        if pid is None:
            return set()
        try:
            return {p.pid for p in psutil.Process(pid).children()}
        except psutil.Error:
            return set()

    async def start(self, timeout_s: float = 15.0) -> int:
        """Start ``nginx -g 'daemon off;'`` on the applied nginx.conf; ready once it wrote its pid file
        (it does so after binding the listener). Managed mode only."""
        s = self.settings
        s.pid_path.unlink(missing_ok=True)
        err = await asyncio.to_thread(open, self.stderr_path, "ab")
        try:
            self._child = await asyncio.create_subprocess_exec(
                s.binary, "-p", f"{s.config_dir}/", "-c", str(s.main_path), "-g", "daemon off;",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=err,
                preexec_fn=_die_with_parent)
        finally:
            err.close()
        child = self._child
        deadline = time.monotonic() + timeout_s
        while True:
            if child.returncode is not None:
                raise NginxError(f"nginx exited with {child.returncode} at start: {_tail(self.stderr_path)}")
            try:
                if int(s.pid_path.read_text().strip()) == child.pid:
                    return child.pid
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                await self.stop()
                raise NginxError(f"nginx did not come up within {timeout_s}s: {_tail(self.stderr_path)}")
            await asyncio.sleep(POLL_S)

    async def reload(self, timeout_s: float = 10.0) -> None:
        """SIGHUP (graceful: old workers finish their requests); done when a new worker process runs
        and no old one accepts connections any more."""
        pid = self.master_pid()
        if pid is None:
            raise NginxError(f"nginx is not running (pid file {self.settings.pid_path})")
        before = self.worker_pids()
        os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while not (self.worker_pids() - before) or any(_accepting(old) for old in before):
            if self.master_pid() is None:
                raise NginxError("nginx exited during the reload")
            if time.monotonic() > deadline:
                raise NginxError(f"nginx did not switch to new workers within {timeout_s}s of SIGHUP: "
                                 f"{_tail(self.settings.config_dir / 'error.log')}")
            await asyncio.sleep(POLL_S)

    async def stop(self) -> None:
        """Managed: SIGQUIT (finish in-flight requests), then SIGTERM, then SIGKILL of master and workers."""
        child = self._child
        if child is None or child.returncode is not None:
            return
        workers = self.worker_pids()
        for sig, wait_s in ((signal.SIGQUIT, self.settings.stop_timeout_s), (signal.SIGTERM, 5.0)):
            try:
                child.send_signal(sig)
                await asyncio.wait_for(child.wait(), wait_s)
                break
            except ProcessLookupError:
                break
            except TimeoutError:
                log.warning("nginx did not stop in time", extra={"signal": sig.name, "wait_s": wait_s})
        else:
            child.kill()
            await child.wait()
            for pid in workers:  # a master killed hard leaves its workers behind
                try:
                    worker = psutil.Process(pid)
                    if worker.ppid() in (child.pid, 1) and worker.name().startswith("nginx"):
                        worker.kill()
                except psutil.Error:
                    pass
        log.info("nginx stopped", extra={"pid": child.pid, "returncode": child.returncode})
