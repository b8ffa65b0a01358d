"""CPU quotas for bench workers through cgroups, created for a run and removed after it.

Real workers whose speeds differ for real need more than int8 against fp32: a
worker held to a fraction of a core is the stand-in for a smaller machine.
The kernel does that with a CFS bandwidth quota: cgroup v2's ``cpu.max``
where a cgroup2 mount has the cpu controller and lets us enable it below our
own cgroup, else cgroup v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
When neither is writable the quota is skipped and ``skipped`` says why (the
bench prints it and records it with the results): a run without quotas still
measures real workers, just fewer kinds of them.

Every group lives under one directory of our own (``inferlb-bench-<pid>``)
inside our cgroup. ``CpuQuotas`` is a context manager: on the way out, on
errors alike, what is still inside a group is moved back to our own cgroup
and every directory it made is removed (and the cpu controller it enabled on
the way, disabled again).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Callable, Literal

PERIOD_US = 100_000
RMDIR_DEADLINE_S = 5.0  # a process just reaped can take a moment to leave its cgroup


@dataclass(frozen=True)
class CgroupPlace:
    """Where groups can be made: our own cgroup ``own`` (a directory) in a hierarchy of ``version``."""

    version: Literal[1, 2]
    own: Path

    @property
    def mechanism(self) -> str:
        return "cgroup v2 cpu.max" if self.version == 2 else "cgroup v1 cpu.cfs_quota_us"


def _mounts(mounts_text: str) -> list[tuple[str, Path, set[str]]]:
    """(fstype, mount point, options) of each cgroup mount in a /proc/self/mounts text."""
    out = []
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
            out.append((parts[2], Path(parts[1]), set(parts[3].split(","))))
    return out


def _own_paths(cgroup_text: str) -> dict[str, str]:
    """Controller (``""`` for the v2 hierarchy) to our cgroup path, from a /proc/self/cgroup text."""
    out: dict[str, str] = {}
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def candidates(mounts_text: str, cgroup_text: str) -> list[CgroupPlace]:
    """The places to try, v2 first: each cgroup2 mount whose controllers include cpu, then the v1 cpu mount."""
    own = _own_paths(cgroup_text)
    found: list[CgroupPlace] = []
    for fstype, mount, options in _mounts(mounts_text):
        if fstype == "cgroup2" and "" in own:
            try:
                controllers = (mount / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" in controllers:
                found.append(CgroupPlace(2, mount / own[""].lstrip("/")))
    for fstype, mount, options in _mounts(mounts_text):
        if fstype == "cgroup" and "cpu" in options and "cpu" in own:
            found.append(CgroupPlace(1, mount / own["cpu"].lstrip("/")))
    return found


class CpuQuotas:
    """``with CpuQuotas() as quotas``: ``quotas.limit(key, cores)`` makes (once) a group held to ``cores``,
    ``quotas.place(key, pid)`` moves a process into it; everything made is removed on exit."""

    def __init__(self, *, report: Callable[[str], None] = lambda line: None, mounts: Path = Path("/proc/self/mounts"),
                 self_cgroup: Path = Path("/proc/self/cgroup")) -> None:
        self._report = report
        self._mounts = mounts
        self._self_cgroup = self_cgroup
        self.place_: CgroupPlace | None = None
        self.skipped = ""  # why there are no quotas, when there are none
        self._base: Path | None = None
        self._groups: dict[str, Path] = {}
        self._enabled: list[Path] = []  # subtree_control files we added +cpu to

    @property
    def mechanism(self) -> str:
        return self.place_.mechanism if self.place_ is not None else f"skipped: {self.skipped}"

    def __enter__(self) -> "CpuQuotas":
        try:
            places = candidates(self._mounts.read_text(), self._self_cgroup.read_text())
        except OSError as exc:
            places, self.skipped = [], f"cannot read {exc.filename}: {exc.strerror}"
        reasons = []
        for place in places:
            try:
                self._base = self._make_base(place)
                self.place_ = place
                return self
            except OSError as exc:
                self._undo_enables()
                reasons.append(f"{place.mechanism} at {place.own}: {exc.strerror or exc}")
        self.skipped = self.skipped or ("; ".join(reasons) if reasons else "no cgroup hierarchy with the cpu "
                                        "controller is mounted")
        self._report(f"CPU quotas skipped: {self.skipped}")
        return self

    def _make_base(self, place: CgroupPlace) -> Path:
        base = place.own / f"inferlb-bench-{os.getpid()}"
        if place.version == 2:
            self._enable_cpu(place.own)
        base.mkdir()
        if place.version == 2:
            try:
                self._enable_cpu(base)
            except OSError:
                base.rmdir()
                raise
        return base

    def _enable_cpu(self, directory: Path) -> None:
        control = directory / "cgroup.subtree_control"
        if "cpu" not in control.read_text().split():
            control.write_text("+cpu")
            self._enabled.append(control)

    def _undo_enables(self) -> None:
        for control in reversed(self._enabled):
            try:
                control.write_text("-cpu")
            except OSError as exc:
                self._report(f"warning: could not disable the cpu controller in {control}: {exc.strerror}")
        self._enabled.clear()

    def limit(self, key: str, cores: float) -> Path | None:
        """The group ``key`` held to ``cores`` (made on first use); None when quotas are skipped."""
        if self._base is None or self.place_ is None:
            return None
        if key in self._groups:
            return self._groups[key]
        group = self._base / key
        group.mkdir()
        self._groups[key] = group
        quota_us = max(1000, round(cores * PERIOD_US))
        if self.place_.version == 2:
            (group / "cpu.max").write_text(f"{quota_us} {PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota_us))
        return group

    def place(self, key: str, pid: int) -> bool:
        """Move process ``pid`` (all its threads) into group ``key``; False when quotas are skipped."""
        group = self._groups.get(key)
        if group is None:
            return False
        (group / "cgroup.procs").write_text(str(pid))
        return True

    def members(self, key: str) -> list[int]:
        """The processes in group ``key`` now."""
        group = self._groups.get(key)
        if group is None:
            return []
        return [int(x) for x in (group / "cgroup.procs").read_text().split()]

    def close(self) -> None:
        """Move what is left back to our own cgroup, then remove every group and the base."""
        for key, group in list(self._groups.items()):
            self._remove(group)
            del self._groups[key]
        if self._base is not None:
            self._remove(self._base)
            self._base = None
        self._undo_enables()

    def _remove(self, group: Path) -> None:
        assert self.place_ is not None
        deadline = time.monotonic() + RMDIR_DEADLINE_S
        while True:
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    try:
                        (self.place_.own / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass  # it exited meanwhile
                group.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if time.monotonic() > deadline:
                    self._report(f"warning: could not remove cgroup {group}: {exc.strerror}")
                    return
                time.sleep(0.05)  # polling the kernel's view of the group until the deadline

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
