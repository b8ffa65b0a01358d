"""``python -m ext_proc``: the ExternalProcessor gRPC service, its xDS client and its metrics in one process."""

from __future__ import annotations

from .fronts.grpc_settings import GRPC_EXPERIMENTS_DEFAULT, use_grpc_defaults

use_grpc_defaults()  # before anything imports grpc

import argparse
import asyncio
import logging
import logging.config
import os
import sys
from pathlib import Path
from typing import Any, Coroutine, Sequence
from urllib.parse import urlsplit

import uvicorn
from pydantic import ValidationError

from inferlb_runtime.http import EmbeddedServer
from inferlb_runtime.logs import configure_json_logging
from inferlb_runtime.pick_chain import PRESETS
from inferlb_runtime.signals import stop_on_signals
from inferlb_runtime.tls import PemFiles, load_pem_files
from inferlb_runtime.tracing import Tracing, TracingConfig, start_tracing

from .admission.gate import GateSettings
from .admission.rules import AdmissionRules
from .cache.redis_store import RedisResponseCache
from .config import ExtProcConfig, load_config
from .fronts.serving import HealthReporter, serve_grpc
from .metrics import ExtProcMetrics, LiveState, create_http_app
from .pick.registry import PluginRegistry
from .pipeline import check_operator_stages
from .quota import QuotaStore
from .quota.stores import open_quota_store
from .server import ExtProcServicer, ServiceSettings
from .stages.operator import OperatorStageSpec
from .tokens import TokenCounter, packaged_tokenizer_path
from .xds.client import PickPolicySpec, XdsClient, XdsClientSettings

log = logging.getLogger("inferlb.ext_proc")

# Streams in flight get this long to finish on SIGTERM (Envoy fails open on the rest).
SHUTDOWN_GRACE_S = 5.0


def redacted_url(url: str) -> str:
    """A store URL fit for a log line: without its user and password."""
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


def xds_tls(config: ExtProcConfig) -> PemFiles | None:
    """The mTLS material of the xDS channel, read and checked (TlsConfigError names the file), or None."""
    if config.xds_tls_cert is None or config.xds_tls_key is None or config.xds_tls_ca is None:
        return None  # the config allows all three or none
    return load_pem_files(config.xds_tls_cert, config.xds_tls_key, config.xds_tls_ca,
                          settings=("xds_tls_cert", "xds_tls_key", "xds_tls_ca"))


def xds_settings(config: ExtProcConfig, tls: PemFiles | None) -> XdsClientSettings:
    """The xDS client's settings, from the service's configuration."""
    return XdsClientSettings(
        target=config.xds_target, node_id=config.node_id, node_cluster=config.node_cluster,
        cluster=config.workers_cluster, delta=config.xds_mode == "delta",
        backoff_initial_s=config.reconnect_initial_s, backoff_max_s=config.reconnect_max_s,
        tls=tls, tls_server_name=config.xds_tls_server_name, metrics_port=config.metrics_port,
    )


def service_settings(config: ExtProcConfig) -> ServiceSettings:
    """The servicer's settings, from the service's configuration."""
    return ServiceSettings(
        pick_header=config.pick_header, pick_metadata_namespace=config.pick_metadata_namespace,
        response_headers=config.response_headers, max_body_bytes=config.max_body_bytes,
        require_api_keys=config.require_api_keys, fair_queue_depth=config.fair_queue_depth,
        slow_start_s=config.slow_start_s,
        cache_max_bytes=config.cache_max_bytes, cache_ttl_s=config.cache_ttl_s,
        cache_max_entry_bytes=config.cache_max_entry_bytes, cache_per_tenant=config.cache_per_tenant,
        fair_queue=GateSettings(max_wait_s=config.fair_queue_max_wait_s, max_queued=config.fair_queue_max_queued,
                                max_queued_per_tenant=config.fair_queue_max_queued_per_tenant,
                                aging_s=config.fair_queue_aging_s,
                                size_rate=None if config.fair_queue_order == "fifo" else config.fair_queue_size_rate),
        admission=AdmissionRules(room=config.admission_room, budget_s=config.admission_budget_s,
                                 flows=config.anonymous_flows, flow_header=config.anonymous_flow_header.lower(),
                                 early_refusal=config.early_refusal),
        inference_paths=tuple(config.inference_paths),
        stages=tuple(OperatorStageSpec(stage.plugin, stage.params, stage.before, stage.timeout_ms / 1000)
                     for stage in config.stages))


