"""Shared fixtures: the reference data, the model cache, and real worker processes.

Every process a test starts is stopped by the fixture that started it, on
success or failure alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from inferlb.bench.processes import free_port  # noqa: F401 - tests import it from here

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture(scope="session")
def reference() -> dict:
    return json.loads((FIXTURES / "minilm_reference.json").read_text())


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache: ``$INFERLB_DATA_DIR`` (set by the Makefile) so runs reuse it."""
    configured = os.environ.get("INFERLB_DATA_DIR")
    return Path(configured) if configured else tmp_path_factory.mktemp("inferlb-data")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def _ready(url: str, process: subprocess.Popen[bytes], log_path: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"worker exited with {process.returncode}:\n{log_path.read_text()}")
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def running_worker(data_dir: Path, tmp_path: Path, *args: str) -> Iterator[WorkerProcess]:
    """Start ``python -m workers`` on a free loopback port and wait until it is ready."""
    port = free_port()
    log_path = tmp_path / f"worker-{port}.log"
    env = {**os.environ, "INFERLB_DATA_DIR": str(data_dir)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "workers", "--port", str(port), *args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _ready(url, process, log_path), 120, "the worker to become ready")
        yield WorkerProcess(process, url, log_path)
    finally:
        stop_process(process)


@pytest.fixture(scope="module")
def worker(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One real int8 worker shared by a test module."""
    with running_worker(data_dir, tmp_path_factory.mktemp("worker")) as w:
        yield w
