"""The ``inferlb`` command: run the local stack (`up`), say what runs (`status`), benchmarks, the simulator."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from inferlb_runtime.model_routing import DEFAULT_POOL, POOL_PATTERN

from .bench.cli import add_bench_parser
from .components import DATAPLANES, DEFAULT_MODELS, StackPorts, WorkerOptions, stack_components, worker_component
from .pool_scaler import ScalerSettings, elastic_pool, parse_bounds
from .sim.cli import add_sim_parser
from .stack_state import StackLock, StackRunning
from .status import add_status_arguments, cmd_status, status_hint
from .supervisor import Component, StackInfo, Supervisor

__all__ = ["StackPorts", "build_parser", "main"]

CURL_EXAMPLE = """curl -s http://127.0.0.1:{port}/v1/embeddings \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat."]}}'"""
# With --require-api-keys: issue a key on the admin API, then send it.
KEY_EXAMPLE = """KEY=$(curl -s -XPOST http://127.0.0.1:{admin}/v1/api-keys -H "Authorization: Bearer $(cat {token})" \\
  -H 'Content-Type: application/json' -d '{{"tenant": "me"}}' | python3 -c 'import json,sys; print(json.load(sys.stdin)["key"])')
curl -s http://127.0.0.1:{port}/v1/embeddings -H "Authorization: Bearer $KEY" \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat."]}}'"""


def default_data_dir() -> Path:
    return Path(os.environ.get("INFERLB_DATA_DIR", ".inferlb")).resolve()


def admin_token_location(data_dir: Path) -> str:
    """Where the admin API's token is (never the token itself)."""
    if os.environ.get("INFERLB_ADMIN_TOKEN"):
        return "$INFERLB_ADMIN_TOKEN"
    if os.environ.get("INFERLB_CP_ADMIN_TOKEN"):
        return "$INFERLB_CP_ADMIN_TOKEN"
    return f"{data_dir / 'admin-token'} (unless admin_token is set in the config)"


def stack_links(ports: StackPorts, dataplane: str, worker_urls: list[str], data_dir: Path) -> dict[str, str]:
    """The summary's URLs (also kept in the status file for `inferlb status`)."""
    p = ports
    links = {"inference": f"http://127.0.0.1:{p.listener}/v1/embeddings",
             "admin API": f"http://127.0.0.1:{p.control_plane_admin}/docs",
             "control": f"http://127.0.0.1:{p.control_plane_admin}/metrics"}
    if dataplane == "envoy":
        links["ext_proc"] = f"http://127.0.0.1:{p.ext_proc_metrics}/metrics"
        links["envoy admin"] = f"http://127.0.0.1:{p.envoy_admin}/clusters"
    else:
        links["nginx"] = f"http://127.0.0.1:{p.control_plane_admin}/v1/dataplane"
    links["workers"] = ", ".join(worker_urls)
    links["logs"] = str(data_dir / "logs")
    return links


def summary(ports: StackPorts, dataplane: str, links: dict[str, str], data_dir: Path, simulate: bool,
            require_api_keys: bool = False) -> str:
    """What `inferlb up` prints once everything is ready."""
    p = ports
    if dataplane == "envoy":
        plane = [f"  inference   {links['inference']}   (Envoy -> ext_proc pick -> worker)",
                 f"  ext_proc    {links['ext_proc']}   (picks each request; gRPC :{p.ext_proc})",
                 f"  envoy admin {links['envoy admin']}"]
    else:
        plane = [f"  inference   {links['inference']}   (NGINX, weights only: no ext_proc pick; see docs/nginx.md)",
                 f"  nginx       {links['nginx']}   (run by the control plane: config version, reloads, errors)"]
    return "\n".join([
        "", "inferlb is up." + ("  (simulated workers: dummy vectors, no model)" if simulate else ""),
        *plane,
        f"  control     {links['control']}   (control plane; xDS on :{p.xds})",
        f"  admin API   {links['admin API']}   (token: {admin_token_location(data_dir)})",
        f"  workers     {links['workers']}",
        f"  logs        {links['logs']}   (one file per component)",
        "",
        "Try it (API keys required: 401 without one):" if require_api_keys else "Try it:",
        KEY_EXAMPLE.format(admin=p.control_plane_admin, token=data_dir / "admin-token", port=p.listener)
        if require_api_keys else CURL_EXAMPLE.format(port=p.listener),
        "",
        f"{status_hint(data_dir)} Ctrl-C stops everything.",
        "",
    ])


