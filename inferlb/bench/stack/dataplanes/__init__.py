"""The data planes the bench compares, one plan per configuration name.

``plan_data_plane`` is pure: from a configuration name, the fleet's endpoints,
a work directory and ports it returns everything needed to run that data
plane (the files to write, the processes to start in stages, where to send
requests, how to set a pick policy). ``launch.start_data_plane`` does the I/O.

- (a)-(c) ``envoy_*``: Envoy on a static bootstrap with its own balancer (``envoy_static``).
- (d) ``nginx_least_conn``: Debian's nginx, ``least_conn`` (``nginx``).
- (e) ``inferlb_weights``: the control plane + Envoy from it, no ext_proc filter.
- (f) ``inferlb_ext_proc``: the same + ext_proc with its default pick policy.
- (g) ``inferlb_pick:<name>``: (f) with the pick policy ``<name>`` set through the admin API.

Fairness: every Envoy runs with ``--concurrency 1`` and nginx with one worker
process (they share 2 cores with everything else); no configuration retries;
every one has the scenario's request timeout.
"""

from __future__ import annotations

import json
import secrets
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ....bootstrap import envoy_startup_stats_url, render_bootstrap
from ....supervisor import Component
from ..fleet import child_env
from ...processes import free_ports
from ...load.scenario import CONFIGURATIONS, PICK_PREFIX, known_configuration
from .envoy_static import POLICIES, WORKERS_CLUSTER, render_static_bootstrap
from .nginx import NGINX, nginx_argv, prefix_directories, render_nginx_conf

# ext_proc's gateway cache (issue 16) is on by default in the product; a balancer comparison turns it off,
# so that each configuration's workers see every request (``inferlb bench cache`` turns it back on).
EXT_PROC_CACHE_ENV = "INFERLB_EXT_PROC_CACHE_MAX_BYTES"
INFERENCE_PATH = "/v1/embeddings"
ENVOY_FLAGS = ("--disable-hot-restart", "--concurrency", "1", "--log-level", "warning", "--drain-time-s", "1")


@dataclass(frozen=True)
class DataPlanePorts:
    """Every port one data plane may listen on (the unused ones are simply not opened)."""

    listener: int
    envoy_admin: int
    xds: int
    control_plane_admin: int
    ext_proc: int
    ext_proc_metrics: int

    @classmethod
    def allocate(cls) -> "DataPlanePorts":
        """Six distinct free ports, each reserved until its process binds it (``free_ports``)."""
        return cls(*free_ports(6))


@dataclass(frozen=True)
class DataPlanePlan:
    """How to run one configuration; ``stages`` start in order, the components of a stage together."""

    configuration: str
    url: str
    files: Mapping[Path, str]
    stages: tuple[tuple[Component, ...], ...]
    envoy_admin_url: str | None = None  # readiness: every worker healthy in its "workers" cluster
    control_plane_url: str | None = None
    ext_proc_metrics_url: str | None = None
    admin_token: str | None = field(default=None, repr=False)
    pick_policy: str | None = None  # set through the admin API after stage 0 (the control plane)
    check_argv: tuple[str, ...] = ()  # run before starting (nginx -t); must exit 0
    directories: tuple[Path, ...] = ()
    notes: Mapping[str, Any] = field(default_factory=dict)  # recorded in every RunResult.extra


def plan_data_plane(
    configuration: str,
    *,
    endpoints: Sequence[tuple[str, int]],
    workdir: Path,
    ports: DataPlanePorts,
    request_timeout_s: float,
    envoy: str,
    python: str = sys.executable,
    nginx: str = NGINX,
    admin_token: str | None = None,
    ext_proc_uds: Path | None = None,
    envoy_ext_proc_uds: bool = True,
    retries: int = 0,
) -> DataPlanePlan:
    """The plan of one configuration. ``workdir`` is this configuration's own directory (logs, configs).
    ``ext_proc_uds``: ext_proc also listens on this Unix socket, and Envoy reaches it there (unless
    ``envoy_ext_proc_uds`` is false: TCP, the socket then only for other clients). ``retries``: Envoy's
    retries per request under inferlb (0 for a balancer comparison; the product's 2 for a fault harness)."""
    if not known_configuration(configuration):
        raise ValueError(f"unknown configuration {configuration!r}; known: {', '.join(CONFIGURATIONS)}, "
                         f"{PICK_PREFIX}<policy>")
    if configuration in POLICIES:
        return _static_envoy_plan(configuration, endpoints, workdir, ports, request_timeout_s, envoy)
    if configuration == "nginx_least_conn":
        return _nginx_plan(configuration, endpoints, workdir, ports, request_timeout_s, nginx)
    return _inferlb_plan(configuration, endpoints, workdir, ports, request_timeout_s, envoy, python=python,
                         admin_token=admin_token, envoy_uds=ext_proc_uds if envoy_ext_proc_uds else None,
                         ext_proc_uds=ext_proc_uds, retries=retries)


