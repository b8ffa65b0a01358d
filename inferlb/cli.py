"""The ``inferlb`` command: run the local stack (more subcommands arrive with their issues)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Sequence

from .supervisor import Component, Supervisor

CURL_EXAMPLE = """curl -s http://127.0.0.1:{port}/v1/embeddings \\
  -H 'Content-Type: application/json' \\
  -d '{{"model": "all-MiniLM-L6-v2", "input": ["The cat sits on the mat."]}}'"""


def default_data_dir() -> Path:
    return Path(os.environ.get("INFERLB_DATA_DIR", ".inferlb")).resolve()


def worker_components(count: int, base_port: int, data_dir: Path, precision: str) -> list[Component]:
    env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
    return [
        Component(
            name=f"worker:{port}",
            argv=[sys.executable, "-m", "workers", "--port", str(port), "--precision", precision, "--threads", "1"],
            ready_url=f"http://127.0.0.1:{port}/readyz",
            log_path=data_dir / "logs" / f"worker-{port}.log",
            env=env,
        )
        for port in range(base_port, base_port + count)
    ]


class StackSupervisor(Supervisor):
    def __init__(self, components: Sequence[Component], base_port: int, data_dir: Path) -> None:
        super().__init__(components)
        self.base_port = base_port
        self.data_dir = data_dir

    def on_ready(self) -> None:
        ports = [c.ready_url.split(":")[2].split("/")[0] for c in self.components]
        print(
            "\ninferlb is up.\n"
            f"  workers   {', '.join('http://127.0.0.1:' + p for p in ports)}\n"
            f"  metrics   http://127.0.0.1:{self.base_port}/metrics\n"
            f"  logs      {self.data_dir / 'logs'}\n\n"
            "Try it:\n" + CURL_EXAMPLE.format(port=self.base_port) + "\n\nCtrl-C stops everything.\n",
            flush=True,
        )


def cmd_up(args: argparse.Namespace) -> int:
    data_dir = (args.data_dir or default_data_dir()).resolve()
    count = args.workers or os.cpu_count() or 1
    components = worker_components(count, args.base_port, data_dir, args.precision)
    print(f"starting {count} worker(s); data dir {data_dir}", flush=True)
    return asyncio.run(StackSupervisor(components, args.base_port, data_dir).run())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferlb",
        description="inferlb: response-time-aware load balancing for small AI models on CPUs.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = sub.add_parser(
        "up",
        help="run the local stack until Ctrl-C",
        description="Start the local stack (today: the ONNX workers) in readiness order, restart crashed "
        "components with backoff, and stop everything cleanly on Ctrl-C or SIGTERM.",
    )
    up.add_argument("--workers", type=int, help="number of workers (default: one per core)")
    up.add_argument("--base-port", type=int, default=8101, help="first worker port (default 8101)")
    up.add_argument("--precision", choices=["int8", "fp32"], default="int8", help="model precision (default int8)")
    up.add_argument("--data-dir", type=Path, help="models, logs, state (default $INFERLB_DATA_DIR or ./.inferlb)")
    up.set_defaults(func=cmd_up)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "workers", None) is not None and args.workers < 1:
        print("inferlb up: --workers must be >= 1", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