class StackSupervisor(Supervisor):
    def __init__(self, components: Sequence[Component], text: str, info: StackInfo) -> None:
        super().__init__(components, info=info)
        self.text = text

    def on_ready(self) -> None:
        print(self.text, flush=True)


def autoscale_plan(args: argparse.Namespace) -> tuple[int, ScalerSettings | None]:
    """(the fixed workers, the pool scaler's settings or None); ``ValueError`` for bad flags."""
    if args.autoscale is None:
        return args.workers or os.cpu_count() or 1, None
    low, high = parse_bounds(args.autoscale)
    if args.workers is not None:
        raise ValueError("--workers and --autoscale do not go together: --autoscale MIN..MAX runs MIN fixed workers")
    settings = ScalerSettings(pool=args.pool, min_workers=low, max_workers=high,
                              scale_up_cooldown_s=args.scale_up_cooldown, scale_down_cooldown_s=args.scale_down_cooldown)
    return low, settings


def pool_env(settings: ScalerSettings, downscale_window_s: float | None) -> dict[str, str]:
    """The control plane's settings for the pool: its signal within the same bounds (and window, if given)."""
    prefix = f"INFERLB_CP_AUTOSCALE__POOLS__{settings.pool}__"
    env = {f"{prefix}MIN_REPLICAS": str(settings.min_workers), f"{prefix}MAX_REPLICAS": str(settings.max_workers)}
    if downscale_window_s is not None:
        env[f"{prefix}DOWNSCALE_WINDOW_S"] = str(downscale_window_s)
    return env


def log_to_file(path: Path, loggers: Sequence[str]) -> None:
    """Structured JSON lines of ``loggers`` (the pool scaler's decisions and steps) to ``path``."""
    from pythonjsonlogger.json import JsonFormatter

    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter("{asctime}{levelname}{name}{message}", style="{", rename_fields={
        "asctime": "ts", "levelname": "level", "name": "logger", "message": "msg"}))
    for name in loggers:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def cmd_up(args: argparse.Namespace) -> int:
    data_dir = (args.data_dir or default_data_dir()).resolve()
    try:
        if not POOL_PATTERN.match(args.pool):
            raise ValueError(f"--pool {args.pool!r} must be a Kubernetes name (lower-case letters, digits and '-', "
                             "at most 63, starting and ending with a letter or digit)")
        count, scaling = autoscale_plan(args)
        models = tuple(m for m in args.models.split(",") if m) if args.models else ()
    except ValueError as exc:
        print(f"inferlb up: {exc}", file=sys.stderr)
        return 2
    ports = StackPorts(args.listener_port, args.envoy_admin_port, args.xds_port, args.admin_port,
                       args.ext_proc_port, args.ext_proc_metrics_port)
    if args.require_api_keys and args.dataplane != "envoy":
        print("inferlb up: --require-api-keys needs --dataplane envoy (ext_proc checks the keys)", file=sys.stderr)
        return 2
    lock = StackLock(data_dir)
    try:
        lock.acquire()
    except StackRunning as exc:
        print(f"inferlb up: {exc}", file=sys.stderr)
        return 2
    try:
        options = WorkerOptions(data_dir, models=models, precision=args.precision, pool=args.pool,
                                config=args.config, simulate=args.simulate,
                                extra_args=tuple(shlex.split(args.worker_args or "")))
        components = stack_components(workers=count, base_port=args.base_port, data_dir=data_dir, ports=ports,
                                      config=args.config, dataplane=args.dataplane, delta=args.delta,
                                      require_api_keys=args.require_api_keys, quota_store=args.quota_store,
                                      worker_options=options,
                                      control_plane_env=pool_env(scaling, args.downscale_window) if scaling else None)
        worker_urls = [f"http://127.0.0.1:{port}" for port in range(args.base_port, args.base_port + count)]
        if scaling is not None:
            worker_urls.append(f"(pool {scaling.pool} scales {scaling.min_workers}..{scaling.max_workers}: "
                               f"more from :{args.base_port + count})")
        links = stack_links(ports, args.dataplane, worker_urls, data_dir)
        plane = ", ext_proc and Envoy" if args.dataplane == "envoy" else " (it runs NGINX; no ext_proc, no Envoy)"
        kind = "simulated worker(s)" if args.simulate else "worker(s)"
        print(f"starting {count} {kind}, the control plane{plane}; data dir {data_dir}", flush=True)
        text = summary(ports, args.dataplane, links, data_dir, args.simulate, args.require_api_keys)
        supervisor = StackSupervisor(components, text, StackInfo(data_dir, args.dataplane, links))
        if scaling is not None:
            log_to_file(data_dir / "logs" / f"pool-scaler-{scaling.pool}.log",
                        ("inferlb.pool_scaler", "inferlb_runtime.supervision"))
            supervisor.background[f"pool-scaler:{scaling.pool}"] = elastic_pool(
                supervisor, scaling, admin_url=f"http://127.0.0.1:{ports.control_plane_admin}", data_dir=data_dir,
                fixed=count, first_port=args.base_port + count, component=lambda port: worker_component(port, options),
                environ=os.environ)
        return asyncio.run(supervisor.run())
    finally:
        lock.release()