def _url(ports: DataPlanePorts) -> str:
    """Where the bench sends its requests: the data plane's listener."""
    return f"http://127.0.0.1:{ports.listener}{INFERENCE_PATH}"


def _envoy_admin_url(ports: DataPlanePorts) -> str:
    return f"http://127.0.0.1:{ports.envoy_admin}"


def _envoy_component(envoy: str, bootstrap: Path, ports: DataPlanePorts, logs: Path) -> Component:
    """One Envoy on ``bootstrap``, ready when its admin ``/ready`` says so."""
    admin_url = _envoy_admin_url(ports)
    return Component(name="envoy", argv=[envoy, "-c", str(bootstrap), *ENVOY_FLAGS],
                     ready_url=f"{admin_url}/ready", log_path=logs / "envoy.log", env=child_env(),
                     ready_timeout_s=30.0, diagnose_url=envoy_startup_stats_url(admin_url))


def _static_envoy_plan(configuration: str, endpoints: Sequence[tuple[str, int]], workdir: Path,
                       ports: DataPlanePorts, request_timeout_s: float, envoy: str) -> DataPlanePlan:
    """(a)-(c): Envoy on a static bootstrap, balancing with its own ``configuration`` policy."""
    logs = workdir / "logs"
    bootstrap = workdir / "envoy-bootstrap.json"
    doc = render_static_bootstrap(configuration, endpoints=endpoints, listener_port=ports.listener,
                                  admin_port=ports.envoy_admin, request_timeout_s=request_timeout_s)
    policy = doc["static_resources"]["clusters"][0]["load_balancing_policy"]["policies"][0]
    return DataPlanePlan(configuration, _url(ports), {bootstrap: json.dumps(doc, indent=2)},
                         ((_envoy_component(envoy, bootstrap, ports, logs),),),
                         envoy_admin_url=_envoy_admin_url(ports), directories=(logs,),
                         notes={"lb_policy": policy["typed_extension_config"]["typed_config"]})


def _nginx_plan(configuration: str, endpoints: Sequence[tuple[str, int]], workdir: Path, ports: DataPlanePorts,
                request_timeout_s: float, nginx: str) -> DataPlanePlan:
    """(d): nginx with ``least_conn`` and keep-alive to the workers, its config checked (``nginx -t``) first."""
    logs = workdir / "logs"
    prefix = workdir / "nginx"
    conf = prefix / "nginx.conf"
    text = render_nginx_conf(endpoints=endpoints, listen_port=ports.listener, prefix=prefix,
                             request_timeout_s=request_timeout_s)
    component = Component(name="nginx", argv=nginx_argv(conf, prefix, binary=nginx),
                          # nginx answers when it proxies a worker's readiness probe
                          ready_url=f"http://127.0.0.1:{ports.listener}/readyz",
                          log_path=logs / "nginx.log", env=child_env(), ready_timeout_s=30.0)
    return DataPlanePlan(configuration, _url(ports), {conf: text}, ((component,),),
                         check_argv=tuple(nginx_argv(conf, prefix, test=True, binary=nginx)),
                         directories=(logs, *prefix_directories(prefix)), notes={"lb": "least_conn", "keepalive": True})