def open_shared_cache(config: ExtProcConfig) -> RedisResponseCache | None:
    """The cache level shared by the replicas (a Redis URL), or None: in-process only, or no cache at all."""
    if config.cache_store == "memory" or not config.cache_max_bytes:
        return None
    return RedisResponseCache.from_url(config.cache_store, timeout_s=config.cache_store_timeout_ms / 1000,
                                       ttl_s=config.cache_ttl_s, max_bytes=config.cache_store_max_bytes)


def metrics_server(config: ExtProcConfig, metrics: ExtProcMetrics, xds: XdsClient) -> EmbeddedServer | None:
    """``/metrics``, ``/healthz`` and ``/readyz`` on the metrics port; None when that port is 0."""
    if not config.metrics_port:
        return None

    def not_ready() -> str | None:
        if xds.view is None:
            return f"no EDS from the control plane at {config.xds_target} yet"
        if config.require_api_keys and xds.key_table is None:
            return f"API keys are required and no key table from the control plane at {config.xds_target} yet"
        return None

    return EmbeddedServer(uvicorn.Config(
        create_http_app(metrics, not_ready), host=config.metrics_address, port=config.metrics_port,
        log_config=None, access_log=False, lifespan="off",
    ))


async def until_stopped(stop: asyncio.Event, tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Until ``stop`` is set or one of ``tasks`` ends: a component that fails stops the process, logged."""
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopper.cancel()
        await asyncio.gather(stopper, return_exceptions=True)
    for task in done:
        if task in tasks and task.exception() is not None:
            log.error("component failed", extra={"task": task.get_name(), "error": repr(task.exception())})


async def close_stores(servicer: ExtProcServicer, quotas: QuotaStore, shared_cache: RedisResponseCache | None) -> None:
    """The fair queue's, the quota store's and the shared cache's connections and tasks."""
    if servicer.gate is not None:
        await servicer.gate.aclose()
    await quotas.aclose()
    if shared_cache is not None:
        await shared_cache.aclose()


async def run(config: ExtProcConfig, tls: PemFiles | None, tracing: Tracing | None = None) -> None:
    """The service, until SIGINT or SIGTERM (or a component fails): NOT_SERVING first, then the streams
    in flight get their grace, then the rest closes."""
    counter = await asyncio.to_thread(TokenCounter.from_package, inline_body_bytes=config.inline_count_bytes)
    holder: list[ExtProcServicer] = []
    metrics = ExtProcMetrics(lambda: holder[0].live_state() if holder else LiveState())
    xds = XdsClient(xds_settings(config, tls), observer=metrics)
    quotas = open_quota_store(config.quota_store, config.quota_failure_mode, config.quota_store_timeout_ms / 1000,
                              config.quota_lease_ttl_s, metrics)
    shared_cache = open_shared_cache(config)
    servicer = ExtProcServicer.create(
        service_settings(config), xds, metrics, counter, PickPolicySpec(config.pick_policy, config.pick_params),
        config.policy_allowlist, quotas, shared_cache, tracing)
    holder.append(servicer)
    health = HealthReporter(xds)
    grpc_server = await serve_grpc(servicer, health, config.grpc_targets, config.grpc_max_message_bytes,
                                   config.reuse_port, config.grpc_front)
    metrics.grpc_front = grpc_server.front
    xds.start()
    http = metrics_server(config, metrics, xds)
    tasks: list[asyncio.Task[Any]] = [] if http is None else [asyncio.create_task(http.serve(), name="metrics-http")]
    stop = stop_on_signals()
    log.info("ext_proc started", extra={
        "grpc": config.grpc_targets, "metrics": f"{config.metrics_address}:{config.metrics_port}",
        "xds": config.xds_target, "xds_mode": config.xds_mode, "xds_mtls": tls is not None,
        "node_id": config.node_id,
        "node_cluster": config.node_cluster, "pick_policy": config.pick_policy,
        "require_api_keys": config.require_api_keys, "quota_store": redacted_url(config.quota_store),
        "cache_store": redacted_url(config.cache_store), "tracing": tracing is not None,
        "grpc_front": grpc_server.front,
    })
    await until_stopped(stop, tasks)
    log.info("stopping")
    await health.stop()  # NOT_SERVING first
    await grpc_server.stop(SHUTDOWN_GRACE_S)
    await xds.stop()
    await close_stores(servicer, quotas, shared_cache)
    if http is not None:
        http.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    if tracing is not None:  # the last spans, off the loop (the flush waits on the collector)
        await asyncio.to_thread(tracing.shutdown)
    log.info("stopped")


def build_parser() -> argparse.ArgumentParser:
    policies = ", ".join(f"{p.name} ({p.summary})" for p in PRESETS.values())
    p = argparse.ArgumentParser(
        prog="python -m ext_proc",
        description=(
            "inferlb's ext_proc service: Envoy's external processor that counts each request's tokens, "
            "predicts its cost on every worker and picks where it finishes first (Endpoint Picker Protocol: "
            "x-gateway-destination-endpoint header and envoy.lb metadata). It follows the workers over ADS "
            "(EDS) from the control plane. Settings: --config FILE ([ext_proc] table), then "
            "INFERLB_EXT_PROC_<NAME> environment variables, then these flags."
        ),
        epilog=f"Pick policies: {policies}. Each is a chain of admit, filter, scorer and picker plugins; its "
               "'admit', 'filters' and 'scorers' params add plugins (README: Write your own policy). The control "
               "plane's EDS may switch it at run time. Tracing: off unless the standard OTEL_* variables turn it on "
               "(e.g. OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317; docs/tracing.md). grpc: "
               f"GRPC_EXPERIMENTS defaults to {GRPC_EXPERIMENTS_DEFAULT} (fewer thread hops per message); set it, "
               "even to \"\", to override.",
    )
    p.add_argument("--config", type=Path, help="TOML file with an [ext_proc] table")
    p.add_argument("--port", type=int, help="ExternalProcessor + grpc.health.v1 port (default 9002)")
    p.add_argument("--metrics-port", type=int, help="HTTP port for /metrics, /healthz, /readyz (default 9090; 0: off)")
    p.add_argument("--xds-address", help="control plane ADS address (default 127.0.0.1)")
    p.add_argument("--xds-port", type=int, help="control plane ADS port (default 18000)")
    p.add_argument("--xds-mode", choices=["delta", "sotw"], help="xDS variant (default delta)")
    p.add_argument("--node-id", help="xDS node id (default ext-proc-<hostname>-<pid>)")
    p.add_argument("--node-cluster", help="xDS node cluster (default inferlb-ext-proc: the rich EDS)")
    p.add_argument("--pick-policy", help="policy until EDS names one (default least_completion_time)")
    p.add_argument("--allow-policy-module", dest="allowed_policy_modules", action="append", metavar="PREFIX",
                   help="let module:attribute pick policies (from the config or EDS) load from this module or "
                        "below it (repeat for more; default: none)")
    p.add_argument("--slow-start", dest="slow_start_s", type=float, metavar="SECONDS",
                   help="ramp a newly routable worker's share of the picks up over this window (default 10; 0: off)")
    p.add_argument("--cache-max-bytes", type=int, metavar="BYTES",
                   help="the gateway cache's in-process bound (default 64 MiB; 0: no cache)")
    p.add_argument("--cache-store", metavar="URL",
                   help="'memory' (default) or a redis:// URL: a level shared by the replicas behind it")
    p.add_argument("--reuse-port", action="store_true", default=None,
                   help="share the gRPC port with other ext_proc processes (SO_REUSEPORT; give each its own "
                        "--metrics-port or 0)")
    p.add_argument("--grpc-front", choices=["auto", "native", "grpcio"],
                   help="the gRPC server: 'native' (gRPC C++, built at install time when libgrpc++ is there: "
                        "about twice the decisions per CPU-second), 'grpcio' (grpcio's aio server) or 'auto' "
                        "(default: native when built)")
    p.add_argument("--uds-path", type=Path, metavar="PATH",
                   help="also serve on this Unix domain socket (for an Envoy on the same host: cheaper than "
                        "loopback TCP; default: none)")
    p.add_argument("--event-loop", choices=["uvloop", "asyncio"], help="event loop (default uvloop when installed)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(args.config, overrides)
        PluginRegistry(config.policy_allowlist).build(config.pick_policy,
                                                      config.pick_params)  # refuse a bad policy up front
        check_operator_stages(service_settings(config).stages, config.policy_allowlist)  # and a bad stage
        packaged_tokenizer_path()  # and a missing model package (tokens are counted with its tokenizer)
        tls = xds_tls(config)  # and unusable TLS files (TlsConfigError is a ValueError)
        tracing_config = TracingConfig.from_env(os.environ, "inferlb-ext-proc")  # OTEL_*: off unless set
    except (ValidationError, ValueError, OSError) as exc:
        print(f"python -m ext_proc: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    configure_json_logging("ext_proc", config.log_level)
    run_loop(run(config, tls, start_tracing(tracing_config)), config.event_loop)
    return 0


def run_loop(main_coro: Coroutine[Any, Any, None], event_loop: str) -> None:
    """Run on uvloop when asked for and installed (grpc.aio supports it: its completion queue is
    polled by its own thread and hands results to whatever loop runs), else on asyncio's loop."""
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed; running on asyncio's default loop")
        else:
            uvloop.run(main_coro)
            return
    asyncio.run(main_coro)


if __name__ == "__main__":
    raise SystemExit(main())
