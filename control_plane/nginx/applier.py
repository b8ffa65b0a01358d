"""The I/O edge of the NGINX data plane: render -> stage -> ``nginx -t`` -> swap -> graceful reload.

Driven by the controller's state changes (``mark``), through a debounce and a
rate limit: a candidate is rendered at most once per debounce window, and a
reload happens at most once per ``min_reload_interval_s`` (each reload resets
nginx's balancing state and starts new worker processes). A candidate whose
bytes equal the running config is dropped: quantised, hysteretic weights
(``quantise``) make telemetry noise render identical bytes.

A candidate that ``nginx -t`` rejects is never applied: it stays in
``<config_dir>/staging`` for inspection, the running config keeps serving,
the error goes to the status (``GET /v1/dataplane``), the metrics and the log,
and the same bytes are not validated again (no retry loop); the next
different candidate is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from ..debounce import Debouncer
from ..model import FleetState
from .model import MAIN_FILE, NginxSettings, RenderedConfig, UpstreamServer
from .process import NginxError, NginxProcess, validate
from .render import render

log = logging.getLogger("inferlb.control_plane.nginx")

FailureStage = Literal["validate", "reload", "start", "process", "extra_file"]
EXTRA_FILE_POLL_S = 1.0
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


@dataclass(frozen=True)
class NginxFailure:
    stage: FailureStage
    message: str  # nginx's own words for "validate"
    digest: str | None  # the rejected candidate's (sha256 of its files)
    at: float  # unix time


@dataclass(frozen=True)
class NginxStatus:
    config_dir: str
    listen: str
    manage_process: bool
    running: bool
    pid: int | None
    version: int  # configs applied since start (the first one included); 0: none yet
    digest: str | None
    applied_at: float | None
    reloads: int  # graceful reloads that took effect
    rejected: int  # candidates nginx -t refused
    cycles: int  # candidates rendered and compared
    pending: bool  # the current state renders a different, not-rejected config: applied at the next slot
    failing: bool  # the current state renders the rejected config: nothing applies until it changes
    last_error: NginxFailure | None
    servers: tuple[UpstreamServer, ...]  # what nginx runs now


class ReloadObserver(Protocol):
    def nginx_applied(self, result: str, at: float) -> None: ...


def _write_files(directory: Path, files: Mapping[str, str]) -> None:
    """Write each file beside its final name, then rename (atomic per file); the main file last."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in sorted(files, key=lambda n: n == MAIN_FILE):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(files[name])
        os.replace(tmp, directory / name)


def _read_extra(path: Path | None) -> str:
    """The operator's directives file; a missing file is empty (deleting it removes the directives)."""
    if path is None:
        return ""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


