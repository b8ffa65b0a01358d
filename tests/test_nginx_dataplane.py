"""NGINX mode on the real wire: a real nginx, run and reloaded by the real control plane, in front of
simulated workers (``python -m workers --simulate``).

Counts come from the workers' own ``inferlb_worker_requests_total`` and nginx's ``X-Inferlb-Upstream``
header; reloads from ``GET /v1/dataplane`` and ``/metrics``. Shares are asserted with wide bands, never
timings. Every process (the nginx master and its workers included) is gone at the end.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from .conftest import free_port
from .stack import (
    ControlPlane,
    SimWorker,
    http,
    prometheus_samples,
    running_control_plane,
    running_sim_workers,
    sample,
    wait_for,
)

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.nginx]

MIN_RELOAD_INTERVAL_S = 1.0
BODY = {"input": "hello nginx", "model": "all-MiniLM-L6-v2"}


def nginx_env(extra_file: Path, **more: str) -> dict[str, str]:
    return {
        "INFERLB_CP_NGINX__ENABLED": "true",
        "INFERLB_CP_NGINX__MIN_RELOAD_INTERVAL_S": str(MIN_RELOAD_INTERVAL_S),
        "INFERLB_CP_NGINX__DEBOUNCE_S": "0.1",
        "INFERLB_CP_NGINX__EXTRA_DIRECTIVES_FILE": str(extra_file),
        **more,
    }


def nginx_processes(config_dir: Path) -> list[psutil.Process]:
    """nginx masters started on ``config_dir`` and their workers (whose command lines do not name it)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(config_dir) in " ".join(p.info["cmdline"] or ()):
                found += [p, *p.children()]
        except psutil.Error:
            pass
    return found


@contextmanager
def nginx_stack(tmp_path: Path, workers: list[SimWorker], **env: str) -> Iterator[ControlPlane]:
    """The control plane in NGINX mode; afterwards no nginx process of its config dir (or child of it) is left."""
    extra = tmp_path / "extra.conf"
    extra.write_text("")
    seen: set[psutil.Process] = set()
    data_dir = tmp_path / "cp-data"
    try:
        with running_control_plane(tmp_path, endpoints=[w.id for w in workers], weight_policy="equal",
                                   data_dir=data_dir, env=nginx_env(extra, **env)) as cp:
            seen.update(nginx_processes(data_dir / "nginx"))
            yield cp
            seen.update(nginx_processes(data_dir / "nginx"))
    finally:
        _, alive = psutil.wait_procs(list(seen), timeout=15)
        assert not alive, f"nginx processes left behind: {alive}"
        assert not nginx_processes(data_dir / "nginx")


def dataplane(cp: ControlPlane) -> dict[str, Any]:
    with http() as client:
        response = client.get(f"{cp.admin_url}/v1/dataplane")
        response.raise_for_status()
        body = response.json()
    assert body["mode"] == "nginx"
    return body["nginx"]


def admin(cp: ControlPlane, method: str, path: str, body: dict | None = None) -> httpx.Response:
    with http() as client:
        response = client.request(method, f"{cp.admin_url}{path}", json=body,
                                  headers={"authorization": f"Bearer {cp.admin_token()}"})
    assert response.status_code < 300, response.text
    return response


def applied_weights(cp: ControlPlane) -> dict[str, int]:
    return {s["endpoint"]: (0 if s["down"] else s["weight"]) for s in dataplane(cp)["servers"]}


def wait_applied(cp: ControlPlane, expected: dict[str, int]) -> dict[str, Any]:
    """Until nginx runs exactly ``expected`` (endpoint -> weight, 0 down) and nothing is pending."""
    def done() -> dict[str, Any] | None:
        status = dataplane(cp)
        got = {s["endpoint"]: (0 if s["down"] else s["weight"]) for s in status["servers"]}
        return status if got == expected and not status["pending"] and status["running"] else None
    return wait_for(done, 30, lambda: f"nginx to run {expected}; status {dataplane(cp)}", [cp.proc])


def worker_requests(worker: SimWorker) -> float:
    with http() as client:
        text = client.get(f"{worker.url}/metrics").text
    return sample(prometheus_samples(text), "inferlb_worker_requests_total", code="200") or 0.0


def send(cp: ControlPlane, count: int) -> tuple[Counter, list[httpx.Response]]:
    """``count`` sequential requests through nginx: 200s by the upstream nginx names."""
    upstreams: Counter = Counter()
    responses = []
    with http() as client:
        for _ in range(count):
            response = client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings", json=BODY)
            assert response.status_code == 200, response.text
            upstreams[response.headers["x-inferlb-upstream"]] += 1
            responses.append(response)
    return upstreams, responses


