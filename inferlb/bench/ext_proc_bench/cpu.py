"""CPU accounting of the bench's processes, and pinning a server to one core.

A figure per CPU-second is only meaningful with the CPU measured per process
over the same interval, and the machine is shared: ``CpuMeter`` also reports
the rest of the machine's load (``others``), so a busy neighbour is visible.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence

import psutil

from .cpu_placement import affinity, set_affinity


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of these processes so far (threads included; gone ones count 0)."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def system_busy_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuMeter:
    """CPU seconds per named group of pids over one measured interval, plus the machine's other load."""

    def __init__(self, groups: Mapping[str, Sequence[int]]) -> None:
        self.groups = dict(groups)
        self.start_cpu = {name: cpu_seconds(pids) for name, pids in self.groups.items()}
        self.start_busy = system_busy_seconds()
        self.start = time.perf_counter()

    def stop(self, extra_seconds: Mapping[str, float] | None = None) -> dict[str, float]:
        """Cores used per group on average (CPU seconds / wall seconds), and ``others``: the
        rest of the machine (the shared machine's other users). ``extra_seconds``: CPU seconds
        of processes measured otherwise (a child that has exited)."""
        wall = time.perf_counter() - self.start
        used = {name: cpu_seconds(pids) - self.start_cpu[name] for name, pids in self.groups.items()}
        used.update(extra_seconds or {})
        busy = system_busy_seconds() - self.start_busy
        cores = {name: value / wall for name, value in used.items()}
        cores["others"] = max(0.0, (busy - sum(used.values())) / wall)
        cores["wall_s"] = wall
        return cores


@contextlib.contextmanager
def pinned(server_pid: int) -> Iterator[str]:
    """The server on the first allowed core, this process (the client) on the others, every thread of each
    (``cpu_placement``); restored after."""
    mine = os.getpid()
    try:
        allowed = sorted(affinity(mine))
        server_before = affinity(server_pid)
    except (AttributeError, OSError):
        yield "not pinned (no CPU affinity here)"
        return
    if len(allowed) < 2:
        yield "not pinned (one core)"
        return
    set_affinity(server_pid, [allowed[0]])
    set_affinity(mine, allowed[1:])
    try:
        yield f"server on core {allowed[0]}, client on {allowed[1:]}"
    finally:
        set_affinity(mine, allowed)
        set_affinity(server_pid, server_before)
