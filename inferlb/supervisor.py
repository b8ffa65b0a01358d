"""Start the stack's processes in readiness order, restart crashes, stop cleanly.

The supervisor only starts processes and speaks HTTP to their probes; it
never imports the services.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import httpx

log = logging.getLogger("inferlb.up")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the supervisor dies, so nothing is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass(frozen=True)
class Component:
    name: str
    argv: Sequence[str]
    ready_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180.0


@dataclass
class Running:
    spec: Component
    process: asyncio.subprocess.Process
    started: float
    restarts: int = 0


Report = Callable[[str], None]


class Supervisor:
    def __init__(self, components: Sequence[Component], *, report: Report = print, stop_timeout_s: float = 35.0,
                 max_backoff_s: float = 30.0) -> None:
        self.components = list(components)
        self.report = report
        self.stop_timeout_s = stop_timeout_s
        self.max_backoff_s = max_backoff_s
        self.running: dict[str, Running] = {}
        self._stopping = asyncio.Event()

    async def _spawn(self, spec: Component) -> asyncio.subprocess.Process:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as out:
            return await asyncio.create_subprocess_exec(
                *spec.argv, stdout=out, stderr=out, env=spec.env or None,
                start_new_session=True, preexec_fn=_die_with_parent,
            )

    async def _wait_ready(self, spec: Component, process: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + spec.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline and not self._stopping.is_set():
                if process.returncode is not None:
                    raise RuntimeError(f"{spec.name} exited with {process.returncode} before it was ready; "
                                       f"see {spec.log_path}")
                try:
                    if (await client.get(spec.ready_url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                try:
                    await asyncio.wait_for(process.wait(), 0.2)
                except TimeoutError:
                    pass
        if not self._stopping.is_set():
            raise RuntimeError(f"{spec.name} was not ready after {spec.ready_timeout_s:.0f}s; see {spec.log_path}")

    async def start_all(self) -> None:
        """Start the components in order, each once the previous one is ready."""
        for spec in self.components:
            process = await self._spawn(spec)
            self.running[spec.name] = Running(spec, process, time.monotonic())
            self.report(f"  {spec.name:<14} starting   pid {process.pid}")
            await self._wait_ready(spec, process)
            if self._stopping.is_set():
                return
            self.report(f"  {spec.name:<14} ready      {spec.ready_url}  (log {spec.log_path})")

    async def watch(self) -> None:
        """Restart components that exit, with exponential backoff, until stop is asked."""
        watchers = [asyncio.create_task(self._watch_one(name)) for name in self.running]
        await self._stopping.wait()
        for task in watchers:
            task.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)

    async def _watch_one(self, name: str) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            entry = self.running[name]
            code = await entry.process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - entry.started > 60:
                backoff = 1.0
            self.report(f"  {name:<14} CRASHED    exit {code}; restarting in {backoff:.0f}s (log {entry.spec.log_path})")
            try:
                await asyncio.wait_for(self._stopping.wait(), backoff)
                return
            except TimeoutError:
                pass
            backoff = min(backoff * 2, self.max_backoff_s)
            process = await self._spawn(entry.spec)
            self.running[name] = Running(entry.spec, process, time.monotonic(), entry.restarts + 1)
            try:
                await self._wait_ready(entry.spec, process)
                self.report(f"  {name:<14} ready      restarted ({entry.restarts + 1} so far)")
            except RuntimeError as exc:
                self.report(f"  {name:<14} not ready  {exc}")

    def request_stop(self) -> None:
        self._stopping.set()

    async def stop_all(self) -> None:
        """SIGTERM in reverse start order (in-flight work finishes), SIGKILL after the timeout."""
        self._stopping.set()
        for entry in reversed(list(self.running.values())):
            if entry.process.returncode is None:
                entry.process.send_signal(signal.SIGTERM)
        for entry in reversed(list(self.running.values())):
            try:
                await asyncio.wait_for(entry.process.wait(), self.stop_timeout_s)
            except TimeoutError:
                self.report(f"  {entry.spec.name:<14} did not stop in {self.stop_timeout_s:.0f}s: killing")
                entry.process.kill()
                await entry.process.wait()
            self.report(f"  {entry.spec.name:<14} stopped    exit {entry.process.returncode}")

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.start_all()
            if not self._stopping.is_set():
                self.on_ready()
                await self.watch()
            return 0
        except RuntimeError as exc:
            self.report(f"error: {exc}")
            return 1
        finally:
            await self.stop_all()

    def on_ready(self) -> None:
        """Hook: called once every component is ready."""
