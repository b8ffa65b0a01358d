"""Every service's /metrics passes ``promtool check metrics`` (Debian's prometheus package; ``make test``
installs it): the format and Prometheus' naming lints, on live processes after they served traffic, so the
per-model, per-tenant and per-pool families are there too."""

from __future__ import annotations

import subprocess
from typing import Iterator

import pytest

from control_plane.telemetry.replica_activity import SAMPLES, read_exposition

from .conftest import WorkerProcess
from .exposition import exercised_gateway, run_promtool, scrape
from .stack import Gateway, http

pytestmark = [pytest.mark.slow, pytest.mark.servers, pytest.mark.envoy, pytest.mark.promtool]


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    return run_promtool("check", "metrics", stdin=text)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    with exercised_gateway(tmp_path_factory.mktemp("promtool"), "promtool") as gw:
        yield gw


def test_the_control_plane_metrics_pass_promtool(gateway: Gateway) -> None:
    text = scrape(f"{gateway.cp.admin_url}/metrics")
    assert "inferlb_autoscale_desired_replicas" in text
    done = promtool(text)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ext_proc_metrics_pass_promtool(gateway: Gateway) -> None:
    text = scrape(f"{gateway.ext_proc.metrics_url}/metrics")
    assert "inferlb_ext_proc_model_requests_total" in text
    assert 'inferlb_ext_proc_cache_requests_total{level="memory",result="hit"} 1.0' in text
    done = promtool(text)
    assert done.returncode == 0, done.stdout + done.stderr


def test_ext_proc_renders_only_the_samples_asked_for(gateway: Gateway) -> None:
    """What the control plane's replica watch asks for every half second: those samples, nothing else."""
    with http() as client:
        response = client.get(f"{gateway.ext_proc.metrics_url}/metrics", params={"name[]": list(SAMPLES)})
    assert response.status_code == 200
    samples = {line.split("{")[0].split(" ")[0] for line in response.text.splitlines() if not line.startswith("#")}
    assert samples == set(SAMPLES)
    reading = read_exposition(response.text)
    assert reading.decisions is not None and reading.decisions > 0
    assert reading.usage is not None and reading.usage.started_at is not None and reading.usage.tenants
    done = promtool(response.text)
    assert done.returncode == 0, done.stdout + done.stderr


def test_simulated_worker_metrics_pass_promtool(gateway: Gateway) -> None:
    text = scrape(f"{gateway.workers[0].url}/metrics")
    assert "inferlb_worker_model_info" in text
    done = promtool(text)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_real_worker_metrics_pass_promtool(worker: WorkerProcess) -> None:
    with http() as client:
        assert client.post(f"{worker.url}/v1/embeddings", json={"input": "count me"}).status_code == 200
    done = promtool(scrape(f"{worker.url}/metrics"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_refuses_a_bad_exposition() -> None:
    """The check can fail: a counter without ``_total`` and a malformed line are refused."""
    done = promtool("# TYPE bad_counter counter\nbad_counter 1\nnot a metric line\n")
    assert done.returncode != 0
