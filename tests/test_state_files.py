"""The control plane's state on disk is its owner's only, and a store's secrets reach no answer, log or console
(issue 41).

- The SQLite database and its -wal and -shm files are 0600; a data directory the
  store (or the token) creates is 0700; an existing one is left as it is; files
  an older version left readable are tightened, with a warning.
- A PostgreSQL URL's password (``user:password@`` and ``?password=``) is in no
  503 body, no log line (caplog), and not on the console of a control plane
  that cannot use it or whose config holds it in the wrong type.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from control_plane.admin import AdminService, create_admin_app
from control_plane.auth import AdminToken, resolve_admin_token
from control_plane.config import ControlPlaneConfig
from control_plane.controller import Controller
from control_plane.metrics import ControlPlaneMetrics
from control_plane.store import DB_NAME, Store
from control_plane.store.postgres import PostgresStore, redact, scrub
from control_plane.xds import SnapshotCache

from .conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
SECRETS = ("s3cret-in-userinfo", "s3cret-in-query", "s3cret-ssl")
TOKEN = "t" * 40


def _url(port: int, database: str = "inferlb") -> str:
    return (f"postgresql://inferlb:{SECRETS[0]}@127.0.0.1:{port}/{database}"
            f"?password={SECRETS[1]}&sslpassword={SECRETS[2]}&connect_timeout=2")


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_database_its_wal_and_shm_are_0600_in_a_0700_directory_the_store_creates(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)  # the operator's directory: left as it is
    data_dir = tmp_path / "state"
    store = Store.open(data_dir)
    try:
        asyncio.run(store.add_endpoint("127.0.0.1", 8101))  # a write: the WAL and its index exist now
        db = data_dir / DB_NAME
        side = [db.with_name(db.name + suffix) for suffix in ("-wal", "-shm")]
        assert all(path.exists() for path in side)
        assert {path.name: _mode(path) for path in [db, *side]} == {path.name: 0o600 for path in [db, *side]}
        assert _mode(data_dir) == 0o700
        assert _mode(tmp_path) == 0o755
    finally:
        store.close()


def test_files_an_older_version_left_readable_are_tightened_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    Store.open(tmp_path).close()
    db = tmp_path / DB_NAME
    os.chmod(db, 0o644)
    with caplog.at_level(logging.WARNING):
        store = Store.open(tmp_path)
    store.close()
    assert _mode(db) == 0o600
    assert any("readable by others" in r.getMessage() and getattr(r, "path", "") == str(db) for r in caplog.records)


def test_the_token_creates_a_missing_data_directory_0700(tmp_path: Path) -> None:
    token = resolve_admin_token(None, tmp_path / "fresh", environ={})
    assert token.path is not None and _mode(token.path) == 0o600
    assert _mode(tmp_path / "fresh") == 0o700


def test_scrub_and_redact_remove_every_password_of_a_url() -> None:
    url = _url(5432)
    text = f"could not parse {url}; password={SECRETS[1]}; {SECRETS[0]}"
    assert not any(secret in scrub(text, url) for secret in SECRETS)
    assert redact(url) == "postgresql://inferlb:***@127.0.0.1:5432/inferlb"


def test_a_store_failure_answers_503_without_the_store_error_and_logs_no_password(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A PostgreSQL store nothing answers for: the 503 carries neither the URL nor the driver's words, the
    log line names the store with its password replaced."""

    async def scenario() -> list[httpx.Response]:
        controller = Controller(ControlPlaneConfig(endpoints=["127.0.0.1:8101"]), SnapshotCache())
        await controller.start()
        store = PostgresStore(_url(free_port()), connect_timeout_s=1)
        try:
            app = create_admin_app(controller, ControlPlaneMetrics(lambda: controller.state),
                                   AdminService(controller, store), AdminToken(TOKEN, "config"))
            transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 12345))
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                         headers={"authorization": f"Bearer {TOKEN}"}) as client:
                return [await client.put("/v1/endpoints/127.0.0.1:8101/weight", json={"weight": 9}),
                        await client.get("/v1/usage"), await client.get("/v1/rollouts")]
        finally:
            store.close()
            await controller.stop()

    with caplog.at_level(logging.INFO):
        responses = asyncio.run(scenario())
    for response in responses:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "store_unavailable"
        assert "127.0.0.1" not in response.text and "postgresql" not in response.text
        assert not any(secret in response.text for secret in SECRETS)
    logged = "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "postgresql://inferlb:***@127.0.0.1" in logged  # the failure is logged, the store named
    assert not any(secret in logged for secret in SECRETS)


def _control_plane(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("INFERLB_CP_", "INFERLB_STORE"))}
    return subprocess.run([sys.executable, "-m", "control_plane", "--data-dir", str(tmp_path / "data"),
                           "--admin-port", str(free_port()), "--xds-port", str(free_port()), *args],
                          cwd=ROOT, env={**environ, **(env or {})}, capture_output=True, text=True, timeout=60)


@pytest.mark.subprocess
def test_a_control_plane_that_cannot_use_its_store_prints_no_password(tmp_path: Path) -> None:
    result = _control_plane(tmp_path, env={"INFERLB_STORE": _url(free_port())})
    assert result.returncode == 2, result.stderr
    assert "cannot use the state database" in result.stderr and "postgresql://inferlb:***@" in result.stderr
    assert not any(secret in result.stdout + result.stderr for secret in SECRETS)


@pytest.mark.subprocess
def test_a_store_url_of_the_wrong_type_in_the_config_is_refused_without_echoing_it(tmp_path: Path) -> None:
    """pydantic would print the value it refuses, password and all (a short one whole: a long one it cuts)."""
    config = tmp_path / "cp.toml"
    config.write_text(f'[control_plane]\nstore = ["postgresql://u:{SECRETS[0]}@h/d"]\n')
    result = _control_plane(tmp_path, "--config", str(config))
    assert result.returncode == 2, result.stderr
    assert "invalid configuration" in result.stderr and "store" in result.stderr.lower()
    assert not any(secret in result.stdout + result.stderr for secret in SECRETS)
