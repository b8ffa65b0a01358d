"""The NGINX data plane's values: its settings, one upstream server line, one rendered config."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MAIN_FILE = "nginx.conf"
UPSTREAMS_FILE = "inferlb-upstreams.conf"
EXTRA_FILE = "inferlb-extra.conf"
UPSTREAM_NAME = "inferlb_workers"
# nginx refuses an upstream without servers: this one stands in, marked down, while none is known.
PLACEHOLDER_SERVER = "127.0.0.1:1"


@dataclass(frozen=True)
class NginxSettings:
    """Resolved settings (see ``config.NginxConfig`` for what each one means)."""

    config_dir: Path
    listen_address: str = "127.0.0.1"
    listen_port: int = 10000
    binary: str = "nginx"
    manage_process: bool = True
    pid_file: Path | None = None
    min_reload_interval_s: float = 2.0
    debounce_s: float = 0.5
    weight_levels: int = 20
    hysteresis: float = 0.3
    max_fails: int = 3
    fail_timeout_s: int = 10
    keepalive: int = 32
    keepalive_timeout_s: float = 60.0
    connect_timeout_s: float = 1.0
    read_timeout_s: float = 60.0
    send_timeout_s: float = 60.0
    next_upstream_tries: int = 3
    worker_processes: int = 1
    worker_connections: int = 1024
    client_max_body_bytes: int = 4 * 1024 * 1024
    access_log: bool = False
    extra_directives: str = ""
    extra_directives_file: Path | None = None
    stop_timeout_s: float = 30.0

    @property
    def main_path(self) -> Path:
        return self.config_dir / MAIN_FILE

    @property
    def pid_path(self) -> Path:
        return self.pid_file or self.config_dir / "nginx.pid"


@dataclass(frozen=True)
class UpstreamServer:
    """One ``server`` line: an endpoint with its nginx weight, or ``down`` (drained, unhealthy, weight 0)."""

    endpoint_id: str
    weight: int
    down: bool = False
    pinned: bool = False


@dataclass(frozen=True)
class RenderedConfig:
    """A complete nginx configuration: file name -> text, plus the upstream it describes.

    The same bytes are validated (in a staging directory) and then applied, so
    ``digest`` identifies exactly what nginx runs.
    """

    files: Mapping[str, str]
    servers: tuple[UpstreamServer, ...]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            h.update(name.encode() + b"\0" + self.files[name].encode() + b"\0")
        return h.hexdigest()

    @property
    def weights(self) -> dict[str, int]:
        """endpoint id -> nginx weight, routable servers only (the hysteresis' memory)."""
        return {s.endpoint_id: s.weight for s in self.servers if not s.down}

    @property
    def routable(self) -> bool:
        return any(not s.down for s in self.servers)
