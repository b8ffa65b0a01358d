"""Control-plane settings: defaults < the config file's ``[control_plane]`` table
< ``INFERLB_CP_*`` environment variables < command-line flags.

pydantic-settings does the merging and validation, so a bad value is refused
at startup with the field's name, never half-applied.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Mapping

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    SettingsConfigDict,
)

from inferlb_runtime.hostport import MAX_UNIX_SOCKET_PATH_BYTES, fits_unix_socket
from inferlb_runtime.model_routing import POOL_PATTERN
from inferlb_runtime.plugins import PolicyAllowlist
from inferlb_runtime.settings import PolicyModules, load_layered
from inferlb_runtime.tls import all_or_none
from inferlb_runtime.tracing import TracingConfig

from .auth import is_loopback
from .autoscale import AutoscaleSettings
from .host_allowlist import check_allowed_host
from .model import DataPlaneSettings, EnvoyTracing, ExtProcSettings
from .nginx.config import NginxConfig


def parse_endpoint(text: str) -> tuple[str, int]:
    """``host:port`` → (host, port); ValueError saying what is wrong."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {text!r} is not host:port with a port in 1..65535")
    return host.strip("[]"), int(port)


class DataPlaneConfig(BaseModel):
    """The tunable part of Envoy's resources (see ``model.DataPlaneSettings``)."""

    model_config = ConfigDict(extra="forbid")

    listener_address: str = "127.0.0.1"
    listener_port: int = Field(10000, ge=1, le=65535)
    # HTTPS on the listener: absolute paths of a PEM certificate chain and its private key, as Envoy
    # sees them (Envoy reads them, on its own host). Both or neither; neither: plaintext HTTP.
    listener_tls_cert: str | None = None
    listener_tls_key: str | None = None
    ext_proc_address: str = "127.0.0.1"
    ext_proc_port: int = Field(9002, ge=1, le=65535)
    # Reach ext_proc over this Unix domain socket (absolute path, as Envoy sees it; ext_proc's uds_path)
    # instead of ext_proc_address:ext_proc_port: for an ext_proc on Envoy's host, cheaper per message.
    ext_proc_uds_path: str | None = None
    ext_proc_message_timeout_ms: int = Field(200, ge=1, le=60000)
    # How long ext_proc may ask Envoy to wait for one answer (override_message_timeout): it does so for a
    # request queued in its fair admission queue. Keep it above ext_proc's fair_queue_max_wait_s.
    ext_proc_max_message_timeout_ms: int = Field(10_000, ge=1, le=3_600_000)
    # false: Envoy gets no ext_proc filter (routing on the control plane's weights alone).
    ext_proc_enabled: bool = True
    # ext_proc checks API keys (its own require_api_keys refuses requests without one). With this on,
    # Envoy never lets a request past ext_proc when ext_proc cannot be reached (failure_mode_allow off):
    # a request that skipped ext_proc would skip the key check. Run several ext_proc replicas.
    require_api_keys: bool = False
    max_request_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    request_timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0, le=10)
    health_check_interval_s: float = Field(1.0, gt=0)
    slow_start_window_s: float = Field(10.0, ge=0)
    # xDS node cluster of the ext_proc replicas: they get the EDS with telemetry metadata.
    ext_proc_node_cluster: str = Field("inferlb-ext-proc", min_length=1)
    # Envoy's access log: one JSON line per request (request_id, status, upstream, time) on its stdout.
    envoy_access_log: bool = True

    @model_validator(mode="after")
    def _paths(self) -> "DataPlaneConfig":
        if (self.listener_tls_cert is None) != (self.listener_tls_key is None):
            raise ValueError("listener_tls_cert and listener_tls_key go together: set both (HTTPS) or neither")
        for name in ("listener_tls_cert", "listener_tls_key", "ext_proc_uds_path"):
            value = getattr(self, name)
            if value is not None and not PurePosixPath(value).is_absolute():
                raise ValueError(f"{name} must be an absolute path (Envoy reads it on its own host), got {value!r}")
        if self.ext_proc_uds_path is not None and not fits_unix_socket(self.ext_proc_uds_path):
            raise ValueError(f"ext_proc_uds_path {self.ext_proc_uds_path!r} is too long for a Unix socket (at most "
                             f"{MAX_UNIX_SOCKET_PATH_BYTES} bytes)")
        return self

    def settings(self, env: Mapping[str, str] | None = None) -> DataPlaneSettings:
        """The resources' settings; Envoy traces when ``env`` (the process's environment unless given) turns
        OpenTelemetry on, to the same collector (ValueError for a bad OTEL_* variable)."""
        return DataPlaneSettings(
            tracing=envoy_tracing(os.environ if env is None else env),
            listener_address=self.listener_address,
            listener_port=self.listener_port,
            listener_tls_cert=self.listener_tls_cert,
            listener_tls_key=self.listener_tls_key,
            ext_proc=ExtProcSettings(
                address=self.ext_proc_address,
                port=self.ext_proc_port,
                uds_path=self.ext_proc_uds_path,
                message_timeout_ms=self.ext_proc_message_timeout_ms,
                max_message_timeout_ms=self.ext_proc_max_message_timeout_ms,
                max_request_body_bytes=self.max_request_body_bytes,
                failure_mode_allow=not self.require_api_keys,
                enabled=self.ext_proc_enabled,
            ),
            request_timeout_s=self.request_timeout_s,
            retries=self.retries,
            health_check_interval_s=self.health_check_interval_s,
            slow_start_window_s=self.slow_start_window_s,
            ext_proc_node_cluster=self.ext_proc_node_cluster,
            access_log=self.envoy_access_log,
        )


