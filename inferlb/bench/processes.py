"""The bench's child processes: started together, stopped together, never orphaned.

A scenario run starts a fleet and a data plane per configuration and must
leave nothing behind, on success, on an error and on Ctrl-C alike. This is
``inferlb.supervisor.Supervisor`` (same spawning: own session, SIGTERM when
the parent dies; same readiness probes; SIGTERM then SIGKILL on stop) without
the restarts: a component that crashes mid-run fails the run instead of being
quietly replaced, since a restarted worker would have fresh queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from types import TracebackType
from typing import Callable, Sequence

import ephemeral_port_reserve

from ..supervisor import Component, Running, Supervisor


def free_port(host: str = "127.0.0.1") -> int:
    """A free port on ``host``, reserved for a minute; see ``free_ports``."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct free ports on ``host``, each reserved for about a minute (ephemeral-port-reserve):
    left in TIME_WAIT, so the kernel hands it to no other bind(0) or outgoing connection meanwhile, while the
    server it is meant for still binds it (with SO_REUSEADDR, as Envoy, gRPC, asyncio, nginx, Redis and
    PostgreSQL do). A port merely bound and released was sometimes handed out again before its server bound
    it, and two processes of one stack met on one port (issue 20's fresh-clone runs).

    IPv6 (``host`` holds a colon; the library is IPv4 only): the ports are held all at once while asked for,
    so they are distinct, but not reserved afterwards."""
    if ":" not in host:
        return [ephemeral_port_reserve.reserve(host) for _ in range(count)]
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET6))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        return ports


class ComponentDied(RuntimeError):
    """A bench process exited while it was needed; the message names it and its log."""


class ProcessGroup:
    """Use as ``async with ProcessGroup() as group``: everything started in it is stopped on the way out."""

    def __init__(self, report: Callable[[str], None] = lambda line: None, stop_timeout_s: float = 15.0) -> None:
        self._supervisor = Supervisor([], report=report, stop_timeout_s=stop_timeout_s)

    async def start(self, components: Sequence[Component]) -> None:
        """Spawn ``components`` at once (their start-ups overlap) and wait until every one is ready."""
        sup = self._supervisor
        for spec in components:
            if spec.name in sup.running:
                raise ValueError(f"component {spec.name!r} is already running")
            process = await sup.spawn(spec)
            sup.running[spec.name] = Running(spec, process, time.monotonic())
        await asyncio.gather(*(sup.wait_ready(spec, sup.running[spec.name].process) for spec in components))

    def check_alive(self) -> None:
        """Raise ``ComponentDied`` if any component has exited."""
        for entry in self._supervisor.running.values():
            if entry.process.returncode is not None:
                raise ComponentDied(f"{entry.spec.name} exited with {entry.process.returncode}; "
                                    f"see {entry.spec.log_path}")

    def pid(self, name: str) -> int:
        """The process id of the running component ``name`` (``KeyError`` if none runs by that name)."""
        return self._supervisor.running[name].process.pid

    def send_signal(self, name: str, sig: int) -> None:
        """Signal the running component ``name`` (a fault harness: SIGSTOP, SIGCONT)."""
        self._supervisor.running[name].process.send_signal(sig)

    async def kill(self, name: str) -> Component:
        """SIGKILL ``name`` (no drain: a crash), reap it and forget it; its spec, to start it again with ``start``."""
        entry = self._supervisor.running.pop(name)
        if entry.process.returncode is None:
            entry.process.kill()
        await entry.process.wait()
        return entry.spec

    def pids(self, *, skip_group: str | None = None) -> list[int]:
        """Process ids of the running components, leaving out those of ``skip_group``."""
        return [entry.process.pid for entry in self._supervisor.running.values()
                if skip_group is None or entry.spec.group != skip_group]

    async def stop(self) -> None:
        """SIGTERM in reverse start order, SIGKILL after the timeout; reaps every child."""
        await self._supervisor.stop_all()

    async def __aenter__(self) -> "ProcessGroup":
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()
