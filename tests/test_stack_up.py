"""`inferlb up` as a user runs it (a subprocess): readiness order, a working curl, `inferlb status`,
crash restarts, in-flight requests finishing on Ctrl-C, and no process or port left behind.
Both data planes: Envoy (ext_proc picks) and NGINX (run by the control plane)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest

from .conftest import ROOT, free_port, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy]


@dataclass
class Up:
    """A running `inferlb up` and the ports it was given."""

    process: subprocess.Popen[bytes]
    out_path: Path
    data_dir: Path
    ports: dict[str, int]

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['listener']}/v1/embeddings"

    def status(self, *flags: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--data-dir", str(self.data_dir),
                               *flags], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _free_consecutive_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (workers get --base-port, +1, ...)."""
    def bindable(port: int) -> bool:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the workers bind (free_port reserves p)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    return wait_until(lambda: (p := free_port()) + count <= 65535 and all(bindable(p + i) for i in range(count))
                      and p, 10, f"{count} consecutive free ports")


@contextmanager
def inferlb_up(data_dir: Path, tmp_path: Path, *args: str, workers: int = 1) -> Iterator[Up]:
    """`python -m inferlb.cli up` on free ports; waits for "inferlb is up"; always stopped and reaped."""
    ports = {name: free_port() for name in ("listener", "envoy-admin", "xds", "admin", "ext-proc",
                                            "ext-proc-metrics")}
    ports["worker"] = _free_consecutive_ports(workers)
    out_path = tmp_path / "up.out"
    argv = [sys.executable, "-m", "inferlb.cli", "up", "--workers", str(workers), "--base-port", str(ports["worker"]),
            "--data-dir", str(data_dir), *args]
    for name in ("listener", "envoy-admin", "xds", "admin", "ext-proc", "ext-proc-metrics"):
        argv += [f"--{name}-port", str(ports[name])]
    with open(out_path, "wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "INFERLB_DATA_DIR": str(data_dir)},
                                   stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    up = Up(process, out_path, data_dir, ports)
    try:
        wait_until(lambda: "inferlb is up" in up.output() or process.poll() is not None, 180, "the stack to come up")
        assert process.poll() is None, up.output()
        yield up
    except BaseException:
        sys.stderr.write(f"\n----- inferlb up output -----\n{up.output()}\n")
        raise
    finally:
        if process.poll() is None:
            for child in up.descendants():
                child.kill()
            process.kill()
        process.wait(30)


def _stop_and_check_nothing_is_left(up: Up, *, port_names: tuple[str, ...]) -> None:
    descendants = up.descendants()
    assert descendants
    up.process.send_signal(signal.SIGINT)  # what Ctrl-C sends
    assert up.process.wait(60) == 0, up.output()
    left = [p for p in descendants if not _gone(p)]
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
    open_ports = [name for name in port_names if _port_open(up.ports[name])]
    assert not open_ports, f"ports still listening: {open_ports}"
    assert "[stopped] control-plane exit 0" in up.output()


def _sim_speed(port: int, speed: float) -> None:
    response = httpx.put(f"http://127.0.0.1:{port}/v1/simulation", json={"speed": speed}, timeout=5)
    response.raise_for_status()


def test_up_simulated_status_in_flight_request_survives_ctrl_c_and_nothing_is_left(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with inferlb_up(data_dir, tmp_path, "--simulate") as up:
        output = up.output()
        assert f"curl -s http://127.0.0.1:{up.ports['listener']}/v1/embeddings" in output
        # readiness order, one line per state change
        order = [output.index(f"[ready] {name}") for name in
                 (f"worker:{up.ports['worker']}", "control-plane", "ext_proc", "envoy")]
        assert order == sorted(order)
        logs = {path.name for path in (data_dir / "logs").iterdir()}
        assert logs == {f"worker-{up.ports['worker']}.log", "control-plane.log", "ext_proc.log", "envoy.log"}

        # `inferlb status`: every component, ready, with its pid
        status = up.status("--json")
        assert status.returncode == 0, status.stdout + status.stderr
        doc = json.loads(status.stdout)
        pids = {c["name"]: c["pid"] for c in doc["components"]}
        children = {p.pid for p in psutil.Process(up.process.pid).children()}
        assert set(pids) == {f"worker:{up.ports['worker']}", "control-plane", "ext_proc", "envoy"}
        assert set(pids.values()) == children
        assert all(c["state"] == "ready" and c["answers"] for c in doc["components"])
        table = up.status()
        assert table.returncode == 0 and "envoy" in table.stdout and "ready" in table.stdout

        # a second `inferlb up` on the same data directory is refused
        second = subprocess.run([sys.executable, "-m", "inferlb.cli", "up", "--simulate", "--data-dir",
                                 str(data_dir)], cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
        assert second.returncode == 2
        assert f"already running on {data_dir} (pid {up.process.pid})" in second.stderr

        # the curl the summary printed works
        assert httpx.post(up.url, json={"input": ["The cat sits on the mat."]}, timeout=30).status_code == 200

        # a request in flight when Ctrl-C arrives still completes
        _sim_speed(up.ports["worker"], 0.0005)  # "hi" takes about 2.7 s now
        result: dict[str, object] = {}

        def send() -> None:
            try:
                result["r"] = httpx.post(up.url, json={"input": "hi"}, timeout=60)
            except httpx.HTTPError as exc:  # e.g. Envoy stopped under it
                result["r"] = exc

        in_flight = threading.Thread(target=send)
        in_flight.start()
        try:
            wait_until(lambda: 'inferlb_worker_inflight_requests 1.0' in
                       httpx.get(f"http://127.0.0.1:{up.ports['worker']}/metrics", timeout=5).text,
                       30, "the slow request to reach the worker")
            _stop_and_check_nothing_is_left(up, port_names=("listener", "envoy-admin", "xds", "admin", "ext-proc",
                                                            "ext-proc-metrics", "worker"))
        finally:
            in_flight.join(60)
        response = result.get("r")
        assert isinstance(response, httpx.Response), f"the in-flight request failed: {response!r}"
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["embedding"]
        stopping = up.output().split("stopping:", 1)[1]
        order = [stopping.index(f"[stopped] {name}") for name in
                 ("envoy", "ext_proc", "control-plane", f"worker:{up.ports['worker']}")]
        assert order == sorted(order)  # reverse start order

    after = subprocess.run([sys.executable, "-m", "inferlb.cli", "status", "--data-dir", str(data_dir)],
                           cwd=ROOT, capture_output=True, text=True, check=False, timeout=60)
    assert after.returncode == 3
    assert "no inferlb stack is running" in after.stdout


@pytest.mark.nginx
def test_up_with_the_nginx_dataplane_serves_and_leaves_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with inferlb_up(data_dir, tmp_path, "--simulate", "--dataplane", "nginx", workers=2) as up:
        output = up.output()
        assert "no ext_proc pick" in output
        assert "[ready] envoy" not in output and "[starting] ext_proc" not in output
        assert f"curl -s http://127.0.0.1:{up.ports['listener']}/v1/embeddings" in output
        response = httpx.post(up.url, json={"input": ["The cat sits on the mat."]}, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["data"][0]["embedding"]
        assert "server: nginx" in "\n".join(f"{k}: {v}" for k, v in response.headers.items()).lower()

        status = up.status("--json")
        assert status.returncode == 0, status.stdout + status.stderr
        doc = json.loads(status.stdout)
        assert doc["dataplane"] == "nginx"
        assert {c["name"] for c in doc["components"]} == {
            f"worker:{up.ports['worker']}", f"worker:{up.ports['worker'] + 1}", "control-plane"}
        # the control plane runs nginx (master and workers) under this stack, on a config in its data dir
        nginx = [p for p in up.descendants() if p.name() == "nginx"]
        assert len(nginx) >= 2, [p.cmdline() for p in up.descendants()]
        assert any(str(data_dir) in " ".join(p.cmdline()) for p in nginx)
        _stop_and_check_nothing_is_left(up, port_names=("listener", "xds", "admin", "worker"))
        assert all(_gone(p) for p in nginx), "nginx processes left behind"
    assert up.status().returncode == 3


def test_up_serves_reference_embeddings_restarts_crashes_and_stops_cleanly(
    data_dir: Path, tmp_path: Path, reference: dict
) -> None:
    """The real model end to end (the `make up` path): ext_proc counts tokens exactly; a killed worker is
    reported, restarted with backoff and shown in `inferlb status`; SIGTERM stops everything."""
    with inferlb_up(data_dir, tmp_path) as up:
        port = up.ports["worker"]
        item = reference["items"][0]
        response = httpx.post(up.url, json={"input": item["text"]}, timeout=60)  # Envoy -> ext_proc -> worker
        doc = response.json()
        assert response.headers["x-inferlb-endpoint"] == f"127.0.0.1:{port}"  # ext_proc picked it
        assert response.headers["x-inferlb-counted-tokens"] == str(item["tokens_with_special"])
        got, want = np.array(doc["data"][0]["embedding"]), np.array(item["embedding"])
        assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) >= 0.99

        supervisor = psutil.Process(up.process.pid)

        def worker_children() -> list[psutil.Process]:
            return [c for c in supervisor.children() if "workers" in c.cmdline()]

        (first,) = worker_children()
        children = supervisor.children()
        assert len(children) == 4  # worker, control plane, ext_proc, Envoy
        first.kill()
        wait_until(lambda: f"[crashed] worker:{port} exit -9; restarting in 1s (attempt 1" in up.output(), 30,
                   "the crash to be reported")
        wait_until(lambda: [c.pid for c in worker_children()] not in ([], [first.pid]) and _ready(port),
                   180, "the worker to be restarted")
        (second,) = worker_children()
        assert second.pid != first.pid
        wait_until(lambda: httpx.post(up.url, json={"input": "again"}, timeout=60).status_code == 200, 60,
                   "traffic through Envoy to the restarted worker")
        status = wait_until(lambda: (s := up.status()).returncode == 0 and s, 60, "status to say ready again")
        assert "ready (crashed 1 time)" in status.stdout
        assert str(second.pid) in status.stdout

        up.process.send_signal(signal.SIGTERM)
        assert up.process.wait(60) == 0, up.output()
        for child in [second, *children]:
            assert _gone(child)
        assert not _ready(port)
        assert "[stopped] envoy exit 0" in up.output()


def test_up_with_required_api_keys_refuses_without_one_and_its_printed_commands_work(tmp_path: Path) -> None:
    """`inferlb up --require-api-keys`: 401 without a key; the summary's commands issue one and use it."""
    with inferlb_up(tmp_path / "data", tmp_path, "--simulate", "--require-api-keys") as up:
        refused = httpx.post(up.url, json={"input": "hi"}, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        script = up.output().split("Try it (API keys required: 401 without one):\n", 1)[1].split("\n\n", 1)[0]
        assert "/v1/api-keys" in script

        def run_script() -> str | None:  # retried: a fresh key reaches ext_proc with the next push (ms)
            ran = subprocess.run(["bash", "-c", f"set -e -o pipefail\n{script}"], capture_output=True, text=True,
                                 timeout=60, check=False, env={**os.environ, "NO_PROXY": "*"})
            return ran.stdout if ran.returncode == 0 and '"embedding"' in ran.stdout else None
        answer = wait_until(run_script, 30, "the printed commands to issue a key and embed with it")
        assert json.loads(answer)["data"][0]["embedding"]