def envoy_tracing(env: Mapping[str, str]) -> EnvoyTracing | None:
    """Envoy's tracer from the OTEL_* variables (None: off). Envoy's exporter here is plaintext gRPC."""
    config = TracingConfig.from_env(env, EnvoyTracing.service_name)
    if config is None:
        return None
    if not config.endpoint.startswith("http://"):
        raise ValueError(f"OTLP endpoint {config.endpoint!r}: Envoy's tracer is configured for plaintext OTLP/gRPC "
                         "(http://host:port) only; put a collector without TLS next to Envoy")
    address, port = config.collector
    return EnvoyTracing(address, port, sampling_percent=config.sampling_percent)


# The node cluster of the Envoys (envoy/bootstrap.yaml's default, `inferlb up`, Compose, Kubernetes).
ENVOY_NODE_CLUSTER = "inferlb"


class XdsLimitsConfig(BaseModel):
    """How much one xDS client may take ([control_plane.xds_limits]; see ``xds/server.py``)."""

    model_config = ConfigDict(extra="forbid")

    keepalive_time_s: float = Field(30.0, gt=0)  # the server pings every connection this often
    keepalive_timeout_s: float = Field(10.0, gt=0)  # and closes one that does not answer within this
    max_connections: int = Field(1024, ge=1)
    max_concurrent_streams: int = Field(16, ge=1)  # per HTTP/2 connection: an excess stream is reset
    max_streams: int = Field(4096, ge=1)  # in all: RESOURCE_EXHAUSTED beyond
    max_streams_per_node: int = Field(4, ge=1)  # per node id: RESOURCE_EXHAUSTED beyond
    max_request_bytes: int = Field(1024 * 1024, ge=64 * 1024)
    inbound_buffer: int = Field(8, ge=1, le=1024)  # requests buffered per stream before reading pauses


class PoolAutoscaleConfig(BaseModel):
    """One pool's overrides of the autoscaling settings ([control_plane.autoscale.pools.NAME]); unset: global."""

    model_config = ConfigDict(extra="forbid")

    target_ongoing_requests: float | None = Field(None, gt=0)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_p99_latency_s: float | None = Field(None, gt=0)
    max_upscale_ratio: float | None = Field(None, ge=1)
    downscale_window_s: float | None = Field(None, ge=0)
    look_back_s: float | None = Field(None, ge=0)


