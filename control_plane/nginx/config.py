"""``[control_plane.nginx]`` / ``INFERLB_CP_NGINX__*``: the NGINX data plane's settings.

The pydantic model validates what the operator wrote; ``settings()`` resolves it
(paths, the listener that falls back to Envoy's, the binary) into the frozen
``NginxSettings`` the renderer and the applier use.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from ..model import DataPlaneSettings
from .model import NginxSettings


def default_binary() -> str:
    """``nginx`` on PATH, else Debian's /usr/sbin/nginx (root's PATH has it; a user's often does not)."""
    return shutil.which("nginx") or "/usr/sbin/nginx"


class NginxConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = False
    # nginx.conf, the includes, nginx.pid, error.log and temp dirs; default <data_dir>/nginx.
    config_dir: Path | None = None
    # The proxy's listener; unset: the data plane's (Envoy's) listener_address / listener_port.
    listen_address: str | None = None
    listen_port: int | None = Field(None, ge=1, le=65535)
    binary: str = Field(default_factory=default_binary, min_length=1)
    # True: the control plane runs nginx as its child and stops it on exit.
    # False: an nginx started elsewhere with -p <config_dir> -c <config_dir>/nginx.conf; reloaded through pid_file.
    manage_process: bool = True
    pid_file: Path | None = None  # default <config_dir>/nginx.pid
    # Rate limiting: a reload resets nginx's balancing state and starts new worker processes.
    min_reload_interval_s: float = Field(2.0, ge=0)
    debounce_s: float = Field(0.5, ge=0)
    # Weights map to nginx's integer weight= 1..weight_levels, relative to the heaviest routable endpoint;
    # a computed weight moves to another level only when it is more than `hysteresis` of a level past the edge.
    weight_levels: int = Field(20, ge=1, le=1000)
    hysteresis: float = Field(0.3, ge=0, le=5)
    # Passive health: after max_fails failed attempts within fail_timeout the server rests for fail_timeout.
    max_fails: int = Field(3, ge=0)
    fail_timeout_s: int = Field(10, ge=1)  # whole seconds: nginx takes no fraction here
    keepalive: int = Field(32, ge=0)  # idle upstream connections cached per nginx worker process (0: none)
    keepalive_timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(1.0, gt=0)
    read_timeout_s: float = Field(60.0, gt=0)
    send_timeout_s: float = Field(60.0, gt=0)
    next_upstream_tries: int = Field(3, ge=1, le=10)
    worker_processes: int = Field(1, ge=1, le=64)
    worker_connections: int = Field(1024, ge=16)
    client_max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    access_log: bool = False
    # Operator directives in the proxy's `location /`: inline, and a file re-read while running.
    extra_directives: str = ""
    extra_directives_file: Path | None = None
    stop_timeout_s: float = Field(30.0, gt=0)

    def settings(self, data_dir: Path, data_plane: DataPlaneSettings) -> NginxSettings:
        config_dir = (self.config_dir or data_dir / "nginx").absolute()
        return NginxSettings(
            config_dir=config_dir,
            listen_address=self.listen_address or data_plane.listener_address,
            listen_port=self.listen_port or data_plane.listener_port,
            binary=self.binary,
            manage_process=self.manage_process,
            pid_file=(self.pid_file or config_dir / "nginx.pid").absolute(),
            min_reload_interval_s=self.min_reload_interval_s,
            debounce_s=self.debounce_s,
            weight_levels=self.weight_levels,
            hysteresis=self.hysteresis,
            max_fails=self.max_fails,
            fail_timeout_s=self.fail_timeout_s,
            keepalive=self.keepalive,
            keepalive_timeout_s=self.keepalive_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            send_timeout_s=self.send_timeout_s,
            next_upstream_tries=self.next_upstream_tries,
            worker_processes=self.worker_processes,
            worker_connections=self.worker_connections,
            client_max_body_bytes=self.client_max_body_bytes,
            access_log=self.access_log,
            extra_directives=self.extra_directives,
            extra_directives_file=self.extra_directives_file.absolute() if self.extra_directives_file else None,
            stop_timeout_s=self.stop_timeout_s,
        )
