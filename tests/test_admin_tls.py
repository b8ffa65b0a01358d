"""HTTPS on the admin API and what the control plane refuses at start-up, through the real command line.

``python -m control_plane`` with ``admin_tls_cert``/``admin_tls_key`` serves the admin API over TLS
only (the bearer token never crosses a network in clear); a client that trusts the throwaway CA
(trustme) gets answers, plain HTTP gets none. Plaintext beyond loopback (admin API or xDS) is refused
unless accepted explicitly, and TLS files that are incomplete, unreadable or do not match exit 2
with a message that names the setting; nothing listens in any of those cases.
"""

from __future__ import annotations

import logging
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Mapping

import httpx
import pytest

from control_plane.config import ControlPlaneConfig
from control_plane.serving import warn_plaintext

from .certs import Pki
from .conftest import free_port
from .stack import ROOT, launch, supervised, wait_for


def start_refused(tmp_path: Path, env: Mapping[str, str], module: str = "control_plane",
                  args: tuple[str, ...] = ()) -> str:
    """Run the command line that must refuse to start; its stderr (exit status 2 asserted)."""
    argv = [sys.executable, "-m", module, *args]
    if module == "control_plane":
        argv += ["--data-dir", str(tmp_path / "data"), "--xds-port", str(free_port()),
                 "--admin-port", str(free_port())]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env})
    assert result.returncode == 2, result.stderr
    return result.stderr


@pytest.mark.servers
@pytest.mark.slow
def test_the_admin_api_answers_over_https_and_refuses_plain_http(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    server = pki.issue("admin", "127.0.0.1")
    port = free_port()
    proc = launch("control-plane-https", [
        sys.executable, "-m", "control_plane", "--admin-port", str(port), "--xds-port", str(free_port()),
        "--data-dir", str(tmp_path / "data")], tmp_path,
        {"INFERLB_CP_ADMIN_TLS_CERT": str(server.cert), "INFERLB_CP_ADMIN_TLS_KEY": str(server.key)})
    with supervised(proc, stop_timeout=10):
        base = f"https://127.0.0.1:{port}"
        trusting = pki.trusting()

        def get(path: str, context: ssl.SSLContext = trusting, **headers: str) -> httpx.Response:
            with httpx.Client(verify=context, timeout=5, trust_env=False) as client:
                return client.get(f"{base}{path}", headers=headers)

        wait_for(lambda: get("/readyz").status_code == 200, 30, "/readyz over HTTPS", [proc])
        token = (tmp_path / "data" / "admin-token").read_text().strip()
        endpoints = get("/v1/endpoints", Authorization=f"Bearer {token}")
        assert endpoints.status_code == 200 and endpoints.json()["endpoints"] == []

        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            get("/readyz", ssl.create_default_context())  # a client that does not trust this CA
        with httpx.Client(timeout=5, trust_env=False) as client, pytest.raises(httpx.TransportError):
            client.get(f"http://127.0.0.1:{port}/readyz")
        assert get("/healthz").status_code == 200  # the plaintext attempt did not hurt the server
        proc.check_alive()


@pytest.mark.slow
@pytest.mark.servers
def test_plaintext_beyond_loopback_is_refused_unless_accepted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stderr = start_refused(tmp_path, {"INFERLB_CP_ADMIN_ADDRESS": "0.0.0.0"})
    assert "admin_address 0.0.0.0 is beyond loopback" in stderr and "admin_allow_plaintext = true" in stderr
    stderr = start_refused(tmp_path, {"INFERLB_CP_XDS_ADDRESS": "0.0.0.0"})
    assert "xds_address 0.0.0.0 is beyond loopback" in stderr and "xds_allow_plaintext = true" in stderr

    accepted = ControlPlaneConfig(admin_address="0.0.0.0", admin_allow_plaintext=True,
                                  xds_address="::", xds_allow_plaintext=True)
    with caplog.at_level(logging.WARNING):
        warn_plaintext(accepted, logging.getLogger("test"))
    assert [r.getMessage().split(" beyond loopback")[0] for r in caplog.records] == [
        "xDS is plaintext", "the admin API is plaintext"]
    caplog.clear()
    warn_plaintext(ControlPlaneConfig(admin_address="localhost", xds_address="::1"), logging.getLogger("test"))
    assert caplog.records == []  # loopback: nothing to say


@pytest.mark.slow
@pytest.mark.servers
def test_incomplete_unreadable_or_mismatched_tls_files_stop_the_start(tmp_path: Path) -> None:
    pki = Pki(tmp_path)
    good, other = pki.issue("admin"), pki.issue("other")
    stderr = start_refused(tmp_path, {"INFERLB_CP_ADMIN_TLS_CERT": str(good.cert)})
    assert "admin_tls_cert, admin_tls_key go together: admin_tls_cert set but admin_tls_key not" in stderr
    stderr = start_refused(tmp_path, {"INFERLB_CP_XDS_TLS_CERT": str(good.cert), "INFERLB_CP_XDS_TLS_KEY": str(good.key)})
    assert "xds_tls_client_ca not" in stderr

    missing = tmp_path / "missing.pem"
    stderr = start_refused(tmp_path, {"INFERLB_CP_ADMIN_TLS_CERT": str(missing),
                                      "INFERLB_CP_ADMIN_TLS_KEY": str(good.key)})
    assert f"admin_tls_cert: cannot read {missing}: No such file or directory" in stderr
    stderr = start_refused(tmp_path, {"INFERLB_CP_XDS_TLS_CERT": str(good.cert), "INFERLB_CP_XDS_TLS_KEY": str(other.key),
                                      "INFERLB_CP_XDS_TLS_CLIENT_CA": str(good.ca)})
    assert "xds_tls_cert/xds_tls_key:" in stderr and "not a PEM certificate chain and its matching private key" in stderr
    stderr = start_refused(tmp_path, {"INFERLB_CP_XDS_TLS_CERT": str(good.cert), "INFERLB_CP_XDS_TLS_KEY": str(good.key),
                                      "INFERLB_CP_XDS_TLS_CLIENT_CA": str(good.key)})
    assert f"xds_tls_client_ca: {good.key} holds no PEM CA certificate" in stderr

    stderr = start_refused(tmp_path, {"INFERLB_EXT_PROC_XDS_TLS_CERT": str(good.cert),
                                      "INFERLB_EXT_PROC_XDS_TLS_KEY": str(good.key),
                                      "INFERLB_EXT_PROC_XDS_TLS_CA": str(missing)},
                           module="ext_proc", args=("--metrics-port", "0", "--port", str(free_port())))
    assert f"xds_tls_ca: cannot read {missing}" in stderr
    stderr = start_refused(tmp_path, {"INFERLB_EXT_PROC_XDS_TLS_KEY": str(good.key)}, module="ext_proc")
    assert "xds_tls_cert, xds_tls_key, xds_tls_ca go together" in stderr