class AutoscaleConfig(BaseModel):
    """The autoscaling signal ([control_plane.autoscale]; see ``autoscale.py``)."""

    model_config = ConfigDict(extra="forbid")

    target_ongoing_requests: float = Field(2.0, gt=0)
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(10, ge=1)
    target_p99_latency_s: float | None = Field(None, gt=0)
    max_upscale_ratio: float = Field(2.0, ge=1)
    downscale_window_s: float = Field(300.0, ge=0)
    look_back_s: float = Field(10.0, ge=0)  # ongoing requests are averaged over this many seconds
    # Per pool (Endpoint.pool, a Kubernetes name): overrides of the settings above, e.g. its own bounds.
    # Environment: INFERLB_CP_AUTOSCALE__POOLS__<NAME>__MAX_REPLICAS (names are lower-cased).
    pools: dict[str, PoolAutoscaleConfig] = Field(default_factory=dict)

    @field_validator("max_replicas")
    @classmethod
    def _max_not_below_min(cls, value: int, info: Any) -> int:
        if value < info.data.get("min_replicas", 0):
            raise ValueError(f"max_replicas ({value}) is below min_replicas ({info.data['min_replicas']})")
        return value

    @field_validator("pools", mode="before")
    @classmethod
    def _pool_names(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            for name in value:
                if not isinstance(name, str) or not POOL_PATTERN.match(name):
                    raise ValueError(f"pool name {name!r} must be a Kubernetes name: lower-case letters, digits "
                                     "and '-', at most 63, starting and ending with a letter or digit")
        return value

    @model_validator(mode="after")
    def _pool_settings_valid(self) -> "AutoscaleConfig":
        self.pool_settings()  # a pool whose merged settings are nonsense (min above max) is refused here
        return self

    def settings(self) -> AutoscaleSettings:
        return AutoscaleSettings(**self.model_dump(exclude={"pools"}))

    def pool_settings(self) -> dict[str, AutoscaleSettings]:
        """Each configured pool's settings: the global ones with the pool's overrides."""
        out = {}
        for name, pool in self.pools.items():
            try:
                out[name] = dataclasses.replace(self.settings(), **pool.model_dump(exclude_none=True))
            except ValueError as exc:
                raise ValueError(f"autoscale pool {name!r}: {exc}") from None
        return out


class ControlPlaneConfig(BaseSettings):
    # populate_by_name: ``store`` (an alias-only setting, below) is also set by its name (file, flag).
    model_config = SettingsConfigDict(env_prefix="INFERLB_CP_", env_nested_delimiter="__", extra="forbid",
                                      populate_by_name=True)

    xds_address: str = "127.0.0.1"
    xds_port: int = Field(18000, ge=1, le=65535)
    admin_address: str = "127.0.0.1"
    admin_port: int = Field(8080, ge=1, le=65535)
    # xDS: the node clusters served (any other node: PERMISSION_DENIED). Unset: the Envoys' (inferlb)
    # and ext_proc's (data_plane.ext_proc_node_cluster). Comma-separated in the environment.
    xds_allowed_node_clusters: Annotated[list[str] | None, NoDecode] = None
    # mTLS on the ADS server: its certificate chain and key, and the CA that signs the clients'
    # certificates (client certificates required). All three or none; none: plaintext.
    xds_tls_cert: Path | None = None
    xds_tls_key: Path | None = None
    xds_tls_client_ca: Path | None = None
    # Plaintext xDS on an address beyond loopback is refused unless this is set (then logged as a warning).
    xds_allow_plaintext: bool = False
    xds_limits: XdsLimitsConfig = Field(default_factory=XdsLimitsConfig)
    # HTTPS on the admin API: certificate chain and key (both or neither). Beyond loopback without
    # them the admin API (and its bearer token) would be plaintext: refused unless admin_allow_plaintext.
    admin_tls_cert: Path | None = None
    admin_tls_key: Path | None = None
    admin_allow_plaintext: bool = False
    # Static endpoints, host:port each (comma-separated in the environment).
    endpoints: Annotated[list[str], NoDecode] = Field(default_factory=list)
    scrape_interval_s: float = Field(0.5, gt=0)
    scrape_timeout_s: float = Field(1.0, gt=0)  # each scrape's total deadline, body included
    scrape_max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)  # a larger /metrics is a failed scrape
    unhealthy_after: int = Field(3, ge=1)
    stale_after_intervals: int = Field(4, ge=1)
    weight_policy: str = "capacity"
    weight_params: dict[str, Any] = Field(default_factory=dict)
    # module:attribute policies may be named (admin API, config, store) only under these module prefixes,
    # by whole dotted components; none by default. Weight policies are loaded here; a pick spec is checked
    # here and again by each ext_proc against its own list. Entry points (inferlb.policies) are always allowed.
    allowed_policy_modules: PolicyModules = Field(default_factory=list)
    debounce_s: float = Field(0.1, ge=0)
    debounce_max_s: float = Field(1.0, gt=0)
    node_group_key: Literal["cluster", "id"] = "cluster"
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    # NGINX as the data plane instead of Envoy ([control_plane.nginx], INFERLB_CP_NGINX__*; docs/nginx.md).
    nginx: NginxConfig = Field(default_factory=NginxConfig)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Operator state (control-plane.db) and the generated admin token (admin-token) live here.
    data_dir: Path = Field(default_factory=lambda: Path(os.environ.get("INFERLB_DATA_DIR", ".inferlb")))
    # The admin API's bearer token; INFERLB_ADMIN_TOKEN beats it; neither: <data_dir>/admin-token.
    admin_token: SecretStr | None = None
    # Reads (GET /v1/..., the dashboard's data) from loopback clients are open without the token unless this
    # is set (the default keeps `inferlb status`, the dashboard's feed and local scripts working); from any
    # other address, and for tenant data (/v1/api-keys, /v1/usage), they always need it.
    admin_auth_reads: bool = False
    # Host names the admin API answers besides localhost and IP addresses (a Service's DNS name, a public
    # name; '*' for any); any other Host gets 400 host_not_allowed (DNS rebinding). Comma-separated in the
    # environment (INFERLB_CP_ADMIN_ALLOWED_HOSTS).
    admin_allowed_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # DELETE /v1/endpoints/{id}: the longest a deregistered endpoint drains before it is removed.
    deregistration_drain_s: float = Field(10.0, ge=0, le=3600)
    # Discovery (control_plane/discovery). DNS: host:port each (comma-separated in the environment);
    # every A/AAAA record of host is an endpoint ip:port, re-resolved every discovery_interval_s.
    discovery_dns: Annotated[list[str], NoDecode] = Field(default_factory=list)
    discovery_interval_s: float = Field(5.0, gt=0)
    # Kubernetes: the EndpointSlices of this Service (namespace/name) are endpoints, at kubernetes_port
    # (a port name or number; None: each slice's only/first port). kubernetes_kubeconfig None: in-cluster,
    # else $KUBECONFIG or ~/.kube/config.
    kubernetes_service: str | None = None
    kubernetes_port: str | None = None
    kubernetes_kubeconfig: Path | None = None
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    # Shared operator state for several replicas: postgresql://user@host:port/db (INFERLB_STORE, the
    # issue's name, or INFERLB_CP_STORE). None: SQLite in data_dir, one process.
    store: str | None = Field(None, validation_alias=AliasChoices("INFERLB_STORE", "INFERLB_CP_STORE"))
    # With a shared store: the safety-net full reload of the operator state, besides LISTEN/NOTIFY.
    store_reload_interval_s: float = Field(30.0, gt=0)
    # Usage for billing (GET /v1/usage): per-minute buckets older than this are deleted.
    usage_retention_days: int = Field(90, ge=1, le=3650)

    @field_validator("xds_allowed_node_clusters")
    @classmethod
    def _valid_clusters(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(not c for c in value)):
            raise ValueError("xds_allowed_node_clusters must name at least one non-empty node cluster "
                             "(unset it for the default: the Envoys' and ext_proc's)")
        return value

    @model_validator(mode="after")
    def _transport_security(self) -> "ControlPlaneConfig":
        xds_tls = all_or_none({"xds_tls_cert": self.xds_tls_cert, "xds_tls_key": self.xds_tls_key,
                               "xds_tls_client_ca": self.xds_tls_client_ca})
        admin_tls = all_or_none({"admin_tls_cert": self.admin_tls_cert, "admin_tls_key": self.admin_tls_key})
        if not xds_tls and not self.xds_allow_plaintext and not is_loopback(self.xds_address):
            raise ValueError(f"xds_address {self.xds_address} is beyond loopback and xDS would be plaintext: "
                             "configure mTLS (xds_tls_cert, xds_tls_key, xds_tls_client_ca) or accept "
                             "plaintext explicitly with xds_allow_plaintext = true")
        if not admin_tls and not self.admin_allow_plaintext and not is_loopback(self.admin_address):
            raise ValueError(f"admin_address {self.admin_address} is beyond loopback and the admin API (and its "
                             "bearer token) would be plaintext: configure admin_tls_cert and admin_tls_key, or "
                             "accept plaintext explicitly with admin_allow_plaintext = true")
        return self

    @property
    def allowed_node_clusters(self) -> frozenset[str]:
        if self.xds_allowed_node_clusters is not None:
            return frozenset(self.xds_allowed_node_clusters)
        return frozenset({ENVOY_NODE_CLUSTER, self.data_plane.ext_proc_node_cluster})

    @property
    def policy_allowlist(self) -> PolicyAllowlist:
        return PolicyAllowlist(tuple(self.allowed_policy_modules))

    @field_validator("discovery_dns", mode="before")
    @classmethod
    def _split_dns(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in (p.strip() for p in value.split(",")) if part]
        return value

    @field_validator("discovery_dns")
    @classmethod
    def _valid_dns(cls, value: list[str]) -> list[str]:
        for text in value:
            parse_endpoint(text)
        return value

    @field_validator("kubernetes_service")
    @classmethod
    def _valid_service(cls, value: str | None) -> str | None:
        if value is not None:
            namespace, sep, name = value.partition("/")
            if not sep or not namespace or not name or "/" in name:
                raise ValueError(f"kubernetes_service {value!r} is not namespace/name")
        return value

    @field_validator("admin_allowed_hosts")
    @classmethod
    def _valid_hosts(cls, value: list[str]) -> list[str]:
        return [check_allowed_host(entry) for entry in value]

    @field_validator("endpoints", "xds_allowed_node_clusters", "admin_allowed_hosts", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part for part in (p.strip() for p in value.split(",")) if part]
        return value

    @field_validator("endpoints")
    @classmethod
    def _valid_endpoints(cls, value: list[str]) -> list[str]:
        seen = set()
        for text in value:
            host, port = parse_endpoint(text)
            if (host, port) in seen:
                raise ValueError(f"endpoint {text!r} is listed twice")
            seen.add((host, port))
        return value

    @model_validator(mode="after")
    def _tls_needs_envoy(self) -> "ControlPlaneConfig":
        if self.nginx.enabled and self.data_plane.listener_tls_cert is not None:
            raise ValueError("data_plane.listener_tls_cert/key configure Envoy's listener; the NGINX data plane "
                             "does not terminate TLS (unset them, or use the Envoy data plane)")
        return self

    @property
    def stale_after_s(self) -> float:
        return self.scrape_interval_s * self.stale_after_intervals


def load_config(config_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> ControlPlaneConfig:
    """Merge defaults < the file's [control_plane] table < environment < flags; pydantic's ValidationError says what is wrong."""
    return load_layered(ControlPlaneConfig, "control_plane", config_file, overrides)