def cmd_status_args(args: argparse.Namespace) -> int:
    return cmd_status(args, (args.data_dir or default_data_dir()).resolve())


def build_parser() -> argparse.ArgumentParser:
    """``inferlb`` and its commands: ``up``, ``status``, ``bench ...`` and ``sim``."""
    parser = argparse.ArgumentParser(
        prog="inferlb",
        description="inferlb: response-time-aware load balancing for small AI models on CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_up_parser(sub)
    status = sub.add_parser(
        "status",
        help="show what `inferlb up` runs",
        description="Show each component of the stack running on a data directory: state, pid, uptime, "
        "readiness URL (each probed now). Exit status: 0 every component ready, 1 something is not, "
        "3 no stack is running there.",
    )
    status.add_argument("--data-dir", type=Path, help="the stack's data dir (default $INFERLB_DATA_DIR or ./.inferlb)")
    add_status_arguments(status)
    status.set_defaults(func=cmd_status_args)
    add_bench_parser(sub)
    add_sim_parser(sub)
    return parser


def _add_up_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """``inferlb up``: what runs, its settings, then its ports."""
    up = sub.add_parser(
        "up",
        help="run the local stack until Ctrl-C",
        description="Start the local stack in readiness order: the ONNX workers, the xDS control plane "
        "(:18000, admin :8080), then ext_proc (:9002, metrics :9090) and Envoy (:10000, admin :9901); with "
        "--dataplane nginx, NGINX on :10000 run by the control plane instead of ext_proc and Envoy. "
        "Crashed components are restarted with backoff; Ctrl-C or SIGTERM stops everything cleanly in reverse "
        "order (Envoy drains first, so requests in flight finish). Logs: <data dir>/logs/, one file per "
        "component. One stack per data directory.",
    )
    up.add_argument("--workers", type=int, help="number of workers (default: one per core)")
    up.add_argument("--dataplane", choices=DATAPLANES, default="envoy",
                    help="envoy (default: per-request ext_proc pick + weights) or nginx (weights only)")
    up.add_argument("--simulate", action="store_true",
                    help="simulated workers: the real API and metrics, FIFO slots of a timed wait, dummy "
                    "vectors; no model needed (demos, tests)")
    up.add_argument("--worker-args", metavar="ARGS",
                    help="more flags for every worker, one string, e.g. \"--sim-fixed-ms 40\" (see python -m workers "
                    "--help)")
    up.add_argument("--base-port", type=int, default=8101, help="first worker port (default 8101)")
    up.add_argument("--precision", choices=["int8", "fp32"], default="int8",
                    help="model precision when --models is empty (default int8)")
    up.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="model versions each worker serves, comma-separated; the first one with an alias answers "
                    f"it (default {','.join(DEFAULT_MODELS)}; '' for the worker's own default, --precision)")
    up.add_argument("--autoscale", metavar="MIN..MAX",
                    help="elastic pool: run MIN workers and add or remove workers up to MAX on the control plane's "
                    "signal inferlb_autoscale_desired_replicas{pool} (the one an HPA uses); new workers are "
                    "registered once warm, removed ones drained first")
    up.add_argument("--pool", default=DEFAULT_POOL,
                    help="the workers' pool (a Kubernetes name; default 'default'): what --autoscale scales")
    up.add_argument("--scale-up-cooldown", type=float, default=5.0, metavar="S",
                    help="--autoscale: seconds after a scale-up before the next one (default 5)")
    up.add_argument("--scale-down-cooldown", type=float, default=30.0, metavar="S",
                    help="--autoscale: seconds after any change before a scale-down (default 30)")
    up.add_argument("--downscale-window", type=float, metavar="S",
                    help="--autoscale: the control plane's scale-down smoothing window for the pool "
                    "(default: [control_plane.autoscale] downscale_window_s, 300)")
    up.add_argument("--data-dir", type=Path, help="models, logs, state (default $INFERLB_DATA_DIR or ./.inferlb)")
    up.add_argument("--config", type=Path, help="TOML file ([worker], [control_plane] and [ext_proc] tables)")
    up.add_argument("--delta", action="store_true", help="Envoy uses incremental (delta) xDS instead of SotW")
    up.add_argument("--require-api-keys", action="store_true",
                    help="refuse inference requests without a live API key (401 invalid_api_key); issue keys with "
                    "POST /v1/api-keys on the admin API (the admin token is in the data dir)")
    up.add_argument("--quota-store", metavar="URL",
                    help="where ext_proc keeps the tenants' quota counters: memory (default, one replica) or a "
                    "redis:// URL shared by several replicas")
    _add_port_arguments(up)
    up.set_defaults(func=cmd_up)


