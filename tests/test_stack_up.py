"""`inferlb up`: starts workers, control plane and Envoy by readiness, serves through Envoy,
restarts a crashed worker, and stops everything on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from .conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.slow


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def test_up_serves_reference_embeddings_restarts_crashes_and_stops_cleanly(
    data_dir: Path, tmp_path: Path, reference: dict
) -> None:
    port, listener, envoy_admin, xds, admin, ext_proc, ext_proc_metrics = (free_port() for _ in range(7))
    out_path = tmp_path / "up.out"
    env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
    with open(out_path, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "inferlb.cli", "up", "--workers", "1", "--base-port", str(port),
             "--data-dir", str(data_dir), "--listener-port", str(listener), "--envoy-admin-port", str(envoy_admin),
             "--xds-port", str(xds), "--admin-port", str(admin), "--ext-proc-port", str(ext_proc),
             "--ext-proc-metrics-port", str(ext_proc_metrics)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    supervisor = psutil.Process(up.pid)
    try:
        wait_until(lambda: "inferlb is up" in out_path.read_text(), 180, "the stack to come up")
        assert f"curl -s http://127.0.0.1:{listener}/v1/embeddings" in out_path.read_text()

        item = reference["items"][0]
        url = f"http://127.0.0.1:{listener}/v1/embeddings"
        response = httpx.post(url, json={"input": item["text"]}, timeout=60)  # Envoy -> ext_proc -> worker
        doc = response.json()
        assert response.headers["x-inferlb-endpoint"] == f"127.0.0.1:{port}"  # ext_proc picked it
        assert response.headers["x-inferlb-counted-tokens"] == str(item["tokens_with_special"])
        got, want = np.array(doc["data"][0]["embedding"]), np.array(item["embedding"])
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.99

        def worker_children() -> list[psutil.Process]:
            return [c for c in supervisor.children() if "workers" in c.cmdline()]

        (first,) = worker_children()
        children = supervisor.children()
        assert len(children) == 4  # worker, control plane, ext_proc, Envoy
        first.kill()
        wait_until(lambda: "CRASHED" in out_path.read_text(), 30, "the crash to be reported")
        wait_until(lambda: [c.pid for c in worker_children()] not in ([], [first.pid]) and _ready(port),
                   180, "the worker to be restarted")
        (second,) = worker_children()
        assert second.pid != first.pid
        wait_until(lambda: httpx.post(url, json={"input": "again"}, timeout=60).status_code == 200, 60,
                   "traffic through Envoy to the restarted worker")

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, out_path.read_text()
        for child in [second, *children]:
            assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert not _ready(port)
        assert "stopped" in out_path.read_text()
    finally:
        for child in supervisor.children(recursive=True) if up.poll() is None else []:
            child.kill()
        if up.poll() is None:
            up.kill()
            up.wait()
