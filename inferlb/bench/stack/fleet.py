"""The fleet: one ``python -m workers --simulate`` per ``scenario.fleet`` worker (or, for a
``kind = "onnx"`` fleet, one real worker: ``real_fleet.py``).

Each configuration gets a fresh fleet (empty queues, same ports in the same
order, same speeds), so no configuration inherits another's backlog. The
scenario's cost curve reaches the workers as flags: ``fixed_s`` and
``per_token_s`` stretched by ``cost_scale``, ``slots`` requests served at
once. Between runs the bench waits until every worker reports nothing queued
and nothing in flight (its Prometheus ``/metrics``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ...supervisor import Component
from ..load.scenario import Fleet

HOST = "127.0.0.1"
INFLIGHT_METRIC = "inferlb_worker_inflight_requests"
QUEUE_METRIC = "inferlb_worker_queue_depth"
FLEET_GROUP = "fleet"  # the workers stop together (their drains overlap)


@dataclass(frozen=True)
class FleetLayout:
    """Where the fleet listens: worker ``i`` on ``ports[i]``."""

    ports: tuple[int, ...]

    @property
    def endpoints(self) -> tuple[tuple[str, int], ...]:
        return tuple((HOST, port) for port in self.ports)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(f"{HOST}:{port}" for port in self.ports)

    def url(self, worker: int) -> str:
        return f"http://{HOST}:{self.ports[worker]}"


SETTINGS_PREFIX = "INFERLB_"  # the services' and the CLI's settings in the environment


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of every bench child: ours without INFERLB_* settings (a developer's own
    configuration must not change a benchmark), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SETTINGS_PREFIX)}
    return {**env, **(extra or {})}


def dropped_settings() -> list[str]:
    """Our INFERLB_* variables that ``child_env`` keeps from the children: the bench says so at start, so
    that nobody takes a run for one with those settings. Not INFERLB_DATA_DIR: the bench reads it itself
    (where the model is) and hands it on."""
    return sorted(k for k in os.environ if k.startswith(SETTINGS_PREFIX) and k != "INFERLB_DATA_DIR")


def worker_argv(fleet: Fleet, worker: int, port: int, python: str = sys.executable) -> list[str]:
    """``python -m workers --simulate`` with the scenario's speed, slots and (scaled) cost curve."""
    spec = fleet.workers[worker]
    return [python, "-m", "workers", "--simulate", "--host", HOST, "--port", str(port),
            "--speed", f"{spec.speed:g}", "--sim-slots", str(spec.slots),
            "--sim-fixed-ms", f"{fleet.fixed_s * 1e3:.6g}", "--sim-per-token-us", f"{fleet.per_token_s * 1e6:.6g}",
            "--sim-cost-scale", f"{fleet.cost_scale:g}",
            "--threads", "1", "--log-level", "warning",
            *(["--models", ",".join(fleet.models)] if fleet.models else [])]


def fleet_components(fleet: Fleet, layout: FleetLayout, log_dir: Path, data_dir: Path,
                     python: str = sys.executable, env: Mapping[str, str] | None = None,
                     models_dir: Path | None = None) -> list[Component]:
    """One component per worker; ``env`` adds to every worker's environment (e.g. its cache setting).
    Real workers (``fleet.kind == "onnx"``) read the prepared models from ``models_dir`` (default: the
    bench's own ``$INFERLB_DATA_DIR``, ``make model``)."""
    if len(layout.ports) != len(fleet.workers):
        raise ValueError(f"{len(fleet.workers)} workers but {len(layout.ports)} ports")
    env = child_env({"INFERLB_DATA_DIR": str(data_dir), **(env or {})})
    if fleet.kind == "onnx":
        from workers.config import default_data_dir

        from .real_fleet import real_worker_argv

        models = models_dir or default_data_dir()
        argvs = [real_worker_argv(fleet, i, HOST, port, models, python) for i, port in enumerate(layout.ports)]
    else:
        argvs = [worker_argv(fleet, i, port, python) for i, port in enumerate(layout.ports)]
    return [
        Component(name=worker_name(port), argv=argv,
                  ready_url=f"http://{HOST}:{port}/readyz", log_path=log_dir / f"worker-{port}.log", env=env,
                  ready_timeout_s=60.0 if fleet.kind == "emulated" else 180.0, group=FLEET_GROUP)
        for port, argv in zip(layout.ports, argvs)
    ]


def worker_name(port: int) -> str:
    """The component name of the worker on ``port``."""
    return f"worker:{port}"


def outstanding(metrics_text: str) -> float:
    """Requests in flight plus inputs queued, from one worker's /metrics text."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name in (INFLIGHT_METRIC, QUEUE_METRIC):
                total += s.value
    return total


async def busy_workers(client: httpx.AsyncClient, layout: FleetLayout) -> list[str]:
    """The workers that still have work (or did not answer)."""
    busy = []
    for i, worker_id in enumerate(layout.ids):
        try:
            response = await client.get(f"{layout.url(i)}/metrics")
            if response.status_code != 200 or outstanding(response.text) > 0:
                busy.append(worker_id)
        except httpx.TransportError:
            busy.append(worker_id)
    return busy


async def set_speed(client: httpx.AsyncClient, layout: FleetLayout, worker: int, speed: float) -> None:
    response = await client.put(f"{layout.url(worker)}/v1/simulation", json={"speed": speed})
    response.raise_for_status()