def share_through_workers(cp: ControlPlane, workers: list[SimWorker], count: int) -> dict[str, float]:
    """Each worker's share of ``count`` requests, counted by the workers themselves (and nginx agrees)."""
    before = {w.id: worker_requests(w) for w in workers}
    upstreams, _ = send(cp, count)
    served = {w.id: worker_requests(w) - before[w.id] for w in workers}
    assert sum(served.values()) == count
    assert dict(upstreams) == {k: v for k, v in served.items() if v}
    return {k: v / count for k, v in served.items()}


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimWorker]]:
    with running_sim_workers(tmp_path_factory.mktemp("nginx-workers"), 2, speed=50.0) as ws:
        yield ws


def test_traffic_share_follows_the_pinned_weights_and_moves_after_a_reload(
        tmp_path: Path, workers: list[SimWorker]) -> None:
    a, b = workers
    with nginx_stack(tmp_path, workers) as cp:
        assert dataplane(cp)["version"] >= 1 and dataplane(cp)["running"]
        admin(cp, "PUT", f"/v1/endpoints/{a.id}/weight", {"weight": 300})
        admin(cp, "PUT", f"/v1/endpoints/{b.id}/weight", {"weight": 100})
        reloads = wait_applied(cp, {a.id: 20, b.id: 7})["reloads"]
        assert reloads >= 1
        share = share_through_workers(cp, workers, 81)
        assert 0.6 <= share[a.id] <= 0.9, share  # 20:7 is 74%

        admin(cp, "PUT", f"/v1/endpoints/{a.id}/weight", {"weight": 100})
        admin(cp, "PUT", f"/v1/endpoints/{b.id}/weight", {"weight": 300})
        status = wait_applied(cp, {a.id: 7, b.id: 20})
        assert status["reloads"] > reloads
        share = share_through_workers(cp, workers, 81)
        assert 0.1 <= share[a.id] <= 0.4, share
        assert sample(cp.metrics(), "inferlb_cp_nginx_reloads_total", result="ok") == status["reloads"]

        # Drained: down in nginx, no traffic; every endpoint drained: nginx answers 503 itself.
        # (A graceful reload: for a moment an old nginx worker may still take a new connection, so wait
        # for the new config to answer rather than assume the first request reaches it.)
        admin(cp, "POST", f"/v1/endpoints/{a.id}/drain")
        wait_applied(cp, {a.id: 0, b.id: 20})
        wait_for(lambda: share_through_workers(cp, workers, 10)[b.id] == 1.0, 30, "all traffic on b", [cp.proc])
        admin(cp, "POST", f"/v1/endpoints/{b.id}/drain")
        wait_applied(cp, {a.id: 0, b.id: 0})

        def answered_by_nginx() -> httpx.Response | None:
            with http() as client:
                response = client.post(f"http://127.0.0.1:{cp.listener_port}/v1/embeddings", json=BODY)
            return response if response.status_code == 503 else None

        response = wait_for(answered_by_nginx, 30, "nginx's own 503", [cp.proc])
        assert response.json()["error"]["code"] == "no_endpoint"