def _inferlb_plan(configuration: str, endpoints: Sequence[tuple[str, int]], workdir: Path, ports: DataPlanePorts,
                  request_timeout_s: float, envoy: str, *, python: str, admin_token: str | None,
                  ext_proc_uds: Path | None, envoy_uds: Path | None, retries: int) -> DataPlanePlan:
    """(e)-(g): the control plane, then ext_proc (unless ``inferlb_weights``) and Envoy, whose bootstrap
    points at the control plane. ``envoy_uds``: the socket Envoy reaches ext_proc on (None: TCP)."""
    logs = workdir / "logs"
    with_ext_proc = configuration != "inferlb_weights"
    pick = configuration[len(PICK_PREFIX):] if configuration.startswith(PICK_PREFIX) else None
    token = admin_token or secrets.token_urlsafe(24)
    cp_data = workdir / "control-plane-data"
    cp_url = f"http://127.0.0.1:{ports.control_plane_admin}"
    control_plane = _control_plane(endpoints, ports, cp_data, logs, python=python, token=token,
                                   with_ext_proc=with_ext_proc, retries=retries,
                                   request_timeout_s=request_timeout_s, envoy_uds=envoy_uds)
    bootstrap = workdir / "envoy-bootstrap.yaml"
    text = render_bootstrap(node_id="envoy-bench", xds_port=ports.xds, admin_port=ports.envoy_admin)
    second: list[Component] = [_envoy_component(envoy, bootstrap, ports, logs)]
    ext_proc_metrics_url = None
    if with_ext_proc:
        ext_proc_metrics_url = f"http://127.0.0.1:{ports.ext_proc_metrics}"
        second.insert(0, ext_proc_component("ext_proc", port=ports.ext_proc, metrics_port=ports.ext_proc_metrics,
                                            xds_port=ports.xds, logs=logs, data_dir=cp_data, python=python,
                                            pick=pick, uds=ext_proc_uds))
    return DataPlanePlan(configuration, _url(ports), {bootstrap: text}, ((control_plane,), tuple(second)),
                         envoy_admin_url=_envoy_admin_url(ports), control_plane_url=cp_url,
                         ext_proc_metrics_url=ext_proc_metrics_url, admin_token=token, pick_policy=pick,
                         directories=(logs, cp_data),
                         notes={"ext_proc": with_ext_proc, "retries": retries,
                                "ext_proc_transport": "uds" if envoy_uds else "tcp",
                                **({"pick_policy": pick} if pick else {})})


def _control_plane(endpoints: Sequence[tuple[str, int]], ports: DataPlanePorts, data_dir: Path, logs: Path, *,
                   python: str, token: str, with_ext_proc: bool, retries: int, request_timeout_s: float,
                   envoy_uds: Path | None) -> Component:
    """``python -m control_plane`` with the fleet's endpoints, configuring Envoy for this data plane."""
    env = child_env({
        "INFERLB_DATA_DIR": str(data_dir),
        "INFERLB_ADMIN_TOKEN": token,
        "INFERLB_CP_DATA_PLANE__LISTENER_PORT": str(ports.listener),
        "INFERLB_CP_DATA_PLANE__EXT_PROC_PORT": str(ports.ext_proc),
        "INFERLB_CP_DATA_PLANE__EXT_PROC_ENABLED": "true" if with_ext_proc else "false",
        "INFERLB_CP_DATA_PLANE__RETRIES": str(retries),  # 0: no configuration retries
        "INFERLB_CP_DATA_PLANE__REQUEST_TIMEOUT_S": f"{request_timeout_s:g}",
        **({"INFERLB_CP_DATA_PLANE__EXT_PROC_UDS_PATH": str(envoy_uds)} if envoy_uds else {}),
    })
    argv = [python, "-m", "control_plane", "--xds-port", str(ports.xds), "--admin-port",
            str(ports.control_plane_admin), "--data-dir", str(data_dir), "--log-level", "warning"]
    for host, port in endpoints:
        argv += ["--endpoint", f"{host}:{port}"]
    return Component(name="control-plane", argv=argv, ready_url=f"http://127.0.0.1:{ports.control_plane_admin}/readyz",
                     log_path=logs / "control-plane.log", env=env, ready_timeout_s=60.0)


def ext_proc_component(name: str, *, port: int, metrics_port: int, xds_port: int, logs: Path, data_dir: Path,
                       python: str = sys.executable, pick: str | None = None, uds: Path | None = None,
                       grpc_front: str | None = None, node_id: str | None = None) -> Component:
    """``python -m ext_proc`` as a bench runs it: gRPC on ``port`` (and ``uds``), ready when its ``/readyz``
    says so, the gateway cache off (a balancer comparison measures the balancer); ``grpc_front`` and
    ``node_id``: ext_proc's own defaults unless given."""
    argv = [python, "-m", "ext_proc", "--port", str(port), "--metrics-port", str(metrics_port),
            "--xds-port", str(xds_port), "--log-level", "warning"]
    if pick:
        argv += ["--pick-policy", pick]
    if uds:
        argv += ["--uds-path", str(uds)]
    if grpc_front:
        argv += ["--grpc-front", grpc_front]
    if node_id:
        argv += ["--node-id", node_id]
    env = child_env({"INFERLB_DATA_DIR": str(data_dir), EXT_PROC_CACHE_ENV: "0"})
    return Component(name=name, argv=argv, ready_url=f"http://127.0.0.1:{metrics_port}/readyz",
                     log_path=logs / f"{name}.log", env=env, ready_timeout_s=60.0)


__all__ = ["DataPlanePlan", "DataPlanePorts", "ext_proc_component", "INFERENCE_PATH", "WORKERS_CLUSTER",
           "known_configuration", "plan_data_plane"]
