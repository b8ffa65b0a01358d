"""docker-compose.yml agrees with the project's defaults (validated here, not run: no Docker engine)."""

from __future__ import annotations

import yaml

from workers.config import WorkerConfig

from .conftest import ROOT


def test_worker_service_matches_the_worker_defaults() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    worker = compose["services"]["worker"]
    command = worker["command"]
    assert command[:3] == ["python", "-m", "workers"]
    port = int(command[command.index("--port") + 1])
    assert port == WorkerConfig().port
    assert str(port) in worker["expose"]
    assert any(p.endswith(f":{port}") for p in worker["ports"])
    assert f"127.0.0.1:{port}/readyz" in " ".join(worker["healthcheck"]["test"])
    # SIGTERM drains in-flight work for up to 30 s by default: the grace period must be longer.
    assert int(worker["stop_grace_period"].rstrip("s")) > WorkerConfig().shutdown_timeout_s


def test_dockerfile_runs_the_same_command_as_non_root() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'CMD ["python", "-m", "workers", "--host", "0.0.0.0", "--port", "8101"]' in dockerfile
    assert "USER inferlb" in dockerfile
    assert "python -m workers prepare" in dockerfile  # the model is built into the image
