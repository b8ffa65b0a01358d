"""NGINX's own balancer (``nginx_least_conn``): a rendered config, run from a temp prefix.

``least_conn`` over the fleet with upstream keep-alive, as NGINX's docs
recommend for an HTTP upstream (``keepalive`` in the upstream block needs
``proxy_http_version 1.1`` and an empty ``Connection`` header). No retries
(``proxy_next_upstream off``), the same timeout as every other configuration.
Every path (pid, logs, temp files) lives under the prefix, so it needs no
system directories; ``nginx -t`` checks the file before the bench starts it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

NGINX = "/usr/sbin/nginx"

# Idle upstream connections kept per worker process: above the fleet's usual concurrency, so that
# steady load does not open a connection per request.
KEEPALIVE = 64
TEMP_DIRS = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")


def render_nginx_conf(
    *,
    endpoints: Sequence[tuple[str, int]],
    listen_port: int,
    prefix: Path,
    request_timeout_s: float,
    keepalive: int = KEEPALIVE,
    worker_processes: int = 1,
    run_as_root: bool | None = None,
) -> str:
    """nginx.conf text. ``run_as_root`` (default: whether we are root): worker processes stay root,
    since the default ``nobody`` could not write the temp dirs a root-owned prefix holds."""
    if not endpoints:
        raise ValueError("nginx needs at least one upstream server")
    if keepalive < 1:
        raise ValueError(f"keepalive must be >= 1, got {keepalive}")
    root = (os.geteuid() == 0) if run_as_root is None else run_as_root
    p = prefix.resolve()
    timeout = f"{request_timeout_s:g}s"
    servers = "\n".join(f"        server {host}:{port};" for host, port in endpoints)
    temp = "\n".join(f"    {name}_temp_path {p / 'temp' / name};" for name in TEMP_DIRS)
    user = "user root;\n" if root else ""
    return f"""# Rendered by inferlb bench (inferlb/bench/stack/dataplanes/nginx.py).
{user}worker_processes {worker_processes};
daemon off;
master_process on;
pid {p / 'nginx.pid'};
error_log {p / 'logs' / 'error.log'} warn;

events {{
    worker_connections 4096;
}}

http {{
    access_log off;
{temp}

    upstream workers {{
        least_conn;
{servers}
        keepalive {keepalive};
    }}

    server {{
        listen 127.0.0.1:{listen_port};
        location / {{
            proxy_pass http://workers;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_next_upstream off;
            proxy_connect_timeout 1s;
            proxy_send_timeout {timeout};
            proxy_read_timeout {timeout};
        }}
    }}
}}
"""


def prefix_directories(prefix: Path) -> tuple[Path, ...]:
    """The directories the rendered config names (they must exist before nginx starts)."""
    return (prefix / "logs", *(prefix / "temp" / name for name in TEMP_DIRS))


def prepare_prefix(prefix: Path) -> None:
    for directory in prefix_directories(prefix):
        directory.mkdir(parents=True, exist_ok=True)


def nginx_argv(conf: Path, prefix: Path, *, test: bool = False, binary: str = NGINX) -> list[str]:
    """``nginx -p PREFIX -c CONF -e LOG`` (``-e``: errors before the config is read go there too)."""
    argv = [binary, "-p", str(prefix.resolve()), "-c", str(conf.resolve()),
            "-e", str((prefix / "logs" / "error.log").resolve())]
    return [*argv, "-t"] if test else argv
