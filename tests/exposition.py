"""The stack every service's /metrics is read from, after traffic that makes the per-model, per-tenant and
cache families appear; and promtool (Debian's prometheus package). Shared by the promtool check
(tests/test_metrics_promtool.py) and the check that the Grafana dashboard and alert rules name only metrics
the services export (tests/test_grafana.py)."""

from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .conftest import need, which
from .stack import Gateway, http, running_gateway

MODELS = "all-MiniLM-L6-v2-int8,all-MiniLM-L6-v2-fp32"


def run_promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    need("promtool")  # skipped, or failed under make test, naming what is missing (tests/conftest.py)
    binary = which("promtool")
    assert binary is not None
    return subprocess.run([binary, *args], input=stdin, capture_output=True, text=True, timeout=60)


def scrape(url: str) -> str:
    with http() as client:
        response = client.get(url)
    assert response.status_code == 200, response.text
    return response.text


@contextmanager
def exercised_gateway(log_dir: Path, name: str) -> Iterator[Gateway]:
    """Two simulated workers serving both MiniLM versions, the gateway cache on, and a few requests through
    Envoy: a cache miss then a hit, each version, an alias, an unknown model and the default."""
    with running_gateway(log_dir, workers=2, worker_args=("--models", MODELS), name=name,
                         ext_proc_env={"INFERLB_EXT_PROC_CACHE_MAX_BYTES": str(1 << 20)}) as gw:
        with http() as client:
            # fp32 twice: a gateway-cache miss, then a hit.
            for model in ("all-MiniLM-L6-v2-fp32", "all-MiniLM-L6-v2-fp32", "all-MiniLM-L6-v2", "no-such-model",
                          None):
                body = {"input": "count me"} | ({"model": model} if model else {})
                client.post(gw.url(), json=body)
            client.get(gw.url("/v1/models"))
        yield gw
