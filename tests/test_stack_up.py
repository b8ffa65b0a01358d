"""`inferlb up`: starts workers by readiness, restarts a crashed one, stops everything on SIGTERM."""

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
    port = free_port()
    out_path = tmp_path / "up.out"
    env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
    with open(out_path, "wb") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "inferlb.cli", "up", "--workers", "1", "--base-port", str(port),
             "--data-dir", str(data_dir)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    supervisor = psutil.Process(up.pid)
    try:
        wait_until(lambda: "inferlb is up" in out_path.read_text(), 180, "the stack to come up")
        assert f"curl -s http://127.0.0.1:{port}/v1/embeddings" in out_path.read_text()

        item = reference["items"][0]
        doc = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"input": item["text"]}, timeout=60).json()
        got, want = np.array(doc["data"][0]["embedding"]), np.array(item["embedding"])
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.99

        (first,) = supervisor.children()
        first.kill()
        wait_until(lambda: "CRASHED" in out_path.read_text(), 30, "the crash to be reported")
        wait_until(lambda: [c.pid for c in supervisor.children()] not in ([], [first.pid]) and _ready(port),
                   180, "the worker to be restarted")
        (second,) = supervisor.children()
        assert second.pid != first.pid

        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0, out_path.read_text()
        assert not second.is_running() or second.status() == psutil.STATUS_ZOMBIE
        assert not _ready(port)
        assert "stopped" in out_path.read_text()
    finally:
        for child in supervisor.children(recursive=True) if up.poll() is None else []:
            child.kill()
        if up.poll() is None:
            up.kill()
            up.wait()
