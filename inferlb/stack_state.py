"""What `inferlb up` runs, on disk: a status file and a lock in the data directory.

`inferlb up` holds an exclusive ``flock`` on ``<data_dir>/inferlb-up.lock``
for as long as it runs, so a second `inferlb up` on the same data directory is
refused, and `inferlb status` can tell a running stack from a stale status
file (a supervisor that was SIGKILLed cannot remove its file, but the kernel
drops its lock). The status file, ``<data_dir>/inferlb-up.json``, is rewritten
atomically (temp file + rename) on every state change, so a reader never sees
half of it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

STATUS_FILE = "inferlb-up.json"
LOCK_FILE = "inferlb-up.lock"

State = Literal["starting", "ready", "crashed", "restarting", "failed", "stopping", "stopped"]


@dataclass(frozen=True)
class ComponentStatus:
    """One supervised process as the supervisor last saw it."""

    name: str
    state: State
    url: str  # its readiness probe
    log: str
    pid: int | None = None
    started_at: float | None = None  # wall clock (time.time()) of the current process's start
    ready_at: float | None = None
    restarts: int = 0
    crashes: int = 0
    last_exit: int | None = None


@dataclass(frozen=True)
class PoolStatus:
    """An elastic pool (`inferlb up --autoscale`): its bounds, its workers now and its last decision."""

    name: str
    min_workers: int
    max_workers: int
    size: int
    target: int | None = None  # the control plane's signal clamped to the bounds; None: none yet
    decision: str = ""  # e.g. "hold: scale-down cooldown"


@dataclass(frozen=True)
class StackStatus:
    supervisor_pid: int
    started_at: float
    data_dir: str
    dataplane: str
    components: tuple[ComponentStatus, ...] = ()
    links: dict[str, str] = field(default_factory=dict)  # what the summary printed: inference, admin, ...
    pools: tuple[PoolStatus, ...] = ()

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StackStatus:
        raw: dict[str, Any] = json.loads(text)
        components = tuple(ComponentStatus(**c) for c in raw.pop("components", []))
        pools = tuple(PoolStatus(**p) for p in raw.pop("pools", []))
        return cls(components=components, pools=pools, **raw)


def status_path(data_dir: Path) -> Path:
    return data_dir / STATUS_FILE


def write_status(data_dir: Path, status: StackStatus) -> None:
    """Atomic: write a temp file next to the target, fsync-free rename over it."""
    path = status_path(data_dir)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(status.to_json())
    os.replace(tmp, path)


def read_status(data_dir: Path) -> StackStatus | None:
    """None when there is no status file or it cannot be parsed."""
    try:
        return StackStatus.from_json(status_path(data_dir).read_text())
    except (OSError, ValueError, TypeError):
        return None


class StackRunning(RuntimeError):
    """Another `inferlb up` holds the data directory's lock."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        who = f"pid {pid}" if pid else "another process"
        super().__init__(f"a stack is already running on {data_dir} ({who}); "
                         f"stop it first (Ctrl-C, or kill -TERM {pid or '<pid>'}), or use another --data-dir")
        self.pid = pid


class StackLock:
    """An exclusive, non-blocking ``flock`` on the data directory, held while `inferlb up` runs.

    The lock file holds the holder's pid, for the error message only: the
    lock itself is the truth.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StackRunning(self.data_dir, holder_pid(self.data_dir)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __enter__(self) -> Self:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / LOCK_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def stack_running(data_dir: Path) -> bool:
    """True while some process holds the lock (probing takes it for an instant when free)."""
    path = data_dir / LOCK_FILE
    if not path.exists():
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