class NginxApplier:
    def __init__(self, settings: NginxSettings, state: Callable[[], FleetState],
                 observer: ReloadObserver | None = None) -> None:
        self.settings = settings
        self._state = state
        self._observer = observer
        self.process = NginxProcess(settings)
        self._debouncer = Debouncer(self._cycle, delay=settings.debounce_s, max_delay=max(settings.debounce_s, 1.0),
                                    task="nginx-apply")  # a failing cycle is logged and retried
        self._applied: RenderedConfig | None = None
        self._applied_at: float | None = None
        self._last_reload = float("-inf")  # monotonic
        self._rejected_digest: str | None = None
        self._last_error: NginxFailure | None = None
        self._extra_text = ""
        self._extra_stamp: tuple[int, int] | None = None
        self._version = self._reloads = self._rejected = self._cycles = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.ready = False

    @property
    def staging_dir(self) -> Path:
        return self.settings.config_dir / "staging"

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Apply the first config and (managed) start nginx; NginxError when there is no valid first config."""
        s = self.settings
        await asyncio.to_thread((s.config_dir / "temp").mkdir, parents=True, exist_ok=True)
        self._extra_text = await asyncio.to_thread(_read_extra, s.extra_directives_file)
        self._extra_stamp = self._stat_extra()
        candidate = render(self._state(), s, None, self._extra_text)
        error = await self._validate(candidate)
        if error is not None:
            self._fail("validate", error, candidate.digest)
            raise NginxError(f"the first nginx config is invalid (staged in {self.staging_dir}): {error}")
        await asyncio.to_thread(_write_files, s.config_dir, candidate.files)
        if s.manage_process:
            try:
                pid = await self.process.start()
            except NginxError as exc:
                self._fail("start", str(exc), candidate.digest)
                raise
            self._tasks.append(asyncio.create_task(self._watch_process(), name="nginx-watch"))
            log.info("nginx started", extra={"pid": pid, "config_dir": str(s.config_dir),
                                             "listen": f"{s.listen_address}:{s.listen_port}"})
        elif self.process.master_pid() is not None:
            await self._reload(candidate)
        else:
            log.warning("nginx is not running: start it with the written config",
                        extra={"command": f"{s.binary} -p {s.config_dir}/ -c {s.main_path}"})
        self._record_applied(candidate)
        self._debouncer.start()
        if s.extra_directives_file is not None:
            self._tasks.append(asyncio.create_task(self._watch_extra_file(), name="nginx-extra-file"))
        self.ready = True

    async def stop(self) -> None:
        """Stop reacting, then (managed) stop nginx gracefully: in-flight requests finish."""
        self._stopping = True
        await self._debouncer.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        await self.process.stop()
        self.ready = False

    def mark(self, _state: FleetState | None = None) -> None:
        """The state changed: a candidate follows after the debounce (a controller listener)."""
        self._debouncer.mark()

    # -- status ---------------------------------------------------------------------------------------

    def status(self) -> NginxStatus:
        s = self.settings
        applied = self._applied
        current = render(self._state(), s, applied.weights if applied else None, self._extra_text)
        differs = applied is None or current.digest != applied.digest
        failing = current.digest == self._rejected_digest
        pid = self.process.master_pid()
        return NginxStatus(
            config_dir=str(s.config_dir), listen=f"{s.listen_address}:{s.listen_port}",
            manage_process=s.manage_process, running=pid is not None, pid=pid, version=self._version,
            digest=applied.digest if applied else None, applied_at=self._applied_at, reloads=self._reloads,
            rejected=self._rejected, cycles=self._cycles, pending=differs and not failing, failing=failing,
            last_error=self._last_error, servers=applied.servers if applied else (),
        )

    # -- the cycle --------------------------------------------------------------------------------------

    async def _cycle(self) -> None:
        wait = self._last_reload + self.settings.min_reload_interval_s - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)  # the rate limit: changes meanwhile fold into this candidate
        applied = self._applied
        candidate = render(self._state(), self.settings, applied.weights if applied else None, self._extra_text)
        self._cycles += 1
        if applied is not None and candidate.digest == applied.digest:
            return
        if candidate.digest == self._rejected_digest:
            return  # refused already: wait for a different candidate, never loop on this one
        error = await self._validate(candidate)
        if error is not None:
            self._fail("validate", error, candidate.digest)
            return
        if self.process.master_pid() is None:
            # No nginx to reload (unmanaged and not started yet, or restarting): the files are what it starts on.
            await asyncio.to_thread(_write_files, self.settings.config_dir, candidate.files)
            self._record_applied(candidate)
            return
        previous = applied
        await asyncio.to_thread(_write_files, self.settings.config_dir, candidate.files)
        try:
            await self._reload(candidate)
        except NginxError as exc:
            if previous is not None:  # the files on disk must be what nginx runs
                await asyncio.to_thread(_write_files, self.settings.config_dir, previous.files)
            self._fail("reload", str(exc), candidate.digest)
            return
        self._record_applied(candidate)

    async def _validate(self, candidate: RenderedConfig) -> str | None:
        await asyncio.to_thread(_write_files, self.staging_dir, candidate.files)
        return await validate(self.settings, self.staging_dir / MAIN_FILE)

    async def _reload(self, candidate: RenderedConfig) -> None:
        started = time.monotonic()
        await self.process.reload()
        self._last_reload = time.monotonic()
        self._reloads += 1
        if self._observer is not None:
            self._observer.nginx_applied("ok", time.time())
        log.info("nginx reloaded", extra={"digest": candidate.digest[:12], "weights": candidate.weights,
                                          "reload_s": round(time.monotonic() - started, 3)})

    def _record_applied(self, candidate: RenderedConfig) -> None:
        self._applied = candidate
        self._applied_at = time.time()
        self._version += 1
        self._rejected_digest = None

    def _fail(self, stage: FailureStage, message: str, digest: str | None) -> None:
        self._last_error = NginxFailure(stage, message, digest, time.time())
        if stage == "validate":
            self._rejected_digest = digest
            self._rejected += 1
        if self._observer is not None:
            self._observer.nginx_applied("invalid" if stage == "validate" else "failed", time.time())
        log.error("nginx config not applied: the last good one keeps serving",
                  extra={"stage": stage, "error": message, "digest": (digest or "")[:12]})

    # -- watchers ----------------------------------------------------------------------------------------

    def _stat_extra(self) -> tuple[int, int] | None:
        path = self.settings.extra_directives_file
        try:
            st = path.stat() if path is not None else None
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size) if st is not None else None

    async def _watch_extra_file(self) -> None:
        """Re-read the operator's directives file when it changes; it goes through the same validation."""
        while True:
            await asyncio.sleep(EXTRA_FILE_POLL_S)
            stamp = self._stat_extra()
            if stamp != self._extra_stamp:
                self._extra_stamp = stamp
                self._extra_text = await asyncio.to_thread(_read_extra, self.settings.extra_directives_file)
                log.info("nginx extra directives file changed",
                         extra={"path": str(self.settings.extra_directives_file)})
                self.mark()

    async def _watch_process(self) -> None:
        """Managed nginx exited on its own: record it and start it again (with backoff) on the last good files."""
        attempt = 0
        while True:
            child = self.process._child
            if child is None:
                return
            code = await child.wait()
            if self._stopping:
                return
            delay = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            self._fail("process", f"nginx exited with {code}; restarting in {delay}s", None)
            await asyncio.sleep(delay)
            try:
                await self.process.start()
                attempt = 0
                log.info("nginx restarted", extra={"pid": self.process.master_pid()})
            except NginxError as exc:
                attempt += 1
                self._fail("start", str(exc), None)
