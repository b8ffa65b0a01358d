"""``python -m control_plane``: the xDS server, the scraper and the admin HTTP API in one process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.config
import signal
import sys
from pathlib import Path
from typing import Sequence

import uvicorn
from pydantic import ValidationError

from inferlb.runtime.http import EmbeddedServer
from inferlb.runtime.logs import configure_json_logging

from .admin import create_admin_app
from .config import ControlPlaneConfig, load_config
from .controller import Controller
from .metrics import ControlPlaneMetrics
from .policy import make_weight_policy
from .scraper import Scraper, ScraperConfig
from .xds import SnapshotCache, serve_xds, stop_xds

log = logging.getLogger("inferlb.control_plane")


async def run(config: ControlPlaneConfig) -> None:
    cache = SnapshotCache()
    controller_ref: list[Controller] = []
    metrics = ControlPlaneMetrics(lambda: controller_ref[0].state)
    controller = Controller(config, cache, metrics)
    controller_ref.append(controller)
    await controller.start()

    xds = await serve_xds(cache, f"{config.xds_address}:{config.xds_port}", metrics)
    scraper = Scraper(
        ScraperConfig(interval_s=config.scrape_interval_s, timeout_s=config.scrape_timeout_s,
                      unhealthy_after=config.unhealthy_after),
        observer=metrics,
    )
    admin = EmbeddedServer(uvicorn.Config(
        create_admin_app(controller, metrics), host=config.admin_address, port=config.admin_port,
        log_config=None, access_log=False, lifespan="off",
    ))
    tasks = [
        asyncio.create_task(scraper.run(lambda: controller.state.endpoints, controller.on_scrape_results),
                            name="scraper"),
        asyncio.create_task(admin.serve(), name="admin-http"),
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    log.info("control plane started", extra={
        "xds": f"{config.xds_address}:{config.xds_port}", "admin": f"{config.admin_address}:{config.admin_port}",
        "endpoints": config.endpoints, "weight_policy": config.weight_policy,
    })
    done, _ = await asyncio.wait([asyncio.create_task(stop.wait()), *tasks], return_when=asyncio.FIRST_COMPLETED)
    for task in done:
        if task in tasks and task.exception() is not None:
            log.error("component failed", extra={"task": task.get_name(), "error": repr(task.exception())})
    log.info("stopping")
    admin.should_exit = True
    await stop_xds(xds, cache, grace=2.0)
    await controller.stop()
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m control_plane",
        description=(
            "inferlb's xDS control plane: scrapes the workers' /metrics, computes endpoint weights with a "
            "WeightPolicy and pushes them to every Envoy and ext_proc over ADS (state of the world and delta). "
            "Settings: --config FILE ([control_plane] table), then INFERLB_CP_<NAME> environment variables "
            "(nested: INFERLB_CP_DATA_PLANE__LISTENER_PORT), then these flags."
        ),
    )
    p.add_argument("--config", type=Path, help="TOML file with a [control_plane] table")
    p.add_argument("--endpoint", dest="endpoints", action="append", metavar="HOST:PORT",
                   help="a static worker endpoint (repeat for more)")
    p.add_argument("--xds-port", type=int, help="ADS gRPC port (default 18000)")
    p.add_argument("--admin-port", type=int, help="admin HTTP port: /metrics, /healthz, /readyz (default 8080)")
    p.add_argument("--scrape-interval", dest="scrape_interval_s", type=float, help="seconds (default 0.5)")
    p.add_argument("--weight-policy", help="capacity (default) or equal")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(args.config, overrides)
        make_weight_policy(config.weight_policy, config.weight_params)  # refuse a bad policy up front
    except (ValidationError, ValueError, OSError) as exc:
        print(f"python -m control_plane: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    configure_json_logging("control_plane", config.log_level)
    asyncio.run(run(config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
