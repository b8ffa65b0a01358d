"""Start the stack's processes in readiness order, restart crashes, stop cleanly.

The supervisor only starts processes and speaks HTTP to their probes; it
never imports the services. Every state change is one console line
(``[ready] worker:8101 (pid 123, 2.1s)``) and one atomic rewrite of the
status file that `inferlb status` reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .stack_state import ComponentStatus, PoolStatus, StackStatus, State, write_status

log = logging.getLogger("inferlb.up")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the supervisor dies, so nothing is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


PreStop = Callable[[], Awaitable[None]]
# A task that runs while the stack is up (e.g. a pool scaler): given the stop event, it returns once it is set.
Background = Callable[[asyncio.Event], Awaitable[None]]


def log_tail(path: Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a component's log ("" if unreadable): put in an error, so that a CI
    run's output says why a component failed without its log files."""
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@dataclass(frozen=True)
class Component:
    name: str
    argv: Sequence[str]
    ready_url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 180.0
    # Components of one group stop together (the workers drain in parallel); groups stop in reverse start order.
    group: str = ""
    # Runs before SIGTERM, e.g. drain Envoy's listeners until no request is in flight.
    pre_stop: PreStop | None = None
    # Asked when it is not ready in time; the answer goes in the error (Envoy: where its start-up stands).
    diagnose_url: str | None = None

    @property
    def stop_group(self) -> str:
        return self.group or self.name


@dataclass
class Running:
    spec: Component
    process: asyncio.subprocess.Process
    started: float
    restarts: int = 0


@dataclass(frozen=True)
class StackInfo:
    """What the status file says besides the components."""

    data_dir: Path
    dataplane: str = "envoy"
    links: dict[str, str] = field(default_factory=dict)


Report = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