def test_a_config_nginx_t_rejects_is_never_applied(tmp_path: Path, workers: list[SimWorker]) -> None:
    a, b = workers
    extra = tmp_path / "extra.conf"
    with nginx_stack(tmp_path, workers) as cp:
        extra.write_text('add_header X-Extra "good" always;\n')

        def good_applied() -> dict[str, Any] | None:
            """The status once the good directives serve and their reload has completed (nothing pending)."""
            before = dataplane(cp)
            serving = send(cp, 1)[1][0].headers.get("x-extra") == "good"
            return before if serving and not before["pending"] and dataplane(cp) == before else None

        good = wait_for(good_applied, 30, "the good extra directives", [cp.proc])

        extra.write_text("bogus_directive on;\n")
        failing = wait_for(lambda: (s := dataplane(cp))["failing"] and s, 30, "the bad config to be refused",
                           [cp.proc])
        assert failing["last_error"]["stage"] == "validate"
        assert 'unknown directive "bogus_directive"' in failing["last_error"]["message"]
        assert failing["digest"] == good["digest"] and failing["version"] == good["version"]
        assert failing["rejected"] == good["rejected"] + 1
        # The last good config keeps serving, its header included; nothing was reloaded.
        upstreams, responses = send(cp, 4)
        assert all(r.headers.get("x-extra") == "good" for r in responses)
        assert set(upstreams) == {a.id, b.id}
        assert sample(cp.metrics(), "inferlb_cp_nginx_reloads_total", result="invalid") == 1

        # No retry loop: more cycles (scrapes keep changing the state) validate nothing new.
        cycles = failing["cycles"]
        wait_for(lambda: dataplane(cp)["cycles"] >= cycles + 3, 30, "more applier cycles", [cp.proc])
        assert dataplane(cp)["rejected"] == failing["rejected"]

        # A weight change while the directives are bad renders a new candidate: refused too.
        admin(cp, "PUT", f"/v1/endpoints/{a.id}/weight", {"weight": 300})
        wait_for(lambda: dataplane(cp)["rejected"] > failing["rejected"], 30, "the next candidate refused",
                 [cp.proc])
        assert dataplane(cp)["digest"] == good["digest"]
        assert applied_weights(cp) == {a.id: 20, b.id: 20}

        extra.write_text('add_header X-Extra "fixed" always;\n')
        status = wait_applied(cp, {a.id: 20, b.id: 7})
        assert not status["failing"] and status["digest"] != good["digest"]
        # A graceful reload: an old worker may still take a new connection for a moment.
        wait_for(lambda: send(cp, 1)[1][0].headers.get("x-extra") == "fixed", 30, "the fixed config serving",
                 [cp.proc])
        assert status["last_error"]["stage"] == "validate"  # kept for the record


def test_a_burst_of_weight_changes_gives_few_reloads(tmp_path: Path, workers: list[SimWorker]) -> None:
    a, b = workers
    with nginx_stack(tmp_path, workers) as cp:
        before = wait_applied(cp, {a.id: 20, b.id: 20})
        # Pins that land on the levels nginx runs already (b weighs 100 too): not one reload.
        for weight in (99, 101, 100):
            admin(cp, "PUT", f"/v1/endpoints/{a.id}/weight", {"weight": weight})
        cycles = dataplane(cp)["cycles"]
        wait_for(lambda: dataplane(cp)["cycles"] >= cycles + 2, 30, "the applier to see the pins", [cp.proc])
        assert dataplane(cp)["reloads"] == before["reloads"]

        changes = 30
        started = time.monotonic()
        for i in range(changes):
            admin(cp, "PUT", f"/v1/endpoints/{a.id}/weight", {"weight": 1000 if i % 2 else 100})
        elapsed = time.monotonic() - started
        final = wait_applied(cp, {a.id: 20, b.id: 2})  # the last pin, 1000 : 100
        reloads = final["reloads"] - before["reloads"]
        # At most one reload per min_reload_interval_s while the burst lasted, plus the trailing one.
        assert 1 <= reloads <= math.ceil(elapsed / MIN_RELOAD_INTERVAL_S) + 1
        assert reloads < changes


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_nginx_stops_with_the_control_plane(tmp_path: Path, workers: list[SimWorker], how: str) -> None:
    data_dir = tmp_path / "cp-data"
    extra = tmp_path / "extra.conf"
    with running_control_plane(tmp_path, endpoints=[w.id for w in workers], data_dir=data_dir,
                               env=nginx_env(extra)) as cp:
        procs = nginx_processes(data_dir / "nginx")
        assert len(procs) >= 2, procs  # the master and a worker
        assert send(cp, 2)[0]
        if how == "sigkill":
            cp.kill()  # nginx gets SIGTERM from PR_SET_PDEATHSIG
        else:
            cp.proc.process.send_signal(signal.SIGTERM)
            assert cp.proc.process.wait(30) == 0
    _, alive = psutil.wait_procs(procs, timeout=15)
    assert not alive, alive
    assert not nginx_processes(data_dir / "nginx")
    assert os.path.isdir(data_dir / "nginx")


def test_an_invalid_first_config_refuses_to_start(tmp_path: Path) -> None:
    """Nothing good to serve: exit 2 with nginx -t's words, and no nginx left running."""
    data_dir = tmp_path / "cp-data"
    result = subprocess.run(
        [sys.executable, "-m", "control_plane", "--dataplane", "nginx", "--admin-port", str(free_port()),
         "--xds-port", str(free_port()), "--data-dir", str(data_dir)],
        env={**os.environ, "INFERLB_CP_NGINX__EXTRA_DIRECTIVES": "bogus_directive on;",
             "INFERLB_CP_DATA_PLANE__LISTENER_PORT": str(free_port())},
        capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert 'unknown directive "bogus_directive"' in result.stderr
    assert not nginx_processes(data_dir / "nginx")
