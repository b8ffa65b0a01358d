"""ext_proc settings: defaults < the config file's ``[ext_proc]`` table
< ``INFERLB_EXT_PROC_*`` environment variables < command-line flags.

pydantic-settings merges and validates, so a bad value is refused at start-up
with the field's name, never half-applied. The defaults are the contract table
of docs/design.md (gRPC on 127.0.0.1:9002, metrics on :9090, ADS at :18000).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    SettingsConfigDict,
)

from inferlb_runtime.hostport import MAX_UNIX_SOCKET_PATH_BYTES, fits_unix_socket
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.settings import PolicyModules, load_layered
from inferlb_runtime.tls import all_or_none

from .quota import check_store_url

MIB = 1024 * 1024


class StageConfig(BaseModel):
    """An operator's request stage (``[[ext_proc.stages]]``; ext_proc/stages/operator.py): an entry point of
    ``inferlb.policies`` or a ``module:attribute`` under ``allowed_policy_modules``, its parameters, the
    built-in stage it runs before, and its time budget per request (over it: skipped, counted)."""

    model_config = ConfigDict(extra="forbid")

    plugin: str = Field(min_length=1)
    params: dict[str, Any] = Field(default_factory=dict)
    before: Literal["quota", "models", "cache", "admission", "decide"] = "decide"
    timeout_ms: int = Field(50, ge=1, le=10_000)


def default_node_id() -> str:
    """Unique per process, readable in the control plane's ``/v1/xds/clients``."""
    return f"ext-proc-{socket.gethostname()}-{os.getpid()}"


class ExtProcConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="INFERLB_EXT_PROC_", extra="forbid")

    # The ExternalProcessor gRPC service (and grpc.health.v1 on the same port).
    address: str = "127.0.0.1"
    port: int = Field(9002, ge=1, le=65535)
    # SO_REUSEPORT: several ext_proc processes on one port, the kernel spreading Envoy's connections over
    # them (one process is one core: this is how ext_proc scales). Off: a taken port is an error.
    reuse_port: bool = False
    # The gRPC server under the ExternalProcessor and health services. "native": gRPC C++ on a thread of its
    # own, handing streams to the loop in batches (about 2x the decisions per CPU-second of grpcio's aio
    # server, docs/benchmarks.md section 3; built at install time when gRPC C++ is there, see setup.py);
    # "grpcio": grpcio's aio server; "auto": native when built, else grpcio.
    grpc_front: Literal["auto", "native", "grpcio"] = "auto"
    # Also serve on this Unix domain socket: for an Envoy on the same host (the sidecar), a pipe costs the
    # kernel less per message than loopback TCP (docs/benchmarks.md section 3). The TCP port stays (health
    # probes, remote Envoys). Each process needs its own path: a socket file is not shared like a port.
    uds_path: Path | None = None
    # Prometheus /metrics, /healthz, /readyz.
    metrics_address: str = "127.0.0.1"
    metrics_port: int = Field(9090, ge=0, le=65535)  # 0: no HTTP side
    # The control plane's ADS server.
    xds_address: str = "127.0.0.1"
    xds_port: int = Field(18000, ge=1, le=65535)
    xds_mode: Literal["delta", "sotw"] = "delta"
    # mTLS to the control plane: this replica's certificate chain and key, and the CA that signs the
    # control plane's certificate. All three or none (none: plaintext, the loopback default).
    xds_tls_cert: Path | None = None
    xds_tls_key: Path | None = None
    xds_tls_ca: Path | None = None
    # The name the control plane's certificate must carry, when it is not xds_address (gRPC checks it).
    xds_tls_server_name: str | None = None
    node_id: str = ""  # empty: ext-proc-<hostname>-<pid>
    # The control plane serves the rich EDS (telemetry, pick policy) to this node cluster.
    node_cluster: str = Field("inferlb-ext-proc", min_length=1)
    workers_cluster: str = Field("workers", min_length=1)  # the ClusterLoadAssignment to follow
    reconnect_initial_s: float = Field(0.25, gt=0)
    reconnect_max_s: float = Field(5.0, gt=0)
    # The Endpoint Picker Protocol.
    pick_header: str = Field("x-gateway-destination-endpoint", min_length=1)
    pick_metadata_namespace: str = Field("envoy.lb", min_length=1)
    # Until the first EDS names one (and when EDS names none). Retry fallbacks are a policy param.
    pick_policy: str = "least_completion_time"
    pick_params: dict[str, Any] = Field(default_factory=dict)
    # module:attribute pick policies (from the config or EDS) load only under these module prefixes, by
    # whole dotted components; none by default. Entry points (inferlb.policies) are always allowed.
    allowed_policy_modules: PolicyModules = Field(default_factory=list)
    # The paths a request with a body may be POSTed to: the inference API the workers serve. A POST elsewhere
    # is answered 404 not_found at the gateway, whatever its model.
    inference_paths: list[str] = Field(default_factory=lambda: ["/v1/embeddings"], min_length=1)
    # The operator's own request stages, in order, each run before the built-in stage it names (default:
    # the decision). Loaded at start-up under the same allowlist as policies; a failing one is skipped.
    stages: list[StageConfig] = Field(default_factory=list)
    # Envoy buffers up to this much body (its route's request_body_buffer_limit) and sends it
    # in one gRPC message; gRPC must accept that message plus the headers around it. A stream whose
    # body goes over it (in one message or in chunks) gets a 413 at once: nothing is buffered past it.
    max_body_bytes: int = Field(4 * MIB, ge=1024)
    grpc_max_message_bytes: int = Field(8 * MIB, ge=64 * 1024)
    # Bodies larger than this are tokenised in a thread, off the event loop.
    inline_count_bytes: int = Field(16 * 1024, ge=0)
    # Observability headers on the response to the client (x-inferlb-endpoint, ...).
    response_headers: bool = True
    # Fair admission: once this replica has fair_queue_depth requests in flight per routable endpoint (of
    # its share of the fleet), new requests wait in ext_proc and leave in weighted fair order across tenants
    # (their API keys' weights), best class first. 0: off. A wait over fair_queue_max_wait_s (or the
    # request's budget) is a 429 overloaded, except for critical requests, which are routed anyway. The
    # control plane's data_plane.ext_proc_max_message_timeout_ms must exceed the wait (Envoy's limit).
    fair_queue_depth: int = Field(8, ge=0, le=10_000)
    fair_queue_max_wait_s: float = Field(5.0, gt=0, le=3600)
    fair_queue_max_queued: int = Field(10_000, ge=1)
    fair_queue_max_queued_per_tenant: int = Field(1_000, ge=1)
    fair_queue_aging_s: float = Field(2.0, gt=0)
    # Within a flow: "smallest" serves the least work first, aged at fair_queue_size_rate tokens a second (a
    # request of n tokens is overtaken only by those arriving within n / rate seconds of it: a large one is
    # never starved); "fifo", first in first out.
    fair_queue_order: Literal["smallest", "fifo"] = "smallest"
    fair_queue_size_rate: float = Field(4000.0, gt=0)
    # Room at the door: "work", while the predicted seconds sent per routable endpoint stay under
    # admission_budget_s (a short request fits in a gap a long one does not; an idle endpoint always takes
    # one); "requests", fair_queue_depth in flight per routable endpoint.
    admission_room: Literal["work", "requests"] = "work"
    admission_budget_s: float = Field(0.5, gt=0, le=60)
    # Callers without an API key wait as one flow per client: by "address" (Envoy's source address), by the
    # last entry of anonymous_flow_header set by a trusted proxy in front ("header"), or all as "one".
    anonymous_flows: Literal["address", "header", "one"] = "address"
    anonymous_flow_header: str = Field("x-forwarded-for", min_length=1)
    # A request whose predicted wait is past its maximum wait (or deadline) gets its 429 at once.
    early_refusal: bool = True
    # Slow start: an endpoint that turned routable (joined, or came back) takes a share of this replica's picks
    # ramping from 10% to all over this many seconds, so a cold worker is not flooded by its empty queue's
    # appeal. Endpoints already routable when ext_proc starts are not ramped. 0: off.
    slow_start_s: float = Field(10.0, ge=0, le=3600)
    # Refuse requests without a known API key (401 invalid_api_key) instead of serving them as the anonymous
    # tenant. Set the control plane's data_plane.require_api_keys too, so Envoy never skips ext_proc.
    require_api_keys: bool = False
    # Where tenants' quota counters live: "memory" (in process: one replica) or a redis://, rediss:// or
    # unix:// URL (shared by the replicas). When Redis does not answer within quota_store_timeout_ms,
    # "open" admits and "closed" refuses (both counted in the metrics).
    quota_store: str = "memory"
    quota_failure_mode: Literal["open", "closed"] = "open"
    quota_store_timeout_ms: int = Field(50, ge=1, le=10_000)
    # A request's tokens in flight are freed when it ends, or after this if its replica died first.
    quota_lease_ttl_s: float = Field(300.0, gt=0, le=86_400)
    # The gateway cache: whole answers to repeated POST /v1/embeddings, keyed by the model version, the input
    # and the parameters that change the output (and the tenant, with cache_per_tenant). Bounded in bytes
    # (LRU; 0: off), each entry for cache_ttl_s and at most cache_max_entry_bytes (and Envoy's buffer limit).
    cache_max_bytes: int = Field(64 * MIB, ge=0)
    cache_ttl_s: float = Field(300.0, gt=0, le=86_400)
    cache_max_entry_bytes: int = Field(1 * MIB, ge=1024)
    cache_per_tenant: bool = False
    # "memory": in process only. A redis://, rediss:// or unix:// URL (the quotas' server): a shared level
    # behind it, for hits across replicas, holding at most cache_store_max_bytes (least recently used out
    # first; its keys expire after cache_ttl_s); Redis slower than cache_store_timeout_ms is a miss, never a
    # failure.
    cache_store: str = "memory"
    cache_store_max_bytes: int = Field(256 * MIB, ge=1024)
    cache_store_timeout_ms: int = Field(50, ge=1, le=10_000)
    # uvloop when installed (grpc.aio runs on it: fewer CPU cycles per stream); "asyncio": the default loop.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("quota_store", "cache_store")
    @classmethod
    def _store_url(cls, value: str) -> str:
        return check_store_url(value)

    @model_validator(mode="after")
    def _consistent(self) -> "ExtProcConfig":
        all_or_none({"xds_tls_cert": self.xds_tls_cert, "xds_tls_key": self.xds_tls_key,
                     "xds_tls_ca": self.xds_tls_ca})
        if self.reconnect_max_s < self.reconnect_initial_s:
            raise ValueError("reconnect_max_s must be >= reconnect_initial_s")
        if self.grpc_max_message_bytes < self.max_body_bytes + 64 * 1024:
            raise ValueError("grpc_max_message_bytes must exceed max_body_bytes by at least 64 KiB "
                             "(a buffered body arrives as one message with its framing)")
        if self.uds_path is not None and not fits_unix_socket(self.uds_path):
            raise ValueError(f"uds_path {str(self.uds_path)!r} is too long for a Unix socket (at most "
                             f"{MAX_UNIX_SOCKET_PATH_BYTES} bytes): use a shorter directory")
        if not self.node_id:
            self.node_id = default_node_id()
        return self

    @property
    def policy_allowlist(self) -> PolicyAllowlist:
        return PolicyAllowlist(tuple(self.allowed_policy_modules))

    @property
    def grpc_target(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def grpc_targets(self) -> list[str]:
        """Every address the gRPC server listens on: the TCP port, and the Unix socket when set."""
        return [self.grpc_target] + ([f"unix:{self.uds_path}"] if self.uds_path is not None else [])

    @property
    def xds_target(self) -> str:
        return f"{self.xds_address}:{self.xds_port}"


def load_config(config_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> ExtProcConfig:
    """Merge defaults < the file's [ext_proc] table < environment < flags; pydantic's ValidationError says what is wrong."""
    return load_layered(ExtProcConfig, "ext_proc", config_file, overrides)