class Supervisor:
    def __init__(self, components: Sequence[Component], *, report: Report = _print, stop_timeout_s: float = 35.0,
                 max_backoff_s: float = 30.0, info: StackInfo | None = None) -> None:
        self.components = list(components)
        self.report = report
        self.stop_timeout_s = stop_timeout_s
        self.max_backoff_s = max_backoff_s
        self.info = info
        self.running: dict[str, Running] = {}
        self.status: dict[str, ComponentStatus] = {
            c.name: ComponentStatus(c.name, "starting", c.ready_url, str(c.log_path)) for c in self.components
        }
        self._started_at = time.time()
        self._stopping = asyncio.Event()
        self.background: dict[str, Background] = {}  # name -> task, started once everything is ready
        self.pools: dict[str, PoolStatus] = {}

    # --- status ------------------------------------------------------------------------------

    def _set(self, name: str, state: State, line: str | None = None, **changes: object) -> None:
        """Record a state change, write the status file, print one line."""
        current = self.status.get(name)
        if current is None:  # started by hand into ``running`` (the bench's ProcessGroup does)
            spec = self.running[name].spec
            current = ComponentStatus(name, state, spec.ready_url, str(spec.log_path))
        self.status[name] = dataclasses.replace(current, state=state, **changes)  # type: ignore[arg-type]
        self._write_status()
        if line is not None:
            self.report(f"[{state}] {name} {line}".rstrip())

    def _write_status(self) -> None:
        if self.info is None:
            return
        try:
            write_status(self.info.data_dir, StackStatus(
                supervisor_pid=os.getpid(), started_at=self._started_at, data_dir=str(self.info.data_dir),
                dataplane=self.info.dataplane, components=tuple(self.status.values()), links=self.info.links,
                pools=tuple(self.pools.values()),
            ))
        except OSError as exc:  # a full disk must not take the stack down
            log.warning("could not write the status file: %s", exc)

    # --- processes ---------------------------------------------------------------------------

    async def spawn(self, spec: Component) -> asyncio.subprocess.Process:
        """Start one component (its own session, dies with us, output to its log); no readiness wait."""
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as out:  # noqa: ASYNC230 - opening a log file, no I/O wait
            return await asyncio.create_subprocess_exec(
                *spec.argv, stdout=out, stderr=out, stdin=asyncio.subprocess.DEVNULL, env=spec.env or None,
                start_new_session=True, preexec_fn=_die_with_parent,
            )

    async def wait_ready(self, spec: Component, process: asyncio.subprocess.Process) -> None:
        """Poll ``spec.ready_url`` until 2xx; raise if the process exits or ``ready_timeout_s`` passes."""
        deadline = time.monotonic() + spec.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline and not self._stopping.is_set():
                if process.returncode is not None:
                    raise RuntimeError(f"{spec.name} exited with {process.returncode} before it was ready; "
                                       f"see {spec.log_path}, which ends:\n{log_tail(spec.log_path)}")
                try:
                    if (await client.get(spec.ready_url)).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                try:
                    await asyncio.wait_for(process.wait(), 0.2)
                except TimeoutError:
                    pass
            if self._stopping.is_set():
                return
            diagnosis = ""
            if spec.diagnose_url:
                try:
                    diagnosis = f"\n{spec.diagnose_url} says:\n{(await client.get(spec.diagnose_url)).text[:4000]}"
                except httpx.HTTPError as exc:
                    diagnosis = f"\n{spec.diagnose_url} did not answer: {exc!r}"
        raise RuntimeError(f"{spec.name} was not ready after {spec.ready_timeout_s:.0f}s; see {spec.log_path}, "
                           f"which ends:\n{log_tail(spec.log_path)}{diagnosis}")

    async def _start(self, spec: Component, restarts: int) -> asyncio.subprocess.Process:
        process = await self.spawn(spec)
        self.running[spec.name] = Running(spec, process, time.monotonic(), restarts)
        state: State = "restarting" if restarts else "starting"
        self._set(spec.name, state, f"(pid {process.pid})", pid=process.pid, started_at=time.time(),
                  ready_at=None, restarts=restarts)
        return process

    def _mark_ready(self, spec: Component) -> None:
        entry = self.running[spec.name]
        took = time.monotonic() - entry.started
        self._set(spec.name, "ready", f"(pid {entry.process.pid}, {took:.1f}s) {spec.ready_url}", ready_at=time.time())

    async def start_all(self) -> None:
        """Start the components in order, each once the previous one is ready."""
        for spec in self.components:
            process = await self._start(spec, 0)
            await self.wait_ready(spec, process)
            if self._stopping.is_set():
                return
            self._mark_ready(spec)

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
                backoff = 1.0  # it ran a good while: this crash starts a fresh backoff
            crashes = self.status[name].crashes + 1
            self._set(name, "crashed",
                      f"exit {code}; restarting in {backoff:.0f}s (attempt {entry.restarts + 1}; log {entry.spec.log_path})",
                      pid=None, last_exit=code, crashes=crashes)
            try:
                await asyncio.wait_for(self._stopping.wait(), backoff)
                return
            except TimeoutError:
                pass
            backoff = min(backoff * 2, self.max_backoff_s)
            process = await self._start(entry.spec, entry.restarts + 1)
            try:
                await self.wait_ready(entry.spec, process)
                if not self._stopping.is_set():
                    self._mark_ready(entry.spec)
            except RuntimeError as exc:
                self._set(name, "failed", str(exc))

    # --- components added and removed while running (a pool scaler's workers) -------------------

    async def start_component(self, spec: Component) -> asyncio.subprocess.Process:
        """Spawn ``spec`` into the stack (status file, console line); the caller waits for it and owns it:
        the supervisor does not restart it, but stops it with its group at the end."""
        if spec.name in self.running:
            raise ValueError(f"component {spec.name!r} is already running")
        return await self._start(spec, 0)

    async def component_ready(self, spec: Component) -> None:
        """Wait for ``spec``'s readiness (RuntimeError if it exits or times out), then mark it ready."""
        await self.wait_ready(spec, self.running[spec.name].process)
        if self._stopping.is_set():
            raise RuntimeError(f"{spec.name}: the stack is stopping")
        self._mark_ready(spec)

    async def stop_component(self, name: str) -> None:
        """SIGTERM (after its pre-stop), wait, and forget ``name``: it leaves the status file."""
        entry = self.running.get(name)
        if entry is None:
            return
        await self._stop_one(entry)
        self.running.pop(name, None)
        self.status.pop(name, None)
        self._write_status()

    def set_pool(self, pool: PoolStatus) -> None:
        """Record an elastic pool's state in the status file (`inferlb status` shows it)."""
        if self.pools.get(pool.name) != pool:
            self.pools[pool.name] = pool
            self._write_status()

    async def _run_background(self) -> list[asyncio.Task[None]]:
        def ended(task: asyncio.Task[None]) -> None:  # no background task ends unnoticed
            if task.cancelled() or self._stopping.is_set():
                return
            error = task.exception()
            log.error("background task ended", exc_info=error, extra={"task": task.get_name()})
            self.report(f"error: {task.get_name()} ended ({error!r}); stopping")
            self.request_stop()

        tasks = [asyncio.create_task(run(self._stopping), name=name) for name, run in self.background.items()]
        for task in tasks:
            task.add_done_callback(ended)
        return tasks

    def request_stop(self) -> None:
        if not self._stopping.is_set():
            self.report("stopping: in reverse start order, each part's in-flight requests finish first")
        self._stopping.set()

    # --- stopping ----------------------------------------------------------------------------

    async def _stop_one(self, entry: Running) -> None:
        name = entry.spec.name
        if entry.process.returncode is None:
            self._set(name, "stopping", f"(pid {entry.process.pid})")
            if entry.spec.pre_stop is not None:
                try:
                    await asyncio.wait_for(entry.spec.pre_stop(), self.stop_timeout_s)
                except (TimeoutError, httpx.HTTPError, OSError) as exc:  # a failed drain still ends in SIGTERM
                    self.report(f"[stopping] {name} drain did not complete: {exc!r}")
            if entry.process.returncode is None:
                entry.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(entry.process.wait(), self.stop_timeout_s)
        except TimeoutError:
            self.report(f"[stopping] {name} did not stop in {self.stop_timeout_s:.0f}s: killing")
            entry.process.kill()
            await entry.process.wait()
        self._set(name, "stopped", f"exit {entry.process.returncode}", pid=None,
                  last_exit=entry.process.returncode)

    async def stop_all(self) -> None:
        """Reverse start order, group by group: each group's in-flight work finishes before the next stops.

        Envoy (last started) drains first, so requests already inside the
        stack still find ext_proc, the control plane and their worker.
        """
        self._stopping.set()
        groups: dict[str, list[Running]] = {}
        for entry in self.running.values():
            groups.setdefault(entry.spec.stop_group, []).append(entry)
        for members in reversed(list(groups.values())):
            await asyncio.gather(*(self._stop_one(entry) for entry in members))

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.request_stop)
        self._write_status()
        background: list[asyncio.Task[None]] = []
        try:
            await self.start_all()
            if not self._stopping.is_set():
                self.on_ready()
                background = await self._run_background()
                await self.watch()
            return 0
        except RuntimeError as exc:
            self.report(f"error: {exc}")
            return 1
        finally:
            self._stopping.set()
            for task in background:  # first: nothing may start or stop a worker while the stack stops
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self.stop_all()

    def on_ready(self) -> None:
        """Hook: called once every component is ready."""
