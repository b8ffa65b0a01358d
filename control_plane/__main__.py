"""``python -m control_plane``: the xDS server, the scraper and the admin HTTP API in one process."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import logging.config
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Sequence

import uvicorn
from pydantic import ValidationError

from inferlb_runtime.http import EmbeddedServer
from inferlb_runtime.logs import configure_json_logging
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.signals import stop_on_signals
from inferlb_runtime.supervision import Supervised

from .admin import AdminService, create_admin_app
from .auth import AdminToken, TokenError, resolve_admin_token
from .autoscale import Autoscaler
from .config import ControlPlaneConfig, load_config
from .controller import Controller, initial_state
from .discovery.service import start_discovery, stop_discovery
from .host_allowlist import AllowedHosts
from .metrics import ControlPlaneMetrics
from .nginx.applier import NginxApplier
from .nginx.process import NginxError
from .policies import pick_catalogue
from .policies.contract import WeightPolicy
from .policies.registry import WeightPolicyRegistry
from .serving import TlsConfigError, admin_tls_arguments, warn_plaintext, xds_server_settings
from .store import OperatorState, OperatorStore, StoreError, live_key_entries, open_store, restore
from .store.follow import follow
from .telemetry.replica_activity import watch_replicas
from .telemetry.scraper import Scraper, ScraperConfig
from .usage.ingest import UsageIngest
from .xds import SnapshotCache, serve_xds, stop_xds

log = logging.getLogger("inferlb.control_plane")
# Each step of the stop after nginx's (xDS, the admin service, ...) may take this long; the xDS grace is 2 s.
STOP_STEP_TIMEOUT_S = 10.0


def restored_policies(stored: OperatorState, allow: PolicyAllowlist) -> tuple[WeightPolicy | None, OperatorState]:
    """The stored weight policy, built, and ``stored`` without a pick policy that no longer validates.

    A stored policy this version cannot build (renamed, a parameter gone, or no longer allowed by
    ``allow``: the store is not a way around the allowlist) is logged as an error and not applied (the
    config's is used); its row stays in the database until the next PUT /v1/policy.
    """
    weight = None
    if stored.weight_policy is not None:
        try:
            weight = WeightPolicyRegistry(allow).make(stored.weight_policy.name, stored.weight_policy.params)
            log.info("weight policy restored from the store (it beats the config's)",
                     extra={"weight_policy": weight.name})
        except (ValueError, TypeError) as exc:
            log.error("stored weight policy not applied: using the config's", extra={"error": str(exc)})
    if stored.pick_policy is not None:
        try:
            pick_catalogue.validate_pick_params(stored.pick_policy.name, stored.pick_policy.params, allow)
        except ValueError as exc:  # UnknownPickPolicy and pydantic's ValidationError
            log.error("stored pick policy not applied: using the default", extra={"error": str(exc)})
            stored = dataclasses.replace(stored, pick_policy=None)
    return weight, stored


async def start_nginx(config: ControlPlaneConfig, controller: Controller,
                      metrics: ControlPlaneMetrics) -> NginxApplier:
    """NGINX mode: render, validate and apply the first config (and start nginx), then follow the state."""
    nginx = NginxApplier(config.nginx.settings(config.data_dir, controller.state.settings),
                         lambda: controller.state, metrics)
    await nginx.start()
    controller.add_listener(nginx.mark)
    return nginx


async def run(config: ControlPlaneConfig, store: OperatorStore | None = None, stored: OperatorState | None = None,
              token: AdminToken | None = None) -> int:
    """Serve until SIGINT/SIGTERM (exit status 0) or until a component fails (1).

    TLS files are read and checked first (:class:`TlsConfigError` before anything starts).
    """
    xds_settings = xds_server_settings(config)
    admin_tls = admin_tls_arguments(config)
    warn_plaintext(config, log)
    cache = SnapshotCache()
    controller_ref: list[Controller] = []
    metrics = ControlPlaneMetrics(lambda: controller_ref[0].state)
    # The operator's state is in the initial state: the first push already carries pins, drains, policy.
    weight_policy, stored = restored_policies(stored or OperatorState(), config.policy_allowlist)
    controller = Controller(config, cache, metrics, restore(initial_state(config), stored), weight_policy,
                            api_keys=live_key_entries(stored.api_keys))
    controller_ref.append(controller)
    await controller.start()
    nginx = await start_nginx(config, controller, metrics) if config.nginx.enabled else None
    service = AdminService(controller, store, deregistration_drain_s=config.deregistration_drain_s,
                           stored_weight_policy=stored.weight_policy, api_keys=stored.api_keys)
    follower = None if store is None else follow_store(store, service, metrics, config)

    xds = await serve_xds(cache, f"{config.xds_address}:{config.xds_port}", metrics, xds_settings)
    scraper = Scraper(
        ScraperConfig(interval_s=config.scrape_interval_s, timeout_s=config.scrape_timeout_s,
                      unhealthy_after=config.unhealthy_after, max_body_bytes=config.scrape_max_body_bytes),
        observer=metrics,
    )
    admin = EmbeddedServer(uvicorn.Config(
        create_admin_app(controller, metrics, service, token, auth_reads=config.admin_auth_reads,
                         allowed_hosts=AllowedHosts.of(config.admin_allowed_hosts), nginx=nginx),
        host=config.admin_address, port=config.admin_port,
        log_config=None, access_log=False, lifespan="off", **admin_tls,
    ))
    loops = start_loops(controller, scraper, metrics, store, config.usage_retention_days)  # cancelled at stop
    tasks = [*loops, asyncio.create_task(admin.serve(), name="admin-http")]
    discovery = start_discovery(config, controller, metrics, stored.overrides)
    # Computed when /metrics is scraped, per pool.
    autoscaler = Autoscaler(config.autoscale.settings(), config.autoscale.pool_settings())
    metrics.register_autoscale(lambda: autoscaler.observe(controller.state.endpoints, time.monotonic(),
                                                          config.stale_after_s))
    stop = stop_on_signals()
    log.info("control plane started", extra={
        "xds": f"{config.xds_address}:{config.xds_port}", "admin": f"{config.admin_address}:{config.admin_port}",
        "endpoints": config.endpoints, "weight_policy": controller.policy.name,
        "pick_policy": controller.state.pick_policy.name, "restored_endpoints": len(stored.endpoints),
        "restored_overrides": len(stored.overrides),
        "state_db": store.location if store is not None else None,
        # Said at every start: reads without the token are a choice (admin_auth_reads), not an accident.
        "admin_reads": "token required" if config.admin_auth_reads else "open to loopback clients",
        "admin_allowed_hosts": ["localhost", "IP addresses", *config.admin_allowed_hosts],
    })
    # A provider ends only on what retrying cannot fix (e.g. an unreadable kubeconfig): stop, exit 1.
    failed = await stopped_or_failed(stop, [*tasks, *discovery])
    log.info("stopping")
    if nginx is not None:  # first: nginx stops accepting and lets in-flight requests finish
        await stop_step("nginx", nginx.stop(), timeout_s=None)  # its own bound: nginx.stop_timeout_s
    admin.should_exit = True
    await stop_step("xds", stop_xds(xds, cache, grace=2.0))
    if follower is not None:
        follower.cancel()
        await stop_step("store-follower", asyncio.gather(follower, return_exceptions=True))
    await stop_step("admin-service", service.stop())
    await stop_step("discovery", stop_discovery(discovery))
    await stop_step("controller", controller.stop())
    for task in loops:
        task.cancel()
    await stop_step("tasks", asyncio.gather(*tasks, return_exceptions=True))
    log.info("stopped", extra={"exit_status": 1 if failed else 0})
    return 1 if failed else 0


def follow_store(store: OperatorStore, service: AdminService, metrics: ControlPlaneMetrics,
                 config: ControlPlaneConfig) -> asyncio.Task[None]:
    """Fold in the changes other replicas make in a shared store (SQLite: none; the task ends at once).
    Supervised: a failure that escapes follow() is logged, counted and retried instead of ending the
    following unnoticed."""
    return asyncio.create_task(
        Supervised("store-follower", observer=metrics, logger=log).run(
            lambda: follow(store, service.reload_from_store, metrics, config.store_reload_interval_s)),
        name="store-follower")


def start_loops(controller: Controller, scraper: Scraper, metrics: ControlPlaneMetrics,
                store: OperatorStore | None, usage_retention_days: int) -> list[asyncio.Task[None]]:
    """The scraper, the replica watch and (with a store) the usage ingest: the loops the stop cancels.
    Usage for billing is the replica watch's reads of each ext_proc, written to the store (usage/)."""
    usage = None if store is None else UsageIngest(store, usage_retention_days)
    loops = [
        asyncio.create_task(scraper.run(lambda: controller.state.endpoints, controller.on_scrape_results),
                            name="scraper"),
        asyncio.create_task(Supervised("replica-watch", observer=metrics, logger=log).run(
            lambda: watch_replicas(controller, scraper.config, None if usage is None else usage.offer)),
            name="replica-watch"),
    ]
    if usage is not None:
        loops.append(asyncio.create_task(Supervised("usage-ingest", observer=metrics, logger=log).run(usage.run),
                                         name="usage-ingest"))
    return loops


async def stopped_or_failed(stop: asyncio.Event, watched: Sequence[asyncio.Task[Any]]) -> bool:
    """Wait for ``stop`` or the end of a ``watched`` task; True (logged) for the latter: none of them ends
    unless stopped, so an end, with or without an error, is a failure."""
    done, _ = await asyncio.wait([asyncio.create_task(stop.wait()), *watched], return_when=asyncio.FIRST_COMPLETED)
    failed = False
    for task in done:
        if task in watched:
            failed = True
            error = None if task.cancelled() else task.exception()
            log.error("component failed" if error is not None else "component ended unexpectedly",
                      exc_info=error, extra={"task": task.get_name(), "error": repr(error)})
    return failed


async def stop_step(name: str, step: Awaitable[object], timeout_s: float | None = STOP_STEP_TIMEOUT_S) -> None:
    """One step of the stop, logged, and bounded: a step that hangs is logged by name and left behind, so
    the process still exits. (A stop once hung for over 30 s in a fresh-clone run, after the admin
    server had finished; the log did not say in which step.)"""
    log.info("stopping %s", name, extra={"step": name})
    try:
        await asyncio.wait_for(step, timeout_s)
    except TimeoutError:
        log.warning("stop step %s did not finish in %g s; going on", name, timeout_s, extra={"step": name})


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
    p.add_argument("--admin-port", type=int, help="admin HTTP port: the admin REST API /v1, /docs, /metrics, /healthz, /readyz (default 8080)")
    p.add_argument("--scrape-interval", dest="scrape_interval_s", type=float, help="seconds (default 0.5)")
    p.add_argument("--weight-policy", help="capacity (default), equal, an inferlb.policies entry point, or an "
                                           "allowed module:attribute")
    p.add_argument("--allow-policy-module", dest="allowed_policy_modules", action="append", metavar="PREFIX",
                   help="let module:attribute policies load from this module or below it (repeat for more; "
                        "default: none)")
    p.add_argument("--data-dir", type=Path,
                   help="operator state (control-plane.db) and the admin token (default $INFERLB_DATA_DIR "
                        "or ./.inferlb)")
    p.add_argument("--store", metavar="URL",
                   help="shared operator state for several replicas: postgresql://user@host:port/db "
                        "(default $INFERLB_STORE; unset: SQLite in the data directory)")
    p.add_argument("--dataplane", choices=["envoy", "nginx"],
                   help="envoy (default: Envoys and ext_proc connect over xDS) or nginx: the control plane "
                        "renders nginx's upstream, validates it with nginx -t, reloads nginx gracefully and, by "
                        "default, runs nginx itself on the listener address (INFERLB_CP_NGINX__*; docs/nginx.md)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def config_problems(exc: ValidationError) -> str:
    """pydantic's errors, one a line, without the values given: pydantic would print a bad ``store`` URL
    whole, its password included."""
    return "\n".join(f"  {'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}"
                     for err in exc.errors(include_url=False, include_input=False))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("config", "dataplane")}
    if args.dataplane is not None:
        overrides["nginx"] = {"enabled": args.dataplane == "nginx"}
    try:
        config = load_config(args.config, overrides)
        # Refuse a bad policy up front.
        WeightPolicyRegistry(config.policy_allowlist).make(config.weight_policy, config.weight_params)
        config.data_plane.settings()  # and a bad OTEL_* variable (Envoy's tracing comes from them)
    except (ValidationError, ValueError, OSError) as exc:
        problems = config_problems(exc) if isinstance(exc, ValidationError) else str(exc)
        print(f"python -m control_plane: invalid configuration:\n{problems}", file=sys.stderr)
        return 2
    configure_json_logging("control_plane", config.log_level)
    try:
        store = open_store(config.store, config.data_dir)
    except StoreError as exc:
        print(f"python -m control_plane: cannot use the state database: {exc}", file=sys.stderr)
        return 2
    try:
        stored = store.load()
        secret = config.admin_token.get_secret_value() if config.admin_token is not None else None
        token = resolve_admin_token(secret, config.data_dir)
    except (StoreError, TokenError) as exc:
        store.close()
        print(f"python -m control_plane: {exc}", file=sys.stderr)
        return 2
    log.info("admin API token", extra={"token_location": token.where(), "token_source": token.source})
    try:
        return asyncio.run(run(config, store, stored, token))
    except NginxError as exc:
        print(f"python -m control_plane: NGINX data plane: {exc}", file=sys.stderr)
        return 2
    except TlsConfigError as exc:
        print(f"python -m control_plane: invalid TLS configuration: {exc}", file=sys.stderr)
        return 2
    finally:
        store.close()


if __name__ == "__main__":
    raise SystemExit(main())