def _add_port_arguments(up: argparse.ArgumentParser) -> None:
    """The stack's ports, each with its default (``StackPorts``)."""
    defaults = StackPorts()
    up.add_argument("--listener-port", type=int, default=defaults.listener,
                    help="Envoy's or NGINX's listener (default 10000)")
    up.add_argument("--envoy-admin-port", type=int, default=defaults.envoy_admin, help="Envoy admin (default 9901)")
    up.add_argument("--xds-port", type=int, default=defaults.xds, help="control plane xDS (default 18000)")
    up.add_argument("--admin-port", type=int, default=defaults.control_plane_admin,
                    help="control plane admin HTTP (default 8080)")
    up.add_argument("--ext-proc-port", type=int, default=defaults.ext_proc, help="ext_proc gRPC (default 9002)")
    up.add_argument("--ext-proc-metrics-port", type=int, default=defaults.ext_proc_metrics,
                    help="ext_proc /metrics (default 9090)")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "workers", None) is not None and args.workers < 1:
        command = " ".join(c for c in ("inferlb", args.command, getattr(args, "bench_command", None)) if c)
        print(f"{command}: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.command == "bench":
        from inferlb.bench.stack.fleet import dropped_settings

        dropped = dropped_settings()
        if dropped:
            print(f"inferlb bench: the components it starts run without your {', '.join(dropped)}: a benchmark "
                  "measures the defaults and its own options", file=sys.stderr)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
