"""A fleet of real ONNX workers (``[fleet] kind = "onnx"``): their command lines and their CPU quotas.

Each worker is ``python -m workers`` serving the real all-MiniLM-L6-v2 at the
scenario's precision and intra-op threads, so speeds differ for real: int8
against fp32, one thread against two, and a CPU quota (a cgroup, ``cpu_quota.py``)
for a worker held to a fraction of a core. Two settings keep the comparison
about routing: the per-input cache is off (the bench's texts repeat, and a hit
would measure the cache), and ``--cpus`` is the worker's share of the host (its
quota, else its threads), so the ORCA ``cpu_utilization`` CSWRR reads is
relative to what the worker may use.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Mapping

from .cpu_quota import CpuQuotas
from ..processes import ProcessGroup
from ..load.scenario import Fleet, WorkerSpec


def worker_cores(spec: WorkerSpec) -> float:
    """The cores a real worker may use: its quota, else its threads (the host's cores permitting)."""
    return spec.cpu_quota or float(spec.threads)


def real_worker_argv(fleet: Fleet, worker: int, host: str, port: int, models_dir: Path,
                     python: str = sys.executable) -> list[str]:
    """``python -m workers`` with the worker's precision and threads, the cache off, the prepared models."""
    spec = fleet.workers[worker]
    return [python, "-m", "workers", "--host", host, "--port", str(port), "--data-dir", str(models_dir),
            "--precision", spec.precision, "--threads", str(spec.threads), "--cpus", f"{worker_cores(spec):g}",
            "--cache-max-bytes", "0", "--log-level", "warning",
            *(["--models", ",".join(fleet.models)] if fleet.models else [])]


def quota_key(worker: int) -> str:
    return f"worker-{worker}"


def place_workers(quotas: CpuQuotas | None, fleet: Fleet, group: ProcessGroup, names: Mapping[int, str]) -> list[str]:
    """Move each running worker ``i`` of ``names`` (worker index to component name) that has a ``cpu_quota``
    into its cgroup (made on first use); a line per worker placed, for the log."""
    placed: list[str] = []
    if quotas is None:
        return placed
    for i in names:
        spec = fleet.workers[i]
        if spec.cpu_quota and quotas.limit(quota_key(i), spec.cpu_quota) is not None:
            quotas.place(quota_key(i), group.pid(names[i]))
            placed.append(f"{names[i]} held to {spec.cpu_quota:g} core ({quotas.mechanism})")
    return placed
