"""`inferlb status`: what the `inferlb up` on a data directory runs, and whether each part answers.

It trusts nothing in the status file blindly: the supervisor's lock says
whether a stack runs at all, each pid is checked, and each readiness URL is
probed with a short timeout. Exit codes: 0 every component ready, 1 something
is not, 3 no stack runs on that data directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from .stack_state import ComponentStatus, StackStatus, read_status, stack_running

EXIT_READY, EXIT_NOT_READY, EXIT_NOT_RUNNING = 0, 1, 3


@dataclass(frozen=True)
class Observed:
    """A component as the status file says it is, and as it answers now."""

    status: ComponentStatus
    alive: bool
    answers: bool

    @property
    def ok(self) -> bool:
        return self.status.state == "ready" and self.alive and self.answers

    def state_text(self) -> str:
        state = self.status.state
        if state == "ready" and not self.alive:
            state = "gone"
        elif state == "ready" and not self.answers:
            state = "not answering"
        if self.status.crashes:
            state += f" (crashed {self.status.crashes} time{'s' if self.status.crashes > 1 else ''})"
        return state


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe(url: str, timeout_s: float) -> bool:
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False) as client:
            return client.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def observe(stack: StackStatus, timeout_s: float = 1.0) -> list[Observed]:
    """Check pids and probe every ready URL, in parallel: a hung component costs one timeout, not one each."""
    components = list(stack.components)
    alive = [pid_alive(c.pid) for c in components]
    with ThreadPoolExecutor(max_workers=max(1, min(16, len(components)))) as pool:
        answers = list(pool.map(lambda c, up: up and probe(c.url, timeout_s), components, alive))
    return [Observed(c, up, a) for c, up, a in zip(components, alive, answers)]


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def render(stack: StackStatus, observed: list[Observed], now: float) -> str:
    """The table `inferlb status` prints (pure: tested without processes)."""
    lines = [(f"inferlb stack: supervisor pid {stack.supervisor_pid}, up {_duration(now - stack.started_at)}, "
              f"data plane {stack.dataplane}, data dir {stack.data_dir}")]
    rows = [("COMPONENT", "STATE", "PID", "UPTIME", "URL")]
    for o in observed:
        c = o.status
        uptime = _duration(now - c.started_at) if o.alive and c.started_at else "-"
        rows.append((c.name, o.state_text(), str(c.pid) if c.pid else "-", uptime, c.url))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    for pool in stack.pools:
        target = "-" if pool.target is None else str(pool.target)
        lines.append(f"  pool {pool.name}: {pool.size} worker(s), autoscale {pool.min_workers}..{pool.max_workers}, "
                     f"target {target} ({pool.decision or 'no decision yet'})")
    for name, url in stack.links.items():
        lines.append(f"  {name:<12} {url}")
    return "\n".join(lines)


def as_json(stack: StackStatus, observed: list[Observed], now: float) -> str:
    return json.dumps({
        "running": True, "ready": all(o.ok for o in observed), "supervisor_pid": stack.supervisor_pid,
        "dataplane": stack.dataplane, "data_dir": stack.data_dir, "links": stack.links,
        "components": [{
            "name": o.status.name, "state": o.status.state, "pid": o.status.pid, "alive": o.alive,
            "answers": o.answers, "restarts": o.status.restarts, "crashes": o.status.crashes,
            "uptime_s": round(now - o.status.started_at, 1) if o.alive and o.status.started_at else None,
            "url": o.status.url, "log": o.status.log,
        } for o in observed],
        "pools": [dataclasses.asdict(pool) for pool in stack.pools],
    }, indent=2)


def status_hint(data_dir: Path, executable: str = sys.executable, cwd: Path | None = None) -> str:
    """The `inferlb up` summary's line on `inferlb status`.

    `make up` runs `.venv/bin/inferlb`, which a newcomer's next shell does not have on its PATH, so
    the line names the venv's own command (relative to the working directory when it is under it) and
    how to activate the venv; when `inferlb` on the PATH is that command, the bare name is enough.
    """
    bindir = Path(executable).parent
    program = bindir / "inferlb"
    if not program.exists() or shutil.which("inferlb") == str(program):
        return f"`inferlb status --data-dir {data_dir}` shows what runs."
    here = (cwd or Path.cwd()).resolve()

    def shown(path: Path) -> str:
        return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)

    return (f"`{shown(program)} status --data-dir {data_dir}` shows what runs "
            f"(or `source {shown(bindir / 'activate')}` first: then `inferlb` is on your PATH).")


def emit(text: str) -> None:
    """Print ``text``; a reader that stopped reading (``inferlb status --json | head``) is not an error.

    Python ignores SIGPIPE, so a closed pipe is a BrokenPipeError here and again when the interpreter
    flushes stdout at exit. The Python docs' recipe: point stdout at /dev/null so that the exit flush
    finds nothing to fail on. The exit status still says whether the stack is ready.
    """
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def cmd_status(args: argparse.Namespace, data_dir: Path) -> int:
    if not stack_running(data_dir):
        emit(json.dumps({"running": False, "data_dir": str(data_dir)}) if args.json
             else f"no inferlb stack is running on {data_dir} (start one with `inferlb up`)")
        return EXIT_NOT_RUNNING
    stack = read_status(data_dir)
    if stack is None:
        emit(f"a stack holds the lock on {data_dir}, but its status file is missing or unreadable")
        return EXIT_NOT_READY
    observed = observe(stack, args.timeout)
    now = time.time()
    emit(as_json(stack, observed, now) if args.json else render(stack, observed, now))
    return EXIT_READY if observed and all(o.ok for o in observed) else EXIT_NOT_READY


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--timeout", type=float, default=1.0, help="seconds per readiness probe (default 1)")
