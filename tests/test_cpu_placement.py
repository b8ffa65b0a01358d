"""Placing a process on CPUs reaches every thread of it, not only the main one (what psutil's and the
os module's per-pid calls do)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import psutil
import pytest

from inferlb.bench.ext_proc_bench.cpu_placement import affinity, set_affinity, thread_ids

pytestmark = pytest.mark.subprocess

CHILD = """
import sys, threading
stop = threading.Event()
threads = [threading.Thread(target=stop.wait) for _ in range(3)]
for t in threads:
    t.start()
print("ready", flush=True)
sys.stdin.read()  # until stdin closes or the test kills us
stop.set()
"""


@pytest.fixture
def threaded_child() -> Iterator[subprocess.Popen[str]]:
    """A process with four threads, stopped when the test ends."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        yield child
    finally:
        child.kill()
        child.wait()


def test_psutil_alone_places_only_the_main_thread(threaded_child: subprocess.Popen[str]) -> None:
    """Why the module exists: the per-pid call leaves the running threads where they were."""
    if len(affinity(os.getpid())) < 2:
        pytest.skip("one core allowed: every thread is on it already")
    first = min(affinity(os.getpid()))
    psutil.Process(threaded_child.pid).cpu_affinity([first])
    placed = [os.sched_getaffinity(tid) == {first} for tid in thread_ids(threaded_child.pid)]
    assert sorted(placed) == [False, False, False, True]


def test_set_affinity_places_every_thread(threaded_child: subprocess.Popen[str]) -> None:
    first = min(affinity(os.getpid()))
    assert set_affinity(threaded_child.pid, [first]) == 4
    assert {tid: os.sched_getaffinity(tid) for tid in thread_ids(threaded_child.pid)} == {
        tid: {first} for tid in thread_ids(threaded_child.pid)}


def test_a_process_that_is_gone_has_no_threads_to_place() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert thread_ids(child.pid) == set()
    assert set_affinity(child.pid, [0]) == 0
