"""Placing a running process on CPUs, every thread of it.

Linux keeps CPU affinity per thread. ``sched_setaffinity(pid)``, and
psutil's ``cpu_affinity`` over it, change only the thread whose id is
``pid``: a server's gRPC, Envoy worker or helper threads that already run
keep their old placement (measured: of a process with three threads,
psutil's ``cpu_affinity([0])`` pinned one of four). So
each thread in ``/proc/<pid>/task`` is placed, and the walk repeats until it
finds no thread it has not placed, since a thread created meanwhile by an
unplaced one inherits the old placement. Threads created afterwards inherit
their creator's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

MAX_PASSES = 10


def thread_ids(pid: int) -> set[int]:
    """The ids of the threads of ``pid`` now (empty once it has exited)."""
    try:
        return {int(tid) for tid in os.listdir(f"/proc/{pid}/task")}
    except FileNotFoundError:
        return set()


def _each_thread(pid: int, place: Callable[[int], None]) -> int:
    """``place`` every thread of ``pid`` until no new one appears; how many were placed."""
    done: set[int] = set()
    for _ in range(MAX_PASSES):
        new = thread_ids(pid) - done
        if not new:
            break
        for tid in new:
            try:
                place(tid)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= new
    return len(done)


def set_affinity(pid: int, cpus: Iterable[int]) -> int:
    """Every thread of ``pid`` on ``cpus`` only; how many threads were placed."""
    allowed = set(cpus)
    return _each_thread(pid, lambda tid: os.sched_setaffinity(tid, allowed))


def affinity(pid: int) -> set[int]:
    """The CPUs the main thread of ``pid`` may run on (the others inherit it unless placed otherwise)."""
    return set(os.sched_getaffinity(pid))
